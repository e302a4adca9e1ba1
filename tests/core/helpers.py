"""What the core's tests share: the stats identity, waiting on a condition, a hung subscriber."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from eventbus import BusStats, Event


def identity(st: BusStats) -> None:
    """Every subscriber: published == delivered + failed + dropped + queued, exactly."""
    for name, s in st.subscribers.items():
        assert s.published == s.delivered + s.failed + s.dropped + s.queued, (name, s)


def until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Wait for a condition another thread makes true (a deadline, not a sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.002)
    return cond()


class Hangs:
    """A lossless sync subscriber that blocks in its first batch until released."""

    policy = "block"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def on_events(self, batch: list[Event]) -> None:
        self.entered.set()
        self.release.wait(60)
