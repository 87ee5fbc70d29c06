"""Scoring by teacher forcing: one forward pass over prompt + answer, read only at the answer.

The model reads the whole example with the run's context-parallel strategy, so any length the run can train on can
be scored. Logits are never formed for the whole sequence ([B, T, V] at a million tokens is terabytes): the final
hidden states are picked at the A positions that predict answer tokens and only those meet the output matrix.

An example is correct when every answer token is the *strict* argmax at its position (a tie is a miss, so a uniform
distribution scores 0%, not whatever the lowest token id happens to be); its log-likelihood is the mean log-probability
of its answer tokens. Its recall is RULER's score (string_match_all: the share of the expected parts found in the
answer) read the same way: a part is found when every token that spells it is the strict argmax. For an answer of one
part, recall is correctness.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from maxctx import model as model_lib
from maxctx import sharding
from maxctx.attention import layout
from maxctx.config import Config
from maxctx.errors import ConfigError
from maxctx.data.tasks import Example
from maxctx.trainer import build_model


def token_scores(logits_BAV: jax.Array, answer_BA: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(log-probability of each answer token, whether it is the strict argmax, the argmax token), each [B, A]."""
  logits_BAV = logits_BAV.astype(jnp.float32)
  logp_BAV = jax.nn.log_softmax(logits_BAV, axis=-1)
  answer_logit_BA = jnp.take_along_axis(logits_BAV, answer_BA[..., None], axis=-1)[..., 0]
  others_BAV = jnp.where(jax.nn.one_hot(answer_BA, logits_BAV.shape[-1], dtype=bool), -jnp.inf, logits_BAV)
  strict_BA = answer_logit_BA > jnp.max(others_BAV, axis=-1)
  logp_BA = jnp.take_along_axis(logp_BAV, answer_BA[..., None], axis=-1)[..., 0]
  return logp_BA, strict_BA, jnp.argmax(logits_BAV, axis=-1).astype(jnp.int32)


def example_scores(logp_BA: np.ndarray, strict_BA: np.ndarray, mask_BA: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(correct [B]: every real answer token is the strict argmax, mean log-probability [B] over real tokens)."""
  mask_BA = np.asarray(mask_BA, bool)
  correct_B = np.all(np.asarray(strict_BA) | ~mask_BA, axis=-1)
  mean_B = np.sum(np.where(mask_BA, logp_BA, 0.0), axis=-1) / np.maximum(mask_BA.sum(-1), 1)
  return correct_B, mean_B


def recall(strict_A: np.ndarray, spans: Sequence[tuple[int, int]]) -> float:
  """The share of an answer's parts (token spans [start, end); none: the whole answer) whose tokens are all right."""
  spans = spans or [(0, len(strict_A))]
  return sum(bool(np.all(strict_A[s:e])) for s, e in spans) / len(spans)


@dataclasses.dataclass(frozen=True)
class Batch:
  """Host arrays of one forward pass, in the device layout (zigzag when load balancing)."""
  tokens: np.ndarray       # [B, T]
  segment_ids: np.ndarray  # [B, T]
  positions: np.ndarray    # [B, T]
  index: np.ndarray        # [B, A] where, in the layout, the token that predicts answer token a sits
  answer: np.ndarray       # [B, A]
  mask: np.ndarray         # [B, A] real answer tokens (answers are padded to the longest in the batch)


def make_batch(examples: Sequence[Example], seq_len: int, context: int, load_balance: bool) -> Batch:
  """Each example in a row of `seq_len` tokens (padding has segment id 0), laid out for the mesh."""
  B, A = len(examples), max(len(e.answer) for e in examples)
  tokens = np.zeros((B, seq_len), np.int32)
  segment_ids = np.zeros((B, seq_len), np.int32)
  positions = np.zeros((B, seq_len), np.int32)
  index = np.zeros((B, A), np.int32)
  answer = np.zeros((B, A), np.int32)
  mask = np.zeros((B, A), bool)
  for b, e in enumerate(examples):
    seq = np.concatenate([e.prompt, e.answer])
    n, p, a = len(seq), len(e.prompt), len(e.answer)
    if n > seq_len:
      raise ValueError(f"example of {n} tokens does not fit a row of {seq_len}")
    tokens[b, :n], segment_ids[b, :n], positions[b, :n] = seq, 1, np.arange(n)
    index[b, :a] = p - 1 + np.arange(a)  # token t predicts token t + 1
    answer[b, :a], mask[b, :a] = e.answer, True
  if load_balance:
    order = layout.zigzag_indices(seq_len, context)
    tokens, segment_ids, positions = (x[:, order] for x in (tokens, segment_ids, positions))
    index = np.argsort(order)[index].astype(np.int32)
  return Batch(tokens, segment_ids, positions, index, answer, mask)


class Scorer:
  """Scores examples with the run's model on the run's mesh; one compilation per (rows, sequence length).

  `forward(params, tokens, segment_ids, positions, index) -> logits [B, A, V]` can be replaced (tests feed an oracle).
  """

  def __init__(self, config: Config, mesh: Mesh, rows: int = 0,
               forward: Callable[..., jax.Array] | None = None):
    self.config, self.mesh = config, mesh
    self.context = mesh.shape[sharding.SEQ_AXIS]
    self.load_balance = config.attention.load_balance
    self.batch_shards = math.prod(mesh.shape[a] for a in sharding.BATCH_AXES)
    rows = rows or self.batch_shards
    if rows % self.batch_shards:
      raise ConfigError(f"eval.batch_size {rows} does not split over the {self.batch_shards} data×fsdp shards of the "
                        f"mesh; make it a multiple of {self.batch_shards} (0 picks {self.batch_shards}).")
    self.rows = rows
    self.model = build_model(config, mesh)
    self._forward = forward or self._answer_logits
    self._sharding = sharding.batch_sharding(mesh)
    self._answer_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(sharding.BATCH_AXES))
    self._step = jax.jit(self._scores)

  def _answer_logits(self, params, tokens_BT, segment_ids_BT, positions_BT, index_BA):
    x_BTD = self.model.apply({"params": params}, tokens_BT, segment_ids_BT, positions_BT)
    # A one-hot contraction instead of a gather: with T sharded over the context axis, each device sums its own
    # tokens and one all-reduce of [B, A, D] finishes it; a gather along a sharded axis would all-gather [B, T, D].
    pick_BAT = jax.nn.one_hot(index_BA, x_BTD.shape[1], dtype=x_BTD.dtype)
    pick_BAT = sharding.constrain(pick_BAT, ("batch", None, "seq"))
    x_BAD = jnp.einsum("bat,btd->bad", pick_BAT, x_BTD)
    return model_lib.logits(params, x_BAD)

  def _scores(self, params, tokens_BT, segment_ids_BT, positions_BT, index_BA, answer_BA):
    return token_scores(self._forward(params, tokens_BT, segment_ids_BT, positions_BT, index_BA), answer_BA)

  def seq_len_for(self, n_tokens: int, exact: bool) -> int:
    """The row length for an example of n_tokens: itself when `exact` (generated tasks), else rounded up."""
    q = layout.row_quantum(self.context, self.load_balance)
    if exact:
      layout.check_length(n_tokens, self.context, self.load_balance, "eval length")
      return n_tokens
    # Records of other lengths share compilations: the smallest q·2^k that holds them.
    return q * 2 ** max(0, math.ceil(math.log2(max(n_tokens, 1) / q)))

  def score(self, params, examples: Sequence[Example], exact: bool = True) -> list[dict]:
    """One record per example: its identity, whether it is correct, the mean log-probability, the argmax answer."""
    groups: dict[int, list[int]] = {}
    for i, e in enumerate(examples):
      groups.setdefault(self.seq_len_for(len(e.prompt) + len(e.answer), exact), []).append(i)
    out: list[dict | None] = [None] * len(examples)
    for seq_len, members in sorted(groups.items()):
      for start in range(0, len(members), self.rows):
        ids = members[start:start + self.rows]
        # Short batches are filled with copies of their first example and the copies' scores dropped.
        chunk = [examples[i] for i in ids] + [examples[ids[0]]] * (self.rows - len(ids))
        b = make_batch(chunk, seq_len, self.context, self.load_balance)
        args = [_put(x, self._sharding) for x in (b.tokens, b.segment_ids, b.positions)]
        args += [_put(x, self._answer_sharding) for x in (b.index, b.answer)]
        logp, strict, top = jax.device_get(self._step(params, *args))
        correct, mean = example_scores(logp, strict, b.mask)
        for row, i in enumerate(ids):
          e = examples[i]
          out[i] = {"task": e.task, "length": e.length, "depth": e.depth, "index": e.index,
                    "correct": bool(correct[row]), "recall": recall(strict[row, :len(e.answer)], e.spans),
                    "logprob": float(mean[row]), "answer": e.answer_text,
                    "argmax": top[row, :len(e.answer)].tolist()}
    return out  # type: ignore[return-value]


def _put(x: np.ndarray, where: jax.sharding.Sharding) -> jax.Array:
  # Every process holds the whole host batch (examples are deterministic), so each device takes its own slice.
  return jax.make_array_from_callback(x.shape, where, lambda idx: x[idx])
