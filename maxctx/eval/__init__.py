"""Long-context evaluation: can the model use its context? Passkey and RULER-style retrieval, swept over length and
needle depth, scored by teacher forcing with the run's context-parallel strategy (so at any length the run trains on).

  local.py          local JSONL task files of {"context", "question", "answer"} records
  scoring.py        one forward pass per example, logits only at the answer positions; correct = strict argmax
  sweep.py          tasks × lengths × depths, checked before compiling; TensorBoard scalars for training
  report.py         eval.jsonl, eval.md and depth × length heatmaps
  params.py         parameters from checkpoint.load_params

The tasks themselves are generated data (maxctx.data.tasks; the demos' training rows, maxctx.data.task_rows), so the
data pipeline and the eval both take them from below.

`python -m maxctx.eval CONFIG [key=value ...] --tasks passkey --lengths 1k,4k --depths 0,0.5,1 --samples 8`
"""
