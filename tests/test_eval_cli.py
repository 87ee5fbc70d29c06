"""`python -m maxctx.eval`: outputs (jsonl, Markdown, heatmap), task files, the training hook's scalars, user errors."""

import json

import pytest

from maxctx.eval import __main__ as cli

SMALL = ["data.batch_size=2", "run.steps=2", "metrics.log_every=1"]


def _tensorboard_tags(logdir):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  acc = EventAccumulator(str(logdir))
  acc.Reload()
  return acc.Tags()["scalars"]


def test_train_then_sweep_writes_outputs_and_eval_scalars_and_saved_params_reload(tmp_path):
  pytest.importorskip("matplotlib")
  qa = tmp_path / "qa.jsonl"
  qa.write_text("\n".join(json.dumps({"context": f"The box holds {n} coins.", "question": "How many coins?",
                                      "answer": str(n)}) for n in (3, 7, 12)) + "\n")
  run_dir = tmp_path / "run"
  args = ["configs/demo-passkey.yml", f"run.output_dir={run_dir}", *SMALL, "eval.every_steps=1", "--train",
          "--tasks", "passkey,niah_single", "--lengths", "256,512", "--depths", "0,1", "--samples", "1",
          "--files", str(qa)]
  assert cli.main(args) == 0
  out = run_dir / "eval"
  records = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
  assert len(records) == 2 * 2 * 2 + 3
  assert {(r["task"], r["length"]) for r in records if r["depth"] >= 0} == {
      (t, n) for t in ("passkey", "niah_single") for n in (256, 512)}
  assert all({"correct", "logprob", "answer", "argmax"} <= set(r) for r in records)
  md = (out / "eval.md").read_text()
  assert "## passkey" in md and "| depth | 256 | 512 |" in md and "| qa | 3 |" in md
  for task in ("passkey", "niah_single"):
    assert (out / f"{task}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert {"eval/passkey/128", "loss"} <= set(_tensorboard_tags(run_dir / "tensorboard"))

  # The saved parameters score the same when loaded back, on another mesh and strategy.
  again = tmp_path / "again"
  assert cli.main(["configs/demo-passkey.yml", f"checkpoint.load_params={run_dir / 'params'}", "mesh.ici.fsdp=1",
                   "mesh.ici.context=8", "attention.strategy=ring", "attention.kernel=blockwise", "--out", str(again),
                   "--tasks", "passkey", "--lengths", "256", "--depths", "0,1", "--samples", "1"]) == 0
  reloaded = [json.loads(line) for line in (again / "eval.jsonl").read_text().splitlines()]
  before = [r for r in records if r["task"] == "passkey" and r["length"] == 256]
  assert [r["argmax"] for r in reloaded] == [r["argmax"] for r in before]
  assert [r["logprob"] for r in reloaded] == pytest.approx([r["logprob"] for r in before], abs=1e-4)


@pytest.mark.parametrize("args, message", [
    (["--tasks", "passkye"], "--tasks names task 'passkye', which does not exist; did you mean 'passkey'?"),
    (["--lengths", "1k,250"], "eval length 250 is not divisible by 4, the context degree; choose a multiple of 4."),
    (["--lengths", "64"], "task passkey needs at least"),
    (["--depths", "0,2"], "--depths has depth '2'"),
    (["--samples", "0"], "score at least one example per cell"),
    (["--files", "missing.jsonl"], "eval task file missing.jsonl does not exist"),
    (["checkpoint.load_params=/nonexistent/params"], "checkpoint.load_params /nonexistent/params is not a directory"),
    (["eval.batch_size=3"], "eval.batch_size 3 does not split over the 2 data×fsdp shards"),
])
def test_user_errors_exit_2_with_one_sentence(tmp_path, capsys, args, message):
  assert cli.main(["configs/demo-passkey.yml", f"run.output_dir={tmp_path}", *args]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_ruler_counting_and_multiquery_tasks_write_tables_and_heatmaps(tmp_path):
  pytest.importorskip("matplotlib")
  # Random parameters (no checkpoint.load_params): what is checked is what the command writes, not the scores.
  assert cli.main(["configs/demo-passkey.yml", f"run.output_dir={tmp_path}", "--tasks", "cwe,fwe,niah_multiquery",
                   "--lengths", "1k", "--depths", "0,1", "--samples", "1"]) == 0
  out = tmp_path / "eval"
  records = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
  # The needle task has a row per depth; the two without a needle have one row, at depth 0.
  assert sorted((r["task"], r["depth"]) for r in records) == [
      ("cwe", 0.0), ("fwe", 0.0), ("niah_multiquery", 0.0), ("niah_multiquery", 1.0)]
  assert all(r["length"] == 1024 and 0.0 <= r["recall"] <= 1.0 for r in records)
  md = (out / "eval.md").read_text()
  for task in ("cwe", "fwe", "niah_multiquery"):
    assert f"## {task}" in md and (out / f"{task}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  cwe = md[md.index("## cwe"):md.index("## fwe")]
  assert "no needle, so one row" in cwe and "\n| - | " in cwe and "\n| 0 | " not in cwe
