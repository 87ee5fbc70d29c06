"""RoPE must be exact at the long positions maxctx trains on, and llama3 scaling must match its definition."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxctx.model import rope

MAX_POSITION = 14_680_064


def _llama8b_inv_freq():
  return rope.inv_frequencies(128, 500000.0, True, 8.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize("max_position", [MAX_POSITION, 2**25])   # the 14M recipes; 33,554,432 tokens (the planner's)
def test_cos_sin_match_float64_at_every_trained_position(max_position):
  inv_freq = _llama8b_inv_freq()
  rng = np.random.default_rng(0)
  edges = np.array([4095, 4096, 4097, 2**23, 2**23 + 1, 2**24 - 1, 2**24])   # digit carries, float32's 2^24
  positions = np.concatenate([np.arange(0, 5000), max_position - 1 - np.arange(5000),
                              rng.integers(0, max_position, 20000), edges[edges < max_position]])
  cos, sin = jax.jit(lambda p: rope.cos_sin(p, inv_freq, max_position - 1))(jnp.asarray(positions, jnp.int32))
  angles = np.outer(positions.astype(np.float64), inv_freq)
  assert np.max(np.abs(np.asarray(cos, np.float64) - np.cos(angles))) <= 1e-6
  assert np.max(np.abs(np.asarray(sin, np.float64) - np.sin(angles))) <= 1e-6


def test_plain_float32_angles_would_not_be_exact():
  # The reason rope.py exists: float32 position × frequency is far off at 14M. If this ever passes, XLA or numpy
  # changed, and the digit tables may be simplified.
  inv_freq = _llama8b_inv_freq()
  p = np.array([MAX_POSITION - 1], np.float32)
  naive = np.cos(p[:, None] * inv_freq.astype(np.float32))
  exact = np.cos(np.float64(MAX_POSITION - 1) * inv_freq)
  assert np.max(np.abs(naive - exact)) > 1e-2


def test_llama3_scaling_matches_its_definition():
  inv = rope.inv_frequencies(128, 500000.0, False)
  scaled = _llama8b_inv_freq()
  wavelen = 2 * math.pi / inv
  high = wavelen < 8192 / 4.0
  low = wavelen > 8192 / 1.0
  np.testing.assert_allclose(scaled[high], inv[high])
  np.testing.assert_allclose(scaled[low], inv[low] / 8.0)
  band = ~(high | low)
  assert band.any()
  assert np.all(scaled[band] < inv[band]) and np.all(scaled[band] > inv[band] / 8.0)


def test_apply_rotates_pairs_of_halves_and_keeps_norms():
  x = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
  cos, sin = rope.cos_sin(jnp.arange(5)[None], rope.inv_frequencies(8, 10000.0), 4)
  y = rope.apply(x, cos, sin)
  np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
  np.testing.assert_allclose(y[:, 0], x[:, 0], atol=1e-6)  # position 0 is the identity
