"""Strategy benchmark, `python -m maxctx.bench`: which context-parallel strategy to use, per sequence length.

Modules: plan (one config per strategy × length, refusals) · measure (a few real training steps: time, memory,
profile) · trace (time in collectives from a jax.profiler trace) · aot (--topology: compile for a TPU slice, cached,
or reuse maxctx.compile reports) · roofline (the estimate's model) · report (results.jsonl, results.md, plots,
TensorBoard). Shared with maxctx.compile: maxctx.hlo (collectives and their bytes from compiled HLO, loop trip counts
included) and maxctx.chips (the chip table with its sources).
"""
