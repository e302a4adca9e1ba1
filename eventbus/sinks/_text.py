"""One readable line per event: shared by the console sink and the `eventbus` command."""

from __future__ import annotations

from typing import Any

from eventbus.events import (
    CheckpointLoaded,
    CheckpointSaved,
    DivergenceDetected,
    EvalEnded,
    Event,
    Loss,
    MemoryLeakSuspected,
    MemorySample,
    OptimizerStepped,
    RunEnded,
    RunStarted,
    Scalars,
    StepEnded,
    StopRequested,
)

__all__ = ["describe", "fields", "fmt"]


def fmt(v: Any) -> str:
    """A number the way the command and the console print it."""
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"
    return str(v)


def fields(ev: Event) -> dict[str, str]:  # noqa: PLR0911 - one per event type
    """The few fields worth a glance, by event type, formatted."""
    if isinstance(ev, Loss):
        return {"loss" if ev.split == "train" else f"{ev.split}_loss": fmt(ev.value)}
    if isinstance(ev, OptimizerStepped):
        return {k: fmt(v) for k, v in (("lr", ev.lr), ("grad_norm", ev.grad_norm)) if v is not None}
    if isinstance(ev, StepEnded) and ev.duration_s is not None:
        return {"time": f"{ev.duration_s * 1e3:.1f}ms"}
    if isinstance(ev, EvalEnded):
        return {f"eval_{k}": fmt(v) for k, v in ev.metrics.items()}
    if isinstance(ev, Scalars):
        return {k: fmt(v) for k, v in ev.values.items()}
    if isinstance(ev, MemorySample):
        out = {}
        if ev.rss_mb is not None:
            out["rss"] = f"{ev.rss_mb:.0f}MB"
        if ev.allocated_mb is not None:
            out["cuda"] = f"{ev.allocated_mb:.0f}MB"
        return out
    return {}


def describe(ev: Event) -> str:  # noqa: PLR0911 - one per event type
    """One readable line for an event (replay output, tail, the console's notices)."""
    if isinstance(ev, DivergenceDetected):
        return (
            f"DivergenceDetected at step {ev.step}: {ev.metric} {fmt(ev.value)} "
            f"(baseline {fmt(ev.baseline)}) {ev.reason}"
        )
    if isinstance(ev, MemoryLeakSuspected):
        return (
            f"MemoryLeakSuspected at step {ev.step}: {ev.metric} "
            f"+{ev.rate_mb_per_step:.3g} MB/step over {ev.window} steps"
        )
    if isinstance(ev, StopRequested):
        return (
            f"{'abort' if ev.abort else 'stop'} requested at step {ev.step} by "
            f"{ev.source}: {ev.reason}"
        )
    if isinstance(ev, RunStarted):
        total = f", {ev.total_steps} steps" if ev.total_steps else ""
        resumed = (
            f", resumed from step {ev.resumed_from_step}"
            if ev.resumed_from_step is not None
            else ""
        )
        return f"run started{total}{resumed}"
    if isinstance(ev, RunEnded):
        return f"run {ev.status}" + (f": {ev.reason}" if ev.reason else "")
    if isinstance(ev, CheckpointSaved | CheckpointLoaded):
        return f"{type(ev).__name__} at step {ev.step}: {ev.path}"
    body = "  ".join(f"{k} {v}" for k, v in fields(ev).items())
    return f"{type(ev).__name__} at step {ev.step}" + (f": {body}" if body else "")
