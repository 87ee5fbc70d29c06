"""maxctx installs as a wheel: built from the source, installed into a fresh venv with no source tree on its path and
no network, it trains the demo for two steps from another directory, finding base.yml and the model preset it names
inside the installed package (configs/ ships as package data)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What a wheel is built from: the project file (it names README.md), the package and the configs it links to.
SOURCES = ("pyproject.toml", "README.md", "maxctx", "configs")


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
  result = subprocess.run(argv, capture_output=True, text=True, timeout=600, **kwargs)
  assert result.returncode == 0, (argv, result.stdout[-3000:], result.stderr[-3000:])
  return result


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_trains_the_demo(tmp_path):
  # A copy of the sources, so the build neither writes into the checkout nor picks up a stale build/ there.
  src = tmp_path / "src"
  src.mkdir()
  for name in SOURCES:
    if (ROOT / name).is_dir():
      shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    else:
      shutil.copy2(ROOT / name, src / name)
  pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
  # The running venv's setuptools (the test extra declares it) builds it: no build isolation, so no download.
  _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp_path / "dist"), str(src)])
  wheel, = (tmp_path / "dist").glob("maxctx-*.whl")

  venv = tmp_path / "venv"
  _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
  python = venv / "bin" / "python"
  site = pathlib.Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
                      .stdout.strip())
  _run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)])
  # The dependencies come from this venv's site-packages, named as plain paths: a plain path line does not run the
  # .pth files there (an editable install's finder among them), so only the wheel's maxctx can be imported.
  here = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
  (site / "dependencies.pth").write_text("".join(f"{p}\n" for p in here))

  work = tmp_path / "elsewhere"
  work.mkdir()
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
  env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu", PYTHONNOUSERSITE="1")
  where = _run([str(python), "-c", "import maxctx, maxctx.config as c; print(maxctx.__file__); print(c.CONFIG_DIR); "
                "print(maxctx.__version__)"], env=env, cwd=work).stdout.split()
  assert all(pathlib.Path(p).is_relative_to(site) for p in where[:2]), where
  assert where[2] != "0+unknown"

  # The run file names the `tiny` preset; base.yml and configs/models/tiny.yml are read from the installed package.
  demo = site / "maxctx" / "configs" / "demo.yml"
  result = _run([str(python), "-m", "maxctx.train", str(demo), "run.steps=2", f"run.output_dir={work / 'run'}",
                 "checkpoint.every_steps=2", "metrics.log_every=1"], env=env, cwd=work)
  assert "step 2" in result.stdout + result.stderr, result.stdout[-3000:]
  assert (work / "run" / "checkpoints" / "2").is_dir()
