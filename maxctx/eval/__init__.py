"""Long-context evaluation: can the model use its context? Passkey and RULER-style retrieval, swept over length and
needle depth, scored by teacher forcing with the run's context-parallel strategy (so at any length the run trains on).

  tasks.py          generators: exact token lengths, needles at exact depths, deterministic from a seed
  local.py          local JSONL task files of {"context", "question", "answer"} records
  scoring.py        one forward pass per example, logits only at the answer positions; correct = strict argmax
  sweep.py          tasks × lengths × depths, checked before compiling; TensorBoard scalars for training
  report.py         eval.jsonl, eval.md and depth × length heatmaps
  params.py         parameters from checkpoint.load_params
  passkey_data.py   training rows of passkey examples (the passkey demo)

`python -m maxctx.eval CONFIG [key=value ...] --tasks passkey --lengths 1k,4k --depths 0,0.5,1 --samples 8`
"""
