"""`eventbus plot`: loss, eval metrics, grad norm, lr, memory and step time of runs into a PNG.

Several runs (`eventbus.cli.runs`) are overlaid, one colour each, with a legend. A series
that never changes (the same value in every run) gets no line: it is listed in the command's
output instead, and a panel left without series is not drawn. Eval points are markers.

Robust y-limits: values that stand apart from the rest of a panel by a gap wider than the
rest's whole range (at most 1% of them, and at least one) are left outside the axis and drawn
as triangles on its edge, so one loss spike does not squash the curve. A panel whose other
values are all positive and span more than two decades gets a log axis.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eventbus.cli._errors import UsageError, fail
from eventbus.cli._format import g
from eventbus.cli.report import Point, RunReport
from eventbus.cli.runs import read_runs, run_names
from eventbus.events import DivergenceDetected

__all__ = ["Panel", "Series", "add_parser", "panels", "plot", "run", "y_limits"]

_MEMORY = ("rss_mb", "allocated_mb", "reserved_mb")
_STYLES = ("-", "--", ":", "-.")
_ORDER = {"loss": 0, "grad norm": 2, "learning rate": 3, "memory (MB)": 4, "step time (s)": 5}
_EVAL_ORDER = 1  # eval metric panels: after loss, in the order found
_DECADES = 2.0  # a positive range wider than this many decades is drawn on a log axis
_MARGIN = 0.05  # of the range, above and below


@dataclass
class Series:
    """One curve of one run: its points, and whether they are drawn as markers (eval)."""

    label: str
    points: list[Point]
    run: int = 0
    markers: bool = False


@dataclass
class Panel:
    """One subplot: its curves, and the y-limits and scale `plot` chose for them."""

    name: str
    series: list[Series] = field(default_factory=list)
    ylim: tuple[float, float] | None = None
    log: bool = False


def add_parser(sub: Any) -> None:
    """Register `eventbus plot LOG... -o FILE.png [--title T] [--merge]`."""
    pl = sub.add_parser("plot", help="loss, eval, grad norm, lr, memory, step time into a PNG")
    pl.add_argument("logs", nargs="+", metavar="LOG", help="a run's directory or files, or a tree")
    pl.add_argument("-o", "--out", required=True, metavar="FILE.png")
    pl.add_argument("--title", default=None, help="default: the run's name (RunStarted.run_id)")
    pl.add_argument("--merge", action="store_true", help="read every LOG as files of one run")
    pl.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Draw the runs' curves (detections marked) into a PNG; say what was left out."""
    if importlib.util.find_spec("matplotlib") is None:
        return fail("plot needs matplotlib: pip install 'eventbus[plot]'", 1)
    out = Path(args.out)
    if out.suffix.lower() != ".png":
        raise UsageError(f"-o {args.out}: the plot is a PNG; name it *.png")
    runs, reports = read_runs(args.logs, merge=args.merge)
    names = run_names(runs, reports)
    for r in reports:
        if r.several_runs:
            print(f"eventbus: warning: {r.several_runs}", file=sys.stderr)
    drawn, constant = panels(reports, names)
    if not drawn:
        files = ", ".join(str(f) for r in runs for f in r.files)
        what = "only constant values: " + ", ".join(constant) if constant else "no plottable events"
        raise UsageError(f"{files}: {what} (Loss, EvalEnded, OptimizerStepped, MemorySample, ...)")
    try:
        plot(reports, out, names=names, title=args.title, drawn=drawn)
    except ValueError as e:  # a value matplotlib cannot draw: name the input, not a traceback
        raise UsageError(f"{', '.join(str(f) for r in runs for f in r.files)}: {e}") from None
    note = f"; constant, not drawn: {', '.join(constant)}" if constant else ""
    print(f"wrote {out} ({', '.join(p.name for p in drawn)}){note}")
    return 0


def panels(reports: Sequence[RunReport], names: Sequence[str]) -> tuple[list[Panel], list[str]]:
    """The panels to draw (series of every run), and the constant series left out: a series
    with one value throughout, the same in every run that has it (nothing to compare)."""
    found: dict[tuple[str, str], list[Series]] = {}  # (panel, label) -> each run's series
    for i, r in enumerate(reports):
        for panel, s in _series(r):
            s.run = i
            found.setdefault((panel, s.label), []).append(s)
    by_name: dict[str, Panel] = {}
    constant: list[str] = []
    for (panel, _), series in found.items():
        if all(_constant(s) for s in series) and len({s.points[0][1] for s in series}) == 1:
            for s in series:
                who = f"{names[s.run]} " if len(reports) > 1 else ""
                constant.append(f"{who}{s.label} {g(s.points[0][1])}")
        else:
            by_name.setdefault(panel, Panel(panel)).series.extend(series)
    order = [p for p, _ in found]  # the order `_series` gives, first run first
    drawn = sorted(
        by_name.values(), key=lambda p: (_ORDER.get(p.name, _EVAL_ORDER), order.index(p.name))
    )
    return drawn, constant


def _constant(s: Series) -> bool:
    ys = [y for _, y in s.points]
    return len(ys) > 1 and all(math.isfinite(y) and y == ys[0] for y in ys)


def _series(r: RunReport) -> list[tuple[str, Series]]:
    out = [("loss", Series(f"{k} loss", v, markers=k != "train")) for k, v in r.loss.items()]
    for k, v in r.eval_metrics.items():
        if k == "loss" and "eval" not in r.loss:
            out.append(("loss", Series("eval loss", v, markers=True)))
        elif k != "loss":
            out.append((f"eval {k}", Series(f"eval {k}", v, markers=True)))
    out += [("grad norm", Series("grad_norm", r.grad_norm)), ("learning rate", Series("lr", r.lr))]
    out += [("memory (MB)", Series(k, r.memory[k])) for k in _MEMORY if r.memory.get(k)]
    out.append(("step time (s)", Series("step time", r.step_time)))
    return [(p, s) for p, s in out if s.points]


def y_limits(values: Sequence[float]) -> tuple[tuple[float, float], bool] | None:
    """((low, high), log axis?) for a panel's values (see the module docstring), or None."""
    v = sorted(x for x in values if math.isfinite(x))
    if not v:
        return None
    n, k = len(v), max(1, len(v) // 100)
    top = n
    for j in range(1, min(k, n - 2) + 1):  # the widest cut of at most k top values
        gap, rest = v[n - j] - v[n - j - 1], v[n - j - 1] - v[0]
        if gap > rest and gap > 1e-9 * abs(v[n - j]):
            top = n - j
    bottom = 0
    for j in range(1, min(k, top - 2) + 1):
        gap, rest = v[j] - v[j - 1], v[top - 1] - v[j]
        if gap > rest and gap > 1e-9 * abs(v[j - 1]):
            bottom = j
    lo, hi = v[bottom], v[top - 1]
    if lo > 0 and math.log10(hi / lo) > _DECADES:
        pad = (hi / lo) ** _MARGIN
        return (lo / pad, hi * pad), True
    pad = (hi - lo) * _MARGIN or max(abs(lo) * _MARGIN, 1e-6)
    return (lo - pad, hi + pad), False


def plot(
    reports: RunReport | Sequence[RunReport],
    out: Path,
    *,
    names: Sequence[str] | None = None,
    title: str | None = None,
    drawn: list[Panel] | None = None,
) -> list[Panel]:
    """Draw the runs' panels into a PNG (matplotlib, Agg); returns them with their limits."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    reports = [reports] if isinstance(reports, RunReport) else list(reports)
    names = list(names) if names is not None else [f"run {i + 1}" for i in range(len(reports))]
    if drawn is None:
        drawn = panels(reports, names)[0]
    if not drawn:
        raise ValueError("no plottable events (Loss, OptimizerStepped, MemorySample, StepEnded)")
    several = len(reports) > 1
    fig, axes = plt.subplots(
        len(drawn), 1, figsize=(9, 2.4 * len(drawn) + 0.6), sharex=True, squeeze=False
    )
    for ax, panel in zip(axes[:, 0], drawn, strict=True):
        limits = y_limits([y for s in panel.series for _, y in s.points])
        if limits is not None:
            panel.ylim, panel.log = limits
            if panel.log:
                ax.set_yscale("log")
            ax.set_ylim(*panel.ylim)
        labels = list(dict.fromkeys(s.label for s in panel.series))
        for s in panel.series:
            _draw(ax, s, panel, names[s.run] if several else None, labels.index(s.label))
        for i, r in enumerate(reports):
            _mark_divergences(ax, r, f"C{i}" if several else "red", names[i] if several else "")
        ax.set_ylabel(panel.name)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title or " vs ".join(names))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return drawn


def _draw(ax: Any, s: Series, panel: Panel, run: str | None, j: int) -> None:
    """One series; values beyond the axis (and non-finite ones) as markers on its edge."""
    label = s.label if run is None else f"{run} {s.label}"
    color = f"C{s.run}" if run is not None else f"C{j}"
    style = _STYLES[j % len(_STYLES)] if run is not None else "-"
    xs = [p[0] for p in s.points]
    ys = [p[1] for p in s.points]
    if s.markers:
        ax.plot(xs, ys, "o:", label=label, markersize=4, linewidth=0.8, color=color)
    else:
        ax.plot(xs, ys, label=label, linewidth=1.2, color=color, linestyle=style)
    if panel.ylim is None:
        return
    bottom, top = panel.ylim
    lo, hi = _inside(panel.ylim, panel.log)
    above = [x for x, y in s.points if top < y < math.inf]
    below = [x for x, y in s.points if -math.inf < y < bottom]
    bad = [x for x, y in s.points if not math.isfinite(y)]  # not silently a gap in the line
    if above or below:
        ax.plot(above, [hi] * len(above), "^", color=color, label=f"{label} off the axis")
        ax.plot(below, [lo] * len(below), "v", color=color)
    if bad:
        ax.plot(bad, [hi] * len(bad), "x", color="red", label=f"{label} non-finite")


def _inside(ylim: tuple[float, float], log: bool) -> tuple[float, float]:
    """Just inside the axis' bottom and top, where an edge marker is drawn whole."""
    lo, hi = ylim
    if log:
        f = (hi / lo) ** 0.02
        return lo * f, hi / f
    d = (hi - lo) * 0.02
    return lo + d, hi - d


def _mark_divergences(ax: Any, r: RunReport, color: str, run: str) -> None:
    marks = [d for d in r.detections if isinstance(d, DivergenceDetected) and d.step is not None]
    for i, d in enumerate(marks):
        label = f"{run} divergence".strip() if i == 0 else None
        ax.axvline(d.step, color=color, linestyle="--", linewidth=1, label=label)
