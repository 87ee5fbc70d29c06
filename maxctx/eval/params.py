"""The parameters an evaluation scores: those at `checkpoint.load_params` (read by `checkpoint.read_params`, as
training reads them) in the run's shardings, or random ones.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from maxctx import checkpoint, sharding, trainer
from maxctx.config import Config
from maxctx.model import Transformer

log = logging.getLogger("maxctx.eval")


def load(config: Config, model: Transformer, mesh: Mesh) -> Any:
  """The parameters of checkpoint.load_params, or (with a warning) random ones from run.seed."""
  # Any length the context axis splits (twice, for zigzag) gives the same parameters.
  shapes, init = trainer.param_shapes(model, mesh, 2 * mesh.shape[sharding.SEQ_AXIS])
  path_text = config.checkpoint.load_params
  if not path_text:
    log.warning("eval: checkpoint.load_params is empty, so these are scores of randomly initialised parameters; "
                "pass checkpoint.load_params=DIR to score a trained model.")
    return init(jax.random.key(config.run.seed))
  return checkpoint.read_params(path_text, shapes)


def save(params: Any, path: str | pathlib.Path) -> pathlib.Path:
  """Writes `params` as an Orbax PyTree that `load` (and checkpoint.load_params in training) reads."""
  path = pathlib.Path(path).expanduser().resolve()
  with ocp.PyTreeCheckpointer() as checkpointer:
    checkpointer.save(path, params, force=True)
  return path
