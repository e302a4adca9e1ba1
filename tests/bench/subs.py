"""Steps and subscribers of known cost for the bench tests (module level: the sidecar imports
them by name)."""

from __future__ import annotations

import threading
import time
from typing import Any

from eventbus.events import Event, Loss

STEP_MS = 2.0


def spin_cpu(ms: float) -> None:
    """Burn `ms` of this thread's CPU in a Python loop (holds the GIL throughout)."""
    end = time.thread_time() + ms / 1e3
    while time.thread_time() < end:
        pass


def cpu_step(step: int, bus: Any) -> None:
    """A step of 2 ms of Python CPU (as a Python-heavy step is) that publishes one Loss."""
    spin_cpu(STEP_MS)
    bus.publish(Loss(step=step, value=1.0))


def heavy_step(step: int, bus: Any) -> None:
    """A step of 4 ms of Python CPU that publishes one Loss."""
    spin_cpu(2 * STEP_MS)
    bus.publish(Loss(step=step, value=1.0))


def quick_step(step: int, bus: Any) -> None:
    """A step of almost nothing, publishing one Loss."""
    bus.publish(Loss(step=step, value=float(step)))


def raising_step(step: int, bus: Any) -> None:
    """Fails at step 3."""
    if step == 3:
        raise ZeroDivisionError("planted at step 3")
    bus.publish(Loss(step=step, value=1.0))


class Sleeper:
    """Sleeps `ms` per Loss (the GIL released): a slow callback that costs no CPU."""

    events = (Loss,)

    def __init__(self, ms: float = 5.0) -> None:
        self.ms = ms

    def on_events(self, batch: list[Event]) -> None:
        for _ in batch:
            time.sleep(self.ms / 1e3)


class Spinner:
    """`ms` of pure-Python CPU per Loss: a CPU-bound analysis holding the GIL."""

    events = (Loss,)

    def __init__(self, ms: float = 3.0) -> None:
        self.ms = ms

    def on_events(self, batch: list[Event]) -> None:
        for _ in batch:
            spin_cpu(self.ms)


class Locked:
    """Holds a lock, so it cannot be pickled for the sidecar."""

    events = (Loss,)

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen = 0

    def on_events(self, batch: list[Event]) -> None:
        self.seen += len(batch)


class Failing:
    """Raises on every event."""

    events = (Loss,)

    def on_events(self, batch: list[Event]) -> None:
        raise RuntimeError("planted failure")
