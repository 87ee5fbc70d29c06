"""Strategy benchmark, `python -m maxctx.bench`: how do the context-parallel strategies compare, length by length?

Modules: cases (one config per strategy × length, refusals; shared with maxctx.plan) · measure (a few real training
steps: time, memory, profile) · trace (time in collectives from a jax.profiler trace) · aot (--topology: compile for a
TPU slice with maxctx.compile, cached, or reuse its reports) · roofline (the estimate's model) · report
(results.jsonl, results.md, TensorBoard) · plots. From maxctx.compile: hlo (collectives and their bytes from compiled
HLO, loop trip counts included); maxctx.chips holds the chip table with its sources.
"""
