"""`RunView`: what `eventbus ctl status` says about the run, kept from the events themselves.

Updated on the bus loop from the newest events (the server's queue keeps only those), read on
the server's thread; a lock keeps the two apart. Steps per second come from the events'
publish times over the last `window_s` seconds, so a stuck loop shows its rate falling.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Any

from eventbus.events import CheckpointSaved, Event, Loss, RunEnded, RunStarted
from eventbus.steps import known_total

__all__ = ["CHECKPOINTS", "RunView"]

CHECKPOINTS = 16  # the newest CheckpointSaved kept, for `save --wait`


class RunView:
    """Step, loss, rate, ETA, last checkpoint and how the run ended, from its events."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_ns = int(window_s * 1e9)
        self._lock = threading.Lock()
        self._step: int | None = None
        self._loss: float | str | None = None
        self._total: int | None = None
        self._started_ns: int | None = None
        self._last_ns: int | None = None  # publish time of the newest event with a step
        self._ended: str | None = None
        self._checkpoints: deque[dict[str, Any]] = deque(maxlen=CHECKPOINTS)  # newest last
        self._rate: deque[tuple[int, int]] = deque(maxlen=4096)  # (ts ns, step)

    def update(self, batch: list[Event]) -> None:
        """Take in a batch of events (on the bus loop)."""
        with self._lock:
            for ev in batch:
                self._take(ev)
            if self._last_ns is not None and self._step is not None:
                rate = self._rate
                if not rate or rate[-1][1] < self._step:
                    rate.append((self._last_ns, self._step))
                while rate and rate[0][0] < self._last_ns - self.window_ns and len(rate) > 2:
                    rate.popleft()

    def _take(self, ev: Event) -> None:
        if isinstance(ev, RunStarted):
            self._total = known_total(ev.total_steps)  # 0 or -1: unknown, no ETA
            self._step = None  # a new run on the same bus counts from its own steps
            self._started_ns = ev.ts
            self._ended = None
            self._rate.clear()
            if ev.ts is not None:  # the first rate: from the start to the first steps seen
                self._rate.append((ev.ts, ev.resumed_from_step or 0))
            return
        if isinstance(ev, RunEnded):
            self._ended = ev.status
            return
        if isinstance(ev, CheckpointSaved):
            self._checkpoints.append({"step": ev.step, "path": ev.path, "seq": ev.seq})
        elif isinstance(ev, Loss) and ev.split == "train":
            self._loss = _number(ev.value)
        step = ev.step
        if isinstance(step, int) and (self._step is None or step >= self._step):
            self._step = step
            if ev.ts is not None:
                self._last_ns = ev.ts

    @property
    def ended(self) -> str | None:
        """How the run ended ("completed", "stopped", ...), or None while it runs."""
        return self._ended

    @property
    def step(self) -> int | None:
        """The newest step seen."""
        return self._step

    def snapshot(self) -> dict[str, Any]:
        """The status fields, ready for JSON."""
        now = time.time_ns()
        with self._lock:
            rate = self._steps_per_s()
            step, total = self._step, self._total
            eta = None
            if rate and total is not None and step is not None and self._ended is None:
                eta = max(0.0, (total - step) / rate)  # an ended run has none, however far
            return {
                "step": step,
                "total_steps": total,
                "loss": self._loss,
                "steps_per_s": rate,
                "eta_s": eta,
                "elapsed_s": _seconds(now - self._started_ns) if self._started_ns else None,
                "last_step_s_ago": _seconds(now - self._last_ns) if self._last_ns else None,
                "run": "running" if self._ended is None else self._ended,
                "last_checkpoint": self._checkpoints[-1] if self._checkpoints else None,
            }

    def checkpoint_after(self, seq: int) -> dict[str, Any] | None:
        """The first checkpoint published after the event `seq` (of those kept), or None."""
        with self._lock:
            return next((dict(c) for c in self._checkpoints if c["seq"] > seq), None)

    def _steps_per_s(self) -> float | None:
        if len(self._rate) < 2:
            return None
        (t0, s0), (t1, s1) = self._rate[0], self._rate[-1]
        if t1 <= t0 or s1 <= s0:
            return None
        return round((s1 - s0) / ((t1 - t0) / 1e9), 4)


def _seconds(ns: int) -> float:
    return round(max(0, ns) / 1e9, 3)


def _number(v: Any) -> float | str | None:
    """A loss as a float; "nan", "inf" or "-inf" as text (JSON has no NaN); None if not one."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else str(f)
