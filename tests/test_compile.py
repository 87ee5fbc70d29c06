"""Ahead-of-time compile for TPU topologies (maxctx.compile) with libtpu, on the CPU: each strategy's collectives show
up in the compiled HLO, memory is read back, and a step too large for HBM is reported instead of raised."""

import dataclasses
import importlib.util
import json
import re

import pytest

from maxctx.compile import __main__ as compile_main
from maxctx.compile import hlo as hlo_lib
from maxctx.compile import step as compile_step
from maxctx.compile.report import CompileReport, format_report
from maxctx import trainer as trainer_lib
from maxctx import topology
from maxctx.errors import ConfigError

pytestmark = pytest.mark.usefixtures("users_matmul_precision")   # see tests/conftest.py

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install -e '.[tpu]'); it compiles for TPUs")

TINY = """
run: {name: tiny-aot}
model: {preset: tiny, remat: full}
mesh: {ici: {data: 1, fsdp: -1, context: 4, tensor: 1}}
attention: {strategy: ring, kernel: blockwise}
data: {seq_len: 512, batch_size: 2}
compile: {topology: "v5p:2x2x1"}
"""

# What each strategy must (and must not) send inside the model's attention scope.
EXPECTED = {
    "all_gather": ({"all-gather"}, {"all-to-all", "collective-permute"}),
    "ulysses": ({"all-to-all"}, {"collective-permute"}),
    "ring": ({"collective-permute"}, {"all-to-all"}),
    "usp": ({"all-to-all", "collective-permute"}, set()),
}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
  path = tmp_path_factory.mktemp("compile") / "tiny.yml"
  path.write_text(TINY)
  return str(path)


@pytest.mark.parametrize("name, libtpu, chips, devices", [
    ("v5p-128", "v5p:4x4x4", 64, 64), ("tpu7x-128", "tpu7x:4x4x4", 64, 128), ("v5p-8", "v5p:2x2x1", 4, 4),
    ("tpu7x-256", "tpu7x:4x4x8", 128, 256), ("v6e-256", "v6e:16x16", 256, 256), ("v5e-8", "v5e:2x4", 8, 8),
    ("v5p:2x4x4", "v5p:2x4x4", 32, 32)])
def test_topology_names(name, libtpu, chips, devices):
  t = topology.resolve(name)
  assert (t.libtpu_name, t.chips, t.devices) == (libtpu, chips, devices)


@pytest.mark.parametrize("name, words", [("v9-128", "unknown TPU generation"), ("v5p-12", "no standard slice"),
                                         ("v5p-7", "whole number of chips"), ("tpu7x", "not of the form"),
                                         ("v5p:4x4", "has 2 axes")])
def test_topology_errors(name, words):
  with pytest.raises(ConfigError, match=words):
    topology.resolve(name)


def test_collective_counts_reads_async_pairs_once_and_scopes():
  hlo = "\n".join([
      '  %ag = bf16[8] all-gather-start(bf16[2] %p), metadata={op_name="jit(f)/layers/attn/attention/all_gather"}',
      '  %agd = bf16[8] all-gather-done(%ag)',
      '  %cp = bf16[2] collective-permute(bf16[2] %x), metadata={op_name="jit(f)/attention/ring/ppermute"}',
      '  %ar = f32[] all-reduce(f32[] %y), to_apply=%add, metadata={op_name="jit(f)/train_step/all-to-all("}',
  ])
  counts = hlo_lib.instruction_counts(hlo)
  kinds = ("all-gather", "collective-permute", "all-reduce", "all-to-all")
  assert tuple(counts[kind] for kind in kinds) == (1, 1, 1, 0)
  scoped = hlo_lib.instruction_counts(hlo, "attention")
  assert (scoped["all-gather"], scoped["collective-permute"], scoped["all-reduce"]) == (1, 1, 0)


def test_parse_oom_messages():
  total = compile_step.parse_oom("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
                                "temporaries (208.62G) exceeds available HBM (95.74G).")
  assert total["required_bytes"] == int(208.62 * 2**30) and not total["required_is_lower_bound"]
  one = compile_step.parse_oom("RESOURCE_EXHAUSTED: Allocation (size=128000000000) would exceed memory "
                              "(size=103079215104) :: ...")
  assert one == {"required_bytes": 128000000000, "required_is_lower_bound": True, "hbm_reported_bytes": 103079215104}


def test_missing_topology_is_a_config_error(tmp_path):
  path = tmp_path / "run.yml"
  path.write_text(TINY.replace('compile: {topology: "v5p:2x2x1"}', ""))
  with pytest.raises(ConfigError, match="compile.topology"):
    compile_step.load(str(path), [])
  with pytest.raises(ConfigError, match="compile.topolgy"):
    compile_step.load(str(path), ["compile.topolgy=v5p-8"])


# Each strategy compiled once, two on each generation (which collectives a strategy issues does not depend on the
# chip); test_flash_kernel_runs_inside_the_ring compiles ring and usp, whose collectives are every kind named here, on
# both. Every pair costs a TPU compile of 0.5-2 minutes of CI's 2 cores.
@needs_libtpu
@pytest.mark.parametrize("strategy,topo", [pytest.param("all_gather", "tpu7x:2x2x1", marks=pytest.mark.slow),
                                           ("ulysses", "v5p:2x2x1"),
                                           pytest.param("ring", "tpu7x:2x2x1", marks=pytest.mark.slow),
                                           ("usp", "v5p:2x2x1")])
def test_collectives_match_strategy(tiny_path, topo, strategy):
  config = compile_step.load(tiny_path, [f"compile.topology={topo}", f"attention.strategy={strategy}"])
  report = compile_step.compile_for(config)
  assert report.fits and report.memory.total > 0
  assert report.devices == topology.resolve(topo).devices
  sent = {k for k, v in report.attention_collectives.items() if v}
  must, must_not = EXPECTED[strategy]
  assert must <= sent and not (must_not & sent), (strategy, report.attention_collectives)
  # ZeRO-3: parameters are all-gathered for use and their gradients reduced, whatever the strategy.
  assert report.collectives["all-gather"] > 0
  assert report.collectives["reduce-scatter"] + report.collectives["all-reduce"] > 0
  assert "does not fit" not in format_report(report)


@needs_libtpu
def test_over_hbm_is_reported_not_raised(tiny_path, capsys):
  # A vocabulary of 2^24 tokens: one loss chunk's float32 logits, [256 tokens, 2^24], are 16 GiB, all of v5e's HBM,
  # beside 6-12 GiB per device of embedding (and head) with Adam's moments. Attention at 64K tokens gets over HBM as
  # well, but made this test take 178 s instead of 52 (alone, on 2 cores of the AMD EPYC kind CI ran on).
  overrides = ["compile.topology=v5e-4", "attention.strategy=all_gather", "model.vocab_size=16777216",
               "data.batch_size=4"]
  rc = compile_main.main([tiny_path, *overrides, "--json"])
  assert rc == 0
  report = json.loads(capsys.readouterr().out)
  assert not report["fits"] and report["memory"] is None and report["error"]
  assert report["over_bytes"] is None or report["over_bytes"] > 0
  # The report names the step it compiled, through JSON, as the launcher's --fit-report compares it.
  config = compile_step.load(tiny_path, overrides)
  assert CompileReport.from_json(report).step == compile_step.step_key(config)
  assert compile_step.step_key(config)["mesh"]["ici"] == {"data": 1, "fsdp": 1, "context": 4, "tensor": 1}


@needs_libtpu
def test_offloaded_layer_inputs_leave_hbm(tiny_path):
  # remat full_offload is what fits the 14M-token v5p recipe: the saved layer inputs move to the host's memory.
  layers, tokens = 16, 4096

  def report(remat):
    config = compile_step.load(tiny_path, [f"model.remat={remat}", f"data.seq_len={tokens}",
                                                   f"model.n_layers={layers}"])
    return compile_step.compile_for(config)

  offloaded = report("full_offload")
  full, offload = report("full").memory, offloaded.memory
  config = compile_step.load(tiny_path, ["model.remat=full_offload", f"data.seq_len={tokens}",
                                           f"model.n_layers={layers}"])
  # The tiny model computes in float32: [batch 2, tokens / 4 chips, d_model] per layer. maxctx.train checks the same
  # figure against the host's RAM before compiling.
  m = config.model
  saved_inputs = layers * 2 * tokens // 4 * m.d_model * 4
  assert trainer_lib.offloaded_bytes_per_device(config, trainer_lib.validate(config, 4, platform="tpu")) == saved_inputs
  assert full.host_temp == 0
  assert saved_inputs <= offload.host_temp <= 1.1 * saved_inputs
  assert offload.temp <= full.temp - saved_inputs // 2   # most of what went to the host left HBM
  # Fit counts the host VM's RAM too: v5p:2x2x1 is one VM of 4 devices with 448 GB, which holds this easily, and would
  # not if it had less than 1.25 × what its 4 devices offload.
  assert offloaded.devices_per_host == 4 and offloaded.host_bytes_per_host == 4 * offload.host_temp
  assert offloaded.fits and offloaded.host_fits
  small = dataclasses.replace(offloaded, host_ram_bytes=int(1.2 * offloaded.host_bytes_per_host))
  assert not small.host_fits
  # model.remat_group 2 (nested remat) keeps one input per pair of layers: half the host memory, and the layers inside
  # a group do not send theirs too (libtpu compiles what JAX asks, so this checks the whole path to the compiled step).
  grouped = compile_step.compile_for(compile_step.load(tiny_path, [
      "model.remat=full_offload", "model.remat_group=2", f"data.seq_len={tokens}", f"model.n_layers={layers}"]))
  assert saved_inputs // 2 <= grouped.memory.host_temp <= 1.1 * saved_inputs // 2
  assert re.search(r"host memory \(offloaded\): .* per device, .* per host VM \(4 devices\) of its .* RAM \(83%; "
                   r"maxctx.train allows 80%\)", format_report(small))


@needs_libtpu
def test_flash_kernel_compiles_for_tpu_under_ulysses(tiny_path):
  # Whole-sequence use of the flash kernel (its own custom_vjp around the same Mosaic kernels) in the full train
  # step under ulysses with zigzag load balancing, which a kernel that read causality from token order could not do.
  config = compile_step.load(tiny_path, [
      "attention.strategy=ulysses", "attention.kernel=flash", "attention.load_balance=true", "model.head_dim=128",
      "mesh.ici.context=2", "data.seq_len=1024"])
  report = compile_step.compile_for(config, inspect=lambda compiled: {"hlo": compiled.as_text()})
  assert report.fits and report.attention_collectives["all-to-all"] > 0
  calls = {line.split("=")[0].strip().split(".")[0].lstrip("%") for line in report.inspected["hlo"].splitlines()
           if 'custom_call_target="tpu_custom_call"' in line}
  assert calls == {"maxctx_flash_fwd", "maxctx_flash_dq", "maxctx_flash_dkv"}


def _computations(hlo: str) -> dict[str, list[str]]:
  """The compiled HLO's computations by name, each as its instruction lines."""
  comps, name = {}, None
  for line in hlo.splitlines():
    if m := re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line):
      name = m.group(1)
      comps[name] = []
    elif line.startswith("}"):
      name = None
    elif name is not None:
      comps[name].append(line)
  return comps


def _callees(line: str) -> list[str]:
  refs = re.findall(r"(?:body|condition|to_apply|calls|branch_computations|true_computation|false_computation)="
                    r"(\{[^}]*\}|%?[\w.\-]+)", line)
  return [n.strip().lstrip("%") for ref in refs for n in ref.strip("{}").split(",")]


def _ring_kernels(hlo: str) -> set[str]:
  """The Mosaic kernels (tpu_custom_call, by instruction name) that run inside a loop whose body sends with a
  collective-permute: inside the ring's hops, reached through the loop body's conditionals and calls."""
  comps = _computations(hlo)
  bodies = {n for lines in comps.values() for line in lines if " while(" in line
            for n in re.findall(r"body=%?([\w.\-]+)", line)}
  found = set()
  for body in (b for b in bodies if any("collective-permute" in line for line in comps.get(b, []))):
    seen, todo = set(), [body]
    while todo:
      name = todo.pop()
      if name in seen or name not in comps:
        continue
      seen.add(name)
      for line in comps[name]:
        todo += _callees(line)
        if 'custom_call_target="tpu_custom_call"' in line:
          found.add(re.match(r"\s*(?:ROOT )?%?([a-z_]+)", line).group(1))
  return found


@needs_libtpu
@pytest.mark.parametrize("topo", ["v5p:2x2x1", pytest.param("tpu7x:2x2x1", marks=pytest.mark.slow)])
@pytest.mark.parametrize("strategy", ["ring", "usp"])
def test_flash_kernel_runs_inside_the_ring(tiny_path, topo, strategy):
  # The whole train step with the flash kernel, lowered by Mosaic for the TPU (not interpreted): forward and both
  # backward kernels sit inside the ring's hop loop, and no array is as large as the local queries times their keys.
  # 640 tokens per device (usp: 1,280 per all-to-all group) keep those lengths apart from every other dimension.
  config = compile_step.load(tiny_path, [f"compile.topology={topo}", f"attention.strategy={strategy}",
                                                 "attention.kernel=flash", "model.head_dim=128",
                                                 "data.seq_len=2560"])
  report = compile_step.compile_for(config, inspect=lambda compiled: {"hlo": compiled.as_text()})
  assert report.fits and report.attention_collectives["collective-permute"] > 0
  assert _ring_kernels(report.inspected["hlo"]) == {"maxctx_flash_fwd", "maxctx_flash_dq", "maxctx_flash_dkv"}
  lengths = (640, 1280) if strategy == "usp" else (640,)
  shapes = set(re.findall(r"\[([\d,]+)\]", report.inspected["hlo"]))
  quadratic = [s for s in shapes if any(f"{a},{b}" in f",{s}," or s.startswith(f"{a},{b}") or s.endswith(f"{a},{b}")
                                        for a in lengths for b in lengths)]
  assert not quadratic, quadratic
