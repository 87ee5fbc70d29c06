"""RoPE must be exact at the long positions maxctx trains on, llama3 scaling must match its definition, and a run that
changes the RoPE settings (a larger base or llama3 scaling for a longer context) must rotate the same parameters'
queries and keys exactly as the new settings define, at the new positions."""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxctx import config as config_lib
from maxctx.model import Transformer, rope

MAX_POSITION = 14_680_064
LLAMA31_SCALING = (8.0, 1.0, 4.0, 8192)   # factor, low_freq_factor, high_freq_factor, original context


def llama31_inv_freq(head_dim: int, theta: float, scaling: tuple | None = None) -> np.ndarray:
  """Llama 3.1's frequencies as Meta's reference defines them (llama/model.py: precompute_freqs_cis, apply_scaling),
  one frequency at a time, in float64: the oracle, written apart from rope.inv_frequencies."""
  freqs = [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)]
  if scaling is None:
    return np.array(freqs, np.float64)
  factor, low_freq_factor, high_freq_factor, old_context_len = scaling
  low_freq_wavelen = old_context_len / low_freq_factor
  high_freq_wavelen = old_context_len / high_freq_factor
  scaled = []
  for freq in freqs:
    wavelen = 2 * math.pi / freq
    if wavelen < high_freq_wavelen:
      scaled.append(freq)
    elif wavelen > low_freq_wavelen:
      scaled.append(freq / factor)
    else:
      smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
      scaled.append((1 - smooth) * freq / factor + smooth * freq)
  return np.array(scaled, np.float64)


def _llama8b_inv_freq():
  return rope.inv_frequencies(128, 500000.0, True, *LLAMA31_SCALING)


@pytest.mark.parametrize("max_position", [MAX_POSITION, 2**25])   # the 14M recipes; 33,554,432 tokens (the planner's)
def test_cos_sin_match_float64_at_every_trained_position(max_position):
  inv_freq = _llama8b_inv_freq()
  rng = np.random.default_rng(0)
  edges = np.array([4095, 4096, 4097, 2**23, 2**23 + 1, 2**24 - 1, 2**24])   # digit carries, float32's 2^24
  positions = np.concatenate([np.arange(0, 5000), max_position - 1 - np.arange(5000),
                              rng.integers(0, max_position, 20000), edges[edges < max_position]])
  cos, sin = jax.jit(lambda p: rope.cos_sin(p, inv_freq, max_position - 1))(jnp.asarray(positions, jnp.int32))
  angles = np.outer(positions.astype(np.float64), llama31_inv_freq(128, 500000.0, LLAMA31_SCALING))
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


@pytest.mark.parametrize("head_dim,theta,scaling", [
    (128, 500000.0, LLAMA31_SCALING),        # Llama 3.1 8B/70B/405B
    (16, 10000.0, None), (16, 40000.0, None),  # a base raised for a longer stage
    (16, 10000.0, (4.0, 1.0, 4.0, 64)), (32, 10000.0, (8.0, 1.0, 4.0, 64)),   # llama3 scaling turned on for one
])
def test_inv_frequencies_match_llama31_reference(head_dim, theta, scaling):
  got = rope.inv_frequencies(head_dim, theta, scaling is not None, *(scaling or ()))
  np.testing.assert_allclose(got, llama31_inv_freq(head_dim, theta, scaling), rtol=1e-13, atol=0)


FIRST_LEN = 64
NEW_LEN = 4 * FIRST_LEN


def _tiny(**rope_keys) -> config_lib.ModelConfig:
  cfg = config_lib.load(None, ["model.preset=tiny"]).model
  return dataclasses.replace(cfg, vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                             d_ff=128, scan_layers=False, remat="none", dtype="float32", init_std=0.2, **rope_keys)


@pytest.mark.parametrize("new_rope", [
    {"rope_theta": 40000.0},
    {"rope_scaling": True, "rope_factor": 4.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
     "rope_original_context": FIRST_LEN},
], ids=["theta-4x", "llama3-scaling"])
def test_new_rope_settings_rotate_existing_parameters_exactly_at_new_positions(new_rope, monkeypatch):
  """Parameters made under one RoPE (base 10,000, unscaled, FIRST_LEN tokens), applied by the model under another
  at 4× the length: no parameter is added or reshaped, and every layer's rotary tables and rotated queries and keys
  equal Llama 3.1's float64 definition at every new position (in packed documents too)."""
  old = _tiny(rope_theta=10000.0, rope_scaling=False)
  new = dataclasses.replace(old, **new_rope)
  t = jnp.zeros((1, FIRST_LEN), jnp.int32)
  params = nn.unbox(Transformer(old).init(jax.random.key(0), t, t, t)["params"])
  t = jnp.zeros((2, NEW_LEN), jnp.int32)
  new_tree = jax.eval_shape(lambda: nn.unbox(Transformer(new).init(jax.random.key(0), t, t, t)["params"]))
  assert jax.tree.map(lambda x: (x.shape, x.dtype), new_tree) == jax.tree.map(lambda x: (x.shape, x.dtype), params)

  tokens = np.random.default_rng(0).integers(0, new.vocab_size, (2, NEW_LEN)).astype(np.int32)
  cut = NEW_LEN - 3 * FIRST_LEN // 2   # row 1: two documents, each longer than FIRST_LEN
  positions = np.stack([np.arange(NEW_LEN), np.r_[np.arange(cut), np.arange(NEW_LEN - cut)]]).astype(np.int32)
  segment_ids = np.stack([np.ones(NEW_LEN), np.r_[np.ones(cut), 2 * np.ones(NEW_LEN - cut)]]).astype(np.int32)
  rotated = []
  apply = rope.apply

  def recording_apply(x_BTNH, cos_BTF, sin_BTF):
    out = apply(x_BTNH, cos_BTF, sin_BTF)
    rotated.append(tuple(np.asarray(a, np.float64) for a in (x_BTNH, cos_BTF, sin_BTF, out)))
    return out

  monkeypatch.setattr(rope, "apply", recording_apply)
  Transformer(new).apply({"params": params}, tokens, segment_ids, positions)
  assert len(rotated) == 2 * new.n_layers   # q and k of every layer

  scaling = None
  if new.rope_scaling:
    scaling = (new.rope_factor, new.rope_low_freq_factor, new.rope_high_freq_factor, new.rope_original_context)
  angles_BTF = positions[..., None].astype(np.float64) * llama31_inv_freq(new.head_dim, new.rope_theta, scaling)
  assert not np.allclose(llama31_inv_freq(new.head_dim, 10000.0), llama31_inv_freq(new.head_dim, new.rope_theta,
                                                                                     scaling))
  half = new.head_dim // 2
  for x, cos, sin, out in rotated:
    assert np.abs(cos - np.cos(angles_BTF)).max() <= 1e-6 and np.abs(sin - np.sin(angles_BTF)).max() <= 1e-6
    c, s = np.cos(angles_BTF)[:, :, None], np.sin(angles_BTF)[:, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    want = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    assert np.abs(out - want).max() <= 1e-6 * np.abs(x).max()
