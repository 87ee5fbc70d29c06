"""Converts Llama checkpoints between Hugging Face (config.json + safetensors) and maxctx (Orbax params + model.yml).

  python scripts/convert_hf.py import <hf_dir> <out_dir> [--unscanned]
  python scripts/convert_hf.py export <params_dir> <model.yml or run config> <hf_out_dir> [--dtype bfloat16]
                                      [section.key=value ...]

import writes <out_dir>/params, an Orbax checkpoint of the maxctx params pytree (set checkpoint.load_params to it),
and <out_dir>/model.yml, the model section the weights need (use it as the run file, or copy its keys into yours).
Layers are stacked for model.scan_layers=true unless --unscanned.

export reads params from an Orbax checkpoint of either the params pytree or a tree holding it under 'params' (only
that subtree is read), and writes safetensors (5 GB shards with an index above that) and a config.json that
transformers' LlamaForCausalLM.from_pretrained loads. Tokenizer files are not touched; copy them alongside.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
from collections.abc import Iterator, Mapping

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # Runs from a checkout without installing.

from maxctx import config as config_lib  # noqa: E402
from maxctx import hf  # noqa: E402
from maxctx.errors import ArgumentParser, CheckpointError, MaxctxError  # noqa: E402

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
  # Builds the full ModelConfig now so a value maxctx's schema rejects fails before any tensor is read.
  model_cfg = config_lib.load(None).replace(**overrides).model
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
      f"# Converted from {hf_dir.resolve()} by scripts/convert_hf.py; params: {params_path}\n"
      + yaml.safe_dump({"model": model}, sort_keys=False))
  return params_path


def _restore_params(params_dir: pathlib.Path) -> dict:
  """The params pytree of an Orbax checkpoint, as numpy on the host whatever sharding it was saved with."""
  import jax
  import orbax.checkpoint as ocp

  from maxctx import params_io

  params_dir = params_dir.resolve()
  if not params_dir.exists():
    raise CheckpointError(f"params directory {params_dir} does not exist; pass the directory convert_hf.py import "
                          "or a training checkpoint wrote.")
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
    try:
      with params_io.quiet_orbax():
        tree = getattr(checkpointer.metadata(params_dir).item_metadata, "tree", None)
    except Exception as e:  # noqa: BLE001 — Orbax's reasons vary; the sentence names the directory and the fix.
      tree, failure = None, f" ({params_io.why(e)})"
    else:
      failure = ""
    if tree is None:
      raise CheckpointError(f"params directory {params_dir} is not an Orbax checkpoint{failure}; pass the params/ "
                            "directory convert_hf.py import wrote, or <run>/checkpoints/<step>/state.")
    under_params = isinstance(tree, Mapping) and "params" in tree
    if under_params:
      tree = {"params": tree["params"]}
    # np.empty targets restore every leaf as a host array, so a checkpoint sharded over a pod exports on one machine.
    target = jax.tree.map(lambda m: np.empty(m.shape, m.dtype), tree)
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
    restored = checkpointer.restore(params_dir, args=ocp.args.PyTreeRestore(
        target, restore_args=restore_args, partial_restore=under_params))
  return restored["params"] if under_params else restored


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
  """Orbax params + the run's model config → a HF directory from_pretrained loads; returns that directory."""
  model_cfg = config_lib.load(config_path, overrides).model
  out = pathlib.Path(hf_out_dir)
  if out.exists() and any(out.iterdir()):
    raise CheckpointError(f"{out} is not empty; choose a new output directory so no old shard is mixed in.")
  state_dict = hf.hf_from_params(_restore_params(pathlib.Path(params_dir)), model_cfg, dtype=dtype)
  out.mkdir(parents=True, exist_ok=True)
  _save_safetensors(state_dict, out)
  hf_config = hf.hf_config_from_model(model_cfg, dtype=dtype or str(next(iter(state_dict.values())).dtype))
  (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
  return out


def main(argv: list[str] | None = None) -> int:
  parser = ArgumentParser(description=__doc__.split("\n\n")[0],
                          formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
  commands = parser.add_subparsers(dest="command", required=True)
  p = commands.add_parser("import", help="HF directory → Orbax params + model.yml")
  p.add_argument("hf_dir")
  p.add_argument("out_dir")
  p.add_argument("--unscanned", action="store_true", help="one subtree per layer, for model.scan_layers=false")
  p = commands.add_parser("export", help="Orbax params + config → HF directory")
  p.add_argument("params_dir")
  p.add_argument("config", help="model.yml from import, or the run's config file")
  p.add_argument("hf_out_dir")
  p.add_argument("overrides", nargs="*", help="section.key=value, as for maxctx.train")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), help="cast the tensors (default: keep the params' dtype)")
  args = parser.parse_args(argv)
  try:
    if args.command == "import":
      path = import_hf(args.hf_dir, args.out_dir, scan_layers=not args.unscanned)
      print(f"wrote {path} and {path.parent / 'model.yml'}")
    else:
      path = export_hf(args.params_dir, args.config, args.hf_out_dir, args.overrides, args.dtype)
      print(f"wrote {path}")
  except MaxctxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
