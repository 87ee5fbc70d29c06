"""Context-parallel attention: forward and forward+backward median time and per-device temp memory, per strategy and
kernel, with the `ringattention` PyPI package (0.1.2) as a baseline row.

  python scripts/bench_attention.py                                  # B=1, T=8192, N=K=8, H=64, causal, f32, context=8
  python scripts/bench_attention.py --strategies ring usp --kernels blockwise --json out.json
  python scripts/bench_attention.py --seq-len 65536 --iters 3 --no-baseline
  python scripts/bench_attention.py --seq-len 65536 --iters 0 --strategies ring usp   # memory only: compiles, no runs
  python scripts/bench_attention.py --kernel flash --head-dim 128 --seq-len 8192 --no-baseline

On a CPU host it fakes `--context` devices (XLA_FLAGS) before JAX starts. Forward+backward is the vjp with a random
output cotangent; temp memory is its compiled `memory_analysis().temp_size_in_bytes` per device. Timings belong
here, never in tests.
Target at the default shape: ring forward+backward ≤ 0.6 × ringattention's time, and per-device temp no larger.
A kernel made for another platform (flash, a TPU kernel, on a CPU or GPU) runs in the Pallas interpreter: its row is
marked "interpreted", its times measure the interpreter, not the kernel, and only its results and memory mean
anything; its speed needs the hardware it is for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


BASELINE_KERNEL = "jax"   # the baseline row's kernel column


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--seq-len", type=int, default=8192)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--context", type=int, default=8)
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--strategies", nargs="+", default=["all_gather", "ulysses", "ring", "usp"])
  p.add_argument("--kernels", nargs="+", default=["blockwise"])
  p.add_argument("--ulysses-degree", type=int, default=2, help="usp's all-to-all group size")
  p.add_argument("--block-q", type=int, default=512)
  p.add_argument("--block-kv", type=int, default=512)
  p.add_argument("--load-balance", action="store_true", help="zigzag layout (ours only; the baseline cannot)")
  p.add_argument("--iters", type=int, default=5, help="timed calls per function; 0 compiles and prints memory only")
  p.add_argument("--no-baseline", action="store_true")
  p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
  return p.parse_args(argv)


def setup_devices(context: int) -> None:
  if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={context}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  setup_devices(args.context)

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import maxctx.attention as attention
  from maxctx import sharding
  from maxctx.attention import layout
  from maxctx.errors import ConfigError

  b, t, n, k, h = args.batch, args.seq_len, args.heads, args.kv_heads, args.head_dim
  dtype = jnp.dtype(args.dtype)
  devices = np.array(jax.devices()[:args.context]).reshape(1, 1, args.context, 1)
  mesh = Mesh(devices, ("data", "fsdp", "context", "tensor"))
  heads = NamedSharding(mesh, P(sharding.BATCH_AXES, sharding.SEQ_AXIS, sharding.HEAD_AXIS, None))
  toks = NamedSharding(mesh, P(sharding.BATCH_AXES, sharding.SEQ_AXIS))
  rng = np.random.default_rng(0)
  seg = np.ones((b, t), np.int32)
  pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
  if args.load_balance:
    pos = layout.zigzag(pos, args.context)
  q = jax.device_put(jnp.asarray(rng.normal(size=(b, t, n, h)), dtype), heads)
  kk = jax.device_put(jnp.asarray(rng.normal(size=(b, t, k, h)), dtype), heads)
  v = jax.device_put(jnp.asarray(rng.normal(size=(b, t, k, h)), dtype), heads)
  dout = jax.device_put(jnp.asarray(rng.normal(size=(b, t, n, h)), dtype), heads)
  seg, pos = jax.device_put(seg, toks), jax.device_put(pos, toks)

  def prepare(label, kernel, fn):
    fwd = jax.jit(fn).lower(q, kk, v, seg, pos).compile()

    # Forward+backward with the output's cotangent as an argument, as inside a model (a loss like sum(out) would add
    # a broadcast of ones that XLA may materialise for one strategy and fuse for another).
    def grads(q, kk, v, seg, pos, dout):
      return jax.vjp(lambda q, kk, v: fn(q, kk, v, seg, pos), q, kk, v)[1](dout)

    fwd_bwd = jax.jit(grads).lower(q, kk, v, seg, pos, dout).compile()
    if args.iters:
      jax.block_until_ready(fwd(q, kk, v, seg, pos))   # warm up
      jax.block_until_ready(fwd_bwd(q, kk, v, seg, pos, dout))
    return dict(strategy=label, kernel=kernel, temp_mib=fwd_bwd.memory_analysis().temp_size_in_bytes / 2**20,
                fns=(fwd, fwd_bwd), times=([], []))

  def time_round_robin(rows):
    """One call of each function per round, so load on a shared host falls on every row alike."""
    for _ in range(args.iters):
      for row in rows:
        for f, operands, times in zip(row["fns"], ((q, kk, v, seg, pos), (q, kk, v, seg, pos, dout)),
                                      row["times"]):
          start = time.perf_counter()
          jax.block_until_ready(f(*operands))
          times.append(time.perf_counter() - start)
    for row in rows:
      row["fwd_ms"], row["fwd_bwd_ms"] = (1e3 * statistics.median(ts) if ts else None for ts in row.pop("times"))
      del row["fns"]
    base = next((r for r in rows if r["kernel"] == BASELINE_KERNEL), None)
    for row in rows:
      # The target's measure: forward+backward time over the baseline's at the same shape and block sizes.
      row["fwd_bwd_vs_baseline"] = row["fwd_bwd_ms"] / base["fwd_bwd_ms"] if base and args.iters else None
      ratio, fwd_ms, fwd_bwd_ms = (f"{x:{spec}}" if x is not None else "—" for x, spec in (
          (row["fwd_bwd_vs_baseline"], ".2f"), (row["fwd_ms"], ".1f"), (row["fwd_bwd_ms"], ".1f")))
      print(f"{row['strategy']:<22} {row['kernel']:<10} {fwd_ms:>10} {fwd_bwd_ms:>12} {ratio:>12} "
            f"{row['temp_mib']:>10.1f}{'  interpreted: not a speed' if row.get('interpreted') else ''}", flush=True)

  print(f"B={b} T={t} N={n} K={k} H={h} causal {args.dtype} context={args.context} "
        f"load_balance={args.load_balance} block_q={args.block_q} block_kv={args.block_kv} "
        f"on {jax.devices()[0].platform}")
  print(f"{'strategy':<22} {'kernel':<10} {'fwd ms':>10} {'fwd+bwd ms':>12} {'÷ baseline':>12} {'temp MiB':>10}")
  rows = []
  for strategy in args.strategies:
    degree = args.ulysses_degree if strategy == "usp" else None
    label = f"usp {degree}x{args.context // degree}" if degree else strategy
    for kernel in args.kernels:
      # validate as on the kernel's own platform; off it the kernel runs interpreted (see the docstring).
      home = attention.kernels.KERNELS[kernel].platforms if kernel in attention.kernels.KERNELS else None
      interpreted = home is not None and jax.default_backend() not in home
      problem = attention.Problem(context=args.context, tensor=1, n_heads=n, n_kv_heads=k, seq_len=t, kernel=kernel,
                                  load_balance=args.load_balance, ulysses_degree=degree, block_q=args.block_q,
                                  block_kv=args.block_kv, head_dim=h, platform=home[0] if interpreted else None)
      try:
        attention.validate(strategy, problem)
      except ConfigError as err:   # a refused combination is a row, not a crash
        print(f"{label:<22} {kernel:<10} refused: {err}")
        continue
      fn = attention.build(strategy, mesh, kernel=kernel, load_balance=args.load_balance, ulysses_degree=degree,
                           block_q=args.block_q, block_kv=args.block_kv)
      rows.append(prepare(label, kernel, fn))
      rows[-1]["interpreted"] = interpreted
  if not args.no_baseline:
    if args.load_balance or k != n:
      print("ringattention baseline skipped: it needs the natural layout and N = K")
    else:
      rows.append(prepare("ringattention 0.1.2", BASELINE_KERNEL, baseline(mesh, args, dtype)))
  time_round_robin(rows)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(shape=dict(batch=b, seq_len=t, heads=n, kv_heads=k, head_dim=h, dtype=args.dtype,
                                context=args.context, load_balance=args.load_balance, block_q=args.block_q,
                                block_kv=args.block_kv), rows=rows), f, indent=2)
  return rows


def baseline(mesh, args, dtype):
  """ringattention's blockwise JAX ring (its CPU path) under the same shard_map, causal via its block-causal mask."""
  import functools
  import types

  import jax
  import jax.extend
  from jax.sharding import PartitionSpec as P

  from maxctx import sharding

  # ringattention 0.1.2 reads the platform through jax.lib.xla_bridge, which moved to jax.extend.backend.
  if not hasattr(jax.lib, "xla_bridge"):
    jax.lib.xla_bridge = types.SimpleNamespace(get_backend=jax.extend.backend.get_backend)
  from ringattention import ringattention_jax

  kwargs = dict(causal_block_size=1, deterministic=True, dropout_rng=None, attn_pdrop=0.0,
                query_chunk_size=min(args.block_q, args.seq_len // args.context),
                key_chunk_size=min(args.block_kv, args.seq_len // args.context), dtype=dtype,
                policy=jax.checkpoint_policies.nothing_saveable, precision=None, prevent_cse=True)
  heads = P(sharding.BATCH_AXES, sharding.SEQ_AXIS, sharding.HEAD_AXIS, None)
  tokens = P(sharding.BATCH_AXES, sharding.SEQ_AXIS)

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(heads, heads, heads, tokens, tokens), out_specs=heads,
                     check_vma=False)
  def attend(q, k, v, segment_ids, positions):
    del positions
    return ringattention_jax(q, k, v, None, segment_ids, None, sharding.SEQ_AXIS, True, kwargs)

  return attend


if __name__ == "__main__":
  sys.exit(0 if main() is not None else 1)
