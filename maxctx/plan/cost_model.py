"""The planner's analytic cost model: per-device memory, collective bytes and a roofline step time of one training
step, from the config and the mesh alone, before anything compiles. Every number here is an estimate; the planner uses
it to decide which candidates to compile (`python -m maxctx.plan --topology`), and the compile decides fit.

Memory per device (bytes), by part; t = tokens per device (rows × seq_len / context), d, f, q = n_heads·head_dim,
kv = n_kv_heads·head_dim the model's widths per tensor shard, a / p the compute / parameter dtype's bytes:
  state      parameters and AdamW's two float32 moments, ZeRO-3-sharded over fsdp × context × tensor
             (maxctx.sharding): P·(p + 8) / shards, donated, so the output aliases it; and the batch's four int32
             arrays of t tokens
  gradients  the float32 gradient of that shard: 4·P / shards
  saved      what each layer keeps for its backward, × n_layers, by model.remat: the layer input t·d·a (the scan
             carry) under `full`; nothing in HBM under `full_offload` (host memory holds it); with model.remat_group
             g > 1 one input per group (n_layers / g of them) and the g − 1 inputs inside the group being
             differentiated; + the attention output
             and the kernel's float32 softmax statistics under `save_attention_out` (the kernels name both where
             they make them, so attention's forward does not run again: tests/test_attention.py); every matmul
             output under `save_dots`; every activation and the gathered weights under `none`
  layer      the residual stream and its float32 norm in the layer being differentiated, and the layer's weights
             gathered in the compute dtype twice (this layer and the next, prefetched) with their gradient before
             its reduce-scatter
  vocab      the embedding table gathered in the compute dtype, the output head gathered in its stored dtype with its
             float32 gradient sum, and one loss chunk's float32 logits twice (scores and their gradient)
  mlp or     the larger of a layer's backward's two phases (one's buffers are gone before the other's exist; the
  attention  compiled steps below peak in the MLP's): the SwiGLU's four [t, f] buffers (gate, up, their product, its
             gradient; [mlp_chunk, f] under model.mlp_chunk, plus float32 copies of the MLP's weights and gradient
             sums), or q, k, v, the output and their gradients with what the strategy holds beyond its own share
             (Strategy.buffer_bytes: all_gather's whole-sequence K, V and float32 dK, dV; a ring's blocks in flight
             with their float32 accumulators, usp's too; ulysses' second layout, which usp's compiled steps do not show)
Not modelled: the compiler's own scheduling (two phases' or layers' buffers alive at once, copies for layout changes)
and the kernels' score blocks (blockwise: a few hundred MB at 8B); which is why the model is checked against compiled
steps (tests/test_plan_model.py, docs/results.md) and the compile, not the model, decides fit.

Collective bytes per device per step, counted as maxctx.compile.hlo counts a compiled step (all-gather b·(G−1),
reduce-scatter b·(G−1)/G, all-reduce 2b·(G−1)/G): the strategy's attention traffic (Strategy.traffic, forward twice
where remat recomputes it, three times in layer groups) and ZeRO-3's: each layer's weights gathered in the compute
dtype for the forward and again for the backward (once, where remat is `none` and the forward keeps them; once more in
layer groups, whose backward reruns the group's forward), their gradient reduce-scattered, and the embedding and head
likewise once per step. On TPU the compiler lowers these gathers as all-reduces of the whole (zero-padded) array,
which count twice the bytes (measured: docs/planner.md, "How far to trust the cost model").

Step time: max(compute, HBM, network) as maxctx.bench.roofline states it (perfect overlap), with compute from the
analytic model FLOPs plus the forward FLOPs remat runs again (`roofline.recomputed_flops`), HBM from the estimated
memory, network from the collective bytes over the chip's links.
"""

from __future__ import annotations

import dataclasses

from maxctx import attention
from maxctx import metrics
from maxctx import topology as topology_lib
from maxctx import trainer as trainer_lib
from maxctx.bench import roofline
from maxctx.chunks import divisor_at_most
from maxctx.config import Config

GB = 1e9
_BYTES = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class Estimate:
  """One candidate's analytic estimate, per device (bytes, seconds)."""
  memory: dict[str, float]            # by part: state, gradients, saved, layer, vocab, and mlp or attention
  host: float                         # host memory per device (remat full_offload's saved layer inputs)
  collective_bytes: dict[str, float]  # sent per step: attention kinds as Strategy.traffic names them, and "zero"
  compute_s: float
  memory_s: float
  network_s: float
  model_flops: float                  # the whole step's analytic model FLOPs (all devices)
  peak_flops: float                   # all devices' bf16 peak, FLOP/s

  @property
  def total(self) -> float:
    return sum(self.memory.values())

  @property
  def step_s(self) -> float:
    return max(self.compute_s, self.memory_s, self.network_s)

  @property
  def bound(self) -> str:
    return max((self.compute_s, "compute"), (self.memory_s, "HBM"), (self.network_s, "ICI"))[1]

  @property
  def mfu(self) -> float:
    return self.model_flops / (self.step_s * self.peak_flops)

  def fields(self) -> dict:
    """The estimate as maxctx.bench.report.Record's `model_*` fields."""
    return {"model_memory": self.memory, "model_memory_total": self.total, "model_host": self.host,
            "model_collective_bytes": self.collective_bytes, "model_step_s": self.step_s, "model_bound": self.bound,
            "model_mfu": self.mfu}


def _mesh(sizes: dict[str, int]) -> dict[str, int]:
  return {a: sizes.get(a, 1) for a in ("data", "fsdp", "context", "tensor")}


def _rows(config: Config, mesh: dict[str, int]) -> int:
  """Sequences per device in one microbatch (at least one)."""
  return max(config.data.batch_size // (mesh["data"] * mesh["fsdp"] * config.optim.grad_accum), 1)


def memory(config: Config, sizes: dict[str, int], platform: str = "tpu") -> tuple[dict[str, float], float]:
  """(bytes per device by part, host bytes per device); see the module's docstring for each part."""
  m, a, mesh = config.model, config.attention, _mesh(sizes)
  act, pb = _BYTES[m.dtype], _BYTES[m.param_dtype]
  tp = mesh["tensor"]
  rows = _rows(config, mesh)
  per_row = config.data.seq_len // mesh["context"]
  t = rows * per_row
  d, f = m.d_model, m.d_ff // tp
  q, kv = m.n_heads * m.head_dim // tp, m.n_kv_heads * m.head_dim // tp
  params = metrics.param_count(m)
  shard = params / (mesh["fsdp"] * mesh["context"] * tp)
  vocab_params = 2 * m.vocab_size * d
  layer_params = (params - vocab_params) / m.n_layers / tp

  parts = {"state": shard * (pb + 8) + 4 * 4 * t, "gradients": 4 * shard}
  per_layer_saved = {   # bytes per token
      "full": d * act, "full_offload": 0, "save_attention_out": (d + q) * act + m.n_heads // tp * 4,
      "save_dots": (3 * d + 2 * q + 2 * kv + 2 * f) * act,
      # the residual stream thrice, q, k, v before and after RoPE, the attention output, the SwiGLU's four [t, f]
      # arrays, and the two norms' float32 inputs
      "none": (3 * d + 3 * q + 4 * kv + 4 * f) * act + 2 * d * 4,
  }[m.remat]
  parts["saved"] = m.n_layers * (t * per_layer_saved + (layer_params * act if m.remat == "none" else 0))
  groups = m.n_layers // m.remat_group
  if m.remat_group > 1:   # one input per group is saved; a group's backward holds the inputs of its other layers
    parts["saved"] = ((groups if m.remat == "full" else 0) + m.remat_group - 1) * t * d * act
  host = groups * t * d * act if m.remat == "full_offload" else 0.0

  mlp_t = rows * divisor_at_most(m.mlp_chunk, per_row) if m.mlp_chunk else t
  mlp = 4 * mlp_t * f * act + (3 * d * f * 4 * 2 if mlp_t < t else 0)
  qkv = t * (4 * q + 4 * kv) * act
  residual = t * d * (3 * act + 2 * 4)
  weights = layer_params * (2 * act + act)
  parts["layer"] = residual + weights

  v = m.vocab_size // tp
  loss_t = rows * divisor_at_most(m.loss_chunk, per_row)
  parts["vocab"] = v * d * (act + pb + 4) + 2 * loss_t * v * 4

  problem = trainer_lib.attention_problem(config, mesh, platform)
  held = attention.get(a.strategy).buffer_bytes(problem, rows, m.head_dim, act) if mesh["context"] > 1 else 0.0
  # One layer's backward peaks in one phase at a time: the MLP's or attention's (the other's buffers are gone).
  if mlp >= qkv + held:
    parts["mlp"] = mlp
  else:
    parts["attention"] = qkv + held
  return parts, host


def collective_bytes(config: Config, sizes: dict[str, int], platform: str = "tpu") -> dict[str, float]:
  """Bytes one device sends per step, by kind: the strategy's attention traffic, and "zero" (ZeRO-3's parameter
  gathers and gradient reductions, whatever collective the compiler lowers them to)."""
  m, mesh = config.model, _mesh(sizes)
  act, pb = _BYTES[m.dtype], _BYTES[m.param_dtype]
  tp = mesh["tensor"]
  rows = _rows(config, mesh)
  out: dict[str, float] = {}
  if mesh["context"] > 1:
    problem = trainer_lib.attention_problem(config, mesh, platform)
    traffic = attention.get(config.attention.strategy).traffic(problem, rows, m.head_dim, act)
    if traffic is not None:
      runs = 1 if m.remat in ("none", "save_attention_out") else roofline.forward_runs(m)
      out.update(traffic.step(m.n_layers, forward_runs=runs))
  g = mesh["fsdp"] * mesh["context"]
  params = metrics.param_count(m)
  zero = 0.0
  if g > 1:
    vocab_params = 2 * m.vocab_size * m.d_model
    layer_params = (params - vocab_params) / tp
    gathers = 1 if m.remat == "none" else roofline.forward_runs(m)
    # An all-gather sends (G-1)/G of the whole array; on TPU it is an all-reduce of the whole array, twice that.
    gather = (g - 1) / g * (2 if platform == "tpu" else 1)
    zero += (layer_params * act * gathers + vocab_params / 2 / tp * (act + pb)) * gather
    zero += (g - 1) / g * (layer_params * act + vocab_params / 2 / tp * (act + 4))   # gradient reduce-scatters
  if mesh["data"] > 1:   # data parallelism: each gradient shard is all-reduced over the data axis
    zero += 2 * (mesh["data"] - 1) / mesh["data"] * 4 * params / (g * tp)
  if zero:
    out["zero"] = zero
  return out


def estimate(config: Config, sizes: dict[str, int], topo: topology_lib.Topology) -> Estimate:
  """The analytic estimate of `config` on mesh `sizes` of slice `topo`."""
  chip = roofline.chip_for(topo)
  per_chip = topo.generation.devices_per_chip
  parts, host = memory(config, sizes, "tpu")
  coll = collective_bytes(config, sizes, "tpu")
  devices = 1
  for v in sizes.values():
    devices *= v
  m = config.model
  step_flops = metrics.flops_per_step(m, config.data.batch_size, config.data.seq_len)
  peak = chip.bf16_tflops * 1e12 / per_chip
  compute_s = (step_flops + roofline.recomputed_flops(config, sizes)) / devices / peak
  memory_s = 2 * sum(parts.values()) / (chip.hbm_gb_s * GB / per_chip)   # the roofline's argument + output + 2 × temp
  network_s = roofline.bytes_per_link(coll, chip, per_chip) / (chip.link_gb_s * GB)
  return Estimate(parts, host, coll, compute_s, memory_s, network_s, step_flops, peak * devices)
