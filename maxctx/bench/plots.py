"""The three plots of a benchmark, readable without the table: tokens_per_s.png and memory.png (one line per strategy
against sequence length) and comm_share.png (one bar per strategy and length, stacked by collective kind). Each title
says what was measured or estimated and on what; a strategy with nothing to draw is named under the plot with why.
"""

from __future__ import annotations

import pathlib
import textwrap
from typing import Sequence

from maxctx.bench.cases import tokens
from maxctx.bench.report import GIB, MIB, Record, all_bytes

_MARKERS = ("o", "s", "^", "D", "v", "P", "X")
_LINES = ("-", "--", ":", "-.")


def _styles(records: Sequence[Record], plt) -> dict[str, dict]:
  """The same color, marker and dash for a strategy in every plot, so lines that coincide stay visible."""
  colors = plt.get_cmap("tab10")
  names = dict.fromkeys(r.strategy for r in records)
  return {s: {"color": colors(i), "marker": _MARKERS[i % len(_MARKERS)], "linestyle": _LINES[i % len(_LINES)]}
          for i, s in enumerate(names)}


def _runs(r: Record) -> bool:
  """Whether `r` ran, or would: measured, or estimated and fitting (a step that does not fit has no throughput)."""
  return r.status == "ok" or (r.status == "estimate" and bool(r.fits))


def _series(records: Sequence[Record], value, keep=_runs) -> dict[str, tuple[list[int], list[float]]]:
  out: dict[str, tuple[list[int], list[float]]] = {}
  for r in records:
    v = value(r) if keep(r) else None
    if v is not None:
      xs, ys = out.setdefault(r.strategy, ([], []))
      xs.append(r.seq_len)
      ys.append(v)
  return out


def _missing(records: Sequence[Record], drawn: dict[str, tuple[list[int], list]]) -> str:
  """`none 1m, 4m: refused; all_gather 4m: does not fit` for the cells without a drawn point."""
  lost: dict[tuple[str, str], list[str]] = {}
  for r in records:
    if r.seq_len not in drawn.get(r.strategy, ([], []))[0]:
      why = r.status.replace("_", " ")
      if r.status == "estimate":
        why = "no collective bytes in its report" if r.fits else "does not fit"
      lost.setdefault((r.strategy, why), []).append(tokens(r.seq_len))
  return "; ".join(f"{s} {', '.join(lengths)}: {why}" for (s, why), lengths in lost.items())


def _finish(fig, ax, records, drawn, path: pathlib.Path, plt) -> pathlib.Path:
  rows = 0
  if missing := _missing(records, drawn):
    text = textwrap.fill(f"not drawn (results.md says why): {missing}", 150)
    rows = text.count("\n") + 1
    fig.text(0.01, 0.01, text, fontsize=7, color="dimgray", va="bottom")
  fig.tight_layout(rect=(0, 0.025 * rows + (0.01 if rows else 0), 1, 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def _lines(ax, series, styles, ylabel: str, title: str) -> None:
  for strategy, (xs, ys) in series.items():
    ax.plot(xs, ys, label=strategy, **styles[strategy])
  ax.set_xscale("log", base=2)
  ax.set_xlabel("sequence length (tokens, log scale)")
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  lengths = sorted({x for xs, _ in series.values() for x in xs})
  ax.set_xticks(lengths, [tokens(n) for n in lengths])
  ax.grid(True, alpha=0.3)
  if series:
    ax.legend(title="strategy")
  else:
    ax.text(0.5, 0.5, "no run completed", transform=ax.transAxes, ha="center")


def plots(records: Sequence[Record], out: pathlib.Path, where: str, estimate: bool) -> list[pathlib.Path]:
  """Writes tokens_per_s.png, memory.png and comm_share.png to `out`; `where` (model, devices) goes in every title."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import FuncFormatter, NullFormatter

  styles = _styles(records, plt)
  paths = []

  fig, ax = plt.subplots(figsize=(8, 5))
  series = _series(records, lambda r: r.est_tokens_per_s if estimate else r.tokens_per_s)
  how = "roofline: tokens per step / est. step time" if estimate else "tokens per step / median step time"
  _lines(ax, series, styles, f"{'estimated ' if estimate else ''}throughput (tokens/s)",
         f"{'Estimated training' if estimate else 'Training'} throughput vs length ({how})\n{where}")
  values = [y for _, ys in series.values() for y in ys]
  if values and max(values) > 10 * min(values):
    ax.set_yscale("log")
    ax.set_ylabel(ax.get_ylabel() + ", log scale")
  ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
  ax.yaxis.set_minor_formatter(NullFormatter())
  paths.append(_finish(fig, ax, records, series, out / "tokens_per_s.png", plt))

  fig, ax = plt.subplots(figsize=(8, 5))
  ok = [r for r in records if r.status == "ok"]
  if not estimate and ok and all(r.peak_bytes_runtime is not None for r in ok):
    series, what = _series(records, lambda r: r.peak_bytes_runtime), "runtime peak, device.memory_stats()"
  else:
    series = _series(records, lambda r: (r.memory_compiled or {}).get("total"),
                     keep=lambda r: r.status in ("ok", "estimate"))
    what = ("compiled for the TPU, memory_analysis() total" if estimate else
            "compiled memory_analysis() total; XLA:CPU keeps no runtime peak")
  hbm = next((r.hbm_per_device_bytes for r in records if r.hbm_per_device_bytes), None)
  top = max([y for _, ys in series.values() for y in ys] + [hbm or 0, 1])
  unit, size = ("GiB", GIB) if top >= 4 * GIB else ("MiB", MIB)
  _lines(ax, {s: (xs, [y / size for y in ys]) for s, (xs, ys) in series.items()}, styles,
         f"memory per device ({unit}, log scale)", f"Memory per device vs length ({what})\n{where}")
  for r in records:
    if r.status == "estimate" and r.fits is False and r.memory_compiled:
      ax.annotate("does not fit", (r.seq_len, r.memory_compiled["total"] / size), textcoords="offset points",
                  xytext=(-10, 8), ha="right", fontsize=8, color="red")
  if hbm:
    ax.axhline(hbm / size, color="red", linestyle="--", linewidth=1, label="HBM per device")
    ax.legend(title="strategy")
  ax.set_yscale("log")
  plain = FuncFormatter(lambda v, _: f"{v:,.3g}")
  ax.yaxis.set_major_formatter(plain)
  low, high = ax.get_ylim()
  # Within two decades label the minor ticks too, so values can be read off; beyond, the majors suffice.
  ax.yaxis.set_minor_formatter(plain if high / low < 100 else NullFormatter())
  ax.tick_params(axis="y", which="minor", labelsize=7)
  paths.append(_finish(fig, ax, records, series, out / "memory.png", plt))

  paths.append(_comm(records, out / "comm_share.png", where, estimate, plt))
  return paths


def _shares(r: Record, estimate: bool) -> dict[str, float]:
  """Kind → share of step time: measured (attention scope), or the estimated ICI share split by bytes per kind."""
  if not estimate:
    return r.comm_share_by_kind or {}
  sent, share = all_bytes(r.collective_bytes), r.est_comm_share
  total = sum(sent.values())
  return {k: share * v / total for k, v in sent.items()} if total and share else {}


def _comm(records, path: pathlib.Path, where: str, estimate: bool, plt) -> pathlib.Path:
  """Grouped bars: one group per strategy, one bar per length, stacked by collective kind, total printed on top."""
  from matplotlib.patches import Patch
  ran = [r for r in records if _runs(r) and (not estimate or r.est_comm_share is not None)]
  strategies = list(dict.fromkeys(r.strategy for r in ran))
  lengths = sorted({r.seq_len for r in ran})
  kinds = sorted({k for r in ran for k in _shares(r, estimate)})
  fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(strategies) * max(len(lengths), 1)), 5))
  width = 0.8 / max(len(lengths), 1)
  colors = plt.get_cmap("tab10")
  ticks, labels = [], []
  for i, s in enumerate(strategies):
    for j, n in enumerate(lengths):
      x = i + (j - (len(lengths) - 1) / 2) * width
      ticks.append(x)
      labels.append(tokens(n))
      r = next((r for r in ran if r.strategy == s and r.seq_len == n), None)
      if r is None:
        continue
      bottom = 0.0
      for c, kind in enumerate(kinds):
        v = 100 * _shares(r, estimate).get(kind, 0.0)
        ax.bar(x, v, width * 0.9, bottom=bottom, color=colors(c))
        bottom += v
      ax.text(x, bottom, f"{bottom:.0f}%" if bottom >= 1 or bottom == 0 else f"{bottom:.1f}%", ha="center",
              va="bottom", fontsize=8)
  ax.set_xticks(ticks, labels, fontsize=8)
  for i, s in enumerate(strategies):
    ax.text(i, -0.09, s, transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=10, weight="bold")
  ax.set_xlabel("strategy and sequence length (tokens)", labelpad=30)
  ax.set_ylim(0, max([p.get_y() + p.get_height() for p in ax.patches] + [1]) * 1.15)
  ax.set_ylabel("estimated share of step time on ICI (%)" if estimate else "share of step time in CP collectives (%)")
  what = ("estimated ICI time of all collectives / estimated step time" if estimate else
          "time in the attention strategy's collectives / step time, from a profiler trace")
  ax.set_title(f"{'Estimated c' if estimate else 'C'}ommunication share by strategy and length\n({what})\n{where}",
               fontsize=10)
  if kinds:
    ax.legend([Patch(color=colors(c)) for c in range(len(kinds))], kinds, title="collective kind")
  ax.grid(True, axis="y", alpha=0.3)
  drawn: dict[str, tuple[list[int], list]] = {}
  for r in ran:
    drawn.setdefault(r.strategy, ([], []))[0].append(r.seq_len)
  return _finish(fig, ax, records, drawn, path, plt)
