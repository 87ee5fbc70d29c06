"""Llama checkpoints between Hugging Face (config.json + safetensors) and maxctx (Orbax params + model.yml):
`python -m maxctx.convert import|export` (maxctx/convert/__main__.py).

import writes <out_dir>/params, an Orbax checkpoint of the maxctx params pytree (set checkpoint.load_params to it),
and <out_dir>/model.yml, the model section the weights need (use it as the run file, or copy its keys into yours).
Layers are stacked for model.scan_layers=true unless --unscanned. A model training would refuse (e.g. query heads that
are not a multiple of the KV heads) is refused before anything is written.

export reads params as training's checkpoint.load_params does (maxctx.params_io: the params pytree, or a training
checkpoint step whose 'params' subtree alone is read), and writes safetensors (5 GB shards with an index above that)
and a config.json that transformers' LlamaForCausalLM.from_pretrained loads, with the RoPE settings of the run stage
(run.stages) that trained the exported step. Tokenizer files are not touched; copy them alongside.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from maxctx import config as config_lib
from maxctx import hf, stages
from maxctx.errors import CheckpointError, ConfigError

SHARD_BYTES = 5 * 2**30
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsDir(Mapping):
  """The tensors of a HF directory, read from disk only when asked for, so conversion never holds two copies."""

  def __init__(self, directory: pathlib.Path, stack: contextlib.ExitStack):
    from safetensors import safe_open

    index = directory / INDEX_FILE
    if index.exists():
      weight_map = json.loads(index.read_text())["weight_map"]
      files = sorted(set(weight_map.values()))
    else:
      files = ([SINGLE_FILE] if (directory / SINGLE_FILE).exists()
               else sorted(p.name for p in directory.glob("*.safetensors")))
      weight_map = None
    if not files:
      raise CheckpointError(f"{directory} holds no *.safetensors files; save the HF model with "
                            "save_pretrained(..., safe_serialization=True) (pytorch_model.bin is not read).")
    self._handles = {}
    for name in files:
      if not (directory / name).exists():
        raise CheckpointError(f"{index} names shard {name}, which is missing from {directory}; download it again.")
      self._handles[name] = stack.enter_context(safe_open(str(directory / name), framework="np"))
    if weight_map is None:
      weight_map = {key: name for name, h in self._handles.items() for key in h.keys()}
    self._where = weight_map

  def __getitem__(self, key: str) -> np.ndarray:
    return self._handles[self._where[key]].get_tensor(key)

  def __iter__(self) -> Iterator[str]:
    return iter(self._where)

  def __len__(self) -> int:
    return len(self._where)


def import_hf(hf_dir: str | pathlib.Path, out_dir: str | pathlib.Path, scan_layers: bool = True) -> pathlib.Path:
  """HF directory → <out_dir>/params (Orbax) and <out_dir>/model.yml; returns the params path."""
  import orbax.checkpoint as ocp
  import yaml

  hf_dir, out_dir = pathlib.Path(hf_dir), pathlib.Path(out_dir).resolve()
  config_path = hf_dir / "config.json"
  if not config_path.exists():
    raise CheckpointError(f"{hf_dir} has no config.json; pass the directory save_pretrained wrote.")
  try:
    hf_config = json.loads(config_path.read_text())
  except (ValueError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{config_path} is not valid JSON ({e}); pass the directory save_pretrained wrote.") from None
  if not isinstance(hf_config, dict):
    raise CheckpointError(f"{config_path} holds a {type(hf_config).__name__}, not a JSON object; pass the directory "
                          "save_pretrained wrote.")
  overrides = hf.model_config_from_hf(hf_config)
  overrides["model.scan_layers"] = scan_layers
  model_cfg = _trainable(config_lib.load(None).replace(**overrides), config_path).model
  params_path = out_dir / "params"
  if params_path.exists():
    raise CheckpointError(f"{params_path} already exists; choose a new output directory or remove it.")

  with contextlib.ExitStack() as stack:
    params = hf.params_from_hf(SafetensorsDir(hf_dir, stack), model_cfg)
  out_dir.mkdir(parents=True, exist_ok=True)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(params_path, params)

  model = {key.removeprefix("model."): value for key, value in overrides.items()}
  (out_dir / "model.yml").write_text(
      f"# Converted from {hf_dir.resolve()} by python -m maxctx.convert import; params: {params_path}\n"
      + yaml.safe_dump({"model": model}, sort_keys=False))
  return params_path


def _trainable(config: config_lib.Config, source: pathlib.Path) -> config_lib.Config:
  """`config` if training would accept its model (the checks `maxctx.train` makes, on one device), so that nothing is
  written for a model no run can use; else one sentence naming the HF config."""
  from maxctx import trainer

  try:
    trainer.validate(config, num_devices=1)
  except ConfigError as e:
    raise ConfigError(f"{source} describes a model maxctx cannot train: {e}") from None
  return config


def read_params(params_dir: str | pathlib.Path, config: config_lib.Config) -> Any:
  """The params at `params_dir` (as checkpoint.load_params reads them, checked against the model first) on this
  host's CPU, whatever sharding they were saved with, so a checkpoint of a pod exports on one machine."""
  import flax.linen as nn
  import jax

  from maxctx import params_io, trainer

  model = trainer.build_model(config, None)
  boxed = jax.eval_shape(lambda rng: trainer.init_params(model, rng, 2), jax.random.key(0))
  host = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=host), nn.unbox(boxed))
  return params_io.read_params(str(params_dir), shapes, what="params directory")


def _save_safetensors(state_dict: dict[str, np.ndarray], out_dir: pathlib.Path) -> None:
  from safetensors.numpy import save_file

  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, w in state_dict.items():
    if shards[-1] and size + w.nbytes > SHARD_BYTES:
      shards.append({})
      size = 0
    shards[-1][name] = w
    size += w.nbytes
  metadata = {"format": "pt"}  # transformers refuses safetensors files without it.
  if len(shards) == 1:
    save_file(shards[0], str(out_dir / SINGLE_FILE), metadata=metadata)
    return
  weight_map = {}
  for i, shard in enumerate(shards):
    name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, str(out_dir / name), metadata=metadata)
    weight_map.update(dict.fromkeys(shard, name))
  total = sum(w.nbytes for w in state_dict.values())
  (out_dir / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def export_hf(params_dir: str | pathlib.Path, config_path: str | pathlib.Path, hf_out_dir: str | pathlib.Path,
              overrides: list[str] | tuple[str, ...] = (), dtype: str | None = None) -> pathlib.Path:
  """Orbax params + the run's model config → a HF directory from_pretrained loads; returns that directory.

  config.json holds the RoPE settings of the stage that made the exported step, and a max_position_embeddings of at
  least that stage's data.seq_len."""
  from maxctx import params_io

  # The stage that made the step (run.stages): its RoPE and length are what the exported model computes with.
  config = stages.stage_config(config_lib.load(config_path, overrides), params_io.steps_done(str(params_dir)))
  model_cfg = config.model
  out = pathlib.Path(hf_out_dir)
  if out.exists() and any(out.iterdir()):
    raise CheckpointError(f"{out} is not empty; choose a new output directory so no old shard is mixed in.")
  state_dict = hf.hf_from_params(read_params(params_dir, config), model_cfg, dtype=dtype)
  out.mkdir(parents=True, exist_ok=True)
  _save_safetensors(state_dict, out)
  hf_config = hf.hf_config_from_model(model_cfg, max(hf.MAX_POSITION_EMBEDDINGS, config.data.seq_len),
                                      dtype=dtype or str(next(iter(state_dict.values())).dtype))
  (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
  return out
