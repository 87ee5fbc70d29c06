"""Long-context scoring: can the model use its context? Passkey and RULER-style retrieval, swept over length and needle
depth, scored by teacher forcing with the run's context-parallel strategy (so at any length the run trains on).

  forward.py        one forward pass per example, logits only at the answer positions; correct = strict argmax
  sweep.py          tasks × lengths × depths, checked before compiling; TensorBoard scalars for training
  report.py         eval.jsonl, eval.md and depth × length heatmaps
  local.py          local JSONL task files of {"context", "question", "answer"} records

This is core: training runs a sweep at eval.every_steps and at each stage's end (eval.at_stage_end), so it sits beside
the trainer, below the tools. The tasks themselves are generated data (maxctx.data.tasks), taken from below; the
command, `python -m maxctx.eval`, is a tool on top of it.
"""
