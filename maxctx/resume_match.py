"""What a checkpoint must share with the run that resumes it, and the checks of the checkpoint.* keys.

A resumed run computes bit-for-bit the losses of the uninterrupted one only if the keys in MUST_MATCH are the same;
everything else (mesh, strategy, run.steps, learning rate, ...) may change between restarts, and the changes are
logged (maxctx.checkpoint).
"""

from __future__ import annotations

from typing import Any

from maxctx.config import Config
from maxctx.errors import ConfigError

# They fix the parameter shapes, what the model computes and which batch comes next.
MUST_MATCH = (
    "model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.head_dim",
    "model.d_ff", "model.norm_eps", "model.rope_theta", "model.rope_scaling", "model.rope_factor",
    "model.rope_low_freq_factor", "model.rope_high_freq_factor", "model.rope_original_context", "model.param_dtype",
    "model.scan_layers", "run.seed", "data.source", "data.path", "data.seq_len", "data.batch_size", "data.tokenizer",
    "data.text_field", "data.text_separator", "data.packing", "data.long_documents", "data.shuffle",
    "data.num_workers", "attention.load_balance",
)
# Not a key but a fact about one: clipping adds a stage to the optimizer state's structure.
CLIPS = "optim.clip_norm > 0"


def _lookup(tree: dict[str, Any], dotted: str) -> Any:
  for part in dotted.split("."):
    if not isinstance(tree, dict) or part not in tree:
      return None
    tree = tree[part]
  return tree


def fingerprint(tree: dict[str, Any]) -> dict[str, Any]:
  """What must match to resume, from a config's dict (this run's or a saved one)."""
  out = {k: _lookup(tree, k) for k in MUST_MATCH}
  clip = _lookup(tree, "optim.clip_norm")
  out[CLIPS] = clip is not None and clip > 0
  return out


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  """A nested config dict as {"section.key": value}."""
  out = {}
  for k, v in tree.items():
    out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
  return out


def validate(config: Config) -> None:
  c = config.checkpoint
  if c.every_steps < 0:
    raise ConfigError(f"checkpoint.every_steps is {c.every_steps}; use 0 (never save) or a positive interval.")
  if c.keep < 1:
    raise ConfigError(f"checkpoint.keep is {c.keep}; keep at least 1 checkpoint (2 or more lets a corrupt latest "
                      "step fall back to the one before).")
  if c.resume not in ("auto", "never") and not (c.resume.isdigit()):
    raise ConfigError(f"checkpoint.resume is {c.resume!r}; use auto, never, or a step number such as 100.")
