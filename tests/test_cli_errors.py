"""A user's mistake ends the run with one sentence on stderr, a non-zero exit, and no traceback."""

import os
import subprocess
import sys

import pytest

ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")


def _train(*args):
  return subprocess.run([sys.executable, "-m", "maxctx.train", "configs/demo.yml", *args], capture_output=True,
                        text=True, env=ENV, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))


@pytest.mark.parametrize("args, fragments", [
    (["optim.lerning_rate=1"], ["unknown config key optim.lerning_rate", "did you mean optim.lr?"]),
    (["run.steps=ten"], ["run.steps expects int", "'ten'"]),
    (["mesh.ici.fsdp=1", "mesh.ici.context=2"], ["multiply to 2", "8 devices"]),
    (["mesh.ici.fsdp=1", "mesh.ici.context=1", "mesh.ici.tensor=8"], ["model.n_heads 4", "tensor degree 8"]),
    (["mesh.ici.fsdp=1", "mesh.ici.context=2", "mesh.ici.tensor=4"], ["model.n_kv_heads 2", "tensor degree 4"]),
    (["attention.strategy=rign"], ["attention.strategy 'rign'", "did you mean"]),
])
def test_user_errors_are_one_sentence_without_traceback(args, fragments):
  result = _train(*args, "run.output_dir=/tmp/maxctx-cli-errors")
  assert result.returncode != 0
  assert "Traceback" not in result.stderr
  lines = [l for l in result.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
  for fragment in fragments:
    assert fragment in lines[0]
