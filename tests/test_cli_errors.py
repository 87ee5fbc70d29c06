"""A user's mistake ends the command with one sentence, and nothing else.

A catalogue of bad inputs to every entry point (maxctx.train, maxctx.eval, maxctx.bench, maxctx.plan,
maxctx.compile and maxctx.convert), each run as the user runs it: exit code 2, exactly one stderr line starting with `error:`, no
traceback anywhere, and nothing under run.output_dir created or changed. Almost every case stops before JAX compiles
anything; the few that need a fault the machine cannot produce (no libtpu) go through tests/faults/inject.py.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
INJECT = str(ROOT / "tests" / "faults" / "inject.py")


def _tree(root: pathlib.Path) -> dict[str, bytes | None] | None:
  """Every path under `root` with its bytes (None for a directory); None if `root` does not exist."""
  if not root.exists():
    return None
  if root.is_file():
    return {".": root.read_bytes()}
  return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


# One data.mixture entry with the given weight (or a misspelt key), for str.format with the case's {F} kept.
MIX = "data.mixture=[{{{{source: jsonl, path: {{F}}/data/oob.jsonl, {}}}}}]"


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> dict[str, pathlib.Path]:
  """Files the bad inputs point at."""
  d = tmp_path_factory.mktemp("inputs")
  from maxctx.data import sources, tokenizers
  tokenizers.train_sentencepiece((sources.read_text(f) for f in sources.stdlib_files()[:60]), d / "tok.model", 320)
  (d / "afile").write_text("not a directory\n")
  (d / "empty").mkdir()
  (d / "data").mkdir()
  (d / "data" / "nofield.jsonl").write_text("".join(json.dumps({"body": f"text {i}"}) + "\n" for i in range(20)))
  (d / "data" / "notjson.jsonl").write_text('{"text": "fine"}\n{"text": \n')
  (d / "data" / "badutf.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
  (d / "data" / "badutf.txt").write_bytes(b"line one\nline two \xff\xfe here\n")
  (d / "data" / "blank.txt").write_text("")
  (d / "data" / "oob.jsonl").write_text(json.dumps({"text": [1, 2, 99999]}) + "\n")
  (d / "data" / "notlist.jsonl").write_text(json.dumps({"text": "words, not ids"}) + "\n")
  (d / "bad.yml").write_text("run: [unclosed\n")
  (d / "list.yml").write_text("- a\n- b\n")
  (d / "run" / "checkpoints" / "4" / "state").mkdir(parents=True)
  (d / "run" / "config.yml").write_text("run:\n  steps: 4\n")
  (d / "notckpt" / "params").mkdir(parents=True)
  (d / "notckpt" / "params" / "README").write_text("not an Orbax checkpoint\n")
  (d / "hf_gpt2").mkdir()
  (d / "hf_gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
  (d / "hf_badjson").mkdir()
  (d / "hf_badjson" / "config.json").write_text("{not json")
  (d / "hf_list").mkdir()
  (d / "hf_list" / "config.json").write_text("[1, 2]")
  (d / "export_out").mkdir()
  # A Llama whose 6 query heads do not split over its 4 KV heads, with every tensor: only the model's check stops it.
  from safetensors.numpy import save_file
  V, D, N, K, H, F = 64, 24, 6, 4, 4, 32
  (d / "hf_heads").mkdir()
  (d / "hf_heads" / "config.json").write_text(json.dumps({
      "model_type": "llama", "vocab_size": V, "hidden_size": D, "num_hidden_layers": 1, "num_attention_heads": N,
      "num_key_value_heads": K, "head_dim": H, "intermediate_size": F}))
  layer = {"self_attn.q_proj": (N * H, D), "self_attn.k_proj": (K * H, D), "self_attn.v_proj": (K * H, D),
           "self_attn.o_proj": (D, N * H), "mlp.gate_proj": (F, D), "mlp.up_proj": (F, D), "mlp.down_proj": (D, F),
           "input_layernorm": (D,), "post_attention_layernorm": (D,)}
  shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D),
            **{f"model.layers.0.{name}.weight": shape for name, shape in layer.items()}}
  save_file({k: np.zeros(v, np.float32) for k, v in shapes.items()}, str(d / "hf_heads" / "model.safetensors"))
  (d / "export_out" / "old.safetensors").write_text("an older export\n")
  # Levels of nine aliases under run.name: nine levels printed 351 MB into the error; five make the point (59K values).
  (d / "bomb.yml").write_text("run:\n  name:\n    - &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
                              + "".join(f"    - &{x} [{', '.join([f'*{p}'] * 9)}]\n" for p, x in zip("abcd", "bcde")))
  (d / "dup.yml").write_text("optim:\n  lr: 3e-3\n  b1: 0.9\n  lr: 1.0\n")
  (d / "tok_empty.model").write_bytes(b"")
  # Another run, and run directories whose checkpoints lead into it.
  (d / "other" / "checkpoints" / "4").mkdir(parents=True)
  (d / "other" / "config.yml").write_text("run:\n  steps: 4\n")
  (d / "linked").mkdir()
  (d / "linked" / "checkpoints").symlink_to(d / "other" / "checkpoints")
  (d / "up").mkdir()
  (d / "up" / "into").symlink_to(d / "other" / "checkpoints")
  return d


# (id, entry point, arguments, fragments of the sentence). In arguments, {OUT} is this case's run.output_dir and
# {F} the fixture directory. Entry points: train, eval, bench, plan, compile (python -m maxctx.<name> configs/demo.yml
# run.output_dir={OUT} ...), convert (python -m maxctx.convert ...), and inject:<fault>:<module> (the module's
# command under tests/faults/inject.py).
CASES = [
    # Config keys and values.
    ("unknown-key", "train", ["optim.lerning_rate=1"], ["unknown config key optim.lerning_rate", "optim.lr?"]),
    ("unknown-section", "train", ["optimiser.lr=1"], ["optimiser"]),
    ("not-an-int", "train", ["run.steps=ten"], ["run.steps expects int", "'ten'"]),
    ("not-a-float", "train", ["optim.lr=fast"], ["optim.lr expects float"]),
    ("lr-nan", "train", ["optim.lr=nan"], ["optim.lr", "finite"]),
    ("lr-inf", "train", ["optim.lr=inf"], ["optim.lr", "finite"]),
    ("lr-negative", "train", ["optim.lr=-0.1"], ["optim.lr is -0.1"]),
    ("b2-above-one", "train", ["optim.b2=1.5"], ["optim.b2 is 1.5", "[0, 1]"]),
    ("eps-zero", "train", ["optim.eps=0"], ["optim.eps is 0", "above 0"]),
    ("norm-eps-nan", "train", ["model.norm_eps=nan"], ["model.norm_eps", "finite"]),
    ("rope-theta-zero", "train", ["model.rope_theta=0"], ["model.rope_theta is 0"]),
    ("peak-negative", "train", ["metrics.peak_tflops=-1"], ["metrics.peak_tflops is -1"]),
    ("bad-choice", "train", ["model.dtype=float16"], ["model.dtype must be one of"]),
    ("not-key-value", "train", ["steps"], ["not of the form section.key=value"]),
    ("section-as-value", "train", ["run=3"], ["run"]),
    ("missing-config", "train:nofile", [], ["cannot read config file"]),
    ("bad-yaml", "train:{F}/bad.yml", [], ["is not valid YAML"]),
    ("yaml-list", "train:{F}/list.yml", [], ["must hold a mapping"]),
    ("yaml-alias-bomb", "train:{F}/bomb.yml", [], ["line 4 uses the YAML alias *a"]),
    ("yaml-duplicate-key", "train:{F}/dup.yml", [], ["gives optim.lr twice (lines 2 and 4)"]),
    ("unknown-preset", "train", ["model.preset=llama9"], ["model preset 'llama9'"]),
    # Shapes, mesh and strategy.
    ("seq-len-zero", "train", ["data.seq_len=0"], ["data.seq_len is 0", "at least 2"]),
    ("seq-len-negative", "train", ["data.seq_len=-64"], ["data.seq_len is -64", "at least 2"]),
    ("seq-len-indivisible", "train", ["data.seq_len=100"], ["data.seq_len 100"]),
    ("batch-zero", "train", ["data.batch_size=0"], ["data.batch_size is 0"]),
    ("steps-zero", "train", ["run.steps=0"], ["run.steps is 0"]),
    ("mesh-product", "train", ["mesh.ici.fsdp=1", "mesh.ici.context=2"], ["multiply to 2", "8 devices"]),
    ("mesh-two-inferred", "train", ["mesh.ici.fsdp=-1", "mesh.ici.context=-1"], ["at most one axis"]),
    ("mesh-zero", "train", ["mesh.ici.fsdp=0"], ["mesh.ici.fsdp is 0"]),
    ("tensor-heads", "train", ["mesh.ici.fsdp=1", "mesh.ici.context=1", "mesh.ici.tensor=8"],
     ["model.n_heads 4", "tensor degree 8"]),
    ("tensor-kv-heads", "train", ["mesh.ici.fsdp=1", "mesh.ici.context=2", "mesh.ici.tensor=4"],
     ["model.n_kv_heads 2", "tensor degree 4"]),
    ("strategy-typo", "train", ["attention.strategy=rign"], ["attention.strategy 'rign'", "did you mean"]),
    ("kernel-unknown", "train", ["attention.kernel=fast"], ["attention.kernel"]),
    ("heads-not-multiple", "train", ["model.n_heads=3", "model.n_kv_heads=2"], ["model.n_heads 3"]),
    ("grad-accum", "train", ["optim.grad_accum=3"], ["optim.grad_accum 3"]),
    ("loss-chunk-zero", "train", ["model.loss_chunk=0"], ["model.loss_chunk is 0"]),
    ("keep-zero", "train", ["checkpoint.keep=0"], ["checkpoint.keep is 0"]),
    ("resume-word", "train", ["checkpoint.resume=latest"], ["checkpoint.resume is 'latest'"]),
    ("coordinator-alone", "train", ["--coordinator=10.0.0.1:1234"], ["go together"]),
    # The run directory.
    ("out-is-file", "train:out={F}/afile", [], ["is a file"]),
    ("out-under-file", "train:out={F}/afile/run", [], ["which is not a directory"]),
    ("out-not-writable", "train:out=/proc/sys/maxctx-run", [], ["/proc/sys", "is not writable"]),
    ("out-cannot-create", "train:out=/proc/maxctx-run", [], ["cannot create run.output_dir /proc/maxctx-run"]),
    ("out-in-configs", "train:out=configs/maxctx-run", [], ["is inside the repository's configs directory"]),
    ("out-checkpoints-link", "train:out={F}/linked", [], ["holds checkpoints as a link to {F}/other/checkpoints"]),
    ("out-dotdot-after-link", "train:out={F}/up/into/..", [], ["follows a link and then `..` into {F}/other"]),
    ("resume-n-without-checkpoints", "train", ["checkpoint.resume=5"], ["checkpoint.resume=5", "holds no checkpoints"]),
    # Data.
    ("data-path-missing", "train", ["data.source=jsonl", "data.path={F}/nothing.jsonl"], ["does not exist"]),
    ("data-glob-empty", "train", ["data.source=jsonl", "data.path={F}/*.parquet"], ["matches no files"]),
    ("data-dir-empty", "train", ["data.source=jsonl", "data.path={F}/empty"], ["is an empty directory"]),
    ("data-text-without-tokenizer", "train", ["data.source=text", "data.path={F}/data/badutf.txt"],
     ["needs data.tokenizer"]),
    ("data-all-blank", "train", ["data.source=text", "data.path={F}/data/blank.txt", "data.tokenizer={F}/tok.model"],
     ["holds no documents"]),
    ("data-no-field", "train", ["data.source=jsonl", "data.path={F}/data/nofield.jsonl", "data.tokenizer={F}/tok.model"],
     ["nofield.jsonl line", "has no field 'text'"]),
    ("data-no-field-skip", "train", ["data.source=jsonl", "data.path={F}/data/nofield.jsonl", "data.tokenizer={F}/tok.model",
                                     "data.bad_records=skip"], ["yields no usable document", "none of its 20 records"]),
    ("data-not-json", "train", ["data.source=jsonl", "data.path={F}/data/notjson.jsonl", "data.tokenizer={F}/tok.model"],
     ["notjson.jsonl line 2 is not JSON"]),
    ("data-jsonl-not-utf8", "train", ["data.source=jsonl", "data.path={F}/data/badutf.jsonl",
                                      "data.tokenizer={F}/tok.model"], ["badutf.jsonl line 2 is not UTF-8"]),
    ("data-text-not-utf8", "train", ["data.source=text", "data.path={F}/data/badutf.txt", "data.tokenizer={F}/tok.model"],
     ["badutf.txt line 2 is not UTF-8", "byte 0xff"]),
    # A mixture of sources (data.mixture, flow YAML on the command line).
    ("mixture-unknown-key", "train", ["data.source=mixture", MIX.format("wieght: 1")],
     ["data.mixture[0].wieght", "did you mean data.mixture[0].weight?"]),
    ("mixture-weight-zero", "train", ["data.source=mixture", MIX.format("weight: 0")],
     ["data.mixture[0].weight is 0; it must be above 0"]),
    ("mixture-weight-negative", "train", ["data.source=mixture", MIX.format("weight: -2")],
     ["data.mixture[0].weight is -2; it must be above 0"]),
    ("mixture-weight-nan", "train", ["data.source=mixture", MIX.format("weight: .nan")],
     ["data.mixture[0].weight is nan"]),
    ("mixture-key-twice", "train", ["data.source=mixture", MIX.format("weight: 1, weight: 2")],
     ["gives weight twice (lines 1 and 1)"]),
    ("long-weight-tiny", "train", ["data.long_threshold=10", "data.long_weight=1e-320"],
     ["data.long_weight is", "it must be in [0.001, 1000]"]),
    ("preset-path", "train", ["model.preset=../../x"], ["model.preset '../../x' is not a preset name"]),
    ("preset-too-long", "train", ["model.preset=" + "a" * 300], ["is not a preset name"]),
    ("mixture-path-missing", "train", ["data.source=mixture", "data.mixture=[{{source: jsonl, path: {F}/data/oob."
                                       "jsonl, weight: 1}}, {{source: jsonl, path: {F}/nothing.jsonl, weight: 1}}]"],
     ["data.mixture[1].path", "nothing.jsonl' does not exist"]),
    ("mixture-source-conflict", "train", [MIX.format("weight: 1")],
     ["data.mixture lists 1 source(s) but data.source is stdlib", "data.source=mixture"]),
    ("mixture-empty", "train", ["data.source=mixture"], ["data.mixture is empty"]),
    ("data-token-out-of-vocab", "train", ["data.source=jsonl", "data.path={F}/data/oob.jsonl"],
     ["token id 99999", "model.vocab_size"]),
    ("data-text-not-ids", "train", ["data.source=jsonl", "data.path={F}/data/notlist.jsonl"],
     ["holds no list of token ids"]),
    ("data-tokenizer-missing", "train", ["data.tokenizer={F}/nothing.model"], ["nothing.model"]),
    ("data-tokenizer-empty", "train", ["data.source=text", "data.path={F}/data/badutf.txt",
                                       "data.tokenizer={F}/tok_empty.model"], ["tok_empty.model is an empty file"]),
    ("data-tokenizer-directory", "train", ["data.tokenizer={F}/empty"], ["empty is a directory"]),
    ("data-tokenizer-unreadable", "train", ["data.tokenizer=/proc/sys/vm/drop_caches"], ["cannot be read"]),
    # Parameters to start from.
    ("load-params-run-dir", "train", ["checkpoint.load_params={F}/run"], ["is a run directory", "checkpoints/4"]),
    ("load-params-missing", "train", ["checkpoint.load_params={F}/nothing"], ["is not a directory"]),
    ("load-params-not-orbax", "train", ["checkpoint.load_params={F}/notckpt"], ["is not a readable Orbax checkpoint"]),
    # maxctx.eval
    ("eval-samples-zero", "eval", ["--samples=0"], ["eval samples is 0"]),
    ("eval-task-file-missing", "eval", ["--files={F}/nothing.jsonl"], ["nothing.jsonl does not exist"]),
    ("eval-unknown-task", "eval", ["--tasks=passkee"], ["passkee"]),
    ("eval-bad-depth", "eval", ["--depths=1.5"], ["1.5"]),
    ("eval-bad-length", "eval", ["--lengths=lots"], ["lots"]),
    ("eval-load-params-run-dir", "eval", ["checkpoint.load_params={F}/run"], ["is a run directory"]),
    ("eval-unknown-key", "eval", ["eval.sample=2"], ["unknown config key eval.sample"]),
    # maxctx.bench
    ("bench-unknown-strategy", "bench", ["--strategies=rings"], ["rings"]),
    ("bench-bad-length", "bench", ["--lengths=10q"], ["10q"]),
    ("bench-steps-zero", "bench", ["--steps=0"], ["--steps 0"]),
    ("bench-unknown-topology", "bench", ["--topology=v9x-8"], ["v9x-8"]),
    # maxctx.plan
    ("plan-unknown-strategy", "plan", ["--strategies=rings"], ["rings"]),
    ("plan-bad-remat", "plan", ["--remat=none,fulll"], ["fulll", "not a remat policy"]),
    ("plan-nothing-valid", "plan", ["--strategies=ulysses", "--lengths=98"], ["no candidate can run"]),
    ("plan-negative-compile", "plan", ["--topology=v5p-8", "--compile=-1"], ["--compile is -1"]),
    # attention.strategy auto: planned by maxctx.train and maxctx.compile; nothing to choose from is one sentence too
    ("train-auto-nothing-runs", "train", ["attention.strategy=auto", "attention.kernel=flash"],
     ["auto found no candidate", "runs only on tpu or gpu"]),
    ("compile-auto-nothing-runs", "compile", ["compile.topology=v5p-16", "attention.strategy=auto",
                                              "data.batch_size=3", "mesh.ici.data=2"],
     ["auto found no candidate", "on v5p-16", "does not split"]),
    # maxctx.compile
    ("compile-no-topology", "compile", [], ["no TPU topology"]),
    ("compile-bad-topology", "compile", ["compile.topology=v5p-7"], ["v5p-7"]),
    ("compile-unknown-key", "compile", ["compile.topo=v5p-8"], ["unknown config key compile.topo"]),
    ("compile-slices-zero", "compile", ["compile.topology=v5p-8", "compile.num_slices=0"], ["compile.num_slices is 0"]),
    ("compile-without-libtpu", "inject:no-libtpu:maxctx.compile", ["compile.topology=v5p-16"],
     ["needs libtpu", "JAX TPU support not installed"]),
    # maxctx.convert
    ("convert-import-no-config", "convert", ["import", "{F}/empty", "{OUT}"], ["has no config.json"]),
    ("convert-import-not-llama", "convert", ["import", "{F}/hf_gpt2", "{OUT}"], ["model_type is 'gpt2'"]),
    ("convert-import-bad-json", "convert", ["import", "{F}/hf_badjson", "{OUT}"], ["is not valid JSON"]),
    ("convert-import-json-list", "convert", ["import", "{F}/hf_list", "{OUT}"], ["not a JSON object"]),
    ("convert-import-heads-not-multiple", "convert", ["import", "{F}/hf_heads", "{OUT}"],
     ["hf_heads/config.json describes a model maxctx cannot train", "model.n_heads 6 is not a multiple of "
      "model.n_kv_heads 4"]),
    ("convert-export-missing", "convert", ["export", "{F}/nothing", "configs/demo.yml", "{OUT}"],
     ["params directory", "nothing is not a directory"]),
    ("convert-export-not-orbax", "convert", ["export", "{F}/notckpt/params", "configs/demo.yml", "{OUT}"],
     ["is not a readable Orbax checkpoint"]),
    ("convert-export-not-empty", "convert:out={F}/export_out", ["export", "{F}/run", "configs/demo.yml", "{OUT}"],
     ["is not empty"]),
]


def _command(entry: str, args: list[str], out: pathlib.Path, f: pathlib.Path) -> tuple[list[str], pathlib.Path]:
  kind, _, option = entry.partition(":")
  if option.startswith("out="):
    out, option = pathlib.Path(option[4:].format(F=f)), ""
  args = [a.format(OUT=out, F=f) for a in args]
  if kind == "convert":
    return [sys.executable, "-m", "maxctx.convert", *args], out
  config = "configs/demo.yml"
  if kind == "train" and option:
    config = option.format(F=f)
  if kind == "inject":
    fault, module = option.split(":")
    return [sys.executable, INJECT, fault, module, config, f"run.output_dir={out}", *args], out
  return [sys.executable, "-m", f"maxctx.{kind}", config, f"run.output_dir={out}", *args], out


@pytest.mark.parametrize("entry, args, fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_sentence_and_touches_nothing(entry, args, fragments, fx, tmp_path):
  out = tmp_path / "out"
  command, out = _command(entry, args, out, fx)
  before = _tree(out)
  result = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300, cwd=ROOT)
  assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
  assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, result.stderr
  assert result.stderr.rstrip().splitlines()[-1] == errors[0], result.stderr  # Nothing printed after the sentence.
  assert len(errors[0]) <= 1000, errors[0][:3000]   # a sentence, never a flood of an echoed value
  for fragment in fragments:
    assert fragment.format(F=fx) in errors[0], errors[0]
  assert _tree(out) == before, f"{out} changed"


def test_a_multi_host_job_that_never_comes_together_ends_with_one_sentence(tmp_path):
  """A process whose coordinator never answers, and the coordinator (process 0) whose peer never comes, each stop after
  the --init-timeout they were given (flag or MAXCTX_INIT_TIMEOUT) with one sentence naming the address and the
  timeout. JAX alone waits 300 s, then aborts from C++ with a stack trace (exit 134)."""
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  out = tmp_path / "out"
  runs = {  # the sentence's start → (flags, environment)
      "process 1 of 2 could not reach the coordinator at 127.0.0.1:1 within 5 s":
          (["--coordinator=127.0.0.1:1", "--num-processes=2", "--process-id=1", "--init-timeout=5"], ENV),
      f"process 0 (the coordinator, at 127.0.0.1:{port}) waited 5 s and not all 2 processes joined":
          ([f"--coordinator=127.0.0.1:{port}", "--num-processes=2", "--process-id=0"],
           dict(ENV, MAXCTX_INIT_TIMEOUT="5")),
  }
  procs = {start: subprocess.Popen([sys.executable, "-m", "maxctx.train", "configs/demo.yml", f"run.output_dir={out}",
                                    *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                   cwd=ROOT)
           for start, (flags, env) in runs.items()}
  for start, proc in procs.items():
    try:
      stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
      proc.kill()
      raise AssertionError(f"still waiting 120 s after starting, with --init-timeout 5: {start}") from None
    assert proc.returncode == 2, (proc.returncode, stderr[-3000:])
    assert "Traceback" not in stdout + stderr and "Check failure" not in stderr, stderr[-3000:]
    last = stderr.rstrip().splitlines()[-1]
    assert last.startswith(f"error: {start}") and "--init-timeout" in last and len(last) <= 1000, stderr[-3000:]
    assert [l for l in stderr.splitlines() if l.startswith("error:")] == [last]
  assert not out.exists()


def test_train_errors_print_only_the_sentence_on_stderr(tmp_path):
  # Training logs go to stdout; stderr holds the sentence and nothing else.
  result = subprocess.run([sys.executable, "-m", "maxctx.train", "configs/demo.yml", f"run.output_dir={tmp_path}/o",
                           "attention.strategy=rign"], capture_output=True, text=True, env=ENV, timeout=120, cwd=ROOT)
  assert result.returncode == 2
  assert [l for l in result.stderr.splitlines() if l.strip()] == [result.stderr.strip()]


def test_catalogue_is_large():
  assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)


def test_log_lines_go_to_the_stream_of_the_moment():
  # Entry points run in-process by tests (and notebooks) set up logging while one stdout is in place and log after it
  # was replaced and closed: the handler must write to the current one, never to the closed one.
  import io
  import logging
  from maxctx import console
  old = sys.stdout
  try:
    sys.stdout = first = io.StringIO()
    console.setup("stdout")
    first.close()
    sys.stdout = second = io.StringIO()
    logging.getLogger("maxctx").info("after the swap")
  finally:
    sys.stdout = old
    logging.basicConfig(force=True)   # no handler left pointing at the test's streams
  assert "after the swap" in second.getvalue()
