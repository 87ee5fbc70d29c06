"""The eval command: scores a checkpoint (or the run it trains first, `--train`) on a sweep of generated tasks and
local task files, and writes the report and heatmaps. The scoring itself is maxctx.scoring, which training uses too.

  params.py         parameters from checkpoint.load_params

`python -m maxctx.eval CONFIG [key=value ...] --tasks passkey --lengths 1k,4k --depths 0,0.5,1 --samples 8`
"""
