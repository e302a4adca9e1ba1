"""What `eventbus summary` and `eventbus plot` read out of a recorded run.

One pass over `read_log(..., records=True)` collects the series (loss, grad norm, lr, memory,
step time), the detections and the bus's stats records; `summary_lines` and `plot` render them.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eventbus.events import (
    DivergenceDetected,
    EvalEnded,
    Event,
    Loss,
    MemoryLeakSuspected,
    MemorySample,
    OptimizerStepped,
    RunEnded,
    RunStarted,
    StepEnded,
    StopRequested,
)
from eventbus.replay import read_log
from eventbus.sinks.jsonl import SKIPPED_TYPE, STATS_TYPE

__all__ = ["RunReport", "collect", "plot", "summary_dict", "summary_lines"]


Point = tuple[int, float]


@dataclass
class RunReport:
    """Everything read from one run's logs (all ranks)."""

    files: list[str] = field(default_factory=list)
    events: int = 0
    ranks: set[int] = field(default_factory=set)
    first_ts: int | None = None
    last_ts: int | None = None
    steps: set[int] = field(default_factory=set)
    loss: dict[str, list[Point]] = field(default_factory=lambda: defaultdict(list))
    eval_metrics: dict[str, list[Point]] = field(default_factory=lambda: defaultdict(list))
    lr: list[Point] = field(default_factory=list)
    grad_norm: list[Point] = field(default_factory=list)
    memory: dict[str, list[Point]] = field(default_factory=lambda: defaultdict(list))
    step_time: list[Point] = field(default_factory=list)
    step_end_ts: list[int] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0
    detections: list[Event] = field(default_factory=list)
    stats_records: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0
    seq_gaps: int = 0
    run_started: RunStarted | None = None
    run_ended: RunEnded | None = None
    _last_seq: dict[int, int] = field(default_factory=dict)  # file -> last seq
    _rank0: int | None = None

    def add(self, item: Event | dict[str, Any], source: int = 0) -> None:
        """Fold one event (or one "eventbus.*" record dict) of file `source` into the report."""
        if type(item) is dict:
            kind = item.get("type")
            if kind == STATS_TYPE:
                self.stats_records.append(item)
            elif kind == SKIPPED_TYPE:
                self.skipped += 1
            return
        ev: Event = item  # type: ignore[assignment]
        self.events += 1
        rank = ev.rank if ev.rank is not None else 0
        self.ranks.add(rank)
        if self._rank0 is None or rank < self._rank0:
            self._rank0 = rank
        if ev.ts is not None:
            self.first_ts = ev.ts if self.first_ts is None else min(self.first_ts, ev.ts)
            self.last_ts = ev.ts if self.last_ts is None else max(self.last_ts, ev.ts)
        if ev.seq is not None:  # per file: each bus (each rank, each replay) counts its own
            prev = self._last_seq.get(source)
            if prev is not None and ev.seq > prev + 1:
                self.seq_gaps += ev.seq - prev - 1
            self._last_seq[source] = ev.seq  # a lower seq starts a new segment (a resume)
        if rank != self._rank0:  # series and throughput from one rank (the lowest)
            if isinstance(ev, DivergenceDetected | MemoryLeakSuspected | StopRequested):
                self.detections.append(ev)
            return
        self._series(ev)

    def _series(self, ev: Event) -> None:
        step = ev.step
        if isinstance(ev, Loss):
            v = _f(ev.value)
            if step is not None and v is not None:
                self.loss[ev.split].append((step, v))
                if ev.split == "train":
                    self.steps.add(step)
        elif isinstance(ev, StepEnded):
            if step is not None:
                self.steps.add(step)
            d = _f(ev.duration_s)
            if ev.ts is not None:
                if d is None and self.step_end_ts:
                    d = (ev.ts - self.step_end_ts[-1]) / 1e9
                self.step_end_ts.append(ev.ts)
            if d is not None and step is not None:
                self.step_time.append((step, d))
            self.samples += int(ev.samples or 0)
            self.tokens += int(ev.tokens or 0)
        elif isinstance(ev, OptimizerStepped) and step is not None:
            for name, series in (("lr", self.lr), ("grad_norm", self.grad_norm)):
                v = _f(getattr(ev, name))
                if v is not None:
                    series.append((step, v))
        elif isinstance(ev, EvalEnded) and step is not None:
            for k, x in ev.metrics.items():
                v = _f(x)
                if v is not None:
                    self.eval_metrics[k].append((step, v))
        elif isinstance(ev, MemorySample) and step is not None:
            for name in ("rss_mb", "allocated_mb", "reserved_mb", "rss_peak_mb",
                         "peak_allocated_mb"):
                v = _f(getattr(ev, name))
                if v is not None:
                    self.memory[name].append((step, v))
        elif isinstance(ev, DivergenceDetected | MemoryLeakSuspected | StopRequested):
            self.detections.append(ev)
        elif isinstance(ev, RunStarted):
            self.run_started = ev
        elif isinstance(ev, RunEnded):
            self.run_ended = ev


def _f(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def collect(files: list[Path]) -> RunReport:
    """A report of these logs (read with `read_log`, records included)."""
    r = RunReport(files=[str(p) for p in files])
    for source, item in read_log(files, records=True, sources=True):
        r.add(item, source)
    return r


# -- summary --------------------------------------------------------------------------------


def _hms(s: float) -> str:
    s = max(0.0, s)
    return f"{int(s // 3600)}:{int(s // 60 % 60):02d}:{s % 60:04.1f}"


def _g(v: float) -> str:
    return f"{v:.4g}" if math.isfinite(v) else str(v)


def summary_dict(r: RunReport) -> dict[str, Any]:
    """The summary as plain data (`eventbus summary --json`)."""
    out: dict[str, Any] = {"files": r.files, "events": r.events, "ranks": sorted(r.ranks)}
    out["status"] = (r.run_ended.status if r.run_ended else None)
    out["steps"] = {"count": len(r.steps), "first": min(r.steps, default=None),
                    "last": max(r.steps, default=None)}
    wall = (r.last_ts - r.first_ts) / 1e9 if r.first_ts is not None and r.last_ts else None
    out["wall_time_s"] = wall
    losses: dict[str, Any] = {}
    for split, pts in r.loss.items():
        finite = [p for p in pts if math.isfinite(p[1])]
        best = min(finite, key=lambda p: p[1]) if finite else None
        losses[split] = {"first": pts[0], "min": best, "last": pts[-1],
                         "non_finite": len(pts) - len(finite)}
    out["loss"] = losses
    out["eval"] = {k: pts[-1] for k, pts in r.eval_metrics.items()}
    tp: dict[str, Any] = {}
    ts = r.step_end_ts
    if len(ts) >= 2 and ts[-1] > ts[0]:
        span = (ts[-1] - ts[0]) / 1e9
        tp["steps_per_s"] = (len(ts) - 1) / span
        n = len(ts)
        if r.samples:
            tp["samples_per_s"] = r.samples * (n - 1) / n / span
        if r.tokens:
            tp["tokens_per_s"] = r.tokens * (n - 1) / n / span
    if r.step_time:
        tp["median_step_s"] = statistics.median(d for _, d in r.step_time)
    out["throughput"] = tp
    out["losses"] = _losses(r)
    out["detections"] = [
        {"type": type(d).__name__, "step": d.step, "rank": d.rank,
         **({"metric": d.metric, "value": d.value, "baseline": d.baseline, "reason": d.reason}
            if isinstance(d, DivergenceDetected) else {}),
         **({"metric": d.metric, "rate_mb_per_step": d.rate_mb_per_step, "window": d.window}
            if isinstance(d, MemoryLeakSuspected) else {}),
         **({"reason": d.reason, "abort": d.abort, "source": d.source}
            if isinstance(d, StopRequested) else {})}
        for d in r.detections
    ]
    out["peak_memory_mb"] = {k: max(v for _, v in pts) for k, pts in r.memory.items() if pts}
    return out


def _losses(r: RunReport) -> dict[str, Any]:
    """Drops and failures: the bus's own stats records, skipped lines and seq gaps."""
    subs: dict[str, dict[str, int]] = {}
    writer: dict[str, int] = defaultdict(int)
    bus: dict[str, int] = defaultdict(int)
    for rec in r.stats_records:
        b = rec.get("bus") or {}
        for k in ("published", "rejected"):
            bus[k] += int(b.get(k) or 0)
        bus["hung"] += len(b.get("hung") or ())
        for name, s in (b.get("subscribers") or {}).items():
            d = subs.setdefault(name, {"dropped": 0, "failed": 0})
            d["dropped"] += int(s.get("dropped") or 0)
            d["failed"] += int(s.get("failed") or 0)
        for k, v in (rec.get("writer") or {}).items():
            if isinstance(v, int):
                writer[k] += v
    return {
        "stats_records": len(r.stats_records),
        "bus": dict(bus),
        "subscribers": subs,
        "dropped": sum(s["dropped"] for s in subs.values()),
        "failed": sum(s["failed"] for s in subs.values()),
        "writer": dict(writer),
        "skipped_lines": r.skipped,
        "seq_gaps": r.seq_gaps,
    }


def summary_lines(r: RunReport) -> list[str]:
    """The human summary, one fact per line."""
    d = summary_dict(r)
    ranks = d["ranks"]
    lines = [f"run:        {', '.join(r.files)} ({r.events:,} events, "
             f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"]
    status = d["status"] or "no RunEnded (still running, or it crashed)"
    if r.run_ended is not None and r.run_ended.reason:
        status += f": {r.run_ended.reason}"
    lines.append(f"status:     {status}")
    st = d["steps"]
    total = r.run_started.total_steps if r.run_started else None
    lines.append(f"steps:      {st['count']:,}" + (f" of {total:,}" if total else "")
                 + (f" ({st['first']} to {st['last']})" if st["count"] else ""))
    if d["wall_time_s"] is not None:
        lines.append(f"wall time:  {_hms(d['wall_time_s'])} ({d['wall_time_s']:.1f} s)")
    for split, lo in d["loss"].items():
        parts = [f"first {_g(lo['first'][1])} @{lo['first'][0]}"]
        if lo["min"]:
            parts.append(f"min {_g(lo['min'][1])} @{lo['min'][0]}")
        parts.append(f"last {_g(lo['last'][1])} @{lo['last'][0]}")
        if lo["non_finite"]:
            parts.append(f"{lo['non_finite']} non-finite")
        lines.append(f"loss {split + ':':<6} " + ", ".join(parts))
    if d["eval"]:
        lines.append("eval:       " + ", ".join(f"{k} {_g(v[1])} @{v[0]}"
                                                 for k, v in d["eval"].items()))
    tp = d["throughput"]
    if tp:
        parts = []
        if "steps_per_s" in tp:
            parts.append(f"{tp['steps_per_s']:.3g} steps/s")
        if "median_step_s" in tp:
            parts.append(f"median step {tp['median_step_s'] * 1e3:.1f} ms")
        for k in ("samples", "tokens"):
            if f"{k}_per_s" in tp:
                parts.append(f"{tp[f'{k}_per_s']:,.1f} {k}/s")
        lines.append("throughput: " + ", ".join(parts))
    lines.append("losses:     " + _losses_line(d["losses"]))
    dets = d["detections"]
    if not dets:
        lines.append("detections: none")
    else:
        lines.append(f"detections: {len(dets)}")
        for x in dets:
            lines.append("  " + _detection(x))
    mem = d["peak_memory_mb"]
    if mem:
        lines.append("peak memory: " + ", ".join(f"{k.removesuffix('_mb')} {v:,.0f} MB"
                                                   for k, v in mem.items()))
    return lines


def _losses_line(lo: dict[str, Any]) -> str:
    parts = []
    if not lo["stats_records"]:
        parts.append("unknown (no stats record: the writer was not closed cleanly)")
    else:
        parts.append(f"{lo['dropped']:,} dropped, {lo['failed']:,} failed")
        bad = [f"{n}: {s['dropped']} dropped, {s['failed']} failed"
               for n, s in lo["subscribers"].items() if s["dropped"] or s["failed"]]
        if bad:
            parts.append("(" + "; ".join(bad) + ")")
        if lo["bus"].get("rejected"):
            parts.append(f"{lo['bus']['rejected']} published after close")
        if lo["bus"].get("hung"):
            parts.append(f"{lo['bus']['hung']} hung")
        w = lo["writer"]
        if w.get("lines_lost"):
            parts.append(f"{w['lines_lost']} lines lost to I/O errors")
    if lo["skipped_lines"]:
        parts.append(f"{lo['skipped_lines']} events skipped (oversize or unserialisable)")
    if lo["seq_gaps"]:
        parts.append(f"{lo['seq_gaps']} events missing from the log (seq gaps)")
    return ", ".join(parts)


def _detection(x: dict[str, Any]) -> str:
    t = x["type"]
    if t == "DivergenceDetected":
        return (f"divergence @{x['step']}: {x['metric']} {_g(x['value'])} "
                f"(baseline {_g(x['baseline'])}) {x['reason']}")
    if t == "MemoryLeakSuspected":
        return (f"memory leak @{x['step']}: {x['metric']} +{x['rate_mb_per_step']:.3g} MB/step "
                f"over {x['window']} steps")
    return f"{'abort' if x['abort'] else 'stop'} @{x['step']} by {x['source']}: {x['reason']}"


# -- plot ------------------------------------------------------------------------------------


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
    mem = {k: v for k, v in r.memory.items()
           if v and k in ("rss_mb", "allocated_mb", "reserved_mb")}
    if mem:
        panels.append(("memory (MB)", mem))
    if r.step_time:
        panels.append(("step time (s)", {"step time": r.step_time}))
    if not panels:
        raise ValueError("no plottable events (Loss, OptimizerStepped, MemorySample, StepEnded)")
    marks = [d for d in r.detections if isinstance(d, DivergenceDetected) and d.step is not None]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.4 * len(panels) + 0.6),
                             sharex=True, squeeze=False)
    for ax, (name, series) in zip(axes[:, 0], panels, strict=True):
        for label, pts in series.items():
            xs = [p[0] for p in pts]
            ys = [p[1] for p in pts]
            ax.plot(xs, ys, label=label, linewidth=1.2)
            bad = [x for x, y in pts if not math.isfinite(y)]
            if bad:  # a NaN/Inf loss is not silently a gap in the line
                ax.plot(bad, [_top(ys)] * len(bad), "x", color="red", label=f"{label} non-finite")
        for i, d in enumerate(marks):
            ax.axvline(d.step, color="red", linestyle="--", linewidth=1,
                       label="divergence" if i == 0 else None)
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
