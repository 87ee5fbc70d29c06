"""The extension demo (configs/demo-extend.yml): its rows, and that its stages train what the demo claims.

The demo trains the tiny model on passkey_short at 128 tokens, then extends it to 512 tokens with a 16× RoPE base;
scripts/bench_extend_demo.py runs it for seeds 0, 1 and 2 and docs/evaluation.md records the sweeps. A small model
learns content-based retrieval through filler only when some examples are short: with one 128-token example per row
seed 0 retrieved nothing in 1,500 steps (0% at every length), so each row packs examples of random lengths from the
task's shortest to data.seq_len, each its own document (docs/evaluation.md has the measurements).
"""

import numpy as np
import pytest

from maxctx import config as config_lib
from maxctx.data import dataset, task_rows, tasks
from maxctx.errors import ConfigError

CONFIG = "configs/demo-extend.yml"


@pytest.fixture(scope="module")
def pieces():
  return tasks.Pieces(dataset.tokenizer_for(config_lib.load(CONFIG, []), writes_text=True))


@pytest.mark.parametrize("seq_len", [128, 512])
def test_packed_rows_hold_whole_examples_each_answer_in_the_loss(pieces, seq_len):
  lengths = []
  for i in range(12):
    row = task_rows.row("passkey_short", pieces, 0, i, 0, seq_len, 27)
    assert all(v.shape == (seq_len,) and v.dtype == np.int32 for v in row.values())
    seg = row["segment_ids"]
    docs = [s for s in np.unique(seg) if s]
    assert list(docs) == list(range(1, len(docs) + 1))
    assert (seg == 0).sum() == len(docs)  # one padding slot per example: n tokens give n - 1 pairs
    for s in docs:
      at = np.flatnonzero(seg == s)
      n = len(at) + 1
      lengths.append(n)
      assert n >= 27 and np.array_equal(row["positions"][at], np.arange(n - 1))
      doc = np.concatenate([row["tokens"][at], row["targets"][at][-1:]])
      assert np.array_equal(row["tokens"][at][1:], row["targets"][at][:-1])
      # The example ends in the question and its answer, as the eval builds it at that length.
      text = pieces.tokenizer.decode(doc.tolist())
      key = text.rsplit("The pass key=", 1)[1].strip()
      assert key.isdigit() and len(set(key)) == 5 and f"The pass key={key}." in text
  assert min(lengths) < seq_len // 2 and max(lengths) > 27  # the lengths do vary


def test_one_example_per_row_without_task_min_len(pieces):
  row = task_rows.row("passkey_short", pieces, 0, 0, 0, 128)
  assert row["segment_ids"].tolist() == [1] * 127 + [0]


@pytest.mark.parametrize("overrides, message", [
    (["data.task_min_len=20"], "data.task_min_len 20 is too short: task passkey_short needs at least 27 tokens"),
    (["data.task_min_len=200"], "data.task_min_len is 200 but data.seq_len is 128"),
    (["data.task=passkey_long"], "data.task names task 'passkey_long', which does not exist; did you mean"),
    (["data.source=passkey"], "data.source is passkey, which ignores data.task \\(passkey_short\\) and "
                              "data.task_min_len \\(27\\); set data.source: task"),
])
def test_bad_task_settings_are_refused_in_one_sentence(overrides, message):
  c = config_lib.load(CONFIG, overrides)
  with pytest.raises(ConfigError, match=message):
    dataset._rows_of_task(c, [0])


def test_the_demo_runs_both_stages_and_sweeps_after_each(tmp_path):
  # The shipped schedule with each stage cut to 2 steps: the same lengths, RoPE, strategies and sweeps, so what the
  # full demo (scripts/bench_extend_demo.py) depends on runs here end to end; whether it learns is the script's to show.
  import json
  import yaml
  from maxctx import train
  shipped = config_lib.load(CONFIG, [])
  stages = [{**s.entry(), "steps": 2} for s in shipped.run.stages]
  c = config_lib.load(CONFIG, [f"run.output_dir={tmp_path}", f"run.stages={yaml.safe_dump(stages, width=1000)}",
                               "eval.every_steps=0", "eval.samples=1", "checkpoint.every_steps=0"])
  assert [s.entry().keys() - {"steps"} for s in c.run.stages] == [s.entry().keys() - {"steps"}
                                                                  for s in shipped.run.stages]
  train.run(c)
  for k in (1, 2):
    records = [json.loads(line) for line in (tmp_path / "eval" / f"stage-{k}" / "eval.jsonl").read_text().splitlines()]
    assert {(r["length"], r["depth"]) for r in records} == {(n, d) for n in (128, 256, 512)
                                                             for d in (0, 0.25, 0.5, 0.75, 1)}
    assert (tmp_path / "eval" / f"stage-{k}" / "passkey_short.png").is_file()
