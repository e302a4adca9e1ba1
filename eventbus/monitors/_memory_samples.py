"""The `MemorySample`s `MemoryProfiler` publishes, and when: phases of a step, lag, due steps.

Pure bookkeeping on numbers already read (`eventbus.monitors._memory_read` reads them): no
torch call, no device.
"""

from __future__ import annotations

import time

from eventbus.events import BackwardEnded, Event, ForwardEnded, MemorySample, OptimizerStepped
from eventbus.monitors._memory_summary import Reading

__all__ = ["due", "lag", "phase_of", "phase_sample", "step_sample"]

_PHASES: dict[type[Event], str] = {
    ForwardEnded: "forward",
    BackwardEnded: "backward",
    OptimizerStepped: "optimizer",
}


def phase_of(cls: type[Event]) -> str | None:
    """The phase a phase-end event type closes ("forward", "backward", "optimizer"), or None."""
    return _PHASES.get(cls) or next((p for c, p in _PHASES.items() if issubclass(cls, c)), None)


def lag(ev: Event) -> float | None:
    """Seconds between the event's publish (training thread) and now (our read)."""
    return max(0.0, (time.time_ns() - ev.ts) / 1e9) if ev.ts is not None else None


def due(step: int, last: int | None, every: int) -> bool:
    """Publish at multiples of `every`; a step that jumped past one (readings coalesced) is
    due too, and so is any step after the steps went back (a resume)."""
    if last is None or step < last:
        return step % every == 0 or every == 1
    return step // every > last // every


def step_sample(
    r: Reading, *, rss_peak_mb: float, device: str, source: str | None, lag_s: float | None
) -> MemorySample:
    """The `MemorySample(phase="step")` of reading `r`."""
    return MemorySample(
        step=r.step,
        phase="step",
        rss_mb=r.rss,
        rss_peak_mb=rss_peak_mb,
        allocated_mb=r.allocated,
        reserved_mb=r.reserved,
        peak_allocated_mb=r.peak_allocated,
        alloc_retries=r.alloc_retries,
        ooms=r.ooms,
        device=device,
        source=source,
        lag_s=lag_s,
    )


def phase_sample(
    step: int,
    phase: str,
    peak_mb: float | None,
    *,
    device: str,
    source: str,
    lag_s: float | None,
) -> MemorySample:
    """The `MemorySample` of one phase of `step`: its allocated-memory peak only."""
    return MemorySample(
        step=step,
        phase=phase,
        peak_allocated_mb=peak_mb,
        device=device,
        source=source,
        lag_s=lag_s,
    )
