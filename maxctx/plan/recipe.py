"""The recipe a plan writes: the run file it was planned from, with the command line's overrides and the chosen
candidate's keys set, which `python -m maxctx.train` and `python -m maxctx.compile` take as is."""

from __future__ import annotations

import pathlib

import yaml

from maxctx import config as config_lib
from maxctx.bench import cases as cases_lib
from maxctx.plan.candidates import Candidate


def recipe(path: str, cand: Candidate, overrides: list[str]) -> str:
  """The run file at `path` with the command line's overrides and the candidate's keys set: what was measured, or
  compiled for the topology in the candidate's compile section."""
  tree = yaml.safe_load(pathlib.Path(path).read_text()) or {}
  if isinstance(tree.get("model"), str):
    tree["model"] = {"preset": tree["model"]}
  keys = dict(config_lib.parse_override(o) for o in overrides)
  keys.update(cand.overrides)
  keys["data.seq_len"] = cand.case.seq_len
  config = cand.case.config
  topology = config.compile.topology
  if topology:
    keys.update({"compile.topology": topology, "compile.num_slices": config.compile.num_slices})
    if "run.name" not in keys and config.model.preset:
      # A recipe for a slice is named as configs/recipes/ names them, not after the run file it was planned from
      # (a 70B plan from the 8B recipe would otherwise be called llama3.1-8b-... and write to its runs/).
      name = f"{config.model.preset}-{cases_lib.tokens(cand.case.seq_len)}-{cand.case.strategy}-{topology}"
      keys.update({"run.name": name, "run.output_dir": f"runs/{name}"})
  for dotted, value in keys.items():
    node = tree
    *parents, leaf = dotted.split(".")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  why = (f"had the least estimated step time of those that fit on {topology} (compiled)" if topology else
         "was the fastest measured candidate")
  head = (f"# Planned by python -m maxctx.plan {path}: {cand.label} at {cand.case.seq_len} tokens {why} (see plan.md "
          "beside this file).\n")
  return head + yaml.safe_dump(tree, sort_keys=False)
