"""Per-process loading with 2 real JAX processes on the CPU (gloo collectives, a 127.0.0.1 coordinator).

Each process makes only the rows its 4 devices hold and hands each device its own slice; the shards the two processes
hold, put together, equal the batch a single process with all 8 devices makes.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from maxctx import config as cfg, mesh as mesh_lib
from maxctx import data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ("tokens", "targets", "segment_ids", "positions")

CHILD = textwrap.dedent("""
  import json, sys
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  port, pid, out, *overrides = sys.argv[1:]
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=int(pid))
  import numpy as np
  from maxctx import config as cfg, mesh as mesh_lib, data
  c = cfg.load(None, overrides)
  p = data.build(c, mesh_lib.build_mesh(c.mesh))
  shards, local = {}, None
  for step in range(2):
    b = next(p)
    for k, v in b.items():
      for i, s in enumerate(v.addressable_shards):
        (r0, r1, _), (c0, c1, _) = s.index[0].indices(v.shape[0]), s.index[1].indices(v.shape[1])
        shards[f"{k}|{step}|{r0}|{r1}|{c0}|{c1}|{i}"] = np.asarray(s.data)
  np.savez(out, **shards)
  json.dump({"rows": p.rows, "local_rows": p.host_batch()["tokens"].shape[0]}, open(out + ".json", "w"))
  jax.distributed.shutdown()
""")

MESHES = {
    # Batch split between the processes: each makes half the rows.
    "fsdp": ["mesh.ici.fsdp=2", "mesh.ici.context=4"],
    # The sequence spans both processes: each makes every row but hands its devices only their columns.
    "context": ["mesh.ici.fsdp=1", "mesh.ici.context=8"],
}


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("source", ["synthetic", "jsonl"])
@pytest.mark.parametrize("mesh", list(MESHES))
def test_two_processes_assemble_the_single_process_batch(tmp_path, mesh, source):
  rng = np.random.default_rng(0)
  with open(tmp_path / "docs.jsonl", "w") as f:
    for _ in range(50):
      f.write(json.dumps({"text": rng.integers(1, 512, rng.integers(3, 100)).tolist()}) + "\n")
  overrides = ["model.preset=tiny", "data.seq_len=64", "data.batch_size=4", f"data.source={source}",
               f"data.path={tmp_path}/docs.jsonl", "attention.load_balance=true", *MESHES[mesh]]
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": REPO}
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(port), str(i), str(tmp_path / f"p{i}.npz"),
                             *overrides], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for i in range(2)]
  for p in procs:
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0, out[-3000:]

  c = cfg.load(None, overrides)
  single = data.build(c, mesh_lib.build_mesh(c.mesh))
  expected = [{k: np.asarray(v) for k, v in next(single).items()} for _ in range(2)]
  seen = {k: [np.full((4, 64), -1, np.int32) for _ in range(2)] for k in FIELDS}
  for i in range(2):
    info = json.load(open(tmp_path / f"p{i}.npz.json"))
    if mesh == "fsdp":
      assert info["rows"] == [2 * i, 2 * i + 1] and info["local_rows"] == 2, "only its own rows"
    else:
      assert info["rows"] == [0, 1, 2, 3]
    for key, shard in np.load(tmp_path / f"p{i}.npz").items():
      k, step, r0, r1, c0, c1, _ = key.split("|")
      seen[k][int(step)][int(r0):int(r1), int(c0):int(c1)] = shard
  for step in range(2):
    for k in FIELDS:
      np.testing.assert_array_equal(seen[k][step], expected[step][k])
