"""flash as lowered for an NVIDIA GPU: its Triton kernels, proven to lower on this CPU host for an H200 (the lowering
Pallas runs when a step is compiled for CUDA; only PTX generation needs the GPU). Their numerics under every strategy
are in test_attention_conformance.py (`flash_gpu`, Pallas interpreter)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from maxctx.attention import flash, flash_gpu


def _h200_mesh():
  """A one-device abstract mesh whose device is an H200 (Pallas's Triton lowering asks the target's GPU), or None
  where this jax cannot name one."""
  try:
    from jax._src import mesh as mesh_lib
    h200 = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)
  except (ImportError, AttributeError, TypeError):
    return None


def lowered_for_h200(fn, *args) -> str:
  """StableHLO of `fn` lowered for CUDA, as for an H200."""
  with jax.sharding.use_abstract_mesh(_h200_mesh()):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.skipif(_h200_mesh() is None, reason="this jax cannot name an abstract GPU to lower for")
@pytest.mark.parametrize("n_heads, kv_heads, dtype", [(4, 1, jnp.bfloat16), (2, 2, jnp.float32)])
def test_forward_and_backward_lower_to_triton_for_cuda(n_heads, kv_heads, dtype, monkeypatch):
  """The whole-sequence kernel with its custom backward, lowered for CUDA: the forward, dq and dkv Triton kernels,
  and neither the TPU's Mosaic kernels nor the interpreter's loop over the grid. (On a GPU host flash picks the GPU's
  kernels itself; this host's default backend is the CPU.)"""
  monkeypatch.setattr(flash, "KERNELS_FOR", "gpu")
  B, T, H = 1, 1024, 128
  attend = flash.make(None, None)

  def step(q, k, v, seg, pos, dout):
    out, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, seg, seg, pos, pos), q, k, v)
    return out, *pullback(dout)

  q = jax.ShapeDtypeStruct((B, T, n_heads, H), dtype)
  kv = jax.ShapeDtypeStruct((B, T, kv_heads, H), dtype)
  ids = jax.ShapeDtypeStruct((B, T), jnp.int32)
  text = lowered_for_h200(step, q, kv, kv, ids, ids, q)
  assert text.count("@__gpu$xla.gpu.triton") == 3
  assert sorted(re.findall(r'name = "(maxctx_flash\w*)"', text)) == [
      "maxctx_flash_gpu_dkv", "maxctx_flash_gpu_dq", "maxctx_flash_gpu_fwd"]
  assert "tpu_custom_call" not in text


def test_gpu_blocks_are_powers_of_two_that_divide_the_length():
  assert flash_gpu.fit(None, 128, 1024) == 128
  assert flash_gpu.fit(100, 128, 1024) == 64          # rounded down to a power of two
  assert flash_gpu.fit(256, 128, 384) == 128          # halved until it divides
  assert flash_gpu.fit(8, 128, 1024) == flash_gpu.MIN_BLOCK
  with pytest.raises(ValueError, match="multiple of 16"):
    flash_gpu.fit(64, 64, 1000)


def test_gpu_recipes_validate_for_their_gpus():
  """The GPU recipes pass every check `maxctx.train` makes before compiling, on the GPU counts they name, with their
  default kernel (blockwise: flash has not run on a GPU yet) and with flash, one key away, as gpu_check.sh runs it."""
  from maxctx import config, trainer
  root = pathlib.Path(config.CONFIG_DIR) / "recipes" / "gpu"
  counts = {"llama3.1-8b-20l-128k-h200": 1, "llama3.1-8b-1m-ring-h200x8": 8}
  assert sorted(p.stem for p in root.glob("*.yml")) == sorted(counts)
  for stem, gpus in counts.items():
    assert config.load(root / f"{stem}.yml").attention.kernel == "blockwise"
    for overrides in ([], ["attention.kernel=flash"]):
      sizes = trainer.validate(config.load(root / f"{stem}.yml", overrides), gpus, platform="gpu")
      assert sizes["context"] == gpus


def test_gpu_check_script_rehearses_on_the_cpu(tmp_path):
  """scripts/gpu_check.sh, the one command an H200 session runs, end to end on this host: the kernel benchmark (flash
  interpreted, XLA in cuDNN's place) and a short training run, summarised in its table. Guards the script against
  drifting from the flags and log lines it reads."""
  env = dict(os.environ, GPU_CHECK_CPU="1", PYTHON=sys.executable, SEQ_LENS="256",
             XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu",
             TRAIN_ARGS="model.preset=tiny model.n_layers=2 data.seq_len=256 attention.kernel=blockwise "
                        "model.loss_chunk=256 model.mlp_chunk=0")
  root = pathlib.Path(__file__).resolve().parent.parent
  result = subprocess.run(["bash", str(root / "scripts" / "gpu_check.sh"), str(tmp_path)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  table = [line for line in result.stdout.splitlines() if line.startswith("| attention") or line.startswith("| train")]
  assert len(table) == 4, result.stdout
  assert "all_gather flash (interpreted: not a speed)" in table[0] and "≥ 0.7 × cuDNN" in table[0]
  assert "16 docs flash" in table[1] and "tokens/s ≥ without documents" in table[1]
  assert "XLA (cuDNN off a GPU)" in table[2]
  assert "step 5/5" in table[3] and "MFU" in table[3]
