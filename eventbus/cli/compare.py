"""`eventbus summary A B`: several runs side by side, one column per run.

Rows are the single-run summary's facts, split so each cell is one number ("-": the run has
none), then the config keys whose values differ between the runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from eventbus.cli._format import g, hms
from eventbus.cli.report import RunReport
from eventbus.steps import known_total

__all__ = ["compare_lines"]

_MISSING = "-"
_MAX_CELL = 32  # a longer cell (a long reason or path) is cut with "..."

Row = tuple[str, list[str]]


def compare_lines(
    names: Sequence[str], reports: Sequence[RunReport], ds: Sequence[dict[str, Any]]
) -> list[str]:
    """The side-by-side table: a header of run names, then one fact per row; `ds` are the
    runs' `summary_dict`s."""
    rows = [(label, [_cut(c) for c in cells]) for label, cells in _facts(ds, reports)]
    rows += [(label, [_cut(c) for c in cells]) for label, cells in _config_rows(reports)]
    rows.insert(0, ("", [n if len(n) <= _MAX_CELL else "..." + n[3 - _MAX_CELL :] for n in names]))
    left = max(len(label) for label, _ in rows)
    widths = [max(len(cells[i]) for _, cells in rows) for i in range(len(names))]
    return [
        (
            f"{label:<{left}}  "
            + "  ".join(f"{c:<{w}}" for c, w in zip(cells, widths, strict=True))
        ).rstrip()
        for label, cells in rows
    ]


def _facts(ds: Sequence[dict[str, Any]], reports: Sequence[RunReport]) -> list[Row]:
    rows: list[Row] = []

    def row(label: str, cells: list[str | None]) -> None:
        if any(c is not None for c in cells):
            rows.append((label, [_MISSING if c is None else c for c in cells]))

    pairs = list(zip(ds, reports, strict=True))
    row("events", [f"{r.events:,} (rank{_s(d['ranks'])} {_list(d['ranks'])})" for d, r in pairs])
    row("status", [_status(d, r) for d, r in pairs])
    row("steps", [_steps(d, r) for d, r in pairs])
    row("wall time", [None if d["wall_time_s"] is None else hms(d["wall_time_s"]) for d in ds])
    for split in dict.fromkeys(s for d in ds for s in d["loss"]):
        loss = [d["loss"].get(split) for d in ds]
        for which in ("first", "min", "last"):
            row(f"{split} loss {which}", [_at(lo[which]) if lo else None for lo in loss])
        row(f"{split} non-finite", [str(lo["non_finite"]) if lo else None for lo in loss])
    for metric in dict.fromkeys(k for d in ds for k in d["eval"]):
        row(f"eval {metric}", [_at(d["eval"].get(metric)) for d in ds])
    tp = [d["throughput"] for d in ds]
    row("steps/s", [_fmt(t.get("steps_per_s"), ".3g") for t in tp])
    median = [t.get("median_step_s") for t in tp]
    row("median step", [_fmt(None if m is None else m * 1e3, ".1f", " ms") for m in median])
    for k in ("samples", "tokens"):
        row(f"{k}/s", [_fmt(t.get(f"{k}_per_s"), ",.1f") for t in tp])
    row("dropped, failed", [_losses(d["losses"]) for d in ds])
    row("seq gaps", [str(d["losses"]["seq_gaps"] or 0) for d in ds])
    row("detections", [_detections(d["detections"]) for d in ds])
    for k in dict.fromkeys(k for d in ds for k in d["peak_memory_mb"]):
        peaks = [d["peak_memory_mb"].get(k) for d in ds]
        row(f"peak {k.removesuffix('_mb')}", [_fmt(v, ",.0f", " MB") for v in peaks])
    row("publish share", [_share(d["instrumentation_cost"]) for d in ds])
    return rows


def _config_rows(reports: Sequence[RunReport]) -> list[Row]:
    """Config keys (nested ones joined by ".") whose values differ between the runs."""
    configs = [_flat(r.run_started.config) if r.run_started else {} for r in reports]
    keys = dict.fromkeys(k for c in configs for k in c)
    rows = []
    for k in keys:
        cells = [repr(c[k]) if k in c else _MISSING for c in configs]
        if len(set(cells)) > 1:
            rows.append((f"config {k}", cells))
    return rows


def _flat(config: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(config, dict):
        return {}
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _status(d: dict[str, Any], r: RunReport) -> str:
    status = d["status"] or ("no RunEnded" if r.run_started is not None else "no RunStarted")
    if r.run_ended is not None and r.run_ended.reason:
        status += f": {r.run_ended.reason}"
    return status


def _steps(d: dict[str, Any], r: RunReport) -> str:
    st = d["steps"]
    total = known_total(r.run_started.total_steps) if r.run_started else None
    return f"{st['count']:,}" + (f" of {total:,}" if total else "")


def _at(p: Any) -> str | None:
    return f"{g(p[1])} @{p[0]}" if p else None


def _losses(lo: dict[str, Any]) -> str:
    if not lo["stats_records"]:
        return "unknown"
    return f"{lo['dropped']:,}, {lo['failed']:,}"


def _detections(dets: list[dict[str, Any]]) -> str:
    if not dets:
        return "none"
    first = dets[0]
    kind = {"DivergenceDetected": "divergence", "MemoryLeakSuspected": "leak"}.get(
        first["type"], "stop"
    )
    return f"{len(dets)} (first: {kind} @{first['step']})"


def _share(c: dict[str, Any] | None) -> str | None:
    return f"{c['share']:.2%}" if c and c.get("share") is not None else None


def _fmt(v: float | None, spec: str, unit: str = "") -> str | None:
    return None if v is None else format(v, spec) + unit


def _s(items: Sequence[Any]) -> str:
    return "s" if len(items) > 1 else ""


def _list(items: Sequence[Any]) -> str:
    return ", ".join(map(str, items))


def _cut(cell: str) -> str:
    return cell if len(cell) <= _MAX_CELL else cell[: _MAX_CELL - 3] + "..."
