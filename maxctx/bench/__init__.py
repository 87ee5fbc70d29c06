"""Strategy benchmark, `python -m maxctx.bench`: which context-parallel strategy to use, per sequence length.

Modules: plan (one config per strategy × length, refusals) · measure (a few real training steps: time, memory,
profile) · trace (time in collectives from a jax.profiler trace) · hlo (collectives and their bytes from compiled HLO,
loop trip counts included) · aot (--topology: compile for a TPU slice, cached, or reuse maxctx.compile reports) ·
roofline (the estimate's model and the chip table with its sources) · report (results.jsonl, results.md, plots,
TensorBoard).
"""
