"""The config is the public interface: every key documented in base.yml, typed, and unknown keys caught."""

import pathlib

import pytest
import yaml

from maxctx import config
from maxctx.errors import ConfigError

PUBLIC_KEYS = ["run.output_dir", "run.steps", "run.seed", "attention.strategy", "data.seq_len", "data.batch_size",
               "checkpoint.every_steps"] + [f"mesh.{l}.{a}" for l in ("ici", "dcn")
                                            for a in ("data", "fsdp", "context", "tensor")]


def _leaves(tree, prefix=""):
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from _leaves(v, f"{prefix}{k}.")
    else:
      yield prefix + k


def test_base_yml_defines_exactly_the_schema_and_comments_every_key():
  text = (config.CONFIG_DIR / "base.yml").read_text()
  assert sorted(_leaves(yaml.safe_load(text))) == sorted(config.schema_keys())
  for line in text.splitlines():
    if line.strip() and not line.lstrip().startswith("#") and not line.rstrip().endswith(":"):
      assert "#" in line, f"base.yml key without a comment: {line!r}"


def test_public_keys_keep_their_names():
  assert set(PUBLIC_KEYS) <= set(config.schema_keys())


def test_resume_and_data_fingerprints_name_schema_keys():
  """A renamed config key must not drop silently out of what a resumed run has to share with its checkpoint (the
  lookup of an unknown key would give None on both sides and always match)."""
  from maxctx import data, resume_match
  keys = set(config.schema_keys())
  assert set(resume_match.MUST_MATCH) <= keys
  assert set(data.STREAM_KEYS) <= set(resume_match.MUST_MATCH)


def test_presets_have_the_published_dimensions():
  c8 = config.load(None, ["model.preset=llama3.1-8b"]).model
  assert (c8.d_model, c8.n_layers, c8.n_heads, c8.n_kv_heads, c8.head_dim, c8.d_ff, c8.vocab_size) == (
      4096, 32, 32, 8, 128, 14336, 128256)
  c70 = config.load(None, ["model.preset=llama3.1-70b"]).model
  assert (c70.d_model, c70.n_layers, c70.n_heads, c70.n_kv_heads, c70.d_ff) == (8192, 80, 64, 8, 28672)
  c405 = config.load(None, ["model.preset=llama3.1-405b"]).model
  assert (c405.d_model, c405.n_layers, c405.n_heads, c405.n_kv_heads, c405.d_ff) == (16384, 126, 128, 8, 53248)


def test_resolution_order_base_preset_run_file_command_line(tmp_path):
  run = tmp_path / "run.yml"
  run.write_text("model: tiny\nrun:\n  steps: 7\ndata:\n  seq_len: 256\n")
  c = config.load(run, ["data.seq_len=128", "optim.lr=1e-3"])
  assert c.model.preset == "tiny" and c.model.d_model == 128  # preset
  assert c.run.steps == 7  # run file
  assert c.data.seq_len == 128  # command line beats run file
  assert c.optim.lr == pytest.approx(1e-3) and isinstance(c.optim.lr, float)  # "1e-3" is a float here
  assert c.optim.b1 == 0.9  # base.yml


def test_run_file_overrides_a_preset_key(tmp_path):
  run = tmp_path / "run.yml"
  run.write_text("model:\n  preset: tiny\n  n_layers: 2\n")
  assert config.load(run).model.n_layers == 2


@pytest.mark.parametrize("override, fragment", [
    ("run.stesp=3", "did you mean run.steps?"),
    ("mesh.ici.contxt=8", "did you mean mesh.ici.context?"),
    ("run.steps=abc", "run.steps expects int"),
    ("attention.load_balance=3", "attention.load_balance expects bool"),
    ("model.remat=ful", "did you mean 'full'?"),
    ("model.preset=llama3-8b", "did you mean llama3.1-8b?"),
    ("mesh.ici=4", "is a section"),
    ("steps", "section.key=value"),
])
def test_bad_overrides_name_the_key_and_the_fix(override, fragment):
  with pytest.raises(ConfigError, match=None) as e:
    config.load(None, [override])
  assert fragment in str(e.value)


def test_unknown_key_in_a_run_file_is_named_with_the_file(tmp_path):
  run = tmp_path / "run.yml"
  run.write_text("optim:\n  learning_rate: 0.1\n")
  with pytest.raises(ConfigError) as e:
    config.load(run)
  assert str(run) in str(e.value) and "optim.learning_rate" in str(e.value)


def test_invalid_yaml_names_file_and_line(tmp_path):
  run = tmp_path / "run.yml"
  run.write_text("run:\n  steps: [1\n")
  with pytest.raises(ConfigError, match="not valid YAML"):
    config.load(run)


def test_saved_config_round_trips(tmp_path):
  c = config.load(None, ["model.preset=tiny", "run.steps=3"])
  path = config.save(c, tmp_path)
  assert config.from_dict(yaml.safe_load(path.read_text())) == c


def test_replace_is_validated():
  c = config.load(None, ["model.preset=tiny"])
  assert c.replace(**{"run.steps": 5}).run.steps == 5
  with pytest.raises(ConfigError, match="run.steps expects int"):
    c.replace(**{"run.steps": "five"})


def test_every_shipped_config_loads():
  root = pathlib.Path(config.CONFIG_DIR)
  for path in sorted(root.glob("*.yml")) + sorted(root.glob("recipes/*.yml")) + sorted(root.glob("recipes/gpu/*.yml")):
    if path.name != "base.yml":
      config.load(path)


def test_yaml_aliases_and_repeated_keys_are_refused_naming_the_lines(tmp_path):
  # An alias bomb under run.name was expanded into a 351 MB error; a second `lr` silently won over the first.
  cases = {"run:\n  name: &a [x, x]\n  output_dir: *a\n": r"line 3 uses the YAML alias \*a",
           "base: &b {steps: 3}\nrun:\n  <<: *b\n": r"line 3 uses the YAML alias \*b",
           "optim:\n  lr: 3e-3\n  b1: 0.9\n  lr: 1.0\n": r"gives optim.lr twice \(lines 2 and 4\)",
           "run:\n  steps: 3\nrun:\n  seed: 1\n": r"gives run twice \(lines 1 and 3\)"}
  for text, message in cases.items():
    path = tmp_path / "run.yml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
      config.load(path)


def test_errors_show_only_an_excerpt_of_a_value(tmp_path):
  path = tmp_path / "run.yml"
  path.write_text("run:\n  name: [" + ", ".join(["x" * 50] * 5000) + "]\n  steps: " + "9" * 5000 + "z\n")
  with pytest.raises(ConfigError, match="run.name expects str") as e:
    config.load(path)
  assert len(str(e.value)) < 250, str(e.value)
  with pytest.raises(ConfigError, match="run.steps expects int") as e:
    config.load(None, ["run.steps=" + "9" * 5000 + "z"])
  assert len(str(e.value)) < 250, str(e.value)
