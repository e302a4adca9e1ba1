"""The "instrumentation cost" of `eventbus summary`: what the bus cost the training process.

Read, best first, from the writer's closing stats record (the final totals), the run's
`RunEnded.cost`, or its last `BusCost`; the lowest rank's.
"""

from __future__ import annotations

from typing import Any

from eventbus.core.cost import totals
from eventbus.events import BusCost, RunEnded

__all__ = ["cost_dict", "cost_lines"]

_HEAVIEST = 3  # subscribers named on the summary line


def cost_dict(
    stats_records: list[dict[str, Any]], run_ended: RunEnded | None, last: BusCost | None
) -> dict[str, Any] | None:
    """Share of step time in publish, per-step figures and the subscribers by CPU, or None."""
    found = _from_records(stats_records)
    if found is None and run_ended is not None and isinstance(run_ended.cost, dict):
        found = ("RunEnded", dict(run_ended.cost), run_ended.cost.get("subscriber_cpu_s"))
    if found is None and last is not None:
        found = ("BusCost", totals(last), last.subscriber_cpu_s)
    if found is None:
        return None
    source, c, cpu = found
    steps = _num(c.get("steps"))
    per_step = 1e3 / steps if steps else None
    subs = sorted(
        ((str(n), v) for n, v in (cpu or {}).items() if _num(v) is not None),
        key=lambda nv: -nv[1],
    )
    bus_cpu = _num(c.get("bus_cpu_s"))
    return {
        "source": source,
        "steps": steps,
        "share": _num(c.get("share")),
        "publish_s": _num(c.get("publish_s")),
        "publish_ms_p50": _num(c.get("publish_ms_p50")),
        "publish_ms_p99": _num(c.get("publish_ms_p99")),
        "step_ms_p50": _num(c.get("step_ms_p50")),
        "bus_cpu_ms_per_step": bus_cpu * per_step if bus_cpu is not None and per_step else None,
        "subscribers": [
            {"name": n, "cpu_s": v, "cpu_ms_per_step": v * per_step if per_step else None}
            for n, v in subs
        ],
    }


def cost_lines(c: dict[str, Any] | None) -> list[str]:
    """The share of step time spent in publish and the bus thread's CPU; the heaviest
    subscribers on a second line."""
    head = "instrumentation cost: "
    if c is None:
        return [head + "unknown (no cost report: EventBus(cost_every=None), or an older log)"]
    parts = []
    if c["share"] is not None:
        p50, p99 = c["publish_ms_p50"], c["publish_ms_p99"]
        parts.append(
            f"{c['share']:.2%} of step time in publish"
            + (f" ({p50 * 1e3:.1f} us/step p50" if p50 is not None else "")
            + (f", {p99 * 1e3:.1f} us p99)" if p50 is not None and p99 is not None else "")
            + (")" if p50 is not None and p99 is None else "")
        )
    if c["bus_cpu_ms_per_step"] is not None:
        parts.append(f"bus thread {c['bus_cpu_ms_per_step']:.3f} ms CPU/step")
    lines = [head + ("; ".join(parts) or "nothing measured (no steps)")]
    heavy = [
        f"{s['name']} {s['cpu_ms_per_step']:.3f}" if s["cpu_ms_per_step"] is not None else s["name"]
        for s in c["subscribers"][:_HEAVIEST]
    ]
    if heavy:
        lines.append("  heaviest subscribers (ms CPU/step): " + ", ".join(heavy))
    return lines


def _from_records(records: list[dict[str, Any]]) -> tuple[str, dict[str, Any], Any] | None:
    best: tuple[Any, dict[str, Any]] | None = None
    for rec in records:
        bus = rec.get("bus")
        if isinstance(bus, dict) and isinstance(bus.get("cost"), dict):
            rank = rec.get("rank") if type(rec.get("rank")) is int else 0
            if best is None or rank <= best[0]:  # the lowest rank, its last record
                best = (rank, bus)
    if best is None:
        return None
    bus = best[1]
    subs = bus.get("subscribers")
    items = subs.items() if isinstance(subs, dict) else ()
    cpu = {n: s.get("cpu_s") for n, s in items if isinstance(s, dict)}
    return "stats record", bus["cost"], cpu


def _num(v: Any) -> float | None:
    return float(v) if type(v) in (int, float) else None
