"""The event catalogue as named scalars: one mapping for every sink that draws curves.

TensorBoardSink, WandbSink and MLflowSink log the same names: `{split}/loss` (train/loss),
each `Scalars` key as given, `train/lr`, `train/grad_norm`, `eval/{metric}`, `memory/{field}`,
`perf/step_time_s`, `perf/steps_per_s`, `perf/samples_per_s`, `perf/tokens_per_s`,
`{kind}/{name}/{stat}` for TensorStats, `divergence/marker` (1 at the step),
`memory/leak_rate_mb_per_step`, `eventbus/{cost}` and `eventbus/cpu_s/{subscriber}`.
Zero is a value; only unknown (None) fields are left out; NaN and ±Inf stay floats.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

from eventbus.events import (
    BusCost,
    DivergenceDetected,
    EvalEnded,
    Event,
    Loss,
    MemoryLeakSuspected,
    MemorySample,
    OptimizerStepped,
    Scalars,
    StepEnded,
    TensorStats,
)

__all__ = ["Scalar", "StepClock", "num", "scalars"]

_MEMORY_FIELDS = (
    "rss_mb",
    "rss_peak_mb",
    "allocated_mb",
    "reserved_mb",
    "peak_allocated_mb",
    "alloc_retries",
    "ooms",
)
_TENSOR_STATS = ("norm", "mean", "std", "absmax", "nan_count", "inf_count")
_COST = ("publish_ms_p50", "publish_ms_p99", "step_ms_p50", "share", "bus_cpu_s", "publish_s")
Scalar = tuple[str, float, int]  # tag, value, step


class StepClock:
    """Per rank: the last step seen (for events without one) and the previous StepEnded's ts
    (for a step time when `duration_s` is unknown)."""

    def __init__(self) -> None:
        self.last_step: dict[int, int] = {}
        self.step_end: dict[int, int] = {}

    def step_of(self, ev: Event, rank: int) -> int:
        """`ev.step`, else the last step seen on `rank` (0 before any)."""
        step = ev.step
        if step is None:
            return self.last_step.get(rank, 0)
        if step > self.last_step.get(rank, -1):
            self.last_step[rank] = step
        return step

    def scalars(self, ev: Event, rank: int) -> list[Scalar]:
        """`ev`'s named scalars at its step (see the module doc)."""
        return list(scalars(ev, self.step_of(ev, rank), self.step_end, rank))


def num(v: Any) -> float | None:
    """A plain float from a number or a one-element CPU tensor (already on the host)."""
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, int | float):
        return float(v)
    if hasattr(v, "numel") and v.numel() == 1:
        return float(v.item())  # a CPU tensor (captured at publish): no device sync here
    return None


def scalars(ev: Event, step: int, step_end: dict[int, int], rank: int) -> Iterator[Scalar]:
    """`ev`'s named scalars at `step`; `step_end` holds each rank's previous StepEnded ts."""
    match ev:
        case Loss():
            v = num(ev.value)
            if v is not None:
                yield f"{ev.split}/loss", v, step
        case Scalars():
            yield from _named(ev.values.items(), "", step)
        case OptimizerStepped():
            yield from _named((("lr", ev.lr), ("grad_norm", ev.grad_norm)), "train/", step)
        case EvalEnded():
            yield from _named(ev.metrics.items(), "eval/", step)
        case MemorySample():
            yield from _named(((f, getattr(ev, f)) for f in _MEMORY_FIELDS), "memory/", step)
        case MemoryLeakSuspected():
            yield from _named((("leak_rate_mb_per_step", ev.rate_mb_per_step),), "memory/", step)
        case StepEnded():
            yield from _throughput(ev, step, step_end, rank)
        case TensorStats():
            base = f"{ev.kind}/{ev.name}/" if ev.name else f"{ev.kind}/"
            yield from _named(((f, getattr(ev, f)) for f in _TENSOR_STATS), base, step)
        case DivergenceDetected():
            yield "divergence/marker", 1.0, step
        case BusCost():
            yield from _named(((f, getattr(ev, f)) for f in _COST), "eventbus/", step)
            yield from _named(ev.subscriber_cpu_s.items(), "eventbus/cpu_s/", step)


def _named(items: Iterable[tuple[str, Any]], prefix: str, step: int) -> Iterator[Scalar]:
    for k, v in items:
        x = num(v)
        if x is not None:  # zero is a value: only None (unknown) is skipped
            yield f"{prefix}{k}", x, step


def _throughput(ev: StepEnded, step: int, step_end: dict[int, int], rank: int) -> Iterator[Scalar]:
    dur = num(ev.duration_s)
    prev = step_end.get(rank)
    if ev.ts is not None:
        step_end[rank] = ev.ts
        if dur is None and prev is not None and ev.ts > prev:
            dur = (ev.ts - prev) / 1e9  # no duration given: the time since the last step
    if dur is None or dur <= 0 or not math.isfinite(dur):
        return
    yield "perf/step_time_s", dur, step
    yield "perf/steps_per_s", 1.0 / dur, step
    for name in ("samples", "tokens"):
        n = num(getattr(ev, name))
        if n is not None:
            yield f"perf/{name}_per_s", n / dur, step
