"""`eventbus summary`: steps, wall time, loss, throughput, losses and detections of a run;
several runs side by side (`eventbus.cli.runs` says what a run is)."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from typing import Any

import orjson

from eventbus.cli._format import g, hms
from eventbus.cli.compare import compare_lines
from eventbus.cli.cost import cost_dict, cost_lines
from eventbus.cli.report import RunReport
from eventbus.cli.runs import read_runs, run_names
from eventbus.events import (
    DivergenceDetected,
    MemoryLeakSuspected,
    RankUnresponsive,
    StallDetected,
    StallEnded,
    StopRequested,
    StragglerDetected,
)
from eventbus.steps import known_total

__all__ = ["add_parser", "run", "summary_dict", "summary_lines"]

_BY_DESIGN = "latest"  # the policy that drops what a newer event replaced (a progress bar)


def add_parser(sub: Any) -> None:
    """Register `eventbus summary LOG... [--json] [--merge]`."""
    s = sub.add_parser(
        "summary",
        help="steps, wall time, loss, throughput, losses, detections; runs side by side",
    )
    s.add_argument("logs", nargs="+", metavar="LOG", help="a run's directory or files, or a tree")
    s.add_argument(
        "--json", action="store_true", help="one JSON object (a list of them for several runs)"
    )
    s.add_argument("--merge", action="store_true", help="read every LOG as files of one run")
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print steps, wall time, loss, throughput, drops/failures, detections, peak memory;
    for several runs, one column (or JSON object) each."""
    runs, reports = read_runs(args.logs, merge=args.merge)
    if len(runs) == 1:
        if args.json:
            print(_json(summary_dict(reports[0])))
        else:
            print("\n".join(summary_lines(reports[0])))
        return 0
    names = run_names(runs, reports)
    ds = [summary_dict(r) for r in reports]
    if args.json:
        print(_json([{"run": n, **d} for n, d in zip(names, ds, strict=True)]))
    else:
        print("\n".join(compare_lines(names, reports, ds)))
    return 0


def _json(d: Any) -> str:
    try:
        return orjson.dumps(d, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
    except orjson.JSONEncodeError:  # a sum past 64 bits (absurd stats records)
        return json.dumps(d, default=str)


def summary_dict(r: RunReport) -> dict[str, Any]:
    """The summary as plain data (`eventbus summary --json`)."""
    out: dict[str, Any] = {"files": r.files, "events": r.events, "ranks": sorted(r.ranks)}
    out["status"] = r.run_ended.status if r.run_ended else None
    out["several_runs"] = r.several_runs
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
            **(
                {"waited_s": d.waited_s, "bound_s": d.bound_s, "path": d.path}
                if isinstance(d, StallDetected)
                else {}
            ),
            **({"stalled_s": d.stalled_s} if isinstance(d, StallEnded) else {}),
            **(
                {
                    "straggler": d.straggler,
                    "phase": d.phase,
                    "relative": d.relative,
                    "history": d.history,
                    "seconds": d.seconds,
                    "fastest_s": d.fastest_s,
                }
                if isinstance(d, StragglerDetected)
                else {}
            ),
            **(
                {"missing_rank": d.missing_rank, "waited_s": d.waited_s, "source": d.source}
                if isinstance(d, RankUnresponsive)
                else {}
            ),
        }
        for d in r.detections
    ]
    out["peak_memory_mb"] = {k: max(v for _, v in pts) for k, pts in r.memory.items() if pts}
    out["instrumentation_cost"] = cost_dict(r.stats_records, r.run_ended, r.bus_cost)
    out["eta"] = _eta(r)
    return out


def _eta(r: RunReport) -> dict[str, Any] | None:
    """SpeedMonitor's last time estimate, for a run that did not complete (else None)."""
    est = r.time_estimate
    if est is None or (r.run_ended is not None and r.run_ended.status == "completed"):
        return None
    return {
        "step": est.step,
        "eta_s": float(est.eta_s),
        "total_steps": est.total_steps,
        "steps_per_s": est.steps_per_s,
    }


def _losses(r: RunReport) -> dict[str, Any]:
    """Drops and failures: the bus's own stats records, skipped lines and seq gaps.

    A subscriber with the `latest` policy (a progress bar) drops what a newer event replaced,
    by design: its drops are `superseded`, not counted in `dropped`.
    """
    subs: dict[str, dict[str, Any]] = {}
    writer: dict[str, int] = defaultdict(int)
    bus: dict[str, int] = defaultdict(int)
    for rec in r.stats_records:
        b = rec.get("bus") or {}
        for k in ("published", "rejected"):
            bus[k] += int(b.get(k) or 0)
        bus["hung"] += len(b.get("hung") or ())
        for name, s in (b.get("subscribers") or {}).items():
            d = subs.setdefault(name, {"policy": None, "dropped": 0, "failed": 0})
            d["policy"] = s.get("policy") or d["policy"]
            d["dropped"] += int(s.get("dropped") or 0)
            d["failed"] += int(s.get("failed") or 0)
        for k, v in (rec.get("writer") or {}).items():
            if type(v) is int:
                writer[k] += v
    return {
        "stats_records": len(r.stats_records),
        "bus": dict(bus),
        "subscribers": subs,
        "dropped": sum(s["dropped"] for s in subs.values() if s["policy"] != _BY_DESIGN),
        "superseded": sum(s["dropped"] for s in subs.values() if s["policy"] == _BY_DESIGN),
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
    if r.several_runs:
        lines.append(f"warning:    {r.several_runs}")
    status = d["status"] or (
        "no RunEnded (still running, or it crashed)"
        if r.run_started is not None
        else "no RunEnded: the loop published no RunStarted, so close() ended no run "
        "(publish RunStarted first)"
    )
    if r.run_ended is not None and r.run_ended.reason:
        status += f": {r.run_ended.reason}"
    lines.append(f"status:     {status}")
    st = d["steps"]
    total = known_total(r.run_started.total_steps) if r.run_started else None
    lines.append(
        f"steps:      {st['count']:,}"
        + (f" of {total:,}" if total else "")
        + (f" ({st['first']} to {st['last']})" if st["count"] else "")
    )
    if d["wall_time_s"] is not None:
        lines.append(f"wall time:  {hms(d['wall_time_s'])} ({d['wall_time_s']:.1f} s)")
    eta = d["eta"]
    if eta is not None:
        lines.append(
            f"eta:        {hms(eta['eta_s'])} left at step {eta['step']} of "
            f"{eta['total_steps']:,} (the last estimate)"
        )
    for split, lo in d["loss"].items():
        parts = [f"first {g(lo['first'][1])} @{lo['first'][0]}"]
        if lo["min"]:
            parts.append(f"min {g(lo['min'][1])} @{lo['min'][0]}")
        parts.append(f"last {g(lo['last'][1])} @{lo['last'][0]}")
        if lo["non_finite"]:
            parts.append(f"{lo['non_finite']} non-finite")
        lines.append(f"loss {split + ':':<6} " + ", ".join(parts))
    if d["eval"]:
        lines.append(
            "eval:       " + ", ".join(f"{k} {g(v[1])} @{v[0]}" for k, v in d["eval"].items())
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
            lines.append("  " + _detection(x, multi_rank=len(ranks) > 1))
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
            f"{n}: {lost} dropped, {s['failed']} failed"
            for n, s in lo["subscribers"].items()
            if (lost := 0 if s["policy"] == _BY_DESIGN else s["dropped"]) or s["failed"]
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
    line = ", ".join(parts)
    if lo["superseded"]:
        names = [
            n for n, s in lo["subscribers"].items() if s["policy"] == _BY_DESIGN and s["dropped"]
        ]
        line += (
            f"; by design: {lo['superseded']:,} superseded by newer events "
            f"({', '.join(names)}: policy {_BY_DESIGN})"
        )
    return line


def _detection(x: dict[str, Any], *, multi_rank: bool) -> str:
    t = x["type"]
    # a stop agreed from another rank carries no step of its own
    at = "(no step)" if x["step"] is None else f"@{x['step']}"
    if multi_rank and x["rank"] is not None:
        at += f" on rank {x['rank']}"
    if t == "DivergenceDetected":
        return (
            f"divergence {at}: {x['metric']} {g(x['value'])} "
            f"(baseline {g(x['baseline'])}) {x['reason']}"
        )
    if t == "MemoryLeakSuspected":
        return (
            f"memory leak {at}: {x['metric']} +{x['rate_mb_per_step']:.3g} MB/step "
            f"over {x['window']} steps"
        )
    if t == "StallDetected":
        where = f"; stacks in {x['path']}" if x["path"] else ""
        return f"stall {at}: no step for {x['waited_s']:.1f} s (bound {x['bound_s']:.1f} s){where}"
    if t == "StallEnded":
        return f"stall ended {at}: no step had ended for {x['stalled_s']:.1f} s"
    if t in ("StragglerDetected", "RankUnresponsive"):
        return _cross_rank(t, at, x)
    return f"{'abort' if x['abort'] else 'stop'} {at} by {x['source']}: {x['reason']}"


def _cross_rank(t: str, at: str, x: dict[str, Any]) -> str:
    """A straggler or a rank gone silent, as rank 0 reported it."""
    if t == "RankUnresponsive":
        return (
            f"rank {x['missing_rank']} unresponsive {at}: sent nothing for "
            f"{x['waited_s']:.1f} s ({x['source']})"
        )
    own = "" if x["history"] is None else f"; {x['history']:.2f} x its own history"
    return (
        f"straggler {at}: rank {x['straggler']} at {x['relative']:.2f} x the fastest rank "
        f"({x['seconds'] * 1e3:.3g} ms against {x['fastest_s'] * 1e3:.3g} ms, most in "
        f"{x['phase']}{own})"
    )
