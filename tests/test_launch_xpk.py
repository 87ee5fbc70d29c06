"""scripts/launch_xpk.py builds the `xpk workload create` command for every recipe; the images install what
pyproject.toml declares; the JobSet example asks for as many hosts as its slice has."""

import importlib.util
import pathlib
import re
import shlex
import tomllib

import pytest
import yaml

from maxctx import topology

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "configs" / "recipes").glob("*.yml"))
CHIPS_PER_HOST = 4   # v5p and v7 hosts

spec = importlib.util.spec_from_file_location("launch_xpk", ROOT / "scripts" / "launch_xpk.py")
launch_xpk = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch_xpk)


def _recipe_topology(path: pathlib.Path) -> str:
  return yaml.safe_load(path.read_text())["compile"]["topology"]


def _flags(argv: list[str]) -> dict[str, str]:
  return {a: b for a, b in zip(argv, argv[1:]) if a.startswith("--")}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_dry_run_prints_the_command(recipe, capsys):
  rel = str(recipe.relative_to(ROOT))
  rc = launch_xpk.main([rel, "--cluster", "pod-a", "--image", "us-docker.pkg.dev/p/maxctx/tpu:v1", "--dry-run",
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


def test_multislice_sets_the_dcn_axis(capsys):
  recipe = str(RECIPES[0].relative_to(ROOT))
  assert launch_xpk.main([recipe, "--cluster", "c", "--image", "i", "--dry-run", "--tpu-type", "tpu7x-128",
                          "--num-slices", "2", "--dcn-axis", "context", "--project", "p", "--zone", "z"]) == 0
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
  recipe = str(RECIPES[0].relative_to(ROOT))
  assert launch_xpk.main([recipe, "--cluster", "c", "--image", "i", "--dry-run", *argv]) == 2
  assert words in capsys.readouterr().err


def test_workload_name_is_kubernetes_safe():
  import datetime
  name = launch_xpk.workload_name(pathlib.Path("configs/recipes/llama3.1-8b-14m-usp-tpu7x-128.yml"),
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
