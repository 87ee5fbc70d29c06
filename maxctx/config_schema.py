"""The schema of each config section: names, types and each key's rules on its own value (maxctx.config reads YAML
into these; configs/base.yml holds the defaults, and a test keeps the two in step)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from maxctx.config_stages import StageSpec
from maxctx.config_types import above, at_least, even, rules, within
from maxctx.errors import excerpt

# Each key's rules on its value sit beside it in the schema below (config_types.rules; `check` applies them). 0
# switches lr decay, weight decay, clipping, a momentum, the peak override, saving and the workers off; an epsilon, a
# scale or a base of 0 breaks the numerics.


def axis_size(key: str, value: int) -> str | None:
  if value == 0 or value < -1:
    return f"{key} is {value}; each axis size must be a positive integer or -1 (inferred)."
  return None


def resume_point(key: str, value: str) -> str | None:
  if value not in ("auto", "never") and not value.isdigit():
    return f"{key} is {excerpt(value)}; use auto, never, or a step number such as 100."
  return None


@dataclasses.dataclass(frozen=True)
class RunConfig:
  name: str
  output_dir: str
  steps: int = rules(at_least(1))
  seed: int
  on_nan: Literal["stop", "skip"]
  stages: tuple[StageSpec, ...]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  preset: str
  vocab_size: int = rules(at_least(2))
  d_model: int = rules(at_least(1))
  n_layers: int = rules(at_least(1))
  n_heads: int = rules(at_least(1))
  n_kv_heads: int = rules(at_least(1))
  head_dim: int = rules(at_least(2, "rotary embeddings rotate pairs of dimensions"),
                        even("for rotary embeddings"))
  d_ff: int = rules(at_least(1))
  norm_eps: float = rules(above(0))
  rope_theta: float = rules(above(0))
  rope_scaling: bool
  rope_factor: float = rules(above(0))
  rope_low_freq_factor: float = rules(above(0))
  rope_high_freq_factor: float = rules(above(0))
  rope_original_context: int = rules(at_least(1))
  init_std: float = rules(above(0))
  dtype: Literal["float32", "bfloat16"]
  param_dtype: Literal["float32", "bfloat16"]
  remat: Literal["none", "full", "full_offload", "save_dots", "save_attention_out", "auto"]
  remat_group: int = rules(at_least(1))
  scan_layers: bool
  loss_chunk: int = rules(at_least(1))
  mlp_chunk: int = rules(at_least(0, "a number of tokens, or 0 for the whole sequence at once"))


@dataclasses.dataclass(frozen=True)
class AxesConfig:
  """Devices per mesh axis (-1: the rest of the devices; at most one axis)."""
  data: int = rules(axis_size)
  fsdp: int = rules(axis_size)
  context: int = rules(axis_size)
  tensor: int = rules(axis_size)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """The mesh within a slice (ici) and across slices (dcn); an axis's degree is the product of the two."""
  ici: AxesConfig
  dcn: AxesConfig


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """The context-parallel strategy and the kernel under it (maxctx.attention)."""
  strategy: str
  kernel: str
  load_balance: bool
  ulysses_degree: int | None = rules(at_least(1))
  block_q: int | None = rules(at_least(1))
  block_kv: int | None = rules(at_least(1))


@dataclasses.dataclass(frozen=True)
class MixtureSource:
  """One entry of data.mixture; its optional keys default here (an entry names what it sets; base.yml says so)."""
  source: Literal["stdlib", "text", "jsonl", "arrayrecord", "tfds"]
  path: str
  weight: float = rules(above(0, "its share of the mixture's tokens, relative to the other weights"))
  name: str = ""            # TensorBoard's data/share/<name>; "" = the entry's index
  text_field: str = "text"
  text_separator: str = ""


@dataclasses.dataclass(frozen=True)
class DataConfig:
  source: Literal["synthetic", "passkey", "task", "stdlib", "text", "jsonl", "arrayrecord", "tfds", "mixture"]
  task: str
  task_min_len: int = rules(at_least(0, "0 makes one example of data.seq_len tokens per row"))
  seq_len: int = rules(at_least(2, "a sequence needs at least 2 tokens (an input and its target)"))
  batch_size: int = rules(at_least(1))
  path: str
  text_field: str
  text_separator: str
  tokenizer: str
  packing: Literal["first_fit", "concat"]
  long_documents: Literal["split", "truncate"]
  bad_records: Literal["error", "skip"]
  shuffle: bool
  mixture: tuple[MixtureSource, ...]
  long_threshold: int = rules(at_least(0, "0 turns long-document up-sampling off"))
  long_weight: float = rules(within(1e-3, 1e3, "how many times as often a long document is drawn"))
  num_workers: int = rules(at_least(0, "0 reads in the main process"))
  prefetch: int = rules(at_least(0, "0 makes each batch when asked"))


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  lr: float = rules(at_least(0))
  warmup_steps: int = rules(at_least(0))
  decay_steps: int = rules(at_least(0))
  min_lr_ratio: float = rules(within(0, 1))
  b1: float = rules(within(0, 1))
  b2: float = rules(within(0, 1))
  eps: float = rules(above(0))
  weight_decay: float = rules(at_least(0))
  clip_norm: float = rules(at_least(0))
  grad_accum: int = rules(at_least(1))


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every_steps: int = rules(at_least(0, "0 never saves"))
  keep: int = rules(at_least(1, "2 or more lets a corrupt latest step fall back to the one before"))
  resume: str = rules(resume_point)
  load_params: str
  async_save: bool
  overwrite: bool


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
  log_every: int = rules(at_least(1))
  tensorboard: bool
  peak_tflops: float = rules(at_least(0))


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  every_steps: int
  at_stage_end: bool
  tasks: str
  lengths: str
  depths: str
  samples: int
  batch_size: int
  seed: int
  files: str
  output_dir: str


@dataclasses.dataclass(frozen=True)
class CompileConfig:
  """What `python -m maxctx.compile` compiles for: a TPU topology (e.g. tpu7x-128) and its slice count."""
  topology: str
  num_slices: int = rules(at_least(1, "a job has at least one slice"))
