"""Every context-parallel strategy, forward and dq/dk/dv, against the dense float32 reference on one device.

The matrix: strategies {all_gather, ulysses, ring, usp 2×R, usp 4×R} × meshes {context=8; fsdp=2×context=4;
data=2×context=2×tensor=2} × heads {N=K; N=4K; one KV head} × masks {causal; packed documents} × layout {natural;
zigzag}. Masks and layouts are data, not shapes, so each (strategy, mesh, heads, dtype) compiles once and runs all
four. Combinations a strategy cannot run must be refused by `validate` with the expected sentence. The fast set runs
each strategy on context=8 with packed documents, GQA and zigzag; the full matrix is `slow`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import maxctx.attention as attention
from maxctx import sharding
from maxctx.attention import flash, kernels, layout, ring
from maxctx.errors import ConfigError

B = 2


@dataclasses.dataclass(frozen=True)
class Case:
  """Sequence length, head dim and block size of a kernel's runs: small tiles, so documents shorter than a block and
  tile skipping are both exercised. flash needs 128 tokens per device, and on the TPU multiples of 128 (its lanes)
  for its blocks and head dim; the Pallas interpreter then runs it at a few seconds per strategy. Its GPU kernels
  (`flash_gpu`: flash as lowered for a GPU) take powers of two, so they run smaller tiles and heads."""
  t: int = 128
  h: int = 16
  block: int = 8


CASES = {"blockwise": Case(), "flash": Case(t=1024, h=128, block=128), "flash_gpu": Case(t=1024, h=32, block=32)}
# A case's kernel and the platform it is validated for; off that platform the kernels run in the Pallas interpreter.
KERNEL_OF = {"blockwise": ("blockwise", None), "flash": ("flash", "tpu"), "flash_gpu": ("flash", "gpu")}
T, H, BLOCK = CASES["blockwise"].t, CASES["blockwise"].h, CASES["blockwise"].block
MESHES = {"ctx8": (1, 1, 8, 1), "fsdp2_ctx4": (1, 2, 4, 1), "data2_ctx2_tp2": (2, 1, 2, 2)}
HEADS = {"mha": (8, 8), "gqa4": (16, 4), "kv1": (8, 1)}
STRATEGIES = {"all_gather": ("all_gather", None), "ulysses": ("ulysses", None), "ring": ("ring", None),
              "usp2": ("usp", 2), "usp4": ("usp", 4)}
MASKS = ("causal", "packed")
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def make_mesh(shape):
  return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), ("data", "fsdp", "context", "tensor"))


def doc_ids(rng, with_padding, case=CASES["blockwise"]):
  """Segment ids and positions of one packed row: short documents (some shorter than a block), one document long
  enough to span every device, more short ones, and optionally a padding tail (segment 0)."""
  T = case.t
  lengths = list(rng.integers(1, case.block, size=3)) + [T - 5 * case.block]
  while sum(lengths) < T - (5 if with_padding else 0):
    lengths.append(int(rng.integers(1, 2 * case.block)))
  seg, pos = [], []
  for i, n in enumerate(lengths):
    seg += [i + 1] * n
    pos += list(range(n))
  seg, pos = np.array(seg[:T]), np.array(pos[:T])
  if with_padding:
    seg = np.concatenate([seg, np.zeros(T - len(seg), int)])
    pos = np.concatenate([pos, np.zeros(T - len(pos), int)])
  return seg, pos


def tokens(mask, seed=0, case=CASES["blockwise"]):
  if mask == "causal":
    return np.ones((B, case.t), np.int32), np.tile(np.arange(case.t, dtype=np.int32), (B, 1))
  rng = np.random.default_rng(seed)
  rows = [doc_ids(rng, with_padding=(b == 0), case=case) for b in range(B)]
  return np.stack([r[0] for r in rows]).astype(np.int32), np.stack([r[1] for r in rows]).astype(np.int32)


def tensors(n_heads, kv_heads, dtype, seed=0, case=CASES["blockwise"]):
  """q, k, v and an output cotangent, rounded to `dtype` and returned in float32 numpy (the reference's inputs)."""
  rng = np.random.default_rng(seed)
  T, H = case.t, case.h
  shapes = [(B, T, n_heads, H), (B, T, kv_heads, H), (B, T, kv_heads, H), (B, T, n_heads, H)]
  return [np.asarray(jnp.asarray(rng.normal(size=s), dtype).astype(jnp.float32)) for s in shapes]


@functools.cache
def _reference_vjp():
  def run(q, k, v, seg, pos, dout):
    out, pullback = jax.vjp(lambda q, k, v: kernels.reference(q, k, v, seg, seg, pos, pos), q, k, v)
    return (out, *pullback(dout))
  return jax.jit(run)


@functools.cache
def reference(n_heads, kv_heads, dtype, mask, case=CASES["blockwise"]):
  q, k, v, dout = tensors(n_heads, kv_heads, dtype, case=case)
  seg, pos = tokens(mask, case=case)
  with jax.default_device(jax.devices()[0]):
    return [np.asarray(x) for x in _reference_vjp()(q, k, v, seg, pos, dout)]


def expected_refusal(strategy, degree, mesh_shape, n_heads, kv_heads):
  """The start of the sentence `validate` must raise for an impossible combination, or None."""
  context, tensor = mesh_shape[2], mesh_shape[3]
  if n_heads % tensor:
    return f"model.n_heads {n_heads} is not divisible by the tensor degree {tensor}"
  if kv_heads % tensor:
    return f"model.n_kv_heads {kv_heads} is not divisible by the tensor degree {tensor}"
  if degree is not None and context % degree:
    return f"attention.ulysses_degree {degree} does not divide"
  a2a = context if strategy == "ulysses" else degree
  if a2a and (n_heads // tensor) % a2a:
    return f"attention.strategy {strategy} splits"
  return None


def check(strategy_key, mesh_key, heads_key, dtype=jnp.float32, masks=MASKS, zigzag=(False, True),
          kernel="blockwise"):
  strategy, degree = STRATEGIES[strategy_key]
  case = CASES[kernel]
  mesh_shape = MESHES[mesh_key]
  n_heads, kv_heads = HEADS[heads_key]
  context, tensor = mesh_shape[2], mesh_shape[3]
  # flash is validated as on the platform it is for (off it, validate refuses training) and runs in the interpreter.
  name, platform = KERNEL_OF[kernel]
  config = attention.AttentionConfig(strategy=strategy, kernel=name, load_balance=True, ulysses_degree=degree,
                                     block_q=case.block, block_kv=case.block)
  problem = attention.Problem(config, context=context, tensor=tensor, n_heads=n_heads, n_kv_heads=kv_heads,
                              seq_len=case.t, platform=platform, head_dim=case.h)
  refusal = expected_refusal(strategy, degree, mesh_shape, n_heads, kv_heads)
  if refusal:
    with pytest.raises(ConfigError, match="^" + refusal):
      attention.validate(problem)
    return
  attention.validate(problem)

  mesh = make_mesh(mesh_shape)
  fn = attention.build(config, mesh)

  @jax.jit
  def run(q, k, v, seg, pos, dout):
    out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, seg, pos), q, k, v)
    return (out, *pullback(dout))

  heads_sharding = NamedSharding(mesh, P(sharding.BATCH_AXES, sharding.SEQ_AXIS, sharding.HEAD_AXIS, None))
  token_sharding = NamedSharding(mesh, P(sharding.BATCH_AXES, sharding.SEQ_AXIS))
  q, k, v, dout = tensors(n_heads, kv_heads, dtype, case=case)
  for mask in masks:
    want = reference(n_heads, kv_heads, dtype, mask, case)
    seg, pos = tokens(mask, case=case)
    for zz in zigzag:
      arrays = [q, k, v, seg, pos, dout]
      if zz:
        arrays = [layout.zigzag(x, context) for x in arrays]
      args = [jax.device_put(jnp.asarray(x, dtype), heads_sharding) for x in arrays[:3]]
      args += [jax.device_put(x, token_sharding) for x in arrays[3:5]]
      args += [jax.device_put(jnp.asarray(arrays[5], dtype), heads_sharding)]
      got = [np.asarray(x.astype(jnp.float32)) for x in run(*args)]
      if zz:
        got = [layout.unzigzag(x, context) for x in got]
      for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        scale = max(1.0, float(np.abs(w).max()))
        err = float(np.abs(g - w).max())
        assert err <= TOLERANCE[dtype] * scale, (
            f"{kernel} {strategy_key} {mesh_key} {heads_key} {mask} zigzag={zz} {jnp.dtype(dtype).name}: {name} "
            f"max abs error {err:.3g} > {TOLERANCE[dtype]} × {scale:.3g}")


@pytest.mark.parametrize("strategy_key", list(STRATEGIES))
def test_fast_context8_packed_gqa_zigzag(strategy_key):
  check(strategy_key, "ctx8", "gqa4", masks=("packed",), zigzag=(True,))


@pytest.mark.parametrize("strategy_key", ["ring", "usp2"])
def test_fast_bfloat16(strategy_key):
  check(strategy_key, "ctx8", "gqa4", jnp.bfloat16, masks=("packed",), zigzag=(True,))


@pytest.mark.parametrize("strategy_key", ["ring", "usp2"])
def test_fast_one_kv_head_per_pass(strategy_key, monkeypatch):
  """With a pass budget of one byte every ring pass carries one KV head with its 4 query heads, as at long sequence
  lengths: passes after the first read q, dout and delta at a head offset. Chunks stay whole (K/V may weigh as much
  as the queries). GQA, packed documents, zigzag."""
  monkeypatch.setattr(ring, "PASS_BYTES", 1)
  monkeypatch.setattr(ring, "KV_SHARE", 1)
  assert plan(strategy_key, "gqa4")[0] > 1 and plan(strategy_key, "gqa4")[3] == 1
  check(strategy_key, "ctx8", "gqa4", masks=("packed",), zigzag=(True,))


@pytest.mark.parametrize("strategy_key, heads_key", [("ring", "gqa4"), ("usp2", "gqa4"), ("usp4", "gqa4"),
                                                     ("ring", "mha"), ("usp2", "mha")])
def test_fast_sub_chunked_hops(strategy_key, heads_key, monkeypatch):
  """When one KV head's chunk is too large for a hop (long sequences), each pass sends its tokens round the ring in
  sub-chunks (for USP, each all-to-all'd on its own) and writes dK/dV back at their token offsets. Packed, zigzag."""
  monkeypatch.setattr(ring, "PASS_BYTES", 1)
  assert plan(strategy_key, heads_key)[3] > 1
  check(strategy_key, "ctx8", heads_key, masks=("packed",), zigzag=(True,))


def plan(strategy_key, heads_key, kernel="blockwise"):
  """`ring.pass_plan` for this suite's per-device shapes on context=8, as the ring plans it for `kernel`."""
  n_heads, kv_heads = HEADS[heads_key]
  case = CASES[kernel]
  local = lambda heads: jax.ShapeDtypeStruct((B, case.t // 8, heads, case.h), jnp.float32)  # noqa: E731
  return ring.pass_plan(local(n_heads), local(kv_heads), STRATEGIES[strategy_key][1] or 1,
                        fit_kv=kernels.parts(KERNEL_OF[kernel][0], case.block, case.block).fit_kv)


@pytest.mark.slow
@pytest.mark.parametrize("heads_key", list(HEADS))
@pytest.mark.parametrize("mesh_key", list(MESHES))
@pytest.mark.parametrize("strategy_key", list(STRATEGIES))
def test_matrix_float32(strategy_key, mesh_key, heads_key):
  check(strategy_key, mesh_key, heads_key)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_key", list(MESHES))
@pytest.mark.parametrize("strategy_key", list(STRATEGIES))
def test_matrix_bfloat16(strategy_key, mesh_key):
  check(strategy_key, mesh_key, "gqa4", jnp.bfloat16, masks=("packed",))


def test_refusals_are_expected():
  """The matrix's impossible combinations exist (so the refusal path is exercised) and are the ones we expect."""
  refused = {(s, m, h) for s, (name, degree) in STRATEGIES.items() for m, shape in MESHES.items()
             for h, heads in HEADS.items() if expected_refusal(name, degree, shape, *heads)}
  assert ("usp4", "data2_ctx2_tp2", "mha") in refused
  assert ("ring", "data2_ctx2_tp2", "kv1") in refused
  assert not any(m == "ctx8" for _, m, _ in refused)


# --- flash: the TPU Pallas kernel, run by the Pallas interpreter -----------------------------------------------------

@pytest.mark.parametrize("strategy_key", list(STRATEGIES))
def test_flash_context8_packed_gqa(strategy_key):
  """Every strategy with the flash kernel: GQA 4:1 (ulysses replicating KV heads), packed documents of random
  lengths (some shorter than a block, padding in one row) in both layouts, forward and dq/dk/dv."""
  check(strategy_key, "ctx8", "gqa4", masks=("packed",), kernel="flash")


@pytest.mark.parametrize("strategy_key", ["ring", "usp4"])
def test_flash_mha_causal(strategy_key):
  """GQA 1:1 under one causal document: whole tiles shown, cut and hidden by positions alone, both layouts."""
  check(strategy_key, "ctx8", "mha", masks=("causal",), kernel="flash")


@pytest.mark.parametrize("strategy_key", ["ring", "usp2"])
def test_flash_bfloat16(strategy_key):
  check(strategy_key, "ctx8", "gqa4", jnp.bfloat16, masks=("packed",), zigzag=(True,), kernel="flash")


@pytest.mark.parametrize("strategy_key", ["ring", "usp2"])
def test_flash_one_kv_head_per_pass(strategy_key, monkeypatch):
  """Passes of one KV head, as at long sequence lengths: the kernel reads q, dout and delta at a head offset (its
  index maps, no copy); under usp2 each pass's tokens also travel in sub-chunks of whole 128-token key blocks."""
  monkeypatch.setattr(ring, "PASS_BYTES", 1)
  n, _, _, subs = plan(strategy_key, "gqa4", "flash")
  assert n > 1 and subs == (2 if strategy_key == "usp2" else 1)
  check(strategy_key, "ctx8", "gqa4", masks=("packed",), zigzag=(True,), kernel="flash")


# --- flash as lowered for an NVIDIA GPU (Triton kernels), run by the Pallas interpreter -------------------------------

@pytest.fixture
def gpu_kernels(monkeypatch):
  """flash's GPU kernels (in the interpreter: the step is lowered for the CPU); off a GPU, flash takes the TPU's."""
  monkeypatch.setattr(flash, "KERNELS_FOR", "gpu")


@pytest.mark.parametrize("strategy_key", list(STRATEGIES))
def test_flash_gpu_context8_packed_gqa(strategy_key, gpu_kernels):
  """Every strategy with the GPU kernels: GQA 4:1, packed documents of random lengths (some shorter than a block,
  padding in one row), both layouts, forward and dq/dk/dv."""
  check(strategy_key, "ctx8", "gqa4", masks=("packed",), kernel="flash_gpu")


@pytest.mark.parametrize("strategy_key", ["ring", "usp4"])
def test_flash_gpu_mha_causal(strategy_key, gpu_kernels):
  check(strategy_key, "ctx8", "mha", masks=("causal",), kernel="flash_gpu")


@pytest.mark.parametrize("strategy_key", ["ring", "usp2"])
def test_flash_gpu_bfloat16(strategy_key, gpu_kernels):
  check(strategy_key, "ctx8", "gqa4", jnp.bfloat16, masks=("packed",), zigzag=(True,), kernel="flash_gpu")


@pytest.mark.parametrize("strategy_key", ["ring", "usp2"])
def test_flash_gpu_one_kv_head_per_pass(strategy_key, gpu_kernels, monkeypatch):
  """Passes of one KV head (q, dout and delta read at a head offset); under usp2 sub-chunks of whole key blocks."""
  monkeypatch.setattr(ring, "PASS_BYTES", 1)
  n, _, _, subs = plan(strategy_key, "gqa4", "flash_gpu")
  assert n > 1 and subs == (2 if strategy_key == "usp2" else 1)
  check(strategy_key, "ctx8", "gqa4", masks=("packed",), zigzag=(True,), kernel="flash_gpu")
