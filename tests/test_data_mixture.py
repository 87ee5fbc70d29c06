"""data.mixture: the config's list of sources, token shares that follow the weights, exact resume, the logged shares,
and long-document up-sampling."""

import json

import numpy as np
import pytest
import yaml

from maxctx import config as cfg, data, mesh as mesh_lib, train
from maxctx.data import packing, tokenizers
from maxctx.errors import ConfigError

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """Two text sources whose documents differ ~8× in length (so document counts and token counts disagree), and a
  tokenizer for both."""
  d = tmp_path_factory.mktemp("mixture")
  rng = np.random.default_rng(0)

  def doc(n):
    return " ".join(rng.choice(WORDS, n))

  (d / "books.txt").write_text("\n@@\n".join(doc(rng.integers(30, 60)) for _ in range(80)))
  with open(d / "chat.jsonl", "w") as f:
    for _ in range(200):
      f.write(json.dumps({"body": doc(rng.integers(3, 8))}) + "\n")
  tok = tokenizers.train_sentencepiece((doc(40) for _ in range(400)), d / "tok.model", 96)
  return d, str(tok)


def mixture_config(corpus, *overrides, weights=(3, 1)):
  d, tok = corpus
  mix = (f"[{{source: text, path: {d}/books.txt, text_separator: '@@', weight: {weights[0]}, name: books}}, "
         f"{{source: jsonl, path: {d}/chat.jsonl, text_field: body, weight: {weights[1]}, name: chat}}]")
  return cfg.load(None, ["model.preset=tiny", "mesh.ici.fsdp=2", "mesh.ici.context=4", "data.seq_len=32",
                         "data.batch_size=8", "data.prefetch=0", f"data.tokenizer={tok}", "data.source=mixture",
                         f"data.mixture={mix}", *overrides])


def build(c):
  return data.build(c, mesh_lib.build_mesh(c.mesh))


def test_mixture_reads_from_flow_yaml_on_the_command_line_and_round_trips(corpus, tmp_path):
  c = mixture_config(corpus)
  books, chat = c.data.mixture
  assert (books.source, books.weight, books.name, books.text_separator) == ("text", 3.0, "books", "@@")
  assert (chat.source, chat.text_field, chat.text_separator) == ("jsonl", "body", "")   # the entry's defaults
  assert cfg.from_dict(yaml.safe_load(cfg.save(c, tmp_path).read_text())) == c
  run_file = tmp_path / "run.yml"   # YAML block syntax in a run file reads the same
  run_file.write_text(yaml.safe_dump({"data": {"mixture": [{"source": "text", "path": "a.txt", "weight": 2}]}}))
  assert cfg.load(run_file).data.mixture == (cfg.MixtureSource(source="text", path="a.txt", weight=2.0),)


@pytest.mark.parametrize("entry, fragment", [
    ("{source: text, path: a.txt, wieght: 1}", "unknown config key data.mixture[0].wieght in the config; did you mean "
                                               "data.mixture[0].weight?"),
    ("{source: text, path: a.txt, weight: .nan}", "data.mixture[0].weight is nan; it must be a finite number"),
    ("{source: text, path: a.txt}", "data.mixture[0].weight is missing"),
    ("{source: synthetic, path: a.txt, weight: 1}", "data.mixture[0].source must be one of"),
])
def test_a_bad_entry_is_refused_naming_it(entry, fragment):
  with pytest.raises(ConfigError) as e:
    cfg.load(None, [f"data.mixture=[{entry}]", "data.source=mixture"])
  assert fragment in str(e.value)


@pytest.mark.parametrize("weight", [0, -1])
def test_weights_must_be_positive(weight):
  c = cfg.load(None, [f"data.mixture=[{{source: text, path: a.txt, weight: {weight}}}]", "data.source=mixture"])
  with pytest.raises(ConfigError, match=r"data.mixture\[0\].weight is -?\d; it must be above 0"):
    cfg.check(c)


@pytest.mark.parametrize("overrides, fragment", [
    (["data.source=stdlib"], "set data.source=mixture"),
    (["data.mixture=[]"], "data.mixture is empty"),
])
def test_source_and_mixture_must_name_one_stream(corpus, overrides, fragment):
  from maxctx.data import mixture
  with pytest.raises(ConfigError, match=fragment):
    mixture.check(mixture_config(corpus, *overrides))


def _shares(c, steps):
  """The shares over `steps` batches, read once (the pipeline counts every token of the interval)."""
  p = build(c)
  for _ in range(steps):
    p.host_batch()
  return p.shares()


def _batch_by_batch(c, steps):
  """Each of the first `steps` batches' own shares (read after every batch) and non-padding tokens."""
  p = build(c)
  shares, tokens = [], []
  for _ in range(steps):
    tokens.append(int((p.host_batch()["segment_ids"] != 0).sum()))
    shares.append(p.shares())
  p.close()
  return shares, tokens


def _weighted(shares, tokens):
  """The share of several batches, from each one's share and tokens."""
  return {k: sum(s[k] * t for s, t in zip(shares, tokens)) / sum(tokens) for k in shares[0]}


@pytest.mark.parametrize("weights", [(1, 3), (3, 1)])
def test_token_shares_follow_the_weights_not_the_document_counts(corpus, weights):
  # books' documents are ~8× longer than chat's: drawn by document count at 1:3, books would hold ~70% of the tokens.
  shares = _shares(mixture_config(corpus, weights=weights), 200)
  want = {"data/share/books": weights[0] / sum(weights), "data/share/chat": weights[1] / sum(weights)}
  assert shares == pytest.approx(want, abs=0.02)


def test_a_share_covers_every_batch_since_it_was_last_read(corpus):
  # Read after 5 batches, the share is the 5 batches' token-weighted share (what a logged step must show for its
  # whole interval), not the last batch's; and reading starts the next interval.
  c = mixture_config(corpus, weights=(1, 1))
  each, tokens = _batch_by_batch(c, 6)
  assert len({s["data/share/books"] for s in each[:5]}) > 1   # else the last batch's share would pass too
  p = build(c)
  for _ in range(5):
    p.host_batch()
  assert p.shares() == pytest.approx(_weighted(each[:5], tokens[:5]), rel=1e-12)
  assert p.shares() == {}
  p.host_batch()   # the next read covers the 6th batch alone
  assert p.shares() == pytest.approx(each[5], rel=1e-12)


def test_the_batch_the_devices_see_holds_no_source_field(corpus):
  batch = next(build(mixture_config(corpus)))
  assert set(batch) == set(packing.FIELDS)


def test_resume_continues_with_exactly_the_next_batches(corpus):
  c = mixture_config(corpus, "data.packing=concat", "data.prefetch=2")
  first = build(c)
  for _ in range(7):
    first.host_batch()
  first.shares()   # read, so that each share below covers one batch
  saved = json.loads(json.dumps(first.state()))  # as a checkpoint stores it
  expected = [(first.host_batch(), first.shares()) for _ in range(5)]
  resumed = build(c)
  resumed.restore(saved)
  for want, want_shares in expected:
    got = resumed.host_batch()
    for k in packing.FIELDS:
      np.testing.assert_array_equal(got[k], want[k])
    assert resumed.shares() == want_shares
  first.close()
  resumed.close()


def test_long_documents_are_up_sampled_within_their_source(corpus, tmp_path):
  # Half the documents are long (60 words, well over 30 tokens), half short (3 words): at long_weight 4 a long one is
  # drawn 4× as often, so 4/5 of the documents read are long.
  rng = np.random.default_rng(1)
  docs = [" ".join(rng.choice(WORDS, n)) for n in [60] * 40 + [3] * 40]
  (tmp_path / "mixed.txt").write_text("@@".join(docs))
  entry = f"data.mixture=[{{source: text, path: {tmp_path}/mixed.txt, text_separator: '@@', weight: 1}}]"

  def long_share(*overrides):
    p = build(mixture_config(corpus, entry, "data.seq_len=512", *overrides))
    pairs = np.concatenate([np.bincount(row)[1:] for _ in range(40) for row in p.host_batch()["segment_ids"]])
    return np.mean(pairs[pairs > 0] >= 30)

  assert long_share() == pytest.approx(0.5, abs=0.05)
  assert long_share("data.long_threshold=30", "data.long_weight=4") == pytest.approx(0.8, abs=0.05)


def test_training_logs_each_sources_share_to_tensorboard_over_each_log_interval(corpus, tmp_path):
  # Logged every 3 steps: each logged value is the share of the 3 steps' batches, as a pipeline reading the same
  # batches reports it (the shares themselves are checked against the weights over 200 batches above).
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  c = mixture_config(corpus, f"run.output_dir={tmp_path}", "run.steps=6", "metrics.log_every=3",
                     "attention.strategy=ring", "model.n_layers=1", "data.prefetch=2")
  train.run(c)
  acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
  acc.Reload()
  each, tokens = _batch_by_batch(c, 6)
  want = [_weighted(each[:3], tokens[:3]), _weighted(each[3:], tokens[3:])]
  assert want[0] != each[2]   # else the last batch's share would pass too
  for name in ("books", "chat"):
    logged = acc.Scalars(f"data/share/{name}")
    assert [e.step for e in logged] == [3, 6]
    assert [e.value for e in logged] == pytest.approx([w[f"data/share/{name}"] for w in want], rel=1e-6)


def test_a_resumed_run_trains_on_the_same_mixture_batches(corpus, tmp_path):
  # Through the checkpoint: the data position saved at step 3 makes steps 4–6 bit-identical to an uninterrupted run.
  def run(out, steps, *overrides):
    return train.run(mixture_config(corpus, f"run.output_dir={out}", f"run.steps={steps}", "model.n_layers=1",
                                    "checkpoint.every_steps=3", "checkpoint.async_save=false", "data.prefetch=2",
                                    *overrides))

  whole = run(tmp_path / "whole", 6)
  first = run(tmp_path / "parts", 3)
  rest = run(tmp_path / "parts", 6)
  assert first + rest == whole
