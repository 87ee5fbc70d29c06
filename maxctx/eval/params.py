"""The parameters an evaluation scores: restored from `checkpoint.load_params` into the run's shardings, or random.

`checkpoint.load_params` may name a parameters directory (Orbax PyTree of the params, as scripts/convert_hf.py import
and the passkey demo write it, or a directory holding `params/`) or a training checkpoint step (`<step>/state`, whose
`params` subtree is read and the optimizer state skipped).
"""

from __future__ import annotations

import logging
import pathlib
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from maxctx import sharding
from maxctx.config import Config
from maxctx.errors import CheckpointError
from maxctx.model import Transformer

log = logging.getLogger("maxctx.eval")


def abstract(model: Transformer, mesh: Mesh, seq_len: int) -> tuple[Any, Any]:
  """(ShapeDtypeStructs with shardings, the init function) of the model's parameters on `mesh`."""
  def init(rng):
    # Parameter shapes do not depend on the batch or length: one row per batch shard keeps shard_map's shapes whole.
    tokens = jnp.zeros((sharding.shards("batch"), seq_len), jnp.int32)
    return model.init(rng, tokens, tokens, tokens)["params"]

  boxed = jax.eval_shape(init, jax.random.key(0))
  shardings = sharding.tree_shardings(mesh, boxed)
  shapes = jax.tree.map(lambda b, s: jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=s), nn.unbox(boxed), shardings)
  return shapes, jax.jit(lambda rng: nn.unbox(init(rng)), out_shardings=shardings)


def load(config: Config, model: Transformer, mesh: Mesh) -> Any:
  """The parameters of checkpoint.load_params, or (with a warning) random ones from run.seed."""
  # Any length the context axis splits (twice, for zigzag) gives the same parameters.
  shapes, init = abstract(model, mesh, 2 * mesh.shape[sharding.SEQ_AXIS])
  path_text = config.checkpoint.load_params
  if not path_text:
    log.warning("eval: checkpoint.load_params is empty, so these are scores of randomly initialised parameters; "
                "pass checkpoint.load_params=DIR to score a trained model.")
    return init(jax.random.key(config.run.seed))
  path = pathlib.Path(path_text).expanduser().resolve()
  for inner in ("params", "state"):
    if (path / inner).is_dir():
      path = path / inner
      break
  if not path.is_dir():
    raise CheckpointError(f"checkpoint.load_params {path_text} is not a directory; pass a parameters directory or a "
                          "checkpoint step directory (<run.output_dir>/checkpoints/<step>).")
  where = f"checkpoint.load_params {path}"
  with ocp.PyTreeCheckpointer() as checkpointer:
    try:
      tree = checkpointer.metadata(path).item_metadata.tree
    except Exception as e:  # noqa: BLE001  (Orbax raises many kinds for a directory that is not a checkpoint)
      raise CheckpointError(f"{where} is not a readable Orbax checkpoint ({type(e).__name__}); pass a parameters "
                            "directory or a checkpoint step directory.") from None
    nested = isinstance(tree, dict) and "params" in tree
    saved = tree["params"] if nested else tree
    _check(saved, shapes, where)
    target = {"params": shapes} if nested else shapes
    start = time.perf_counter()
    restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
        target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=nested))
  log.info("eval: loaded parameters from %s in %.1fs", path, time.perf_counter() - start)
  return restored["params"] if nested else restored


def save(params: Any, path: str | pathlib.Path) -> pathlib.Path:
  """Writes `params` as an Orbax PyTree that `load` (and checkpoint.load_params in training) reads."""
  path = pathlib.Path(path).expanduser().resolve()
  with ocp.PyTreeCheckpointer() as checkpointer:
    checkpointer.save(path, params, force=True)
  return path


def _check(saved: Any, wanted: Any, where: str) -> None:
  flat_saved = {jax.tree_util.keystr(k): tuple(getattr(v, "shape", ())) for k, v in
                jax.tree_util.tree_flatten_with_path(saved)[0]}
  flat_wanted = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_flatten_with_path(wanted)[0]}
  for name, shape in flat_wanted.items():
    if name not in flat_saved:
      raise CheckpointError(f"{where} has no parameter {name}; set the model.* keys to those the parameters were "
                            "made with.")
    if flat_saved[name] != shape:
      raise CheckpointError(f"{where} holds {name} of shape {flat_saved[name]} but this model needs {shape}; set the "
                            "model.* keys to those the parameters were made with.")
