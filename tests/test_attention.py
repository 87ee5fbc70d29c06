"""The attention library beyond the conformance matrix: the blockwise kernel against the reference, the block-skip
test, the zigzag layout, validate's sentences, collectives in the compiled HLO, memory from `memory_analysis()`,
and the strategies under jit, scan over layers and remat."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import maxctx.attention as attention
from maxctx import sharding
from maxctx.attention import kernels, layout, mask, ring
from maxctx.errors import ConfigError
from maxctx.model.transformer import REMAT_POLICIES


def make_mesh(data=1, fsdp=1, context=8, tensor=1):
  devices = np.array(jax.devices()[:data * fsdp * context * tensor]).reshape(data, fsdp, context, tensor)
  return Mesh(devices, ("data", "fsdp", "context", "tensor"))


def packed(rng, b, t, shuffle=True):
  """Random documents (segment ids from 1, positions restarting at 0), a padding tail on row 0, tokens shuffled."""
  seg = np.zeros((b, t), np.int32)
  pos = np.zeros((b, t), np.int32)
  for row in range(b):
    cuts = np.sort(rng.choice(np.arange(1, t), size=5, replace=False))
    for i, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, t])):
      seg[row, lo:hi] = i + 1
      pos[row, lo:hi] = np.arange(hi - lo)
  seg[0, -3:] = 0
  order = rng.permutation(t) if shuffle else np.arange(t)
  return seg[:, order], pos[:, order]


# --- kernels ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("blocks", [(16, 8), (None, None)])
def test_blockwise_matches_reference(dtype, blocks):
  rng = np.random.default_rng(0)
  b, t, n, k, h = 2, 96, 8, 2, 16
  q, kk, v, dout = (jnp.asarray(rng.normal(size=s), dtype)
                    for s in [(b, t, n, h), (b, t, k, h), (b, t, k, h), (b, t, n, h)])
  seg, pos = packed(rng, b, t)

  def vjp(kernel, *xs):
    out, pullback = jax.vjp(lambda q, k, v: kernel(q, k, v, seg, seg, pos, pos), *xs)
    return (out, *pullback(dout.astype(out.dtype)))

  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  want = jax.jit(lambda *xs: vjp(kernels.reference, *xs))(f32(q), f32(kk), f32(v))
  got = jax.jit(lambda *xs: vjp(kernels.get("blockwise", *blocks), *xs))(q, kk, v)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  for g, w in zip(got, want):
    assert float(jnp.abs(f32(g) - w).max()) <= tol * max(1.0, float(jnp.abs(w).max()))
  assert got[0].dtype == dtype


def test_fully_masked_rows_are_zero_with_finite_gradients():
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 16, 2, 8)), jnp.float32) for _ in range(3))
  seg = np.zeros((1, 16), np.int32)
  seg[0, :8] = 1
  pos = np.tile(np.arange(16, dtype=np.int32), (1, 1))
  fn = kernels.get("blockwise", 4, 4)
  out = fn(q, k, v, seg, seg, pos, pos)
  grads = jax.grad(lambda q, k, v: fn(q, k, v, seg, seg, pos, pos).sum(), argnums=(0, 1, 2))(q, k, v)
  assert float(jnp.abs(out[0, 8:]).max()) == 0.0
  assert all(bool(jnp.isfinite(g).all()) for g in grads)


def test_hidden_and_full_tiles_are_sound():
  """The block tests on random layouts: a tile pair `hidden` skips has no visible (query, key) pair, and one `full`
  computes without a mask has only visible pairs."""
  rng = np.random.default_rng(2)
  hidden_some = full_some = False
  for trial in range(20):
    seg, pos = packed(rng, 2, 64, shuffle=trial % 3 == 0)
    if trial % 3 == 1:   # zigzag over 4 devices
      seg, pos = layout.zigzag(seg, 4), layout.zigzag(pos, 4)
    vis = np.asarray(mask.visible(seg, seg, pos, pos)).reshape(2, 8, 8, 8, 8)
    hid = np.asarray(mask.hidden(mask.summarize(seg, pos, 8), mask.summarize(seg, pos, 8)))
    assert not np.any(hid[None, :, None, :, None] & vis)
    whole = np.asarray(mask.full(mask.summarize(seg, pos, 8), mask.summarize(seg, pos, 8)))
    assert np.all(vis | ~whole[None, :, None, :, None])
    hidden_some |= bool(hid.any())
    full_some |= bool(whole.any())
  assert hidden_some and full_some


def test_zigzag_layout_balances_and_inverts():
  x = np.arange(32)[None]
  z = layout.zigzag(x, 4)
  assert z[0, :8].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]
  np.testing.assert_array_equal(layout.unzigzag(z, 4), x)
  with pytest.raises(ValueError):
    layout.zigzag(np.arange(30)[None], 4)


# --- validate --------------------------------------------------------------------------------------------------

BASE = dict(context=8, tensor=1, n_heads=8, n_kv_heads=2, seq_len=1024, kernel="blockwise")
SECTION = {f.name for f in dataclasses.fields(attention.AttentionConfig)}


def section(strategy, kernel="blockwise", load_balance=False, ulysses_degree=None, block_q=None, block_kv=None):
  """The run's attention section with base.yml's defaults."""
  return attention.AttentionConfig(strategy, kernel, load_balance, ulysses_degree, block_q, block_kv)


def problem(strategy, **changes):
  """BASE with `changes`, the attention section's keys among them going into the section."""
  kw = {**BASE, **changes}
  return attention.Problem(section(strategy, **{k: v for k, v in kw.items() if k in SECTION}),
                           **{k: v for k, v in kw.items() if k not in SECTION})


@pytest.mark.parametrize("strategy, changes, message", [
    ("rign", {}, r"attention.strategy 'rign' is not a known strategy; did you mean 'ring'\?"),
    ("ring", dict(kernel="blockwize"), r"attention.kernel 'blockwize' is not a known kernel; did you mean"),
    ("ring", dict(seq_len=1020), r"data.seq_len 1020 is not divisible by 8, the context degree"),
    ("ring", dict(seq_len=1032, load_balance=True), r"not divisible by 16, 2 × the context degree 8 \(zigzag"),
    ("ulysses", dict(n_heads=4, n_kv_heads=4), r"attention.strategy ulysses splits the 4 query heads"),
    ("usp", dict(ulysses_degree=3), r"attention.ulysses_degree 3 does not divide the context degree 8"),
    ("usp", dict(n_heads=4, n_kv_heads=4, ulysses_degree=8), r"attention.strategy usp splits the 4 query heads"),
    ("ring", dict(ulysses_degree=2), r"attention.ulysses_degree=2 is read only by usp, not by ring"),
    ("all_gather", dict(n_heads=6, n_kv_heads=4), r"model.n_heads 6 is not a multiple of model.n_kv_heads 4"),
    ("all_gather", dict(tensor=4), r"model.n_kv_heads 2 is not divisible by the tensor degree 4"),
    ("ring", dict(kernel="flash"), r"attention.kernel 'flash' runs only on tpu or gpu, not on cpu; use "
                                   r"attention.kernel=blockwise there\."),
    ("ring", dict(kernel="flash", platform="tpu", block_kv=100), r"attention.block_kv 100 is not a multiple of 128"),
    ("usp", dict(kernel="flash", platform="tpu", seq_len=512), r"the flash kernel needs the 64 tokens per device"),
    ("ring", dict(kernel="flash", platform="tpu", head_dim=64), r"the flash kernel needs model.head_dim to be a "
                                                                r"multiple of 128"),
    ("ring", dict(kernel="flash", platform="gpu", block_q=96), r"attention.block_q 96 is not a power of two of at "
                                                               r"least 16, which the flash kernel's GPU tiles need"),
    ("ring", dict(kernel="flash", platform="gpu", head_dim=96), r"the flash kernel on a GPU needs model.head_dim to "
                                                                r"be a power of two from 16 to 256, not 96"),
    ("usp", dict(kernel="flash", platform="gpu", seq_len=512), r"the flash kernel needs the 64 tokens per device"),
])
def test_validate_refuses_with_one_sentence(strategy, changes, message):
  with pytest.raises(ConfigError, match=message) as err:
    attention.validate(problem(strategy, **changes))
  assert str(err.value).count(". ") == 0 and str(err.value)[-1] in ".?"


def test_validate_accepts_kv_heads_below_the_all_to_all_degree():
  attention.validate(problem("ulysses"))                         # 2 KV heads over 8 devices
  attention.validate(problem("usp", ulysses_degree=4))
  attention.validate(problem("usp"))                             # default degree


@pytest.mark.parametrize("strategy", ["all_gather", "ulysses", "ring", "usp"])
def test_validate_accepts_flash_on_tpu_and_gpu_under_every_strategy(strategy):
  attention.validate(problem(strategy, kernel="flash", platform="tpu", head_dim=128, load_balance=True, block_q=256,
                             block_kv=512))
  attention.validate(problem(strategy, kernel="flash", platform="gpu", head_dim=64, load_balance=True, block_q=64,
                             block_kv=32))


# --- compiled HLO: context parallelism did not switch itself off ------------------------------------------------

def compiled_vjp(strategy, mesh, b, t, n, k, h, dtype=jnp.float32, **kw):
  fn = attention.build(section(strategy, **kw), mesh)
  heads = NamedSharding(mesh, P(sharding.BATCH_AXES, sharding.SEQ_AXIS, sharding.HEAD_AXIS, None))
  toks = NamedSharding(mesh, P(sharding.BATCH_AXES, sharding.SEQ_AXIS))

  # The output's cotangent is an argument, as it is inside a model: a loss like sum(out) would make it a broadcast
  # of ones that XLA may or may not materialise, which is the loss's cost, not the attention's.
  def grads(q, kk, v, seg, pos, dout):
    return jax.vjp(lambda q, kk, v: fn(q, kk, v, seg, pos), q, kk, v)[1](dout)

  spec = lambda shape, dt, s: jax.ShapeDtypeStruct(shape, dt, sharding=s)  # noqa: E731
  return jax.jit(grads).lower(spec((b, t, n, h), dtype, heads), spec((b, t, k, h), dtype, heads),
                              spec((b, t, k, h), dtype, heads), spec((b, t), jnp.int32, toks),
                              spec((b, t), jnp.int32, toks), spec((b, t, n, h), dtype, heads)).compile()


@pytest.mark.parametrize("strategy, kw, present, absent", [
    ("all_gather", {}, ["all-gather"], ["all-to-all", "collective-permute"]),
    ("ulysses", {}, ["all-to-all"], ["collective-permute"]),
    ("ring", {}, ["collective-permute"], ["all-gather", "all-to-all"]),
    ("usp", dict(ulysses_degree=2), ["all-to-all", "collective-permute"], []),
])
def test_hlo_contains_the_strategy_collectives(strategy, kw, present, absent):
  hlo = compiled_vjp(strategy, make_mesh(), 2, 256, 8, 2, 16, **kw).as_text()
  ops = set(re.findall(r"\b(all-gather|all-to-all|collective-permute|all-reduce)(?:-start)?\(", hlo))
  for op in present:
    assert op in ops, f"{strategy}: no {op} in the compiled HLO ({sorted(ops)})"
  for op in absent:
    assert op not in ops, f"{strategy}: unexpected {op} in the compiled HLO"


def test_every_pass_of_the_ring_is_counted_in_the_compiled_step(monkeypatch):
  # The ring's pass loop has a bound XLA cannot see (Ring.pass_loop), so no compiler states its trip count; its op
  # name carries it (scopes.trips) and maxctx.compile.hlo reads it there. Two KV heads in a pass each (PASS_BYTES
  # lowered) make two passes: each hop's collectives run twice as often, and no loop's count is unknown.
  from maxctx.compile import hlo
  from maxctx.attention import ring
  one = hlo.collectives(compiled_vjp("ring", make_mesh(), 2, 256, 8, 2, 16).as_text(), 8)
  monkeypatch.setattr(ring, "PASS_BYTES", 1)
  two = hlo.collectives(compiled_vjp("ring", make_mesh(), 2, 256, 8, 2, 16).as_text(), 8)
  assert one.unknown_trip_counts == two.unknown_trip_counts == 0
  assert two.executions["collective-permute"] == 2 * one.executions["collective-permute"] > 0


# --- memory ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, dtype, degree, block_kv, want", [
    # T=8192 over 8 devices: a head's K/V is 512 KiB, so 4 heads fit a 2 MiB hop and chunks stay whole.
    ((1024, 8, 8, 64), jnp.float32, 1, None, (2, 4, 1, 1)),
    # The memory test's ring: one head's 4 MiB hop against 4 MiB of query state → 8 sub-chunks of 1,024 tokens.
    ((8192, 8, 8, 64), jnp.float32, 1, None, (8, 1, 1, 8)),
    # Blocks of 4,096 keys allow only 2 sub-chunks of 8,192 tokens: the most the blocks allow.
    ((8192, 8, 8, 64), jnp.float32, 1, 4096, (8, 1, 1, 2)),
    # The reference kernel is one block: never split.
    ((8192, 8, 8, 64), jnp.float32, 1, 2**31 - 1, (8, 1, 1, 1)),
    # Llama 3.1 8B at 14M tokens on 64 devices, usp over 8: 2 KV heads per pass (8 query heads split 8 ways), copied
    # 4× for the all-to-all (0.9 GiB a hop whole) against 1.7 GiB of query state → 7 sub-chunks (blocks of 1,024).
    ((229_376, 32, 8, 128), jnp.bfloat16, 8, 1024, (4, 2, 4, 7)),
])
def test_pass_plan_splits_a_head_only_when_its_kv_outweighs_the_queries(shape, dtype, degree, block_kv, want):
  t, n, k, h = shape
  q, kv = jax.ShapeDtypeStruct((1, t, n, h), dtype), jax.ShapeDtypeStruct((1, t, k, h), dtype)
  assert ring.pass_plan(q, kv, degree, block_kv) == want


MEM = dict(b=1, t=65_536, n=8, k=8, h=64)


def temp_bytes(compiled):
  return compiled.memory_analysis().temp_size_in_bytes


def largest_array(compiled) -> int:
  sizes = [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in
           re.findall(r"\b(?:f32|bf16|s32|pred)\[([\d,]*)\]", compiled.as_text())]
  return max(sizes)


@pytest.fixture(scope="module")
def blockwise_one_device_temp():
  """The blockwise kernel alone on one device (context=1), forward+backward."""
  kernel = kernels.get("blockwise")
  b, t, n, k, h = MEM.values()
  spec = jax.ShapeDtypeStruct

  def grads(q, kk, v, s, p, dout):
    return jax.vjp(lambda q, kk, v: kernel(q, kk, v, s, s, p, p), q, kk, v)[1](dout)

  return temp_bytes(jax.jit(grads).lower(spec((b, t, n, h), jnp.float32), spec((b, t, k, h), jnp.float32),
                                         spec((b, t, k, h), jnp.float32), spec((b, t), jnp.int32),
                                         spec((b, t), jnp.int32), spec((b, t, n, h), jnp.float32)).compile())


# usp 4×2 is not held to it: its pass holds the queries (and their float32 numerator) of the all-to-all group's
# U·T/P tokens, 16 MiB at U=4, which with the 16 MiB output saved for the backward is already above 0.2 (it measures
# 0.29).
@pytest.mark.parametrize("strategy, kw", [("ring", {}), ("usp", dict(ulysses_degree=2))])
def test_memory_falls_with_the_context_degree(strategy, kw, blockwise_one_device_temp):
  """B=1, T=65,536, N=K=8, H=64, causal, float32, forward+backward: per-device temp at context=8 is at most 0.2 ×
  the blockwise kernel's alone on one device."""
  temp = temp_bytes(compiled_vjp(strategy, make_mesh(), **kw, **MEM))
  assert temp <= 0.2 * blockwise_one_device_temp, (
      f"{strategy}: {temp / 2**20:.1f} MiB > 0.2 × {blockwise_one_device_temp / 2**20:.1f} MiB")


@pytest.mark.slow
@pytest.mark.parametrize("strategy, kw", [("all_gather", {}), ("ulysses", {}), ("ring", {}),
                                          ("usp", dict(ulysses_degree=2)), ("usp", dict(ulysses_degree=4))])
def test_nothing_holds_a_quadratic_matrix(strategy, kw):
  """The smallest quadratic score matrix a device could hold is its T/P queries × T keys; no array comes close."""
  compiled = compiled_vjp(strategy, make_mesh(), **kw, **MEM)
  quadratic = MEM["t"] // 8 * MEM["t"]
  assert largest_array(compiled) < quadratic // 8
  assert temp_bytes(compiled) < quadratic * 4 // 2


# --- inside jit, scan over layers and remat ------------------------------------------------------------------------

@pytest.mark.parametrize("strategy, kw, dtype", [
    ("all_gather", {}, jnp.float32), ("ulysses", {}, jnp.float32), ("ring", {}, jnp.float32),
    ("usp", dict(ulysses_degree=2), jnp.float32), ("ring", {}, jnp.bfloat16), ("usp", dict(ulysses_degree=2),
                                                                                jnp.bfloat16)])
def test_strategies_under_scan_and_remat(strategy, kw, dtype):
  """Two layers scanned with jax.checkpoint around the body, under jax.set_mesh: loss and parameter gradients equal
  the same model with the reference kernel on one device."""
  rng = np.random.default_rng(3)
  b, t, d, n, k, h, layers = 2, 64, 32, 4, 2, 8, 2
  mesh = make_mesh(fsdp=2, context=4)
  seg, pos = packed(rng, b, t)
  seg, pos = layout.zigzag(seg, 4), layout.zigzag(pos, 4)
  x = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
  params = {name: jnp.asarray(rng.normal(size=(layers, *shape)) * d**-0.5, jnp.float32)
            for name, shape in dict(wq=(d, n * h), wk=(d, k * h), wv=(d, k * h), wo=(n * h, d)).items()}

  def model(attend, params, x):
    def layer(x, p):
      xc = x.astype(dtype)
      q = (xc @ p["wq"].astype(dtype)).reshape(b, t, n, h)
      kk = (xc @ p["wk"].astype(dtype)).reshape(b, t, k, h)
      v = (xc @ p["wv"].astype(dtype)).reshape(b, t, k, h)
      out = attend(q, kk, v, seg, pos).reshape(b, t, n * h)
      return x + (out @ p["wo"].astype(dtype)).astype(jnp.float32), None
    y, _ = jax.lax.scan(jax.checkpoint(layer), x, params)
    return jnp.mean(y**2)

  ref = lambda q, kk, v, s, p: kernels.reference(q, kk, v, s, s, p, p).astype(q.dtype)  # noqa: E731
  want_loss, want_grads = jax.jit(jax.value_and_grad(lambda p: model(ref, p, x)))(params)
  fn = attention.build(section(strategy, block_q=8, block_kv=8, **kw), mesh)
  with jax.set_mesh(mesh):
    got_loss, got_grads = jax.jit(jax.value_and_grad(lambda p: model(fn, p, x)))(params)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  assert abs(float(got_loss) - float(want_loss)) <= tol * max(1.0, abs(float(want_loss)))
  for name in params:
    scale = max(1.0, float(jnp.abs(want_grads[name]).max()))
    assert float(jnp.abs(got_grads[name] - want_grads[name]).max()) <= tol * scale, name


@pytest.mark.parametrize("strategy, kernel", [("ring", "blockwise"), ("usp", "blockwise"), ("all_gather", "blockwise"),
                                              ("ring", "flash")])
def test_save_attention_out_runs_no_attention_forward_in_the_backward(strategy, kernel):
  """`model.remat: save_attention_out` keeps what attention's custom backward needs (its output and softmax
  statistics, named by the kernels where they are made), so the gradient runs attention's forward once, as without
  remat, where `full` runs it twice: counted by the loops in the gradient's jaxpr (the ring's hops and passes, the
  kernel's blocks; the projections that remat reruns have none). K and V are recomputed, so all_gather gathers them
  again."""
  b, t, d, n, k, h = 1, 1024, 256, 2, 1, 128
  mesh = make_mesh(context=4)
  fn = attention.build(section(strategy, kernel, ulysses_degree=2 if strategy == "usp" else None), mesh)
  seg, pos = jnp.ones((b, t), jnp.int32), jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  wq, wk = jnp.ones((d, n * h)), jnp.ones((d, k * h))

  def count(policy):
    def layer(x):
      q, kv = (x @ wq).reshape(b, t, n, h), (x @ wk).reshape(b, t, k, h)
      return jnp.sum(fn(q, kv, kv, seg, pos) ** 2)
    f = layer if policy is None else jax.checkpoint(layer, policy=REMAT_POLICIES[policy])
    with jax.set_mesh(mesh):
      return str(jax.make_jaxpr(jax.grad(f))(jnp.ones((b, t, d)))).count(" while[")

  none = count(None)
  assert count("save_attention_out") == none < count("full")


# --- cudnn (XLA's implementation off the GPU) -------------------------------------------------------------------

def test_validate_refuses_a_whole_sequence_kernel_under_the_ring():
  with pytest.raises(ConfigError, match=r"attention.strategy ring feeds the kernel one chunk of keys at a time, "
                                        r"which attention.kernel 'cudnn' cannot do"):
    attention.validate(problem("ring", kernel="cudnn", platform="gpu"))
  attention.validate(problem("all_gather", kernel="cudnn", platform="gpu"))


def _strategy_against_reference(strategy, kernel, mesh, b, t, n, k, h, seg, pos, block=None):
  rng = np.random.default_rng(4)
  q, kk, v, dout = (jnp.asarray(rng.normal(size=s), jnp.float32)
                    for s in [(b, t, n, h), (b, t, k, h), (b, t, k, h), (b, t, n, h)])
  fn = attention.build(section(strategy, kernel, block_q=block, block_kv=block), mesh)

  def vjp(f):
    out, pullback = jax.vjp(lambda q, kk, v: f(q, kk, v, seg, pos), q, kk, v)
    return (out, *pullback(dout))

  got = jax.jit(lambda: vjp(fn))()
  want = jax.jit(lambda: vjp(lambda q, kk, v, s, p: kernels.reference(q, kk, v, s, s, p, p)))()
  for g, w in zip(got, want):
    assert float(jnp.abs(g - w).max()) <= 1e-5 * max(1.0, float(jnp.abs(w).max()))


def test_cudnn_kernel_wrapper_under_all_gather():
  rng = np.random.default_rng(5)
  seg, pos = packed(rng, 2, 64)
  _strategy_against_reference("all_gather", "cudnn", make_mesh(fsdp=2, context=4), 2, 64, 4, 2, 16, seg, pos)


# --- scripts/bench_attention.py ------------------------------------------------------------------------------------

def test_bench_attention_leaves_the_platform_to_jax(monkeypatch):
  """scripts/gpu_check.sh runs the bench with JAX_PLATFORMS unset on a GPU host; the bench must not pin it to cpu (it
  did, and the first H200 check timed its kernels on the host's CPU) and only adds the CPU's fake-device flag."""
  import importlib.util
  import os
  import pathlib
  script = pathlib.Path(__file__).parent.parent / "scripts" / "bench_attention.py"
  spec = importlib.util.spec_from_file_location("bench_attention_script", script)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.setenv("XLA_FLAGS", "")
  module.setup_devices(4)
  assert "JAX_PLATFORMS" not in os.environ
  assert "--xla_force_host_platform_device_count=4" in os.environ["XLA_FLAGS"]


def test_bench_attention_script_reports_every_row(tmp_path):
  """The benchmark script runs end to end at a small shape and writes one JSON row per strategy, with per-device temp
  memory and both timings (timings are never asserted; only that they were measured), or memory alone."""
  import json
  import pathlib
  import subprocess
  import sys

  script = pathlib.Path(__file__).parent.parent / "scripts" / "bench_attention.py"
  out = tmp_path / "rows.json"

  def run_script(argv):   # as a user runs it: its own process, on the installed package
    subprocess.run([sys.executable, str(script), *argv], check=True, capture_output=True, timeout=600)

  run_script(["--seq-len", "512", "--strategies", "ring", "usp", "--iters", "1", "--block-q", "32", "--block-kv", "32",
              "--no-baseline", "--json", str(out)])
  rows = json.loads(out.read_text())["rows"]
  assert [r["strategy"] for r in rows] == ["ring", "usp 2x4"]
  for r in rows:
    assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["temp_mib"] > 0
    assert r["fwd_bwd_vs_baseline"] is None   # no baseline row to divide by

  # --iters 0: memory only (compiled, never run), so long shapes can be sized in seconds.
  run_script(["--seq-len", "512", "--strategies", "ring", "--iters", "0", "--no-baseline", "--json", str(out)])
  rows = json.loads(out.read_text())["rows"]
  assert [r["strategy"] for r in rows] == ["ring"]
  for r in rows:
    assert r["fwd_ms"] is None and r["fwd_bwd_ms"] is None and r["fwd_bwd_vs_baseline"] is None
    assert not r["interpreted"]
    assert r["temp_mib"] > 0

  # A TPU kernel on the CPU runs in the Pallas interpreter, and its row says so (its times are not the kernel's).
  run_script(["--seq-len", "1024", "--strategies", "ring", "--kernel", "flash", "--head-dim", "128", "--heads", "2",
              "--kv-heads", "1", "--block-q", "128", "--block-kv", "128", "--iters", "0", "--no-baseline",
              "--json", str(out)])
  rows = json.loads(out.read_text())["rows"]
  assert [(r["strategy"], r["kernel"], r["interpreted"]) for r in rows] == [("ring", "flash", True)]
  assert rows[0]["temp_mib"] > 0
