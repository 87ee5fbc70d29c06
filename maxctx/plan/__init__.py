"""The planner: which strategy, split of the devices and memory policy a run should use (`python -m maxctx.plan`).

  candidates.py   what is tried: a strategy at a context (and ulysses) degree, a remat policy, MLP and loss chunks
  measured.py     measured mode: each candidate trains a few steps on the devices present (maxctx.bench.measure)
  estimated.py    topology mode: the cost model's order, then compiles for the slice until one fits (maxctx.bench.aot)
  cost_model.py   the analytic per-device memory, collective bytes and roofline step time, before anything compiles
  ranking.py      which records can be the plan, and every candidate in order
  tables.py       plan.md: the ranked candidates and the one sentence saying what was chosen, or what came closest
  recipe.py       recipe.yml: the run file with the chosen candidate's keys
  auto.py         `attention.strategy: auto` and `model.remat: auto`: measured for maxctx.train, for the slice for
                  maxctx.compile
  __main__.py     the command

A tool above maxctx.bench and maxctx.compile; the training path imports it only when a run file says `auto`.
"""
