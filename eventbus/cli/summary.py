"""`eventbus summary`: steps, wall time, loss, throughput, losses and detections of a run."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from typing import Any

import orjson

from eventbus.cli._errors import no_events
from eventbus.cli.cost import cost_dict, cost_lines
from eventbus.cli.report import RunReport, collect
from eventbus.events import DivergenceDetected, MemoryLeakSuspected, StopRequested
from eventbus.logformat import log_files

__all__ = ["add_parser", "run", "summary_dict", "summary_lines"]


def add_parser(sub: Any) -> None:
    """Register `eventbus summary LOG... [--json]`."""
    s = sub.add_parser("summary", help="steps, wall time, loss, throughput, losses, detections")
    s.add_argument("logs", nargs="+", metavar="LOG")
    s.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print steps, wall time, loss, throughput, drops/failures, detections, peak memory."""
    files = log_files(args.logs)
    report = collect(files)
    if report.events == 0:
        raise no_events(files)
    if args.json:
        d = summary_dict(report)
        try:
            text = orjson.dumps(d, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
        except orjson.JSONEncodeError:  # a sum past 64 bits (absurd stats records)
            text = json.dumps(d, default=str)
        print(text)
    else:
        print("\n".join(summary_lines(report)))
    return 0


def _hms(s: float) -> str:
    s = max(0.0, s)
    return f"{int(s // 3600)}:{int(s // 60 % 60):02d}:{s % 60:04.1f}"


def _g(v: float) -> str:
    return f"{v:.4g}" if math.isfinite(v) else str(v)


def summary_dict(r: RunReport) -> dict[str, Any]:
    """The summary as plain data (`eventbus summary --json`)."""
    out: dict[str, Any] = {"files": r.files, "events": r.events, "ranks": sorted(r.ranks)}
    out["status"] = r.run_ended.status if r.run_ended else None
    out["steps"] = {
        "count": len(r.steps),
        "first": min(r.steps, default=None),
        "last": max(r.steps, default=None),
    }
    wall = (r.last_ts - r.first_ts) / 1e9 if r.first_ts is not None and r.last_ts else None
    out["wall_time_s"] = wall
    losses: dict[str, Any] = {}
    for split, pts in r.loss.items():
        finite = [p for p in pts if math.isfinite(p[1])]
        best = min(finite, key=lambda p: p[1]) if finite else None
        losses[split] = {
            "first": pts[0],
            "min": best,
            "last": pts[-1],
            "non_finite": len(pts) - len(finite),
        }
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
        {
            "type": type(d).__name__,
            "step": d.step,
            "rank": d.rank,
            **(
                {"metric": d.metric, "value": d.value, "baseline": d.baseline, "reason": d.reason}
                if isinstance(d, DivergenceDetected)
                else {}
            ),
            **(
                {"metric": d.metric, "rate_mb_per_step": d.rate_mb_per_step, "window": d.window}
                if isinstance(d, MemoryLeakSuspected)
                else {}
            ),
            **(
                {"reason": d.reason, "abort": d.abort, "source": d.source}
                if isinstance(d, StopRequested)
                else {}
            ),
        }
        for d in r.detections
    ]
    out["peak_memory_mb"] = {k: max(v for _, v in pts) for k, pts in r.memory.items() if pts}
    out["instrumentation_cost"] = cost_dict(r.stats_records, r.run_ended, r.bus_cost)
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
            if type(v) is int:
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
        "seq_duplicates": r.seq_duplicates,
    }


def summary_lines(r: RunReport) -> list[str]:
    """The human summary, one fact per line."""
    d = summary_dict(r)
    ranks = d["ranks"]
    lines = [
        f"run:        {', '.join(r.files)} ({r.events:,} events, "
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
    ]
    status = d["status"] or "no RunEnded (still running, or it crashed)"
    if r.run_ended is not None and r.run_ended.reason:
        status += f": {r.run_ended.reason}"
    lines.append(f"status:     {status}")
    st = d["steps"]
    total = r.run_started.total_steps if r.run_started else None
    lines.append(
        f"steps:      {st['count']:,}"
        + (f" of {total:,}" if total else "")
        + (f" ({st['first']} to {st['last']})" if st["count"] else "")
    )
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
        lines.append(
            "eval:       " + ", ".join(f"{k} {_g(v[1])} @{v[0]}" for k, v in d["eval"].items())
        )
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
        lines.append(
            "peak memory: "
            + ", ".join(f"{k.removesuffix('_mb')} {v:,.0f} MB" for k, v in mem.items())
        )
    lines += cost_lines(d["instrumentation_cost"])
    return lines


def _losses_line(lo: dict[str, Any]) -> str:
    parts = []
    if not lo["stats_records"]:
        parts.append("unknown (no stats record: the writer was not closed cleanly)")
    else:
        parts.append(f"{lo['dropped']:,} dropped, {lo['failed']:,} failed")
        bad = [
            f"{n}: {s['dropped']} dropped, {s['failed']} failed"
            for n, s in lo["subscribers"].items()
            if s["dropped"] or s["failed"]
        ]
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
    if lo["seq_duplicates"]:
        parts.append(f"{lo['seq_duplicates']} events written twice (repeated seq)")
    return ", ".join(parts)


def _detection(x: dict[str, Any]) -> str:
    t = x["type"]
    if t == "DivergenceDetected":
        return (
            f"divergence @{x['step']}: {x['metric']} {_g(x['value'])} "
            f"(baseline {_g(x['baseline'])}) {x['reason']}"
        )
    if t == "MemoryLeakSuspected":
        return (
            f"memory leak @{x['step']}: {x['metric']} +{x['rate_mb_per_step']:.3g} MB/step "
            f"over {x['window']} steps"
        )
    return f"{'abort' if x['abort'] else 'stop'} @{x['step']} by {x['source']}: {x['reason']}"
