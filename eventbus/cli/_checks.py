"""Checks of the event fields the commands read: a log is input, not trusted.

`codec.decode` rebuilds events by their declared types; these checks make sure the values the
summary, plot and tail use are what they claim, so a bad one is reported at its line.
"""

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
    RankUnresponsive,
    RunEnded,
    RunStarted,
    Scalars,
    StallDetected,
    StallEnded,
    StepEnded,
    StopRequested,
    StragglerDetected,
)

__all__ = ["MEMORY_FIELDS", "as_float", "check_event"]

MEMORY_FIELDS = ("rss_mb", "allocated_mb", "reserved_mb", "rss_peak_mb", "peak_allocated_mb")


def check_event(ev: Event) -> None:
    """Raise `ValueError` naming the field if a field the commands read has the wrong type."""
    if isinstance(ev, Loss):
        _numbers(ev, "value")
        _text(ev, "split", optional=False)
    elif isinstance(ev, OptimizerStepped):
        _numbers(ev, "lr", "grad_norm", "duration_s")
    elif isinstance(ev, StepEnded):
        _numbers(ev, "duration_s")
        _integers(ev, "samples", "tokens")
    elif isinstance(ev, EvalEnded):
        _numbers(ev, "duration_s")
        _mapping(ev, "metrics")
    elif isinstance(ev, Scalars):
        _mapping(ev, "values")
    elif isinstance(ev, MemorySample):
        _numbers(ev, *MEMORY_FIELDS)
    elif isinstance(ev, DivergenceDetected):
        _text(ev, "metric", "reason", optional=False)
        _numbers(ev, "value", "baseline", optional=False)
    elif isinstance(ev, MemoryLeakSuspected):
        _text(ev, "metric", optional=False)
        _numbers(ev, "rate_mb_per_step", optional=False)
        _integers(ev, "window")
    elif isinstance(ev, StopRequested):
        _text(ev, "reason", optional=False)
        _text(ev, "source")
        if type(ev.abort) is not bool:
            raise _bad(ev, "abort", "true or false")
    elif isinstance(ev, RunStarted):
        _integers(ev, "total_steps", "resumed_from_step")
    elif isinstance(ev, RunEnded):
        _text(ev, "status", optional=False)
        _text(ev, "reason")
    elif isinstance(ev, CheckpointSaved | CheckpointLoaded):
        _text(ev, "path", optional=False)
    elif isinstance(ev, StallDetected):
        _numbers(ev, "waited_s", "bound_s", optional=False)
        _text(ev, "path")
    elif isinstance(ev, StallEnded):
        _numbers(ev, "stalled_s", optional=False)
    elif isinstance(ev, StragglerDetected):
        _integers(ev, "straggler")
        _numbers(ev, "relative", "seconds", "fastest_s", optional=False)
        _numbers(ev, "history")
        _text(ev, "phase", optional=False)
    elif isinstance(ev, RankUnresponsive):
        _integers(ev, "missing_rank")
        _numbers(ev, "waited_s", optional=False)
        _text(ev, "source", optional=False)


def as_float(v: Any) -> float | None:
    """`v` as a float if it is a JSON number within float range, else None."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        return None
    try:
        return float(v)
    except OverflowError:
        return None


def _numbers(ev: Event, *names: str, optional: bool = True) -> None:
    for name in names:
        v = getattr(ev, name)
        if not (optional and v is None) and as_float(v) is None:
            raise _bad(ev, name, "a number" + (" or null" if optional else ""))


def _integers(ev: Event, *names: str) -> None:
    for name in names:
        v = getattr(ev, name)
        if v is not None and type(v) is not int:
            raise _bad(ev, name, "an integer or null")


def _text(ev: Event, *names: str, optional: bool = True) -> None:
    for name in names:
        v = getattr(ev, name)
        if not (isinstance(v, str) or (optional and v is None)):
            raise _bad(ev, name, "a string" + (" or null" if optional else ""))


def _mapping(ev: Event, name: str) -> None:
    v = getattr(ev, name)
    if not isinstance(v, dict):
        raise _bad(ev, name, "an object of numbers")
    for k, x in v.items():
        if x is not None and as_float(x) is None:
            raise ValueError(f"{type(ev).__name__}.{name}[{k!r}] must be a number, got {_short(x)}")


def _bad(ev: Event, name: str, what: str) -> ValueError:
    return ValueError(f"{type(ev).__name__}.{name} must be {what}, got {_short(getattr(ev, name))}")


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."
