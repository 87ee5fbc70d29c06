"""Training data as global, sharded batches.

    pipeline = maxctx.data.build(config, mesh)
    batch = next(pipeline)   # {"tokens", "targets", "segment_ids", "positions"}: int32 [batch_size, seq_len]
    pipeline.shares()        # with data.mixture: {"data/share/<name>": each source's share of the tokens of the
                             # batches made since the last call}; reading it starts the next interval
    saved = pipeline.state()  # JSON-able; pipeline.restore(saved) continues with exactly the next batch

Contract with the model: the loss counts token t iff segment_ids[t] != 0, and targets[t] is the token that follows
tokens[t] in its document (a document of L tokens gives L−1 pairs; no target crosses a document boundary). Segment ids
run 1..n per sequence (0 = padding) and positions restart at 0 in each document. Arrays are sharded batch over
data×fsdp and sequence over context; with `attention.load_balance` every array is in zigzag layout
(maxctx.attention.layout).

Each process makes only the rows of the global batch that its devices hold (dataset.py explains how rows stay the
same for any process count) and hands each device its slice; no process ever builds the whole global batch. The
state is per process and keyed by row: with several processes, save each process's `state()` (grain's checkpoint
handler does) and restore it into a process that makes the same rows; one process holds every row, so its state
restores onto any mesh.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
from typing import Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from maxctx import sharding
from maxctx.config import Config
from maxctx.data import dataset, mixture
from maxctx.data.packing import FIELDS, SOURCE_TOKENS
from maxctx.errors import CheckpointError

log = logging.getLogger("maxctx.data")

STATE_VERSION = 1
# Sources whose rows are made from (seed, batch index, row): every row is at the same batch index.
GENERATED = ("synthetic", "passkey", "task")
# The keys that decide the stream of rows (a resumed run must share them: maxctx.resume_match). Not the mesh: the
# layout is applied to each batch as it is made, and rows do not depend on which process makes them.
STREAM_KEYS = ("data.source", "data.task", "data.task_min_len", "data.path", "data.seq_len", "data.batch_size",
               "data.tokenizer", "data.text_field", "data.text_separator", "data.packing", "data.long_documents",
               "data.shuffle", "data.num_workers", "data.mixture", "data.long_threshold", "data.long_weight", "run.seed")


def local_rows(batch_sharding: NamedSharding, shape: tuple[int, int]) -> list[int]:
  """The global batch rows held by this process's devices, sorted."""
  rows = set()
  for idx in batch_sharding.addressable_devices_indices_map(shape).values():
    rows.update(range(*idx[0].indices(shape[0])))
  return sorted(rows)


def to_global(local: dict[str, np.ndarray], batch_sharding: NamedSharding,
              shape: tuple[int, int]) -> dict[str, jax.Array]:
  """Global arrays from this process's rows (`local_rows`, in that order, every column): jax places each addressable
  device's [rows, columns] slice, and no process holds or sends another's rows."""
  return {k: jax.make_array_from_process_local_data(batch_sharding, v, shape) for k, v in local.items()}


class Pipeline(Iterator[dict[str, jax.Array]]):
  """Iterates global batches; `state()` / `restore(state)` make resuming exact."""

  def __init__(self, config: Config, mesh: Mesh):
    """`config` as maxctx.trainer.validate passed it for this mesh."""
    d = config.data
    self._config, self._mesh = config, mesh
    self._shape = (d.batch_size, d.seq_len)
    self._sharding = sharding.batch_sharding(mesh)
    self.rows = local_rows(self._sharding, self._shape)
    self._dataset, self._bad = dataset.local_dataset(config, self.rows, mesh.shape[sharding.SEQ_AXIS])
    self._iter = iter(self._dataset)
    self._step = 0
    # Target tokens per mixture source since shares() was last read (None without a mixture).
    self._source_tokens = np.zeros(len(d.mixture), np.int64) if d.mixture else None
    if d.num_workers or d.prefetch:
      # Worker processes (and the prefetch thread) must stop before the interpreter tears down the modules they use.
      atexit.register(self.close)
    log.info("data: %s, %d × %d tokens per batch; this process makes rows %s", d.source, d.batch_size, d.seq_len,
             _ranges(self.rows))

  @property
  def skipped(self) -> int:
    """Records dropped under data.bad_records=skip, in this process so far."""
    return self._bad.skipped if self._bad else 0

  def host_batch(self) -> dict[str, np.ndarray]:
    """The next batch's rows of this process, as numpy [len(self.rows), seq_len], laid out as on the devices."""
    out = next(self._iter)
    self._step += 1
    if SOURCE_TOKENS in out:   # the packer's per-row counts; the batch the devices see holds FIELDS only
      self._source_tokens += out.pop(SOURCE_TOKENS).sum(axis=0)
    return out

  def shares(self) -> dict[str, float]:
    """Each mixture source's share of the (non-padding target) tokens of this process's rows in the batches made
    since the last call, as TensorBoard scalars data/share/<name>, and starts counting afresh: read it only on the
    steps that are logged, so a logged share covers the whole interval. Empty without a mixture or a batch."""
    counts = self._source_tokens
    if counts is None or not counts.any():
      return {}
    self._source_tokens = np.zeros_like(counts)
    total = int(counts.sum())
    return {f"data/share/{mixture.name(self._config.data, i)}": int(c) / total for i, c in enumerate(counts)}

  def __next__(self) -> dict[str, jax.Array]:
    return to_global(self.host_batch(), self._sharding, self._shape)

  def check_first_batch(self) -> None:
    """Makes the first batch and rewinds, so that a record the data cannot use stops the run before the run directory
    is written. Skipped with worker processes, which a rewind would restart."""
    if self._config.data.num_workers:
      return
    start = self.state()
    self.host_batch()
    self.restore(start)

  def close(self) -> None:
    """Stops grain's worker processes (data.num_workers > 0) or prefetch thread; the pipeline cannot be used
    afterwards."""
    self._iter.close()

  def _fingerprint(self) -> dict:
    """STREAM_KEYS by their last name (the form saved states keep)."""
    out = {}
    for key in STREAM_KEYS:
      section, name = key.split(".")
      value = getattr(getattr(self._config, section), name)
      out[name] = [dataclasses.asdict(v) for v in value] if isinstance(value, tuple) else value
    return out

  def state(self) -> dict:
    it = self._iter.get_state()
    if not self._config.data.num_workers:
      # Keyed by row, so a state restores on another mesh as long as it holds the rows the new process makes (a
      # single process always does). Worker processes interleave rows in their own state and cannot be re-keyed.
      it = {"by_row": {str(r): s for r, s in zip(self.rows, it["parents"], strict=True)}}
    return {"version": STATE_VERSION, "step": self._step, "rows": list(self.rows), "config": self._fingerprint(),
            "iterator": it}

  def restore(self, state: dict, carry: bool = False) -> None:
    """Continues exactly after the batch `state` was taken at. `carry`: the state is the previous stage's (run.stages,
    checked by maxctx.stages): each row's documents continue from where that stage stopped reading, packed at this
    stage's length, and a mixture's shares count afresh under this stage's weights."""
    if state.get("version") != STATE_VERSION:
      raise CheckpointError(f"the data iterator state has version {state.get('version')}, this maxctx reads "
                            f"{STATE_VERSION}; resume with the maxctx that saved it or set checkpoint.resume=never.")
    if carry:
      state = _carried(state, self.rows, self._config.data.source in GENERATED)
    saved, now = state["config"], self._fingerprint()
    for k in now:
      # A key an older state did not keep was checked against the checkpoint's config already (resume_match); a
      # carried state's keys are the last stage's.
      if k in saved and saved[k] != now[k] and not carry:
        raise CheckpointError(f"the data iterator state was saved with {k}={saved.get(k)!r} but this run has "
                              f"{now[k]!r}; resume with the same data settings or set checkpoint.resume=never.")
    it = state["iterator"]
    if "by_row" in it:
      have = {int(r) for r in it["by_row"]}
      if not set(self.rows) <= have:
        raise CheckpointError(f"the data iterator state holds rows {_ranges(sorted(have))} but this process makes "
                              f"rows {_ranges(self.rows)}; restore each process's own state, or resume on a mesh "
                              "whose processes make the same rows.")
      it = {"parents": [it["by_row"][str(r)] for r in self.rows]}
    elif list(state["rows"]) != list(self.rows):
      raise CheckpointError(f"the data iterator state holds rows {_ranges(state['rows'])} but this process makes "
                            f"rows {_ranges(self.rows)}; with data.num_workers > 0 resume on the same mesh.")
    self._iter.set_state(it)
    self._step = int(state["step"])
    if self._source_tokens is not None:   # batches made before a rewind are made again
      self._source_tokens[:] = 0


def _carried(state: dict, rows: Sequence[int], generated: bool) -> dict:
  """The previous stage's state as a starting point for this stage: each row's packer restarts at its cursor (no
  sequence of the old length is left to send), a mixture's per-source pair counts restart at 0, and a generated
  source's rows (all at the same batch index) give any new row their index."""
  by_row = state["iterator"].get("by_row")
  if by_row is None:
    raise CheckpointError("the data iterator state was saved with data.num_workers > 0, which a stage of another "
                          "length cannot continue; resume with data.num_workers: 0.")

  def carry(s):
    if isinstance(s, dict) and "emitted" in s and "offset" in s:   # a packer's state
      cursor = s.get("next", {"parent": s["parent"], "offset": s["offset"]})
      parent = cursor["parent"]
      if isinstance(parent, dict) and "taken" in parent:           # a mixture's
        # Counts restart; the document in progress is read again from its own source, then the weights choose.
        parent = {**parent, "taken": [0] * len(parent["taken"]), "first": cursor.get("source")}
      return {"parent": parent, "offset": cursor["offset"], "emitted": 0}
    return s

  any_row = next(iter(by_row.values()))
  missing = [r for r in rows if str(r) not in by_row]
  if missing and not generated:
    raise CheckpointError(f"this process makes rows {_ranges(missing)} in this stage but the last stage's data state "
                          "holds none of them; keep the rows each process makes (the same data×fsdp split of the "
                          "batch) from one stage to the next.")
  out = {str(r): carry(by_row.get(str(r), any_row)) for r in rows}
  return {**state, "rows": list(rows), "iterator": {"by_row": out}}


def _ranges(rows: Sequence[int]) -> str:
  rows = list(rows)
  if rows and rows == list(range(rows[0], rows[-1] + 1)):
    return f"{rows[0]}–{rows[-1]}" if len(rows) > 1 else str(rows[0])
  return ",".join(map(str, rows))


def build(config: Config, mesh: Mesh) -> Pipeline:
  return Pipeline(config, mesh)
