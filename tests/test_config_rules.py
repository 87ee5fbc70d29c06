"""Each key's rule on its value is declared once, beside the key in the schema, and `config.check` applies every one:
keys whose rule lived in a component (the mesh, the compile entry) or nowhere are refused by the same check."""

import pytest

from maxctx import config, trainer
from maxctx.errors import ConfigError


@pytest.mark.parametrize("override, message", [
    # Under usp, 0 used to fall through to the default degree in silence; a block of 0 reached the kernel.
    ("attention.ulysses_degree=0", "attention.ulysses_degree is 0; it must be at least 1."),
    ("attention.block_kv=0", "attention.block_kv is 0; it must be at least 1."),
    # These were checked only by the mesh and by maxctx.compile, with their own copies of the rule.
    ("mesh.ici.fsdp=0", "mesh.ici.fsdp is 0; each axis size must be a positive integer or -1 (inferred)."),
    ("compile.num_slices=0", "compile.num_slices is 0; it must be at least 1 (a job has at least one slice)."),
    # Unchanged sentences of rules that moved beside their keys.
    # llama3 RoPE scaling divides by each of these: 0 made infinite frequencies, so every loss was nan. A stage that
    # changes them (run.stages) is checked by the same rule.
    ("model.rope_factor=0", "model.rope_factor is 0; it must be above 0."),
    ("model.rope_high_freq_factor=-1", "model.rope_high_freq_factor is -1; it must be above 0."),
    ("model.rope_original_context=0", "model.rope_original_context is 0; it must be at least 1."),
    ("model.head_dim=7", "model.head_dim 7 must be even for rotary embeddings."),
    ("data.seq_len=1", "data.seq_len is 1; it must be at least 2 (a sequence needs at least 2 tokens (an input and "
                       "its target))."),
    ("optim.b2=1.5", "optim.b2 is 1.5; it must be in [0, 1]."),
    ("checkpoint.resume=latest", "checkpoint.resume is 'latest'; use auto, never, or a step number such as 100."),
])
def test_each_keys_rule_refuses_with_one_sentence(override, message):
  c = config.load("configs/demo.yml", ["attention.strategy=usp", override])
  with pytest.raises(ConfigError) as err:
    config.check(c)
  assert str(err.value) == message
  with pytest.raises(ConfigError) as err:
    trainer.validate(c, 8)   # the run's one check applies the same rule first
  assert str(err.value) == message


def test_the_demo_passes_every_rule():
  config.check(config.load("configs/demo.yml"))


def test_an_unknown_data_source_is_refused_when_the_config_is_read():
  # It used to pass the schema as any string and be refused only when the pipeline opened it.
  with pytest.raises(ConfigError, match=r"config key data.source must be one of 'synthetic', .*, got 'jsonlines' "
                                        r"\(did you mean 'jsonl'\?\)"):
    config.load("configs/demo.yml", ["data.source=jsonlines"])
