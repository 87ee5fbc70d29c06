"""python -m maxctx.launch builds the `xpk workload create` command for every recipe, refusing names GKE, the registry
or Cloud Storage would not accept and steps no compile has shown to fit; the images install what pyproject.toml
declares; the JobSet example asks for as many hosts as its slice has."""

import dataclasses
import json
import pathlib
import re
import shlex
import tomllib

import pytest
import yaml

from maxctx.compile import step as compile_step
from maxctx.compile.report import CompileReport
from maxctx import launch
from maxctx import topology

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "configs" / "recipes").glob("*.yml"))
V7_14M = "configs/recipes/llama3.1-8b-14m-ring-tpu7x-128.yml"   # the tpu7x-128 recipe the tests launch
CHIPS_PER_HOST = 4   # v5p and v7 hosts

def _recipe_topology(path: pathlib.Path) -> str:
  return yaml.safe_load(path.read_text())["compile"]["topology"]


def _flags(argv: list[str]) -> dict[str, str]:
  return {a: b for a, b in zip(argv, argv[1:]) if a.startswith("--")}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_dry_run_prints_the_command(recipe, capsys):
  rel = str(recipe.relative_to(ROOT))
  rc = launch.main([rel, "--cluster", "pod-a", "--image", "us-docker.pkg.dev/p/maxctx/tpu:v1", "--dry-run",
                        "--workload", "w1", "--output-dir", "gs://bucket/runs", "--", "run.steps=7"])
  assert rc == 0
  argv = shlex.split(capsys.readouterr().out.strip())
  assert argv[:3] == ["xpk", "workload", "create"]
  flags = _flags(argv)
  assert flags["--tpu-type"] == topology.resolve(_recipe_topology(recipe)).name
  assert (flags["--cluster"], flags["--num-slices"], flags["--docker-image"]) == ("pod-a", "1",
                                                                                  "us-docker.pkg.dev/p/maxctx/tpu:v1")
  assert shlex.split(flags["--command"]) == ["python", "-m", "maxctx.train", rel, "run.steps=7",
                                             "run.output_dir=gs://bucket/runs/w1"]


def _fit_report(tmp_path, recipe: str, overrides: list[str], fits: bool = True) -> str:
  """A `maxctx.compile --json` report for `recipe` with `overrides` that says `fits`: the fields the launcher reads
  are the compile's own (`step_key`); the rest are placeholders (a real report's round trip is tested in
  test_compile)."""
  config = compile_step.load(recipe, overrides)
  tree = {f.name: 0 for f in dataclasses.fields(CompileReport)
          if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
  tree.update(step=compile_step.step_key(config), fits=fits, over_bytes=0 if fits else 3 * 2**30)
  path = tmp_path / "fit.json"
  path.write_text(json.dumps(tree))
  return str(path)


def test_multislice_sets_the_dcn_axis(tmp_path, capsys):
  recipe = V7_14M
  fit = _fit_report(tmp_path, recipe, ["compile.num_slices=2", "mesh.dcn.context=2"])
  assert launch.main([recipe, "--cluster", "c", "--image", "i", "--dry-run", "--tpu-type", "tpu7x-128",
                          "--num-slices", "2", "--dcn-axis", "context", "--project", "p", "--zone", "z",
                          "--fit-report", fit]) == 0
  flags = _flags(shlex.split(capsys.readouterr().out.strip()))
  assert (flags["--num-slices"], flags["--project"], flags["--zone"]) == ("2", "p", "z")
  assert "mesh.dcn.context=2" in shlex.split(flags["--command"])


@pytest.mark.parametrize("argv, words", [
    (["--num-slices", "2"], "mesh.dcn"),                      # two slices but the recipe has no DCN axis
    (["--tpu-type", "v5p-12"], "no standard slice"),
    (["--workload", "Bad_Name"], "lower-case"),
    (["--", "data.seq_len=1000"], "seq_len"),                 # not divisible by the context degree
])
def test_refuses_what_cannot_run(argv, words, capsys):
  recipe = V7_14M
  assert launch.main([recipe, "--cluster", "c", "--image", "i", "--dry-run", *argv]) == 2
  assert words in capsys.readouterr().err


LAUNCH = [V7_14M, "--cluster", "c", "--image", "i", "--dry-run"]


@pytest.mark.parametrize("argv, words", [
    # The v7 recipe needs 102 GiB per device, more than a v5p device's 95: the shapes allow it, the HBM does not.
    (["--tpu-type", "v5p-128"], ["was compiled for 1 × tpu7x-128", "not for 1 × v5p-128",
                                 "python -m maxctx.compile configs/recipes/llama3.1-8b-14m-ring-tpu7x-128.yml "
                                 "compile.topology=v5p-128 compile.num_slices=1 --json > fit.json",
                                 "--fit-report fit.json"]),
    (["--", "data.seq_len=16777216"], ["changes data.seq_len", "from 14680064 to 16777216",
                                       "compile.topology=tpu7x-128 compile.num_slices=1 data.seq_len=16777216 --json"]),
])
def test_a_launch_no_compile_has_shown_to_fit_is_refused(argv, words, capsys):
  """Acceptance 7 of the planner issue: launching checks fit, not only shape."""
  assert launch.main([*LAUNCH, *argv]) == 2
  err = capsys.readouterr().err
  assert all(w in err for w in words), err
  assert err.count("\n") == 1 and err.startswith("error: ")     # one sentence


def test_a_fit_report_for_the_launched_step_lets_it_launch(tmp_path, capsys):
  fit = _fit_report(tmp_path, V7_14M, ["compile.topology=v5p-128", "model.remat=full_offload"])
  assert launch.main([*LAUNCH, "--tpu-type", "v5p-128", "--fit-report", fit, "--",
                          "model.remat=full_offload", "run.steps=3"]) == 0
  assert _flags(shlex.split(capsys.readouterr().out))["--tpu-type"] == "v5p-128"


@pytest.mark.parametrize("report_overrides, fits, words", [
    (["compile.topology=v5p-128"], False, "says the step does not fit in 1 × v5p-128's HBM by 3.0 GiB"),
    (["compile.topology=v5p-128", "model.remat=none"], True,
     "was compiled with model.remat=none, but this launch has model.remat=full"),
    (["compile.topology=tpu7x-128"], True,
     "was compiled with topology=tpu7x-128, but this launch has topology=v5p-128"),
])
def test_a_fit_report_that_does_not_prove_the_launch_is_refused(tmp_path, capsys, report_overrides, fits, words):
  fit = _fit_report(tmp_path, V7_14M, report_overrides, fits=fits)
  assert launch.main([*LAUNCH, "--tpu-type", "v5p-128", "--fit-report", fit]) == 2
  assert words in capsys.readouterr().err


def test_a_fit_report_that_is_not_one_is_refused(tmp_path, capsys):
  bad = tmp_path / "fit.json"
  bad.write_text('{"fits": true}')
  assert launch.main([*LAUNCH, "--tpu-type", "v5p-128", "--fit-report", str(bad)]) == 2
  assert "is not a report of `python -m maxctx.compile ... --json`" in capsys.readouterr().err


def test_workload_name_is_kubernetes_safe():
  import datetime
  name = launch.workload_name(pathlib.Path("configs/recipes/llama3.1-8b-14m-usp-tpu7x-128.yml"),
                                  datetime.datetime(2026, 1, 2, 3, 4))
  assert re.fullmatch(r"[a-z]([a-z0-9-]*[a-z0-9])?", name) and len(name) <= 40 and name.endswith("0102-0304")


@pytest.mark.parametrize("dockerfile, extra", [("Dockerfile", "tpu"), ("Dockerfile.gpu", "gpu")])
def test_dockerfiles_install_pyproject_extras(dockerfile, extra):
  text = (ROOT / "docker" / dockerfile).read_text()
  extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
  declared = re.search(r"^ARG EXTRAS=(\S+)$", text, re.M).group(1).split(",")
  assert extra in declared and set(declared) <= set(extras)
  # The requirements are read from pyproject.toml, never repeated in the Dockerfile.
  assert "tomllib" in text and "pyproject.toml" in text
  assert not re.search(r"pip install [^\n]*(jax|flax|optax)", text)
  assert 'pip install --no-deps -e ".[${EXTRAS}]"' in text


def test_jobset_example_matches_its_slice():
  doc = yaml.safe_load((ROOT / "deploy" / "jobset-tpu7x-128.yaml").read_text())
  job = doc["spec"]["replicatedJobs"][0]["template"]["spec"]
  pod = job["template"]["spec"]
  topo = topology.resolve("tpu7x-128")
  assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == topo.shape_text
  assert job["parallelism"] == job["completions"] == topo.chips // CHIPS_PER_HOST
  assert pod["containers"][0]["resources"]["limits"]["google.com/tpu"] == CHIPS_PER_HOST
  command = pod["containers"][0]["command"]
  assert command[:3] == ["python", "-m", "maxctx.train"] and (ROOT / command[3]).is_file()


@pytest.mark.parametrize("flag, value, words", [
    ("--cluster", "pod-a; rm -rf ~", "is not a GKE cluster name"),
    ("--cluster", "Pod_A", "is not a GKE cluster name"),
    ("--cluster", "pod-", "ending with a letter or digit"),
    ("--cluster", "p" * 41, "1 to 40"),
    ("--cluster", "$(id)" * 2000, "is not a GKE cluster name"),       # echoed as a short excerpt only
    ("--image", "us-docker.pkg.dev/p/maxctx/tpu:v1 && curl evil", "is not a container image reference"),
    ("--image", "$(whoami)/tpu:v1", "is not a container image reference"),
    ("--image", "us-docker.pkg.dev/P/Maxctx:v1", "with a lower-case path"),
    ("--image", "maxctx:" + "t" * 129, "is not a container image reference"),
    ("--output-dir", "gs://my bucket/runs", "names bucket 'my bucket', which Cloud Storage does not allow"),
    ("--output-dir", "gs://Runs/x", "lower-case letters"),
    ("--output-dir", "gs://ab/x", "3 to 63 characters"),
    ("--output-dir", f"gs://{'b' * 64}/x", "3 to 63 characters"),
    ("--output-dir", "gs://192.168.1.1/x", "IP address"),
    ("--output-dir", "gs://google-runs/x", "'google'"),
    ("--output-dir", "gs://goog-runs/x", "'goog'"),
])
def test_names_the_cloud_would_refuse_stop_the_launch(flag, value, words, capsys):
  """Issue 37: cluster, image and bucket names holding shell metacharacters or breaking their service's rules are
  refused in one short sentence before anything else (a repeated flag's last value is the one used)."""
  assert launch.main([*LAUNCH, flag, value]) == 2
  err = capsys.readouterr().err
  assert words in err, err
  assert err.count("\n") == 1 and err.startswith("error: ") and len(err) < 400, err


@pytest.mark.parametrize("flag, value", [
    ("--cluster", "a"), ("--cluster", "pod-2-" + "x" * 33),
    ("--image", "maxctx:tpu"), ("--image", "localhost:5000/team/maxctx_tpu/x-y:v1.2-rc_3"),
    ("--image", f"us-docker.pkg.dev/my-project/maxctx/tpu@sha256:{'a1' * 32}"),
    ("--output-dir", "gs://my-bucket_2/runs"), ("--output-dir", "gs://runs.example.com/x"), ("--output-dir", "/tmp/r"),
])
def test_names_the_cloud_accepts_launch(flag, value, capsys):
  assert launch.main([*LAUNCH, flag, value]) == 0, capsys.readouterr().err
  flags = _flags(shlex.split(capsys.readouterr().out))
  if flag == "--output-dir":
    assert f"run.output_dir={value}/" in flags["--command"]
  else:
    assert flags[{"--image": "--docker-image"}.get(flag, flag)] == value


def test_the_recipe_is_passed_by_its_path_under_configs(tmp_path):
  # A wheel's configs lie in site-packages, the recipe a user launches in the checkout the image is built from: both
  # are configs/<path>; a recipe under no configs/ directory is refused, since the image would not hold it.
  ours = ROOT / "configs" / "recipes" / "llama3.1-8b-14m-ring-tpu7x-128.yml"
  assert launch.image_path(ours) == "configs/recipes/llama3.1-8b-14m-ring-tpu7x-128.yml"
  checkout = tmp_path / "checkout" / "configs" / "recipes" / "mine.yml"
  checkout.parent.mkdir(parents=True)
  checkout.write_text(ours.read_text())
  assert launch.image_path(checkout) == "configs/recipes/mine.yml"
  (tmp_path / "r.yml").write_text(ours.read_text())
  with pytest.raises(launch.ConfigError, match=r"r.yml is outside configs/"):
    launch.image_path(tmp_path / "r.yml")
