"""A local attention kernel against `reference` on this host's devices under every strategy: the largest error of the
output and of dq, dk and dv, with packed documents (and a padding tail) and grouped-query heads, in the natural and
the zigzag layout.

  python scripts/check_kernel.py --kernels flash blockwise          # on a TPU or GPU VM: every device on the context axis
  python scripts/check_kernel.py --kernels flash --json exact.json --seq-len 8192

The reference runs in float32 at the highest matmul precision on the same inputs (rounded to --dtype), once, on the
first device. An error is max |got − want| / max(1, max |want|), as tests/test_attention_conformance.py measures it,
and is held to that suite's tolerance for the dtype. A kernel off the platforms it is made for (flash on a CPU) runs
in the Pallas interpreter, validated as on its own platform: a rehearsal, whose errors mean what they say.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}   # tests/test_attention_conformance.py's


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--kernels", nargs="+", default=["flash", "blockwise"])
  p.add_argument("--strategies", nargs="+", default=["all_gather", "ulysses", "ring", "usp"])
  p.add_argument("--context", type=int, default=None, help="devices on the context axis (default: all)")
  p.add_argument("--ulysses-degree", type=int, default=2, help="usp's all-to-all group size")
  p.add_argument("--batch", type=int, default=2, help="rows; the first ends in padding (segment 0)")
  p.add_argument("--seq-len", type=int, default=4096)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, default=4)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--documents", type=int, default=8, help="documents packed into each row")
  p.add_argument("--block", type=int, default=None, help="block_q and block_kv (default: each kernel's own)")
  p.add_argument("--dtype", default="bfloat16", choices=sorted(TOLERANCE))
  p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
  return p.parse_args(argv)


def packed_ids(rng, batch: int, length: int, documents: int):
  """(segment ids, positions) [batch, length]: `documents` documents of random lengths per row, positions restarting
  in each; the first row's last sixteenth is padding (segment 0), which sees nothing and gets zeros."""
  import numpy as np
  seg, pos = np.zeros((batch, length), np.int32), np.zeros((batch, length), np.int32)
  for row in range(batch):
    used = length - length // 16 if row == 0 else length
    cuts = np.sort(rng.choice(np.arange(1, used), size=documents - 1, replace=False))
    for i, (start, end) in enumerate(zip([0, *cuts], [*cuts, used])):
      seg[row, start:end], pos[row, start:end] = i + 1, np.arange(end - start)
  return seg, pos


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import maxctx.attention as attention
  from maxctx import sharding
  from maxctx.attention import kernels, layout
  from maxctx.errors import ConfigError

  context = args.context or jax.device_count()
  b, t, n, k, h = args.batch, args.seq_len, args.heads, args.kv_heads, args.head_dim
  dtype = jnp.dtype(args.dtype)
  mesh = Mesh(np.array(jax.devices()[:context]).reshape(1, 1, context, 1), ("data", "fsdp", "context", "tensor"))
  heads = NamedSharding(mesh, P(sharding.BATCH_AXES, sharding.SEQ_AXIS, sharding.HEAD_AXIS, None))
  toks = NamedSharding(mesh, P(sharding.BATCH_AXES, sharding.SEQ_AXIS))
  rng = np.random.default_rng(0)
  # q, k, v, dout rounded to the dtype: the reference sees exactly what the kernel sees.
  q, kk, v, dout = (np.asarray(jnp.asarray(rng.normal(size=s), dtype).astype(jnp.float32))
                    for s in ((b, t, n, h), (b, t, k, h), (b, t, k, h), (b, t, n, h)))
  seg, pos = packed_ids(rng, b, t, args.documents)

  def ref_vjp(q, kk, v, seg, pos, dout):
    out, pullback = jax.vjp(lambda q, kk, v: kernels.reference(q, kk, v, seg, seg, pos, pos), q, kk, v)
    return (out, *pullback(dout))

  with jax.default_device(jax.devices()[0]), jax.default_matmul_precision("highest"):
    want = [np.asarray(x) for x in jax.jit(ref_vjp)(q, kk, v, seg, pos, dout)]
  scales = [max(1.0, float(np.abs(w).max())) for w in want]

  print(f"B={b} T={t} N={n} K={k} H={h} {args.dtype}, {args.documents} documents a row, context={context}, on "
        f"{jax.devices()[0].platform} ({jax.devices()[0].device_kind}), jax {jax.__version__}")
  rows = []
  for strategy in args.strategies:
    degree = args.ulysses_degree if strategy == "usp" else None
    label = f"usp {degree}x{context // degree}" if degree else strategy
    for kernel in args.kernels:
      home = kernels.KERNELS[kernel].platforms if kernel in kernels.KERNELS else None
      interpreted = home is not None and jax.default_backend() not in home
      config = attention.AttentionConfig(strategy=strategy, kernel=kernel, load_balance=True, ulysses_degree=degree,
                                         block_q=args.block, block_kv=args.block)
      problem = attention.Problem(config, context=context, tensor=1, n_heads=n, n_kv_heads=k, seq_len=t, head_dim=h,
                                  platform=home[0] if interpreted else None)
      try:
        attention.validate(problem)
      except ConfigError as err:   # a refused combination is a row, not a crash
        rows.append(dict(strategy=label, kernel=kernel, refused=str(err)))
        print(f"{label:<12} {kernel:<10} refused: {err}", flush=True)
        continue
      fn = attention.build(config, mesh)

      @jax.jit
      def run(q, kk, v, seg, pos, dout):
        out, pullback = jax.vjp(lambda q, kk, v: fn(q, kk, v, seg, pos), q, kk, v)  # noqa: B023
        return (out, *pullback(dout))

      for zigzag in (False, True):
        arrays = [q, kk, v, seg, pos, dout]
        if zigzag:
          arrays = [layout.zigzag(x, context) for x in arrays]
        operands = [jax.device_put(jnp.asarray(x, dtype), heads) for x in arrays[:3]]
        operands += [jax.device_put(x, toks) for x in arrays[3:5]]
        operands += [jax.device_put(jnp.asarray(arrays[5], dtype), heads)]
        try:
          got = [np.asarray(x.astype(jnp.float32)) for x in run(*operands)]
        except Exception as err:  # noqa: BLE001 -- a kernel that fails on the device is this check's finding
          rows.append(dict(strategy=label, kernel=kernel, zigzag=zigzag, failed=f"{type(err).__name__}: {err}"[:300]))
          print(f"{label:<12} {kernel:<10} zigzag={zigzag}: failed: {rows[-1]['failed']}", flush=True)
          continue
        if zigzag:
          got = [layout.unzigzag(x, context) for x in got]
        errors = {name: float(np.abs(g - w).max()) / s for name, g, w, s in zip(("out", "dq", "dk", "dv"), got, want,
                                                                                scales)}
        ok = all(e <= TOLERANCE[args.dtype] for e in errors.values())
        rows.append(dict(strategy=label, kernel=kernel, zigzag=zigzag, interpreted=interpreted, errors=errors,
                         tolerance=TOLERANCE[args.dtype], ok=ok))
        print(f"{label:<12} {kernel:<10} {'zigzag' if zigzag else 'natural':<8} "
              + " ".join(f"{name} {e:.2e}" for name, e in errors.items())
              + f"  {'within' if ok else 'OVER'} {TOLERANCE[args.dtype]:g}"
              + ("  (interpreted)" if interpreted else ""), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(shape=dict(batch=b, seq_len=t, heads=n, kv_heads=k, head_dim=h, dtype=args.dtype,
                                context=context, documents=args.documents, block=args.block), rows=rows), f, indent=2)
  return rows


if __name__ == "__main__":
  if os.environ.get("JAX_PLATFORMS") == "cpu" and "device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
  rows = main()
  sys.exit(0 if rows and all(r.get("ok") for r in rows) else 1)
