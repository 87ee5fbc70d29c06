"""What a sweep writes: eval.jsonl (one record per example), eval.md (tables), <task>.png (depth × length heatmaps).

A cell's accuracy is the mean recall of its examples (RULER's score: the share of each answer's parts found), which
for a one-part answer is the share answered right. A task without a needle (cwe, fwe) has one row, depth "-".
"""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Sequence

import numpy as np

from maxctx.data import tasks as tasks_lib

log = logging.getLogger("maxctx.eval")


def _grid(records: Sequence[dict], task: str) -> tuple[list[int], list[float], np.ndarray, np.ndarray]:
  """(lengths, depths, accuracy [depth, length], count [depth, length]) of one generated task."""
  rs = [r for r in records if r["task"] == task]
  lengths = sorted({r["length"] for r in rs})
  depths = sorted({r["depth"] for r in rs})
  hits = np.zeros((len(depths), len(lengths)))
  count = np.zeros_like(hits)
  for r in rs:
    i, j = depths.index(r["depth"]), lengths.index(r["length"])
    hits[i, j] += r["recall"]
    count[i, j] += 1
  return lengths, depths, hits / np.maximum(count, 1), count


def _tasks(records: Sequence[dict], generated: bool) -> list[str]:
  return list(dict.fromkeys(r["task"] for r in records if (r["depth"] >= 0) == generated))


def _depth(task: str, d: float) -> str:
  return "-" if task in tasks_lib.NO_DEPTH else f"{d:g}"


def _tokens(n: int) -> str:
  for unit, size in (("M", 1 << 20), ("k", 1 << 10)):
    if n >= size and n % size == 0:
      return f"{n // size}{unit}"
  return str(n)


def markdown(records: Sequence[dict], title: str) -> str:
  lines = [f"# {title}", ""]
  for task in _tasks(records, generated=True):
    lengths, depths, acc, count = _grid(records, task)
    rs = [r for r in records if r["task"] == task]
    where = ("by length in tokens (columns); no needle, so one row" if task in tasks_lib.NO_DEPTH
             else "by needle depth (rows) and length in tokens (columns)")
    lines += [f"## {task}", "", f"accuracy (%, the share of the answer's parts found) {where}; "
              f"{int(count.max())} examples per cell", ""]
    lines.append("| depth | " + " | ".join(_tokens(n) for n in lengths) + " |")
    lines.append("|---:|" + "---:|" * len(lengths))
    for i, d in enumerate(depths):
      lines.append(f"| {_depth(task, d)} | " + " | ".join(f"{100 * a:.0f}" for a in acc[i]) + " |")
    by_len = [[r for r in rs if r["length"] == n] for n in lengths]
    lines.append("| **all** | " + " | ".join(f"**{100 * np.mean([r['recall'] for r in g]):.0f}**" for g in by_len)
                 + " |")
    lines.append("| log p/token | " + " | ".join(f"{np.mean([r['logprob'] for r in g]):.3f}" for g in by_len) + " |")
    lines.append("")
  files = _tasks(records, generated=False)
  if files:
    lines += ["## task files", "", "| file | records | accuracy (%) | log p/token | mean tokens |",
              "|---|---:|---:|---:|---:|"]
    for task in files:
      rs = [r for r in records if r["task"] == task]
      lines.append(f"| {task} | {len(rs)} | {100 * np.mean([r['recall'] for r in rs]):.0f} | "
                   f"{np.mean([r['logprob'] for r in rs]):.3f} | {np.mean([r['length'] for r in rs]):.0f} |")
    lines.append("")
  return "\n".join(lines)


def heatmap(records: Sequence[dict], task: str, path: pathlib.Path, title: str) -> bool:
  """A depth × length accuracy heatmap; False (with a warning naming the fix) when matplotlib is missing."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    log.warning("matplotlib is not installed, so no heatmap %s; `pip install matplotlib` to get it.", path)
    return False
  lengths, depths, acc, count = _grid(records, task)
  fig, ax = plt.subplots(figsize=(1.4 * len(lengths) + 3.2, 0.55 * len(depths) + 2.4), dpi=120)
  im = ax.imshow(100 * acc, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto", origin="upper")
  for i in range(len(depths)):
    for j in range(len(lengths)):
      ax.text(j, i, f"{100 * acc[i, j]:.0f}", ha="center", va="center", fontsize=10,
              color="black" if 25 < 100 * acc[i, j] < 85 else "white")
  ax.set_xticks(range(len(lengths)), [_tokens(n) for n in lengths])
  ax.set_yticks(range(len(depths)), [_depth(task, d) for d in depths])
  ax.set_xlabel("length (tokens, prompt + answer)")
  ax.set_ylabel("no needle" if task in tasks_lib.NO_DEPTH else "needle depth (0 = start, 1 = end)")
  ax.set_title(f"{title}\n{task}: accuracy (%), {int(count.max())} examples per cell", fontsize=10)
  bar = fig.colorbar(im, ax=ax)
  bar.set_label("accuracy (%)")
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return True


def write(records: Sequence[dict], out_dir: str | pathlib.Path, title: str) -> list[pathlib.Path]:
  """Writes eval.jsonl, eval.md and one PNG per generated task; returns the paths written."""
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  written = [out / "eval.jsonl", out / "eval.md"]
  with open(written[0], "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
  written[1].write_text(markdown(records, title))
  for task in _tasks(records, generated=True):
    if heatmap(records, task, out / f"{task}.png", title):
      written.append(out / f"{task}.png")
  return written
