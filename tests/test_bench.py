"""The strategy benchmark (python -m maxctx.bench): a 2 strategies × 2 lengths slice on 8 fake CPU devices writes its
files, `none` has no CP communication and ring some, and the exact strategies' last-step losses agree; the HLO byte
counter multiplies loop trip counts; --topology compiles the tiny model for a small TPU slice and estimates."""

import dataclasses
import importlib.util
import json

import jax
import pytest
import yaml

from maxctx import config as config_lib
from maxctx import attention
from maxctx import scopes
from maxctx import topology
from maxctx import trainer as trainer_lib
from maxctx.bench import __main__ as bench_main
from maxctx.bench import cases as cases_lib
from maxctx.bench import measure, report, roofline
from maxctx.compile import hlo
from maxctx.compile.report import CompileReport, Memory
from maxctx.errors import ConfigError

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install -e '.[tpu]'); it compiles for TPUs")

FILES = ("results.jsonl", "results.md", "tokens_per_s.png", "memory.png", "comm_share.png")


def _records(out):
  return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_cpu_slice_writes_files_and_losses_agree(tmp_path):
  rc = bench_main.main(["configs/bench.yml", "--strategies", "none,ring", "--lengths", "128,256", "--steps", "1",
                        "--out", str(tmp_path)])
  assert rc == 0
  for name in FILES:
    assert (tmp_path / name).stat().st_size > 0, name
  assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
  records = _records(tmp_path)
  assert [(r["strategy"], r["seq_len"], r["status"]) for r in records] == [
      ("none", 128, "ok"), ("ring", 128, "ok"), ("none", 256, "ok"), ("ring", 256, "ok")]
  for r in records:
    assert r["tokens_per_s"] > 0 and r["memory_compiled"]["total"] > 0 and r["peak_bytes_runtime"] is None
    if r["strategy"] == "none":
      assert r["comm_share"] == 0 and r["collective_bytes"]["bytes_attention"] == {}
      assert r["mesh"]["context"] == 1 and r["mesh"]["fsdp"] == 8
    else:
      assert r["comm_share"] > 0 and r["comm_share_by_kind"].keys() == {"collective-permute"}
      assert r["collective_bytes"]["bytes_attention"]["collective-permute"] > 0
  for n in (128, 256):
    losses = [r["loss"] for r in records if r["seq_len"] == n]
    assert max(losses) - min(losses) <= 1e-4, losses
  assert "Strategy benchmark" in (tmp_path / "results.md").read_text()
  # The ring's own account of its bytes (the planner's cost model: K/V and ids 3 hops each way, float32 dK/dV 4
  # hops home, per layer) is what the compiled step sends.
  base = config_lib.load("configs/bench.yml")
  for r in (r for r in records if r["strategy"] == "ring"):
    config = base.replace(**{"data.seq_len": r["seq_len"]})
    problem = trainer_lib.attention_problem(config, r["mesh"], "cpu")
    rows = config.data.batch_size // (r["mesh"]["data"] * r["mesh"]["fsdp"])
    modelled = attention.get("ring").traffic(problem, rows, config.model.head_dim, 4).step(config.model.n_layers)
    assert modelled == r["collective_bytes"]["bytes_attention"], (modelled, r["collective_bytes"])


def test_rounds_time_a_lengths_runs_in_turns_and_also_adds_a_run_file_as_it_stands(tmp_path):
  # Issue 18, acceptance 2: a pick from maxctx.plan is compared with the sweep in the same turns (--also, --rounds),
  # so a host whose speed drifts slows them alike. The run file runs its own strategy and mesh at its own length.
  recipe = yaml.safe_load(open("configs/bench.yml"))
  recipe["attention"]["strategy"], recipe["data"]["seq_len"] = "ring", 128
  (tmp_path / "pick-128.yml").write_text(yaml.safe_dump(recipe))
  rc = bench_main.main(["configs/bench.yml", "--strategies", "none", "--lengths", "128", "--steps", "1", "--rounds",
                        "2", "--also", str(tmp_path / "pick-128.yml"), "--out", str(tmp_path / "out")])
  assert rc == 0
  records = _records(tmp_path / "out")
  assert [(r["strategy"], r["seq_len"], r["status"]) for r in records] == [("none", 128, "ok"),
                                                                          ("ring_pick-128", 128, "ok")]
  assert records[1]["mesh"]["context"] == 4 and records[1]["collective_bytes"]["bytes_attention"]["collective-permute"]
  for r in records:
    assert r["timed_rounds"] == 2 and len(r["step_times_s"]) == 2 and len(r["losses"]) == 1 + 2 + 1
  assert abs(records[0]["loss"] - records[1]["loss"]) <= 1e-4
  assert "2 × 1 (each length's runs held at once" in (tmp_path / "out" / "results.md").read_text()
  recipe["attention"]["strategy"] = "auto"
  (tmp_path / "auto.yml").write_text(yaml.safe_dump(recipe))
  pick = str(tmp_path / "pick-128.yml")
  for bad, says in ((["--rounds", "0"], "--rounds 0 must all be at least 1"),
                    (["--rounds", "2", "--topology", "v5p-8"], "drop one"),
                    (["--also", str(tmp_path / "auto.yml")], "is a plan, not a run"),
                    (["--also", pick, "--also", pick], "like an earlier --also file")):
    with pytest.raises(ConfigError, match=says):
      bench_main.run(bench_main._parser().parse_args(["configs/bench.yml", *bad, "--out", str(tmp_path / "x")]))
  assert not (tmp_path / "x").exists()


def test_rounds_alternate_the_order_and_a_run_that_fails_leaves_the_others_timing(monkeypatch):
  # measure.attempt_all with rounds > 1: every run is built (compiled, warmed up) first, then timed in turns, every
  # other turn backwards; a run that fails in a turn is that run's record, the rest go on, and an out-of-memory
  # failure says how many runs were held with it.
  calls = []

  class Run:
    def __init__(self, case, steps):
      if case.strategy == "refused":
        raise ConfigError("block_q 100 does not divide 128.")
      self.name = case.strategy
      calls.append(("built", self.name))

    def timed(self, n):
      calls.append((self.name, n))
      if self.name == "oom" and calls.count(("oom", n)) == 2:
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory\nmore")

    def finish(self, steps, rounds, held):
      return {"step_time_s": 1.0, "timed_rounds": rounds, "peak_runtime_note": f"{held} held"}

  monkeypatch.setattr(measure, "_Run", Run)
  cases = [cases_lib.Case(name, 128, None) for name in ("a", "refused", "oom", "b")]
  out = measure.attempt_all(cases, measure.Steps(timed=2), rounds=3)
  assert calls == [("built", "a"), ("built", "oom"), ("built", "b"), ("a", 2), ("oom", 2), ("b", 2),
                   ("b", 2), ("oom", 2), ("a", 2), ("a", 2), ("b", 2)]
  assert out[1] == {"status": "refused", "reason": "block_q 100 does not divide 128."}
  assert out[2] == {"status": "failed", "reason": "RESOURCE_EXHAUSTED: Out of memory (3 runs held at once, --rounds)"}
  assert out[0] == out[3] == {"status": "ok", "step_time_s": 1.0, "timed_rounds": 3, "peak_runtime_note": "3 held"}
  # The sweep's cases by length, an --also file's beside those of its own length, each length a group of turns.
  sweep = [cases_lib.Case(s, n, None) for n in (256, 128) for s in ("none", "ring")]
  also = [cases_lib.Case("ring_pick", 128, None), cases_lib.Case("usp_x", 512, None)]
  ordered = bench_main.in_length_order(sweep + also)
  assert [(c.strategy, c.seq_len) for c in ordered] == [("none", 256), ("ring", 256), ("none", 128), ("ring", 128),
                                                        ("ring_pick", 128), ("usp_x", 512)]
  assert bench_main._by_length(ordered) == [[0, 1], [2, 3, 4], [5]]


def test_a_strategy_that_cannot_run_is_refused_with_validates_sentence():
  base = config_lib.load("configs/bench.yml")
  case = cases_lib.configure(base, "ulysses", 256, 8, context=8)
  assert case.config is None and "query heads" in case.refused
  none = cases_lib.configure(base, "none", 256, 8)
  assert none.config.attention.strategy == "all_gather"
  assert (none.config.mesh.ici.context, none.config.mesh.ici.fsdp) == (1, 8)
  assert cases_lib.configure(base, "usp", 256, 8).config.mesh.ici.context == 4
  assert cases_lib.lengths("4k,1m,14m,256") == [4096, 1 << 20, 14 * (1 << 20), 256]


HLO = """HloModule jit__step, num_partitions=8

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]) parameter(0)
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %cp = f32[4,8]{1,0} collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}, metadata={op_name="/attention/"}
  %cpd = f32[4,8]{1,0} collective-permute-done(%cp)
  %one = f32[4,8]{1,0} all-gather(%x), replica_groups=[8,1]<=[8], metadata={op_name="/attention/"}
  ROOT %t = (s32[], f32[4,8]) tuple(%i, %cpd)
}

%cond (q: (s32[], f32[4,8])) -> pred[] {
  %q = (s32[], f32[4,8]) parameter(0)
  %i = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[4,8]) -> f32[4,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %zero = s32[] constant(2)
  %init = (s32[], f32[4,8]) tuple(%zero, %a)
  %w = (s32[], f32[4,8]) while(%init), condition=%cond, body=%body
  %ar = f32[4,8]{1,0} all-reduce(%a), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  ROOT %ag = f32[16,8]{1,0} all-gather(%a), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={0}
}
"""


def test_hlo_bytes_multiply_trip_counts_and_skip_single_device_groups():
  c = hlo.collectives(HLO, 8)
  assert c.module == "jit__step"
  # The loop runs 6 - 2 = 4 times (read from its condition); 128 bytes per hop.
  assert c.executions["collective-permute"] == 4 and c.bytes_attention["collective-permute"] == 4 * 128
  assert c.kinds["cp"] == ("collective-permute", True) and "one" not in c.kinds  # a group of one moves nothing
  assert c.bytes_other["all-reduce"] == 2 * 128 * 3 / 4 and c.bytes_other["all-gather"] == 128 * 3
  assert c.unknown_trip_counts == 0
  known = HLO.replace("body=%body", 'body=%body, backend_config={"known_trip_count":{"n":"3"}}')
  assert hlo.collectives(known, 8).executions["collective-permute"] == 3
  # A bound the compiler cannot see (the ring's passes: a loop-carried value, as the TPU compiler leaves it) counts
  # once, as unknown, unless the loop's op name carries its count (scopes.trips).
  opaque = HLO.replace("%n = s32[] constant(6)", "%n = s32[] get-tuple-element(%q), index=0")
  assert hlo.collectives(opaque, 8).executions["collective-permute"] == 1
  assert hlo.collectives(opaque, 8).unknown_trip_counts == 1
  name = f'op_name="jit(_step)/ring_fwd/{scopes.trips(5)}/while"'
  scoped = opaque.replace("condition=%cond, body=%body", f"condition=%cond, body=%body, metadata={{{name}}}")
  assert hlo.collectives(scoped, 8).executions["collective-permute"] == 5
  assert hlo.collectives(scoped, 8).unknown_trip_counts == 0


def test_roofline_estimate_is_the_largest_part_and_labelled():
  topo = topology.resolve("tpu7x-128")
  rep = CompileReport(
      config="t", topology=topo.name, libtpu_topology=topo.libtpu_name, num_slices=1, devices=128, chips=64,
      device_kind="TPU7x", mesh={"context": 128}, strategy="ring", kernel="blockwise", seq_len=1 << 20, batch_size=1,
      tokens_per_device=(1 << 20) // 128, context_degree=128, remat="full", loss_chunk=2048, mlp_chunk=0,
      block_q=None, block_kv=None, params=8_000_000_000, flops_per_step=2307e12 / 2 * 3 * 128,
      flops_per_device=2307e12 / 2 * 3, seconds_at_peak=None, hbm_per_device_bytes=topo.hbm_bytes,
      memory=Memory(argument=1, output=1, alias=1, temp=2**30, code=0),
      inspected={"collective_bytes": {"bytes_attention": {"collective-permute": 100e9}, "bytes_other": {}}})
  est = roofline.estimate(rep, topo)
  assert est["est_compute_s"] == pytest.approx(4.0)  # 3 s at peak, × 4/3 for the recomputed forward
  assert est["est_network_s"] == pytest.approx(1.0)  # 100 GB over one link at 100 GB/s
  assert est["est_step_s"] == pytest.approx(4.0) and est["est_bound"] == "compute"
  assert est["est_mfu"] == pytest.approx(0.75)
  assert est["est_step_s_range"] is None   # blockwise: no measured comparable, only the ceiling
  assert "2,307" in roofline.table() and "7,380" in roofline.table()
  # flash: compute at the measured shares of peak (0.73 and 0.037), each step still at least the network's 1 s.
  est = roofline.estimate(dataclasses.replace(rep, kernel="flash"), topo)
  assert est["est_step_s_range"] == pytest.approx((4.0 / 0.73, 4.0 / 0.037))
  assert est["est_mfu_range"] == pytest.approx((0.75 * 0.73, 0.75 * 0.037))


@needs_libtpu
@pytest.mark.usefixtures("users_matmul_precision")   # compiles for a TPU: see tests/conftest.py
def test_topology_compiles_estimates_and_reuses_reports(tmp_path):
  out = tmp_path / "a"
  args = ["configs/bench.yml", "data.batch_size=4", "--context", "4", "--topology", "v5p-8", "--strategies",
          "none,ring", "--lengths", "512"]
  assert bench_main.main(args + ["--out", str(out)]) == 0
  records = _records(out)
  assert [r["status"] for r in records] == ["estimate", "estimate"]
  for r in records:
    assert r["fits"] and r["est_step_s"] > 0 and r["source"].startswith("compiled")
  ring = records[1]
  assert ring["collective_bytes"]["bytes_attention"]["collective-permute"] > 0
  text = (out / "results.md").read_text()
  assert "estimate" in text and "Strategy estimates on v5p-8" in text
  for name in FILES:
    assert (out / name).exists()
  # Again: the cached reports are used, nothing compiles.
  assert bench_main.main(args + ["--out", str(out), "--no-compile"]) == 0
  assert all(r["source"].startswith("cache") for r in _records(out))
  # A maxctx.compile report (no collective bytes) from another directory matches by its fields.
  reports = tmp_path / "reports"
  reports.mkdir()
  for path in (out / "compile-cache").glob("ring-*.json"):
    rep = json.loads(path.read_text())
    del rep["inspected"], rep["config_key"], rep["program_fields"]
    (reports / "ring.json").write_text(json.dumps(rep))
  other = tmp_path / "b"
  assert bench_main.main(args + ["--out", str(other), "--no-compile", "--reports", str(reports)]) == 0
  none, ring = _records(other)
  assert none["status"] == "missing" and "not compiled" in none["reason"]
  assert ring["source"].startswith("report") and ring["est_network_s"] is None and "no collective bytes" in ring["note"]


def test_loss_spread_only_compares_runs_that_ran():
  def rec(strategy, n, **fields):
    return report.Record(strategy, n, str(n)).set(**fields)
  records = [rec("a", 8, status="ok", loss=1.0), rec("b", 8, status="ok", loss=1.00002),
             rec("c", 8, status="refused", reason="x"), rec("a", 16, status="ok", loss=2.0)]
  assert report.loss_spread(records) == {8: pytest.approx(2e-5)}


def test_a_record_refuses_a_field_it_does_not_have():
  # measure.attempt and aot.record fill records by name; a misspelt name must fail, not vanish into the JSON.
  with pytest.raises(TypeError, match="no field 'tokens_per_sec'"):
    report.Record("ring", 8, "8").set(tokens_per_sec=1.0)
