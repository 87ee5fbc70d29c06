"""Scoring: oracles score 100% and uniform 0%; ring over 8 devices scores exactly like all_gather + reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxctx import config, mesh as mesh_lib
from maxctx.data import tokenizers
from maxctx.eval import params as params_lib
from maxctx.data import tasks
from maxctx.scoring import forward as scoring, report, sweep
from maxctx import trainer as trainer_lib
from maxctx.trainer import build_model


@pytest.fixture(scope="module")
def pieces():
  return tasks.Pieces(tokenizers.stdlib_tokenizer(512))


def test_token_scores_oracle_and_uniform():
  rng = np.random.default_rng(0)
  answer = rng.integers(0, 512, (6, 9))
  mask = np.ones((6, 9), bool)
  mask[0, 5:] = False
  oracle = 20.0 * jax.nn.one_hot(answer, 512) + rng.normal(size=(6, 9, 512))
  correct, logp = scoring.example_scores(*scoring.token_scores(oracle, answer)[:2], mask)
  assert correct.all() and (logp > -1e-3).all()
  uniform = jnp.zeros((6, 9, 512))
  correct, logp = scoring.example_scores(*scoring.token_scores(uniform, answer)[:2], mask)
  assert not correct.any()  # a tie is not an argmax, whatever the tie-break picks
  np.testing.assert_allclose(logp, -np.log(512), rtol=1e-6)
  # One wrong token makes the example wrong; a wrong token under the mask does not.
  logits = np.array(oracle)
  logits[1, 3, answer[1, 3]] = -50.0
  logits[0, 7, answer[0, 7]] = -50.0
  correct, _ = scoring.example_scores(*scoring.token_scores(logits, answer)[:2], mask)
  assert correct.tolist() == [True, False, True, True, True, True]


def test_recall_is_the_share_of_parts_found_as_ruler_scores(pieces):
  e = tasks.generate("cwe", pieces, 1024, 0.0, 0)
  A = len(e.answer)
  strict = np.ones(A, bool)
  assert scoring.recall(strict, e.spans) == 1.0
  strict[e.spans[3][0]] = False  # one token of the fourth word wrong: that word is missed, the other nine are found
  assert scoring.recall(strict, e.spans) == pytest.approx(0.9)
  assert not scoring.example_scores(np.zeros((1, A)), strict[None], np.ones((1, A), bool))[0][0]
  # A separator RULER's string match does not look at: recall is whole, exact correctness is not.
  between = sorted(set(range(A)) - {i for s, t in e.spans for i in range(s, t)})
  assert between
  strict = np.ones(A, bool)
  strict[between[0]] = False
  assert scoring.recall(strict, e.spans) == 1.0
  # One part, no spans: recall is whether every token is right.
  assert scoring.recall(np.array([True, False]), ()) == 0.0 and scoring.recall(np.array([True, True]), ()) == 1.0


def _next_token_oracle(params, tokens_BT, segment_ids_BT, positions_BT, index_BA):
  """Logits that put all mass on the true next token, found through positions, so any layout must be undone right."""
  del params
  pos_BA = jnp.take_along_axis(positions_BT, index_BA, axis=1)
  hit_BAT = (positions_BT[:, None, :] == pos_BA[..., None] + 1) & (segment_ids_BT[:, None, :] != 0)
  next_BA = jnp.take_along_axis(tokens_BT, jnp.argmax(hit_BAT, axis=-1), axis=1)
  return 30.0 * jax.nn.one_hot(next_BA, 512)


@pytest.mark.parametrize("load_balance", [False, True])
def test_scorer_with_oracle_scores_everything_and_uniform_nothing(pieces, load_balance):
  c = config.load("configs/demo.yml", ["mesh.ici.fsdp=2", "mesh.ici.context=4", "attention.strategy=ring",
                                       f"attention.load_balance={load_balance}"])
  mesh = mesh_lib.build_mesh(c.mesh)
  examples = tasks.sweep(["passkey", "niah_multivalue", "niah_multiquery"], [512], [0.0, 1.0], 2, pieces)
  examples += tasks.sweep(["cwe", "fwe"], [1024], [0.0, 1.0], 1, pieces)
  with jax.set_mesh(mesh):
    oracle = scoring.Scorer(c, mesh, rows=4, forward=_next_token_oracle).score(None, examples)
    assert all(r["correct"] and r["recall"] == 1.0 for r in oracle) and len(oracle) == len(examples)
    for r, e in zip(oracle, examples):
      assert r["argmax"] == e.answer.tolist()
    uniform = scoring.Scorer(c, mesh, forward=lambda *a: jnp.zeros((2, a[4].shape[1], 512))).score(None, examples)
    assert not any(r["correct"] or r["recall"] for r in uniform)


def _scores(overrides, params_dir, examples):
  c = config.load("configs/demo.yml", ["eval.batch_size=8", f"checkpoint.load_params={params_dir}", *overrides])
  mesh = mesh_lib.build_mesh(c.mesh)
  with jax.set_mesh(mesh):
    scorer = scoring.Scorer(c, mesh, rows=8)
    return scorer.score(params_lib.load(c, scorer.model, mesh), examples)


def test_ring_over_8_devices_scores_like_all_gather_reference(pieces, tmp_path):
  # A checkpoint with peaked predictions (a large init scale), so the argmax tokens compared are decided, not near-ties.
  c = config.load("configs/demo.yml", ["mesh.ici.fsdp=8", "mesh.ici.context=1", "model.init_std=0.3"])
  mesh = mesh_lib.build_mesh(c.mesh)
  with jax.set_mesh(mesh):
    _, init = trainer_lib.param_shapes(build_model(c, mesh), mesh, 16)
    params_lib.save(init(jax.random.key(1)), tmp_path / "params")
  examples = tasks.sweep(["passkey", "niah_single"], [1024], [0.0, 0.5, 1.0, 0.25], 1, pieces)
  ref = _scores(["mesh.ici.fsdp=8", "mesh.ici.context=1", "attention.strategy=all_gather",
                 "attention.kernel=reference", "model.init_std=0.3"], tmp_path / "params", examples)
  for lb in (False, True):
    ring = _scores(["mesh.ici.fsdp=1", "mesh.ici.context=8", "attention.strategy=ring", "attention.kernel=blockwise",
                    f"attention.load_balance={lb}", "model.init_std=0.3"], tmp_path / "params", examples)
    for a, b in zip(ref, ring):
      assert a["correct"] == b["correct"] and a["argmax"] == b["argmax"]
      assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)


def test_tables_and_scalars_report_recall_not_all_or_nothing():
  # Two multi-part answers, one with 3 of 4 parts found: RULER scores the cell (3/4 + 1) / 2, not 1/2.
  records = [{"task": "niah_multivalue", "length": 512, "depth": 0.0, "index": i, "correct": c, "recall": r,
              "logprob": -1.0} for i, (c, r) in enumerate([(False, 0.75), (True, 1.0)])]
  assert sweep.accuracy(records) == {("niah_multivalue", 512): 0.875}
  assert sweep.scalars(records) == {"eval/niah_multivalue/512": 0.875}
  assert "| 0 | 88 |" in report.markdown(records, "t")
