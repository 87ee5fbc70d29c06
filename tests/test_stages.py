"""run.stages: a schedule of lengths in one run. The config's stages and their refusals, the data carried from one
stage's length to the next, the learning-rate schedule across stages, and (acceptance 1 of issue 35) a three-stage
run that goes through both boundaries in one process and, killed inside stage 2, resumes bit for bit."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from maxctx import config as cfg, data, mesh as mesh_lib, optim, stages, train
from maxctx.data import tokenizers
from maxctx.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pathlib.Path:
  """Books (long documents) and chat (short ones) with one tokenizer for both."""
  d = tmp_path_factory.mktemp("stages")
  rng = np.random.default_rng(0)

  def doc(n):
    return " ".join(rng.choice(WORDS, n))

  (d / "books.txt").write_text("\n@@\n".join(doc(rng.integers(100, 400)) for _ in range(80)))
  with open(d / "chat.jsonl", "w") as f:
    for _ in range(300):
      f.write(json.dumps({"body": doc(rng.integers(3, 30))}) + "\n")
  tokenizers.train_sentencepiece((doc(40) for _ in range(400)), d / "tok.model", 96)
  return d


def _mixture(d: pathlib.Path, books: float, chat: float) -> list[dict]:
  return [{"source": "text", "path": str(d / "books.txt"), "text_separator": "@@", "weight": books, "name": "books"},
          {"source": "jsonl", "path": str(d / "chat.jsonl"), "text_field": "body", "weight": chat, "name": "chat"}]


def run_file(d: pathlib.Path, out: pathlib.Path, stage_list: list[dict], **sections) -> pathlib.Path:
  """A run file of the tiny model on the two-source mixture, with `stage_list` as run.stages."""
  tree = {"run": {"name": "stages", "output_dir": str(out), "stages": stage_list},
          "model": "tiny",
          "mesh": {"ici": {"data": 1, "fsdp": 4, "context": 2, "tensor": 1}},
          "attention": {"strategy": "all_gather"},
          "data": {"source": "mixture", "tokenizer": str(d / "tok.model"), "batch_size": 8, "seq_len": 64,
                   "prefetch": 0, "mixture": _mixture(d, 3, 1)},
          "optim": {"lr": 3.0e-3, "warmup_steps": 2},
          "checkpoint": {"every_steps": 6, "keep": 10},
          "metrics": {"log_every": 1, "peak_tflops": 1},
          "compile": {}}
  for section, keys in sections.items():
    tree[section].update(keys)
  path = out.parent / f"{out.name}.yml"
  path.write_text(yaml.safe_dump(tree, sort_keys=False))
  return path


# The acceptance run: 64 → 128 → 256 tokens, all_gather on fsdp 4 × context 2 → ring on fsdp 2 × context 4 (new mesh,
# new weights) → usp with a larger RoPE base. Stage ends at 4 and 8; saves at 4, 6, 8 and 10.
def three_stages(d: pathlib.Path) -> list[dict]:
  return [{"steps": 4},
          {"steps": 4, "data.seq_len": 128, "attention.strategy": "ring", "mesh": {"ici": {"fsdp": 2, "context": 4}},
           "data.mixture": _mixture(d, 1, 1)},
          {"steps": 2, "data.seq_len": 256, "attention.strategy": "usp", "model.rope_theta": 40000.0}]


def test_stages_read_from_yaml_each_setting_what_changes_from_the_stage_before(corpus, tmp_path):
  c = cfg.load(run_file(corpus, tmp_path / "run", three_stages(corpus)))
  assert c.run.steps == 10   # left out of the run file: the stages' sum
  plan = stages.resolve(c)
  assert [(s.start, s.end) for s in plan] == [(0, 4), (4, 8), (8, 10)]
  assert [s.config.data.seq_len for s in plan] == [64, 128, 256]
  assert [s.config.attention.strategy for s in plan] == ["all_gather", "ring", "usp"]
  # Stage 3 keeps stage 2's mesh and weights, which it does not name, and changes only RoPE's base.
  assert [dict(s.config.mesh.ici.__dict__)["context"] for s in plan] == [2, 4, 4]
  assert [[m.weight for m in s.config.data.mixture] for s in plan] == [[3, 1], [1, 1], [1, 1]]
  assert [s.config.model.rope_theta for s in plan] == [c.model.rope_theta, c.model.rope_theta, 40000.0]
  assert cfg.from_dict(yaml.safe_load(c.to_yaml())) == c   # config.yml reads back as the same run
  assert [stages.producer(plan, n).index for n in (0, 4, 5, 8, 10)] == [0, 0, 1, 1, 2]
  assert [stages.at(plan, n).index for n in (0, 4, 5, 8, 10)] == [0, 1, 1, 2, 2]


REFUSED = [
    ([{"steps": 2}, {"steps": 2, "data.seq_lne": 128}], "unknown config key data.seq_lne in run.stages[1]; did you "
                                                         "mean data.seq_len?"),
    ([{"steps": 2}, {"steps": 2, "model.d_model": 256}], "config key model.d_model cannot change between stages"),
    ([{"steps": 2, "data.seq_len": 128}, {"steps": 2, "data.seq_len": 64}],
     "run.stages[1] (steps 2–4) sets data.seq_len 64, shorter than the 128"),
    ([{"steps": 2}, {"steps": 2, "data.seq_len": 129}], "run.stages[1] (steps 2–4): "),
    ([{"steps": 2}, {"data.seq_len": 128}], "config key run.stages[1] has no steps"),
    ([{"steps": 2}, {"steps": 2, "attention.strategy": "auto"}], "leaves attention.strategy or model.remat at auto"),
    ([{"steps": 2}, {"steps": 2, "data.batch_size": 16}], "keep data.batch_size and change optim.grad_accum"),
    ([{"steps": 2}, {"steps": 2, "data.mixture": [{"source": "text", "path": "x.txt", "weight": 1}]}],
     "a stage may change only the weights"),
    ([{"steps": 2}, {"steps": 2, "data.mixture": "ZERO"}],
     "run.stages[1] (steps 2–4): data.mixture[0].weight is 0; it must be above 0"),
]


@pytest.mark.parametrize("stage_list,fragment", REFUSED, ids=[f[:40] for _, f in REFUSED])
def test_a_stage_schedule_no_run_can_follow_is_one_sentence_exit_2_and_nothing_written(
    corpus, tmp_path, capsys, stage_list, fragment):
  out = tmp_path / "run"
  stage_list = [{**s, "data.mixture": _mixture(corpus, 0, 1)} if s.get("data.mixture") == "ZERO" else s
                for s in stage_list]
  assert train.main([str(run_file(corpus, out, stage_list))]) == 2
  lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
  assert fragment in lines[-1] and lines[-1].startswith("error: "), lines[-3:]
  assert not out.exists()


def test_run_steps_that_disagree_with_the_stages_is_refused(corpus, tmp_path, capsys):
  out = tmp_path / "run"
  path = run_file(corpus, out, [{"steps": 2}, {"steps": 3}])
  assert train.main([str(path), "run.steps=6"]) == 2
  assert "run.steps is 6 but run.stages trains 5 steps" in capsys.readouterr().err
  assert not out.exists()


def test_an_unreadable_mixture_source_is_refused_before_anything_is_written(corpus, tmp_path, capsys):
  out = tmp_path / "run"
  mix = _mixture(corpus, 1, 1)
  mix[1]["path"] = str(tmp_path / "missing.jsonl")
  path = run_file(corpus, out, [{"steps": 2}, {"steps": 2, "data.seq_len": 128}], data={"mixture": mix})
  assert train.main([str(path)]) == 2
  assert "missing.jsonl" in capsys.readouterr().err
  assert not out.exists()


def _pairs(batches: list[dict], row: int) -> list[tuple[int, int]]:
  """Row `row`'s (token, target) pairs across batches, padding left out."""
  out = []
  for b in batches:
    keep = b["segment_ids"][row] != 0
    out += list(zip(b["tokens"][row][keep].tolist(), b["targets"][row][keep].tolist()))
  return out


@pytest.mark.parametrize("source", ["text", "mixture"])
def test_the_next_stage_packs_each_rows_documents_from_where_the_last_stage_stopped(corpus, tmp_path, source):
  """With concat packing a row's pairs are one stream whatever the length, so stage 1 at 32 tokens then stage 2 at 64
  must give exactly the pairs one pipeline at 32 gives over the same tokens: no document reread, none skipped. A
  mixture's weights count afresh in the new stage, so after the document in progress its picks may differ; that
  document must still continue from its own source where it stopped."""
  over = ["data.packing=concat", "attention.load_balance=false"]
  if source == "text":
    over += ["data.source=text", f"data.path={corpus}/books.txt", "data.text_separator=@@", "data.mixture=[]"]
  # Chat (listed second) mostly: the document in progress at the cut is often chat's, which a fresh count would not
  # pick first (ties go to books).
  c = cfg.load(run_file(corpus, tmp_path / "run", [], data={"mixture": _mixture(corpus, 1, 3)}),
               ["data.seq_len=32", *over])
  mesh = mesh_lib.build_mesh(c.mesh)
  first = data.build(c, mesh)
  stage1 = [first.host_batch() for _ in range(37)]   # past the first documents: cuts inside both sources' documents
  longer = data.build(c.replace(**{"data.seq_len": 64}), mesh)
  longer.restore(first.state(), carry=True)
  stage2 = [longer.host_batch() for _ in range(2)]
  one = data.build(c, mesh)
  straight = [one.host_batch() for _ in range(37 + 4)]
  in_progress = 0
  for row in range(8):
    before, after, whole = _pairs(stage1, row), _pairs(stage2, row), _pairs(straight, row)
    assert whole[:len(before)] == before
    if source == "text":
      assert before + after == whole[:len(before) + len(after)]
    # The cut fell inside a document: the token after it is no BOS (which every row's first token is).
    elif straight[len(stage1)]["tokens"][row][0] != straight[0]["tokens"][row][0]:
      in_progress += 1
      first_document = int((stage2[0]["segment_ids"][row] == 1).sum())
      assert after[:first_document] == whole[len(before):len(before) + first_document], row
  assert source == "text" or in_progress >= 4


def test_a_stage_that_resets_the_schedule_warms_up_again_and_decays_over_its_own_steps(corpus, tmp_path):
  c = cfg.load(run_file(corpus, tmp_path / "run", [{"steps": 10}, {"steps": 20, "reset_schedule": True},
                                                   {"steps": 10}]))
  plan = stages.resolve(c)
  assert [stages.schedule_span(plan, s) for s in plan] == [(0, 10), (10, 30), (10, 30)]
  start, steps = stages.schedule_span(plan, plan[1])
  lr = optim.schedule(plan[1].config.optim, steps, start)
  assert float(lr(10)) == 0.0 and float(lr(12)) == pytest.approx(c.optim.lr)   # warm-up of 2 from step 10
  # One schedule over stages 2 and 3 (steps 10–40), down to optim.min_lr_ratio by the end; stage 1's ends at 10.
  assert float(lr(40)) == pytest.approx(c.optim.lr * c.optim.min_lr_ratio)
  first = optim.schedule(plan[0].config.optim, *reversed(stages.schedule_span(plan, plan[0])))
  assert float(first(10)) == pytest.approx(c.optim.lr * c.optim.min_lr_ratio)
  no_reset = stages.resolve(c.replace(**{"run.stages": [{"steps": 10}, {"steps": 30}]}))
  assert stages.schedule_span(no_reset, no_reset[1]) == (0, 40)


# ---------------------------------------------------------------------------------------------------------------------
# Acceptance: three stages in one process; SIGKILL inside stage 2 (once resuming at the stage boundary, once inside the
# stage), each rerun with the same command; every logged loss equals the uninterrupted run's.


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
  # One compilation cache for the runs: a rerun loads each stage's step instead of compiling it again.
  return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
              PYTHONPATH=str(ROOT), JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def _scalars(out: pathlib.Path, tag: str, before: set) -> dict[int, float]:
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  (new,) = set((out / "tensorboard").glob("events.out.tfevents.*")) - before
  acc = EventAccumulator(str(new))
  acc.Reload()
  return {e.step: e.value for e in acc.Scalars(tag)} if tag in acc.Tags()["scalars"] else {}


def _complete(out: pathlib.Path) -> list[int]:
  return sorted(int(p.name) for p in (out / "checkpoints").glob("*") if p.name.isdigit())


def _run(path: pathlib.Path, env, kill_when_saved: int | None = None) -> tuple[str, set]:
  """Runs the command; with `kill_when_saved`, SIGKILLs it once that step's save is complete. Returns its output and
  the event files there were before it."""
  out = pathlib.Path(yaml.safe_load(path.read_text())["run"]["output_dir"])
  before = set((out / "tensorboard").glob("events.out.tfevents.*"))
  cmd = [sys.executable, "-m", "maxctx.train", str(path)]
  if kill_when_saved is None:
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout, before
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
  deadline = time.monotonic() + 600
  while kill_when_saved not in _complete(out) and proc.poll() is None and time.monotonic() < deadline:
    time.sleep(0.02)
  proc.send_signal(signal.SIGKILL)
  stdout, _ = proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed:\n" + stdout[-3000:]
  return stdout, before


def test_three_stages_run_in_one_process_and_resume_bit_for_bit_after_sigkill_in_stage_2(corpus, tmp_path, env):
  whole = run_file(corpus, tmp_path / "whole", three_stages(corpus))
  stdout, before = _run(whole, env)
  assert "run.stages[1]: steps 4–8 at 128 tokens" in stdout and "run.stages[2]: steps 8–10 at 256 tokens" in stdout
  losses = _scalars(tmp_path / "whole", "loss", before)
  assert sorted(losses) == list(range(1, 11))
  assert _scalars(tmp_path / "whole", "stage", before) == {n: 1 + (n > 4) + (n > 8) for n in range(1, 11)}
  assert set(_scalars(tmp_path / "whole", "data/share/books", before)) == set(range(1, 11))
  assert _complete(tmp_path / "whole") == [4, 6, 8, 10]   # every stage's end is saved

  killed = run_file(corpus, tmp_path / "killed", three_stages(corpus))
  _run(killed, env, kill_when_saved=4)   # in stage 2 before its step-6 save: the rerun resumes at the boundary
  seen: dict[int, float] = {}
  for restored, kill in ((4, 6), (6, None)):   # then in stage 2 after step 6's save: resumes inside the stage
    stdout, before = _run(killed, env, kill_when_saved=kill)
    assert f"checkpoint: restored step {restored} " in stdout, stdout[-3000:]
    seen.update(_scalars(tmp_path / "killed", "loss", before))
  assert set(range(5, 11)) <= set(seen)
  for step, loss in sorted(seen.items()):
    assert loss == losses[step], f"step {step}: {loss} after resuming, {losses[step]} uninterrupted"


def test_compile_compiles_each_stage_as_its_own_step(corpus, tmp_path, monkeypatch, capsys):
  """python -m maxctx.compile on a staged run compiles every stage's step (its length, mesh and strategy), not the
  run file's top-level keys; the TPU compile itself is tests/test_compile.py's."""
  from maxctx.compile import __main__ as compile_main
  asked = []

  class Report:
    def __init__(self, c):
      self.c = c

  def compile_for(c):
    asked.append((c.data.seq_len, c.attention.strategy, c.mesh.ici.context, c.model.rope_theta))
    return Report(c)

  monkeypatch.setattr(compile_main.compile_step, "compile_for", compile_for)
  monkeypatch.setattr(compile_main, "format_report", lambda r: f"report of {r.c.data.seq_len} tokens")
  path = run_file(corpus, tmp_path / "run", three_stages(corpus), compile={"topology": "v5p:2x2x2"})
  assert compile_main.main([str(path)]) == 0
  theta = cfg.load(path).model.rope_theta
  assert asked == [(64, "all_gather", 2, theta), (128, "ring", 4, theta), (256, "usp", 4, 40000.0)]
  assert capsys.readouterr().out.split("\n")[:3] == [f"report of {n} tokens" for n in (64, 128, 256)]
