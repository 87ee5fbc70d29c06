"""Context-parallel attention: forward and forward+backward median time, TFLOP/s and per-device temp memory, per
strategy and kernel, with a baseline row: the `ringattention` PyPI package (0.1.2), cuDNN's fused attention, or JAX's
splash attention (TPU).

  python scripts/bench_attention.py                                  # B=1, T=8192, N=K=8, H=64, causal, f32, context=8
  python scripts/bench_attention.py --strategies ring usp --kernels blockwise --json out.json
  python scripts/bench_attention.py --seq-len 65536 --iters 3 --no-baseline
  python scripts/bench_attention.py --seq-len 65536 --iters 0 --strategies ring usp   # memory only: compiles, no runs
  python scripts/bench_attention.py --kernel flash --head-dim 128 --seq-len 8192 --no-baseline
  python scripts/bench_attention.py --kernel flash --baseline cudnn --context 1 --strategies all_gather \
      --batch 1 --heads 32 --kv-heads 8 --head-dim 128 --seq-len 131072 --dtype bfloat16 --documents 64   # one GPU
  python scripts/bench_attention.py --kernels flash blockwise --baseline splash --context 1 --strategies all_gather \
      --batch 1 --heads 32 --kv-heads 8 --head-dim 128 --seq-len 131072 --dtype bfloat16 --documents 16   # one TPU

On a CPU host it fakes `--context` devices (XLA_FLAGS) before JAX starts. Forward+backward is the vjp with a random
output cotangent; temp memory is its compiled `memory_analysis().temp_size_in_bytes` per device. Timings belong
here, never in tests.
Target at the default shape: ring forward+backward ≤ 0.6 × ringattention's time, and per-device temp no larger.
TFLOP/s count the pairs the mask shows (causal: T(T+1)/2 per row and head; with `--documents`, each document's own
triangle) at 4·H FLOPs each forward and 3.5× that forward+backward (FlashAttention-2's convention: the backward's five
products, one of them the recomputed scores); the cuDNN row is causal without documents, so `--documents` adds rows
of ours with packed documents next to rows without. On one GPU, `--context 1 --strategies all_gather` is the kernel
alone. Splash (jax.experimental.pallas.ops.tpu.splash_attention) takes a static mask over token indices plus
segment ids, which is our mask only in the natural layout with each document contiguous and no padding, as here; so
it is timed on one device (the kernel alone), causal and with `--documents`, and refused under zigzag.
A kernel off the platforms it is made for (flash, for TPUs and NVIDIA GPUs, on a CPU) runs in the Pallas interpreter:
its row is marked "interpreted", its times measure the interpreter, not the kernel, and only its results and memory
mean anything; its speed needs the hardware it is for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


BASELINE_KERNEL = "jax"   # the baseline row's kernel column
DEFAULT_BLOCK = 512       # the baseline's chunks when no block size is given (blockwise's default)


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
  p.add_argument("--block-q", type=int, default=None, help="default: the kernel's own (blockwise 512; flash 512 on "
                 "a TPU, 128 forward and 64 backward on a GPU)")
  p.add_argument("--block-kv", type=int, default=None, help="default: the kernel's own (blockwise 512; flash 512 on "
                 "a TPU, 64 on a GPU)")
  p.add_argument("--load-balance", action="store_true", help="zigzag layout (ours only; the baseline cannot)")
  p.add_argument("--iters", type=int, default=5, help="timed calls per function; 0 compiles and prints memory only")
  p.add_argument("--baseline", choices=["ringattention", "cudnn", "splash"], default="ringattention",
                 help="ringattention 0.1.2's JAX ring (the `bench` extra), jax.nn.dot_product_attention with "
                      "implementation='cudnn' and is_causal=True (XLA's implementation off a GPU), or splash "
                      "attention, causal with segment ids (the Pallas interpreter off a TPU)")
  p.add_argument("--no-baseline", action="store_true")
  p.add_argument("--documents", type=int, default=0,
                 help="also time our rows with each row packed with this many documents of random lengths")
  p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
  return p.parse_args(argv)


def setup_devices(context: int) -> None:
  """Fakes `context` CPU devices for a CPU host. Only the CPU platform reads the flag, and JAX_PLATFORMS is left as
  it is, so on a GPU or TPU host JAX still picks the accelerator (setting JAX_PLATFORMS=cpu when it was unset made
  the first H200 check time the kernels on the host's CPU)."""
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={context}"


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
  causal = np.ones((b, t), np.int32), np.tile(np.arange(t, dtype=np.int32), (b, 1))
  id_sets = {"": causal}   # row label suffix -> (segment ids, positions), natural order
  if args.documents:
    id_sets[f" {args.documents} docs"] = packed(rng, b, t, args.documents)
  q = jax.device_put(jnp.asarray(rng.normal(size=(b, t, n, h)), dtype), heads)
  kk = jax.device_put(jnp.asarray(rng.normal(size=(b, t, k, h)), dtype), heads)
  v = jax.device_put(jnp.asarray(rng.normal(size=(b, t, k, h)), dtype), heads)
  dout = jax.device_put(jnp.asarray(rng.normal(size=(b, t, n, h)), dtype), heads)

  def ids(seg, pos):
    if args.load_balance:
      seg, pos = layout.zigzag(seg, args.context), layout.zigzag(pos, args.context)
    return jax.device_put(seg, toks), jax.device_put(pos, toks)

  def prepare(label, kernel, fn, seg_pos):
    seg, pos = ids(*seg_pos)
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
                fwd_flops=4 * h * n * visible_pairs(seg_pos[0]), tokens=b * t, fns=(fwd, fwd_bwd),
                operands=((q, kk, v, seg, pos), (q, kk, v, seg, pos, dout)), times=([], []))

  def time_round_robin(rows):
    """One call of each function per round, so load on a shared host falls on every row alike."""
    for _ in range(args.iters):
      for row in rows:
        for f, operands, times in zip(row["fns"], row["operands"], row["times"]):
          start = time.perf_counter()
          jax.block_until_ready(f(*operands))
          times.append(time.perf_counter() - start)
    for row in rows:
      row["fwd_ms"], row["fwd_bwd_ms"] = (1e3 * statistics.median(ts) if ts else None for ts in row.pop("times"))
      del row["fns"], row["operands"]
      ms = row["fwd_bwd_ms"]
      row["fwd_bwd_tflops"] = 3.5 * row["fwd_flops"] / ms / 1e9 if ms else None
      row["fwd_bwd_tokens_per_s"] = row["tokens"] / ms * 1e3 if ms else None
    base = next((r for r in rows if r["kernel"] == BASELINE_KERNEL), None)
    for row in rows:
      # The target's measure: forward+backward time over the baseline's at the same shape and block sizes.
      row["fwd_bwd_vs_baseline"] = row["fwd_bwd_ms"] / base["fwd_bwd_ms"] if base and args.iters else None
      cells = (f"{x:{spec}}" if x is not None else "—" for x, spec in (
          (row["fwd_ms"], ".1f"), (row["fwd_bwd_ms"], ".1f"), (row["fwd_bwd_vs_baseline"], ".2f"),
          (row["fwd_bwd_tflops"], ".2f"), (row["fwd_bwd_tokens_per_s"], ",.0f")))
      fwd_ms, fwd_bwd_ms, ratio, tflops, tokens = cells
      print(f"{row['strategy']:<28} {row['kernel']:<10} {fwd_ms:>10} {fwd_bwd_ms:>12} {ratio:>12} {tflops:>10} "
            f"{tokens:>10} {row['temp_mib']:>10.1f}{'  interpreted: not a speed' if row.get('interpreted') else ''}",
            flush=True)

  print(f"B={b} T={t} N={n} K={k} H={h} causal {args.dtype} context={args.context} "
        f"load_balance={args.load_balance} block_q={args.block_q} block_kv={args.block_kv} "
        f"on {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), jax {jax.__version__}")
  print(f"{'strategy':<28} {'kernel':<10} {'fwd ms':>10} {'fwd+bwd ms':>12} {'÷ baseline':>12} {'TFLOP/s':>10} "
        f"{'tokens/s':>10} {'temp MiB':>10}")
  rows = []
  for strategy in args.strategies:
    degree = args.ulysses_degree if strategy == "usp" else None
    label = f"usp {degree}x{args.context // degree}" if degree else strategy
    for kernel in args.kernels:
      # validate as on the kernel's own platform; off it the kernel runs interpreted (see the docstring).
      home = attention.kernels.KERNELS[kernel].platforms if kernel in attention.kernels.KERNELS else None
      interpreted = home is not None and jax.default_backend() not in home
      config = attention.AttentionConfig(strategy=strategy, kernel=kernel, load_balance=args.load_balance,
                                         ulysses_degree=degree, block_q=args.block_q, block_kv=args.block_kv)
      problem = attention.Problem(config, context=args.context, tensor=1, n_heads=n, n_kv_heads=k, seq_len=t,
                                  head_dim=h, platform=home[0] if interpreted else None)
      try:
        attention.validate(problem)
      except ConfigError as err:   # a refused combination is a row, not a crash
        print(f"{label:<28} {kernel:<10} refused: {err}")
        continue
      fn = attention.build(config, mesh)
      for suffix, seg_pos in id_sets.items():
        rows.append(prepare(label + suffix, kernel, fn, seg_pos))
        rows[-1]["interpreted"] = interpreted
  if args.no_baseline:
    pass
  elif args.baseline == "cudnn":
    if args.context != 1:
      print("cuDNN baseline skipped: it is the kernel alone, so it needs --context 1")
    else:
      on_gpu = jax.default_backend() == "gpu"
      rows.append(prepare("cuDNN fused" if on_gpu else "XLA (cuDNN off a GPU)", BASELINE_KERNEL,
                          cudnn_baseline(mesh, "cudnn" if on_gpu else None), causal))
  elif args.baseline == "splash":
    if args.context != 1 or args.load_balance:
      print("splash baseline skipped: its mask is static over token indices, so it needs --context 1 and the natural "
            "layout")
    else:
      on_tpu = jax.default_backend() == "tpu"
      for suffix, seg_pos in id_sets.items():
        rows.append(prepare("splash" + suffix, BASELINE_KERNEL, splash_baseline(mesh, t, n, h, not on_tpu), seg_pos))
        rows[-1]["interpreted"] = not on_tpu
  elif args.load_balance or k != n:
    print("ringattention baseline skipped: it needs the natural layout and N = K")
  else:
    rows.append(prepare("ringattention 0.1.2", BASELINE_KERNEL, baseline(mesh, args, dtype), causal))
  time_round_robin(rows)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(shape=dict(batch=b, seq_len=t, heads=n, kv_heads=k, head_dim=h, dtype=args.dtype,
                                context=args.context, load_balance=args.load_balance, block_q=args.block_q,
                                block_kv=args.block_kv), rows=rows), f, indent=2)
  return rows


def packed(rng, batch: int, length: int, documents: int):
  """(segment ids, positions) [batch, length] of rows packed with `documents` documents of random lengths each."""
  import numpy as np
  seg, pos = np.zeros((batch, length), np.int32), np.zeros((batch, length), np.int32)
  for row in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, length), size=documents - 1, replace=False))
    for i, (start, end) in enumerate(zip([0, *cuts], [*cuts, length])):
      seg[row, start:end], pos[row, start:end] = i + 1, np.arange(end - start)
  return seg, pos


def visible_pairs(seg) -> int:
  """(query, key) pairs the causal mask shows in rows with segment ids `seg` (natural order): L(L+1)/2 a document."""
  import numpy as np
  total = 0
  for row in seg:
    _, lengths = np.unique(row[row != 0], return_counts=True)
    total += int(sum(int(n) * (int(n) + 1) // 2 for n in lengths))
  return total


def cudnn_baseline(mesh, implementation):
  """jax.nn.dot_product_attention, causal, no segment ids: cuDNN's fused flash attention on a GPU."""
  import functools

  import jax
  from jax.sharding import PartitionSpec as P

  from maxctx import sharding

  heads = P(sharding.BATCH_AXES, sharding.SEQ_AXIS, sharding.HEAD_AXIS, None)
  tokens = P(sharding.BATCH_AXES, sharding.SEQ_AXIS)

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(heads, heads, heads, tokens, tokens), out_specs=heads,
                     check_vma=False)
  def attend(q, k, v, segment_ids, positions):
    del segment_ids, positions
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)

  return attend


def splash_baseline(mesh, length: int, n_heads: int, head_dim: int, interpret: bool):
  """JAX's splash attention (Pallas, TPU), causal over token indices with segment ids: our mask for contiguous
  documents in the natural layout. It takes [N, T, H] per row and does not scale the scores, so q is scaled first."""
  import functools

  import jax
  from jax.experimental.pallas.ops.tpu import splash_attention as splash
  from jax.sharding import PartitionSpec as P

  from maxctx import sharding

  block = min(512, length)
  blocks = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                             block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  kernel = splash.make_splash_mha_single_device(splash.MultiHeadMask([splash.CausalMask((length, length))] * n_heads),
                                                block_sizes=blocks, interpret=interpret)
  heads = P(sharding.BATCH_AXES, sharding.SEQ_AXIS, sharding.HEAD_AXIS, None)
  tokens = P(sharding.BATCH_AXES, sharding.SEQ_AXIS)

  def one_row(q_NTH, k_KTH, v_KTH, segment_ids):
    return kernel(q_NTH, k_KTH, v_KTH, segment_ids=splash.SegmentIds(q=segment_ids, kv=segment_ids))

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(heads, heads, heads, tokens, tokens), out_specs=heads,
                     check_vma=False)
  def attend(q, k, v, segment_ids, positions):
    del positions   # contiguous documents in the natural layout: index order is position order
    q = q * head_dim**-0.5
    out_BNTH = jax.vmap(one_row)(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), segment_ids)
    return out_BNTH.transpose(0, 2, 1, 3)

  return attend


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
                query_chunk_size=min(args.block_q or DEFAULT_BLOCK, args.seq_len // args.context),
                key_chunk_size=min(args.block_kv or DEFAULT_BLOCK, args.seq_len // args.context), dtype=dtype,
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
