"""usp (unified sequence parallelism): the context axis of P devices is cut into R = P / U groups of U adjacent
devices. Inside a group an all-to-all (ulysses) moves from token to head sharding; across groups the K/V of the
group's U·T/P tokens travel a ring of R hops (ppermute to the same member of the next group; in sub-chunks of
tokens when a KV head's whole chunk would outweigh a share of the pass's query state, see `ring`). About r/U of the
ring's bytes on the ring, r being the copies of each KV head the all-to-all needs (1 when the KV heads of a pass
split U ways; Llama 3.1 8B at U=8 takes passes of 2 KV heads, so r=4: half the ring's bytes); smaller all-to-alls
than `ulysses`, which keeps them on the fast links of adjacent devices.

`attention.ulysses_degree` is U; null picks the largest U that divides both the context degree and the KV heads per
tensor shard (no KV replication needed). U = 1 is the ring, U = P is ulysses.
"""

from __future__ import annotations

import math

from maxctx import sharding
from maxctx.attention import kernels
from maxctx.attention.registry import Strategy, Traffic, ids_bytes, register
from maxctx.attention.ring import ring_attention, ring_buffer_bytes, ring_traffic
from maxctx.attention.ulysses import AllToAll, check_heads, kv_replication
from maxctx.errors import ConfigError


def default_degree(context: int, kv_heads_local: int) -> int:
  return math.gcd(context, kv_heads_local)


@register
class USP(Strategy):
  name = "usp"
  uses_ulysses_degree = True

  def validate(self, p):
    super().validate(p)
    self.require_chunked(p, self.name)
    degree = p.attention.ulysses_degree or default_degree(p.context, p.n_kv_heads // p.tensor)
    if p.context % degree:   # attention.ulysses_degree >= 1 is the schema's rule
      raise ConfigError(f"attention.ulysses_degree {degree} does not divide the context degree {p.context}; "
                        f"choose a divisor of {p.context}.")
    check_heads(p, degree, self.name, "choose a smaller attention.ulysses_degree.")

  def buffer_bytes(self, p, rows, head_dim, dtype_bytes):
    # The ring between groups carries the group's u·t tokens of the device's share of heads: its own t tokens' bytes.
    # The all-to-all's second layout adds nothing the compiler keeps: every usp step compiled against the same ring
    # (8B, 1M to 32M tokens, v5p-128 and tpu7x-128, u = 2 and the 14M recipes' 8) needs the ring's memory to within
    # 0.2 GiB (docs/results.md, "The planner for a TPU slice"), so the relayout presumably takes its input's place.
    kv = rows * p.seq_len // p.context * (p.n_kv_heads // p.tensor) * head_dim
    return ring_buffer_bytes(kv, dtype_bytes)

  def traffic(self, p, rows, head_dim, dtype_bytes):
    # All-to-alls inside groups of u: forward q, the (copied) K/V and the output; backward q, the output's cotangent,
    # delta (float32), K/V, and back dq, dK, dV as float32 accumulators. Between the groups a ring of context / u hops
    # carries the group's u·t tokens of the device's share of heads (the same bytes as its own t tokens of all of
    # them). The ids are gathered once per step within the group.
    t, kv_local = p.seq_len // p.context, p.n_kv_heads // p.tensor
    u = p.attention.ulysses_degree or default_degree(p.context, kv_local)
    head = rows * t * head_dim                  # elements of one head over the device's tokens
    n, kv = p.n_heads // p.tensor * head, kv_local * kv_replication(kv_local, u) * head
    share = (u - 1) / u
    fwd, bwd = ring_traffic(p.context // u, 2 * kv * dtype_bytes, ids_bytes(rows, u * t), 2 * kv * 4)
    return Traffic(
        forward={"all-to-all": (2 * n + 2 * kv) * dtype_bytes * share, "collective-permute": fwd},
        backward={"all-to-all": ((2 * n + 2 * kv) * dtype_bytes + (n + 2 * kv) * 4 + rows * t * p.n_heads // p.tensor
                                 * 4) * share, "collective-permute": bwd},
        once={"all-gather": ids_bytes(rows, t) * (u - 1)})

  def build(self, mesh, a):
    context = mesh.shape[sharding.SEQ_AXIS]
    parts = kernels.parts(a.kernel, a.block_q, a.block_kv)

    def per_device(q, k, v, segment_ids, positions):
      degree = a.ulysses_degree or default_degree(context, k.shape[2])
      hops = context // degree
      groups = [list(range(g * degree, (g + 1) * degree)) for g in range(hops)]
      # Member u of group g sends to member u of group g + 1.
      perm = [(g * degree + u, (g + 1) % hops * degree + u) for g in range(hops) for u in range(degree)]
      a2a = AllToAll(sharding.SEQ_AXIS, groups if hops > 1 else None, degree)
      return ring_attention(parts, sharding.SEQ_AXIS, perm, hops, a2a)(q, k, v, segment_ids, positions)

    return self.shard(mesh, per_device)
