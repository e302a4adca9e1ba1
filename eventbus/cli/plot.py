"""`eventbus plot`: loss, grad norm, lr, memory and step time of a run into a PNG."""

from __future__ import annotations

import argparse
import importlib.util
import math
from pathlib import Path
from typing import Any

from eventbus.cli._errors import UsageError, fail, no_events
from eventbus.cli.report import Point, RunReport, collect
from eventbus.events import DivergenceDetected
from eventbus.logformat import log_files

__all__ = ["add_parser", "plot", "run"]


def add_parser(sub: Any) -> None:
    """Register `eventbus plot LOG... -o FILE.png [--title T]`."""
    pl = sub.add_parser("plot", help="loss, grad norm, lr, memory and step time into a PNG")
    pl.add_argument("logs", nargs="+", metavar="LOG")
    pl.add_argument("-o", "--out", required=True, metavar="FILE.png")
    pl.add_argument("--title", default=None)
    pl.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Draw loss, grad norm, lr, memory and step time (detections marked) into a PNG."""
    if importlib.util.find_spec("matplotlib") is None:
        return fail("plot needs matplotlib: pip install 'eventbus[plot]'", 1)
    out = Path(args.out)
    if out.suffix.lower() != ".png":
        raise UsageError(f"-o {args.out}: the plot is a PNG; name it *.png")
    files = log_files(args.logs)
    report = collect(files)
    if report.events == 0:
        raise no_events(files)
    try:
        panels = plot(report, out, title=args.title)
    except ValueError as e:
        raise UsageError(f"{', '.join(map(str, files))}: {e}") from None
    print(f"wrote {out} ({', '.join(panels)})")
    return 0


def plot(r: RunReport, out: Path, *, title: str | None = None) -> list[str]:
    """Draw the run's curves into a PNG (matplotlib, Agg); returns the panels drawn."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    panels: list[tuple[str, dict[str, list[Point]]]] = []
    loss = {f"{k} loss": v for k, v in r.loss.items() if v}
    if "loss" in r.eval_metrics and "eval" not in r.loss:
        loss["eval loss"] = r.eval_metrics["loss"]
    if loss:
        panels.append(("loss", loss))
    if r.grad_norm:
        panels.append(("grad norm", {"grad_norm": r.grad_norm}))
    if r.lr:
        panels.append(("learning rate", {"lr": r.lr}))
    mem = {
        k: v for k, v in r.memory.items() if v and k in ("rss_mb", "allocated_mb", "reserved_mb")
    }
    if mem:
        panels.append(("memory (MB)", mem))
    if r.step_time:
        panels.append(("step time (s)", {"step time": r.step_time}))
    if not panels:
        raise ValueError("no plottable events (Loss, OptimizerStepped, MemorySample, StepEnded)")
    marks = [d for d in r.detections if isinstance(d, DivergenceDetected) and d.step is not None]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(9, 2.4 * len(panels) + 0.6), sharex=True, squeeze=False
    )
    for ax, (name, series) in zip(axes[:, 0], panels, strict=True):
        for label, pts in series.items():
            xs = [p[0] for p in pts]
            ys = [p[1] for p in pts]
            ax.plot(xs, ys, label=label, linewidth=1.2)
            bad = [x for x, y in pts if not math.isfinite(y)]
            if bad:  # a NaN/Inf loss is not silently a gap in the line
                ax.plot(bad, [_top(ys)] * len(bad), "x", color="red", label=f"{label} non-finite")
        for i, d in enumerate(marks):
            ax.axvline(
                d.step,
                color="red",
                linestyle="--",
                linewidth=1,
                label="divergence" if i == 0 else None,
            )
        finite = [p[1] for pts in series.values() for p in pts if math.isfinite(p[1])]
        if finite and min(finite) > 0 and max(finite) / min(finite) > 100:
            ax.set_yscale("log")  # a diverging loss spans decades: keep the early curve visible
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title or ", ".join(Path(f).name for f in r.files))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return [p[0] for p in panels]


def _top(ys: list[float]) -> float:
    finite = [y for y in ys if math.isfinite(y)]
    return max(finite) if finite else 0.0
