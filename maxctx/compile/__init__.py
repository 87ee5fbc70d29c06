"""Ahead-of-time compiles for a TPU slice, on any machine with libtpu (the `tpu` extra), and what they say.

  step.py      compile a run's train step for its `compile.topology` (`compile_for`), and the key of what it proves
  report.py    CompileReport: compiled memory per device and per host VM, collectives, fit; the printed report
  hlo.py       the collectives of a compiled step and the bytes each device sends, from its HLO text
  __main__.py  the command, `python -m maxctx.compile RUN_FILE`: does this run file fit its slice?

A library for maxctx.bench and maxctx.plan, which compile through it; nothing imports the command.
"""
