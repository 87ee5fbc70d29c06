"""Rotary position embeddings with llama3 frequency scaling, exact at positions in the tens of millions.

float32 angles `position × inv_freq` are off by up to ~0.5 rad at 14M (one float32 ulp of 1.4e7 is 1.0), which would
scramble exactly the long-range positions that long-context training is for. Instead a position is split into 12-bit
digits, p = Σ d_i · 4096^i, and cos/sin of each digit's angle come from tables computed in float64 on the host and
reduced mod 2π. The angle-addition formulas combine them in float32, each step adding ~1e-7 of error, so cos/sin
match float64 within 1e-6 at any position up to 4096^digits.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np

DIGIT_BITS = 12


def inv_frequencies(head_dim: int, theta: float, scaling: bool = False, factor: float = 8.0,
                    low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                    original_context: int = 8192) -> np.ndarray:
  """float64 [head_dim/2] inverse frequencies, llama3-scaled if `scaling`."""
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  if not scaling:
    return inv_freq
  # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
  wavelen = 2 * math.pi / inv_freq
  low_freq_wavelen = original_context / low_freq_factor
  high_freq_wavelen = original_context / high_freq_factor
  smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
  interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
  return np.where(wavelen < high_freq_wavelen, inv_freq,
                  np.where(wavelen > low_freq_wavelen, inv_freq / factor, interpolated))


@functools.lru_cache(maxsize=8)
def _digit_tables(inv_freq: tuple[float, ...], digits: int) -> tuple[np.ndarray, np.ndarray]:
  """cos and sin of (d · 4096^i) · inv_freq for every digit value d and digit i: float32 [digits, 4096, H/2]."""
  base = 1 << DIGIT_BITS
  f = np.asarray(inv_freq, np.float64)
  d = np.arange(base, dtype=np.float64)
  angles = np.stack([np.mod(np.outer(d * float(base**i), f), 2 * math.pi) for i in range(digits)])
  return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def digits_for(max_position: int) -> int:
  return max(1, math.ceil(max(1, int(max_position)).bit_length() / DIGIT_BITS))


def cos_sin(positions: jnp.ndarray, inv_freq: np.ndarray, max_position: int) -> tuple[jnp.ndarray, jnp.ndarray]:
  """float32 cos, sin [..., H/2] of positions (int, < max_position + 1) times inv_freq."""
  digits = digits_for(max_position)
  cos_t, sin_t = _digit_tables(tuple(float(x) for x in inv_freq), digits)
  mask = (1 << DIGIT_BITS) - 1
  positions = positions.astype(jnp.int32)
  cos = jnp.asarray(cos_t[0])[positions & mask]
  sin = jnp.asarray(sin_t[0])[positions & mask]
  for i in range(1, digits):
    digit = (positions >> (DIGIT_BITS * i)) & mask
    c, s = jnp.asarray(cos_t[i])[digit], jnp.asarray(sin_t[i])[digit]
    cos, sin = cos * c - sin * s, sin * c + cos * s
  return cos, sin


def apply(x_BTNH: jnp.ndarray, cos_BTF: jnp.ndarray, sin_BTF: jnp.ndarray) -> jnp.ndarray:
  """Rotates the two halves of the head dimension (the Hugging Face / Meta layout), in float32."""
  x = x_BTNH.astype(jnp.float32)
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  c, s = cos_BTF[:, :, None, :], sin_BTF[:, :, None, :]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x_BTNH.dtype)
