"""Parameters from disk and the checks that they fit: what `checkpoint.load_params` and maxctx.eval read.

A parameters directory is an Orbax PyTree: the `params/` that `python -m maxctx.convert import` writes, or the `state/`
of a training checkpoint step (whose `params` subtree is read and the optimizer state skipped). A tree that does not fit
the model is refused naming the first parameter that differs, before anything is restored.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from maxctx.errors import CheckpointError

log = logging.getLogger("maxctx")

STATE = "state"


def path_of(name: str) -> epath.Path:
  # Orbax misreads some metadata under relative local paths; URLs (gs://...) stay as they are.
  return epath.Path(name if "://" in name else os.path.abspath(name))


def why(e: BaseException) -> str:
  """An exception in a few words, for a sentence that names its cause."""
  text = str(e).strip().splitlines()
  text = text[0] if text else ""
  return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


@contextlib.contextmanager
def quiet_orbax():
  """Orbax logs its own guesses (missing metadata files, ...) while probing a directory that the caller reports in
  one sentence anyway."""
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.CRITICAL)
  try:
    yield
  finally:
    logger.setLevel(level)


def _key_name(k) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
  """Dotted leaf name → shape, for arrays, ShapeDtypeStructs and Orbax array metadata alike."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {".".join(_key_name(k) for k in path): tuple(leaf.shape) for path, leaf in leaves if hasattr(leaf, "shape")}


def _what(name: str) -> str:
  if name.startswith("params."):
    return f"parameter {name.removeprefix('params.')}"
  if name.startswith("opt_state."):
    return f"optimizer state {name}"
  return name


def check_tree(saved: Any, wanted: Any, where: str, fix: str) -> None:
  """Raises a CheckpointError naming the first leaf that is missing, unexpected or of another shape."""
  have, want = _shapes(saved), _shapes(wanted)
  for name, shape in want.items():
    if name not in have:
      raise CheckpointError(f"{where} has no {_what(name)} (shape {shape}), which the model has; {fix}")
    if have[name] != shape:
      raise CheckpointError(f"{where} holds {_what(name)} with shape {have[name]}, but the model needs {shape}; {fix}")
  for name, shape in have.items():
    if name not in want:
      raise CheckpointError(f"{where} holds {_what(name)} (shape {shape}), which the model does not have; {fix}")


LOAD_PARAMS = "checkpoint.load_params"


def _params_dir(name: str, what: str) -> epath.Path:
  """The Orbax PyTree directory that `name` names, or a sentence saying why it names none."""
  path = path_of(name)
  for inner in ("params", STATE):  # A maxctx.convert import output directory, or a step of a training run.
    if (path / inner).is_dir():
      return path / inner
  if (path / "checkpoints").is_dir():
    steps = sorted(int(p.name) for p in (path / "checkpoints").iterdir() if p.name.isdigit())
    example = path / "checkpoints" / str(steps[-1]) if steps else path / "checkpoints" / "<step>"
    example = f"{what}={example}" if what == LOAD_PARAMS else example
    raise CheckpointError(f"{what} {path} is a run directory, not a step of it; pass one of its checkpoint steps, "
                          f"e.g. {example}.")
  if not path.is_dir():
    raise CheckpointError(f"{what} {path} is not a directory; pass the output of python -m maxctx.convert import "
                          "or a checkpoint step directory.")
  return path


def steps_done(name: str) -> int:
  """Steps trained to make the parameters at `name`: a training checkpoint step's number (`<run>/checkpoints/<step>`
  or its `state/`), 0 for any other parameters directory (an import's). With run.stages it picks the stage whose
  settings (RoPE, length) computed them."""
  path = path_of(name)
  step_dir = path.parent if path.name == STATE else path
  return int(step_dir.name) if step_dir.name.isdigit() and (step_dir / STATE).is_dir() else 0


def _tree(checkpointer, path: epath.Path, what: str) -> Any:
  where = f"{what} {path}"
  try:
    with quiet_orbax():
      tree = checkpointer.metadata(path).item_metadata
    tree = getattr(tree, "tree", None)
    if tree is None:
      raise ValueError("it holds no PyTree metadata")
    return tree
  except Exception as e:  # noqa: BLE001
    raise CheckpointError(f"{where} is not a readable Orbax checkpoint ({why(e)}); pass the params directory "
                          "python -m maxctx.convert import wrote, or a checkpoint step.") from None


_FIX = ("set the model.* keys to those the parameters were made with (maxctx.convert import writes them to model.yml "
        "beside params/; a run's config.yml holds them).")


def _checked(checkpointer, path: epath.Path, abstract_params: Any, what: str) -> bool:
  """Whether the tree at `path` is a training state (params beside opt_state); raises if its params do not fit."""
  tree = _tree(checkpointer, path, what)
  # A training checkpoint holds the params under 'params' next to the optimizer state; only that subtree is read.
  nested = isinstance(tree, dict) and "params" in tree and "opt_state" in tree
  check_tree({"params": tree["params"] if nested else tree}, {"params": abstract_params},
             f"{what} {path}", _FIX)
  return nested


def check_params(name: str, abstract_params: Any, what: str = LOAD_PARAMS) -> None:
  """Refuses `checkpoint.load_params` = `name` unless it holds parameters that fit `abstract_params`, reading only
  metadata: a run checks this before it creates anything. `what` names the path in errors."""
  path = _params_dir(name, what)
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
    _checked(checkpointer, path, abstract_params, what)


def read_params(name: str, abstract_params: Any, what: str = LOAD_PARAMS) -> Any:
  """The parameters at `checkpoint.load_params` = `name`, restored into `abstract_params`' shapes and shardings.

  `name` is a parameters directory (an Orbax PyTree as `python -m maxctx.convert import` writes it, or a directory
  holding `params/`) or a training checkpoint step (`<step>/state`, whose `params` subtree is read and the optimizer
  state skipped). Training (`checkpoint.load_params`), maxctx.eval and maxctx.convert export all read parameters here;
  `what` names the path in errors.
  """
  path = _params_dir(name, what)
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
    nested = _checked(checkpointer, path, abstract_params, what)
    target = {"params": abstract_params} if nested else abstract_params
    t = time.perf_counter()
    restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
        target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=nested))
  log.info("checkpoint: loaded parameters from %s in %.1fs", path, time.perf_counter() - t)
  return restored["params"] if nested else restored
