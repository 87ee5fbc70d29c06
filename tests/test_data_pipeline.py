"""The pipeline end to end on 8 fake devices: sources, the batch contract, layout and sharding, errors, exact resume."""

import json
import os
import subprocess
import sys
import sysconfig
import textwrap

import jax
import numpy as np
import pytest

from maxctx import config as cfg, mesh as mesh_lib
from maxctx import data
from maxctx.attention import layout
from maxctx.data import sources, tokenizers
from maxctx.errors import CheckpointError, ConfigError, DataError
from maxctx.trainer import validate

FIELDS = ("tokens", "targets", "segment_ids", "positions")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
  files = sources.stdlib_files()[:60]
  out = tmp_path_factory.mktemp("tok") / "small.model"
  return str(tokenizers.train_sentencepiece((sources.read_text(f) for f in files), out, 320))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A JSONL and a text corpus: 30 stdlib files' text, as records and as separated documents."""
  d = tmp_path_factory.mktemp("corpus")
  # Non-empty ones only: which stdlib files are empty (a bare __init__.py) depends on the Python version.
  texts = [t for t in (sources.read_text(f)[:3000] for f in sources.stdlib_files()[100:200]) if t.strip()][:30]
  with open(d / "a.jsonl", "w") as f:
    for t in texts:
      f.write(json.dumps({"text": t, "id": 1}) + "\n")
  (d / "docs.txt").write_text("\n<|doc|>\n".join(texts))
  return d


def config(*overrides):
  return cfg.load(None, ["model.preset=tiny", "mesh.ici.fsdp=2", "mesh.ici.context=4", "data.seq_len=64",
                         "data.batch_size=8", *overrides])


def build(c):
  return data.build(c, mesh_lib.build_mesh(c.mesh))


def host(batch):
  return {k: np.asarray(v) for k, v in batch.items()}


def check_contract(b, seq_len, context=None):
  """Every row: segments 1..n contiguous, padding 0 at the end, positions restart, targets shift inside a document."""
  if context:
    b = {k: layout.unzigzag(v, context, axis=1) for k, v in b.items()}
  for r in range(b["tokens"].shape[0]):
    seg, pos, tok, tgt = (b[k][r] for k in ("segment_ids", "positions", "tokens", "targets"))
    n = int((seg > 0).sum())
    assert n > 0 and (seg[:n] > 0).all() and seg[0] == 1 and set(np.diff(seg[:n])) <= {0, 1}
    for k in range(1, seg[n - 1] + 1):
      idx = np.flatnonzero(seg == k)
      assert (pos[idx] == np.arange(len(idx))).all()
      assert (tok[idx][1:] == tgt[idx][:-1]).all(), "the target of token t is token t+1 of the same document"


@pytest.mark.parametrize("source,extra", [
    ("jsonl", ["data.path={d}/a.jsonl"]),
    ("text", ["data.path={d}/*.txt", "data.text_separator=<|doc|>"]),
])
@pytest.mark.parametrize("packing", ["first_fit", "concat"])
def test_batches_keep_the_contract(sp_model, corpus, source, extra, packing):
  c = config(f"data.source={source}", f"data.tokenizer={sp_model}", f"data.packing={packing}",
             "attention.load_balance=true", *(e.format(d=corpus) for e in extra))
  p = build(c)
  for _ in range(3):
    b = next(p)
    assert set(b) == set(FIELDS)
    for v in b.values():
      assert v.shape == (8, 64) and v.dtype == np.int32
      assert v.sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"), "context")
    check_contract(host(b), 64, context=4)
  hb = host(b)
  assert hb["tokens"].max() < 320 and (hb["segment_ids"] > 0).mean() > 0.8


def test_text_separator_splits_documents(corpus):
  assert len(sources.Files(sources.expand(f"{corpus}/*.txt"), "<|doc|>")) == 30
  assert len(sources.Files(sources.expand(f"{corpus}/*.txt"))) == 1


def test_text_source_one_file_per_document(sp_model, tmp_path):
  for i in range(3):
    (tmp_path / f"{i}.md").write_text(f"document {i}\n" * 20)
  (tmp_path / "empty.md").write_text("")
  c = config("data.source=text", f"data.path={tmp_path}/*.md", f"data.tokenizer={sp_model}", "data.shuffle=false")
  assert len(sources.Files(sources.expand(c.data.path))) == 3
  check_contract(host(next(build(c))), 64)


def test_pretokenized_jsonl_and_arrayrecord(tmp_path):
  rng = np.random.default_rng(0)
  docs = [rng.integers(1, 512, rng.integers(5, 150)).astype(np.int32) for _ in range(40)]
  with open(tmp_path / "t.jsonl", "w") as f:
    for d in docs:
      f.write(json.dumps({"ids": d.tolist()}) + "\n")
  from array_record.python.array_record_module import ArrayRecordWriter
  w = ArrayRecordWriter(str(tmp_path / "t.arrayrecord"), "group_size:1")
  for d in docs:
    w.write(d.astype("<i4").tobytes())
  w.close()
  a = host(next(build(config("data.source=jsonl", f"data.path={tmp_path}/t.jsonl", "data.text_field=ids"))))
  b = host(next(build(config("data.source=arrayrecord", f"data.path={tmp_path}/t.arrayrecord"))))
  check_contract(a, 64)
  for k in FIELDS:
    np.testing.assert_array_equal(a[k], b[k])


def test_synthetic_is_a_pure_function_of_seed_and_step():
  c = config("data.source=synthetic", "attention.load_balance=true")
  first = [host(next(build(c))) for _ in range(2)]
  for k in FIELDS:
    np.testing.assert_array_equal(first[0][k], first[1][k])
  check_contract(first[0], 64, context=4)


def test_stdlib_corpus_is_sorted_and_excludes_installed_packages():
  files = sources.stdlib_files()
  rel = [f.relative_to(sysconfig.get_paths()["stdlib"]).as_posix() for f in files]
  assert len(files) > 500 and rel == sorted(rel)
  assert not any("site-packages" in f.parts for f in files)
  assert any(f.name == "argparse.py" for f in files)


# ---------------------------------------------------------------------------------------------------------------------
# Errors: one sentence naming the path or value, before anything compiles.


def test_glob_matching_nothing(sp_model, tmp_path):
  with pytest.raises(DataError, match=r"data.path '.*nothing\*.txt' matches no files"):
    build(config("data.source=text", f"data.path={tmp_path}/nothing*.txt", f"data.tokenizer={sp_model}"))


def test_empty_corpus(sp_model, tmp_path):
  (tmp_path / "a.txt").write_text("")
  with pytest.raises(DataError, match=r"holds no documents \(1 files, all empty\)"):
    build(config("data.source=text", f"data.path={tmp_path}/*.txt", f"data.tokenizer={sp_model}"))
  (tmp_path / "b.jsonl").write_text("\n\n")
  with pytest.raises(DataError, match=r"b.jsonl holds no JSON lines"):
    build(config("data.source=jsonl", f"data.path={tmp_path}/b.jsonl", f"data.tokenizer={sp_model}"))


def test_missing_and_oversized_tokenizer(sp_model, corpus):
  with pytest.raises(DataError, match=r"data.tokenizer /no/such.model does not exist"):
    build(config("data.source=jsonl", f"data.path={corpus}/a.jsonl", "data.tokenizer=/no/such.model"))
  with pytest.raises(ConfigError, match=r"has 320 tokens but model.vocab_size is 300"):
    build(config("data.source=jsonl", f"data.path={corpus}/a.jsonl", f"data.tokenizer={sp_model}",
                 "model.vocab_size=300"))


def test_text_without_tokenizer(corpus):
  with pytest.raises(ConfigError, match=r"data.source=text reads text, so it needs data.tokenizer"):
    build(config("data.source=text", f"data.path={corpus}/*.txt"))


def test_bad_jsonl_lines_error_or_skip(sp_model, tmp_path, caplog):
  good = json.dumps({"text": "print('hello world')\n" * 30})
  (tmp_path / "x.jsonl").write_text("\n".join([good, "{not json", good, json.dumps({"body": "x"}), good]) + "\n")
  base = ["data.source=jsonl", f"data.path={tmp_path}/x.jsonl", f"data.tokenizer={sp_model}", "data.shuffle=false",
          "data.batch_size=2", "mesh.ici.fsdp=2", "mesh.ici.context=4"]
  with pytest.raises(DataError, match=r"x.jsonl line 2 is not JSON .*data.bad_records=skip"):
    p = build(config(*base))
    for _ in range(4):
      next(p)
  with pytest.raises(DataError, match=r"x.jsonl line 4 has no field 'text' \(it has: body\)"):
    p = build(config(*base, "data.shuffle=true", "run.seed=3"))
    for _ in range(8):
      next(p)
  p = build(config(*base, "data.bad_records=skip"))
  with caplog.at_level("WARNING", logger="maxctx.data"):
    for _ in range(6):
      check_contract(host(next(p)), 64)
  assert p.skipped == 2  # Each bad line once, however many epochs read it again.
  assert caplog.text.count("x.jsonl line 2") == 1 and caplog.text.count("x.jsonl line 4") == 1


def test_undecodable_text_is_a_bad_record(sp_model, tmp_path):
  good = json.dumps({"text": "print('hello world')\n" * 30}).encode()
  (tmp_path / "x.jsonl").write_bytes(good + b'\n{"text": "caf\xe9"}\n' + good + b"\n")
  (tmp_path / "y.txt").write_bytes(b"ok\nstill ok\nbinary \x89PNG\x00\xff here\n")
  base = [f"data.tokenizer={sp_model}", "data.shuffle=false", "data.batch_size=2", "mesh.ici.fsdp=2"]
  with pytest.raises(DataError, match=r"y.txt line 3 is not UTF-8 text \(byte 0x89 at offset 19\)"):
    next(build(config(*base, "data.source=text", f"data.path={tmp_path}/y.txt")))
  p = build(config(*base, "data.source=jsonl", f"data.path={tmp_path}/x.jsonl", "data.bad_records=skip"))
  for _ in range(6):
    check_contract(host(next(p)), 64)
  assert p.skipped == 1


def test_shape_errors_before_reading():
  # The run's one check (maxctx.trainer.validate) refuses them before the pipeline is built.
  with pytest.raises(ConfigError, match=r"a microbatch of 3 sequences .* does not split over the 2 data×fsdp shards"):
    validate(config("data.batch_size=3"), 8)
  with pytest.raises(ConfigError, match=r"data.seq_len 36 is not divisible by 8, 2 × the context degree 4"):
    validate(config("data.seq_len=36", "attention.load_balance=true"), 8)


# ---------------------------------------------------------------------------------------------------------------------
# Resume: 7 batches, save, restore in a new process; batches 8–10 equal an uninterrupted run byte for byte, with and
# without the prefetch thread.

CHILD = textwrap.dedent("""
  import json, sys
  import numpy as np
  from maxctx import config as cfg, mesh as mesh_lib, data
  mode, state_path, out_path, *overrides = sys.argv[1:]
  c = cfg.load(None, overrides)
  p = data.build(c, mesh_lib.build_mesh(c.mesh))
  if mode == "save":
    for _ in range(7):
      next(p)
    json.dump(p.state(), open(state_path, "w"))
  else:
    p.restore(json.load(open(state_path)))
    out = {}
    for i in range(3):
      for k, v in next(p).items():
        out[f"{k}{i}"] = np.asarray(v)
    np.savez(out_path, **out)
""")


def child_env(devices=8):
  return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
          "PYTHONPATH": REPO}


@pytest.mark.parametrize("packing,source", [("first_fit", "text"), ("concat", "jsonl")])
def test_resume_in_a_new_process_is_exact(sp_model, corpus, tmp_path, packing, source):
  path = f"{corpus}/a.jsonl" if source == "jsonl" else f"{corpus}/*.txt"
  overrides = ["model.preset=tiny", "mesh.ici.fsdp=2", "mesh.ici.context=4", "data.seq_len=64", "data.batch_size=8",
               f"data.source={source}", f"data.path={path}", f"data.tokenizer={sp_model}", f"data.packing={packing}",
               "attention.load_balance=true", "data.text_separator=<|doc|>"]
  # The uninterrupted run makes each batch when asked; the children make them ahead in a thread (data.prefetch, on
  # by default), whose saved state must still be that of the 7th batch handed out.
  p = build(cfg.load(None, overrides + ["data.prefetch=0"]))
  full = [host(next(p)) for _ in range(10)]
  state, out = tmp_path / "state.json", tmp_path / "out.npz"
  for mode in ("save", "load"):
    run = subprocess.run([sys.executable, "-c", CHILD, mode, str(state), str(out), *overrides], env=child_env(),
                         capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
  resumed = np.load(out)
  for i in range(3):
    for k in FIELDS:
      assert resumed[f"{k}{i}"].tobytes() == full[7 + i][k].tobytes(), (k, 8 + i)


def test_state_restores_onto_another_mesh(corpus, sp_model):
  over = ["data.source=jsonl", f"data.path={corpus}/a.jsonl", f"data.tokenizer={sp_model}",
          "attention.load_balance=true"]
  p = build(config(*over))
  for _ in range(3):
    next(p)
  state = json.loads(json.dumps(p.state()))
  other = ["mesh.ici.fsdp=1", "mesh.ici.context=8"]
  full = build(config(*over, *other))
  expected = [host(next(full)) for _ in range(5)][3:]
  q = build(config(*over, *other))
  q.restore(state)
  for e in expected:
    b = host(next(q))
    for k in FIELDS:
      np.testing.assert_array_equal(b[k], e[k])


def test_restore_refuses_a_state_from_other_settings(sp_model, corpus):
  c = config("data.source=jsonl", f"data.path={corpus}/a.jsonl", f"data.tokenizer={sp_model}")
  p = build(c)
  next(p)
  state = p.state()
  with pytest.raises(CheckpointError, match=r"saved with seq_len=64 but this run has 128"):
    build(config("data.source=jsonl", f"data.path={corpus}/a.jsonl", f"data.tokenizer={sp_model}",
                 "data.seq_len=128")).restore(state)


@pytest.mark.slow
def test_worker_processes_resume_exactly(tmp_path):
  rng = np.random.default_rng(0)
  with open(tmp_path / "t.jsonl", "w") as f:
    for _ in range(200):
      f.write(json.dumps({"ids": rng.integers(1, 512, rng.integers(3, 100)).tolist()}) + "\n")
  c = config("data.source=jsonl", f"data.path={tmp_path}/t.jsonl", "data.text_field=ids", "data.num_workers=2")
  p = build(c)
  full = [host(next(p)) for _ in range(10)]
  p.close()
  p = build(c)
  for _ in range(7):
    next(p)
  state = json.loads(json.dumps(p.state()))
  p.close()
  p = build(c)
  p.restore(state)
  for i in range(3):
    b = host(next(p))
    for k in FIELDS:
      np.testing.assert_array_equal(b[k], full[7 + i][k])
  p.close()


def test_tfds_without_the_extra_says_how_to_install(tmp_path):
  try:
    import tensorflow_datasets  # noqa: F401
    pytest.skip("tensorflow-datasets is installed")
  except ImportError:
    pass
  with pytest.raises(ConfigError, match=r"data.source=tfds needs tensorflow-datasets; install the extra"):
    build(config("data.source=tfds", f"data.path={tmp_path}"))


def test_restore_refuses_a_state_without_this_process_rows():
  p = build(config("data.source=synthetic"))
  next(p)
  state = p.state()
  del state["iterator"]["by_row"]["5"]
  with pytest.raises(CheckpointError, match=r"holds rows 0,1,2,3,4,6,7 but this process makes rows 0–7"):
    build(config("data.source=synthetic")).restore(state)


@pytest.mark.slow
def test_stdlib_source_trains_and_caches_its_tokenizer(tmp_path, monkeypatch, caplog):
  monkeypatch.setenv("MAXCTX_CACHE", str(tmp_path))
  c = config("data.source=stdlib", "attention.load_balance=true")
  with caplog.at_level("INFO", logger="maxctx.data"):
    b = host(next(build(c)))
  assert "training a 512-token SentencePiece" in caplog.text
  assert list(tmp_path.glob("tokenizers/stdlib-py*-bpe512.model"))
  check_contract(b, 64, context=4)
  assert b["tokens"].max() < 512
  caplog.clear()
  with caplog.at_level("INFO", logger="maxctx.data"):
    again = host(next(build(c)))
  assert "training" not in caplog.text, "the cached tokenizer is reused"
  for k in FIELDS:
    np.testing.assert_array_equal(b[k], again[k])
