"""`StragglerDetector`: which rank is slow, from the phase times every rank publishes.

    every rank, bus loop: BatchLoaded / ForwardEnded / BackwardEnded / OptimizerStepped
      -> the phase's host time (its duration_s, else the time since the step's previous
         boundary) -> medians over `every` steps -> link.put(("w", window), medians)
    rank 0, link thread: once every rank sent a window -> StragglerRule -> StragglerDetected

In a data-parallel job every rank's step lasts as long as the slowest rank's: the whole step
names no one, and the phase that holds the collective (DDP's backward) is longest on the ranks
that wait. So the rule scores the phases a rank spends on its own work before it waits (all but
`wait_phases`): there the slow rank stands out, relative to the fastest rank and to its own
history. Host time: on a GPU a phase's host time is its launch time unless the loop waits for
the device in it. With one rank, it does nothing.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any, ClassVar

from eventbus.events import (
    BackwardEnded,
    BatchLoaded,
    Event,
    ForwardEnded,
    OptimizerStepped,
    StepEnded,
    StepStarted,
    StragglerDetected,
)
from eventbus.log import get_logger
from eventbus.monitors._rank_link import Key
from eventbus.monitors._rank_monitor import RankMonitor
from eventbus.monitors._straggler_rule import StragglerRule

__all__ = ["PHASE_OF", "StragglerDetector"]

PHASE_OF: dict[type[Event], str] = {
    BatchLoaded: "data",
    ForwardEnded: "forward",
    BackwardEnded: "backward",
    OptimizerStepped: "optimizer",
}


class StragglerDetector(RankMonitor):
    """Publishes, on rank 0, `StragglerDetected` for a rank whose own work (its phases but
    `wait_phases`) takes `threshold` x the fastest rank's, `patience` windows of `every` steps
    in a row."""

    events: ClassVar[tuple[type[Event], ...]] = (StepStarted, StepEnded, *PHASE_OF)
    name = "stragglers"
    silent = "a rank sent no step times for too long: it may be dead or hung"

    def __init__(
        self,
        *,
        every: int = 10,
        threshold: float = 1.5,
        min_excess_s: float = 0.002,
        patience: int = 3,
        wait_phases: Iterable[str] = ("backward",),
        timeout_s: float = 300.0,
        close_wait_s: float = 5.0,
        every_s: float = 0.1,
        channel: str = "stragglers",
    ) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1 (steps a window); got {every!r}")
        self.wait_phases = frozenset(wait_phases)
        unknown = self.wait_phases - set(PHASE_OF.values())
        if unknown:
            known = ", ".join(PHASE_OF.values())
            raise ValueError(f"unknown wait_phases {sorted(unknown)}; the phases are {known}")
        self.every = every
        self.rule = StragglerRule(threshold=threshold, min_excess_s=min_excess_s, patience=patience)
        super().__init__(channel, every_s=every_s, timeout_s=timeout_s, close_wait_s=close_wait_s)
        self.detected = 0  # StragglerDetected published (rank 0)
        self._window: int | None = None  # the window being filled
        self._times: dict[str, list[float]] = {}
        self._last_step: int | None = None
        self._prev_ts: int | None = None  # the step's previous boundary (ns)
        self._ended = 0  # StepEnded seen (windows of a loop without step numbers)

    async def on_events(self, batch: list[Event]) -> None:
        """Note each phase's time (bus loop); a finished window goes to rank 0."""
        if not self._on:
            return
        for ev in batch:
            if isinstance(ev, StepStarted):
                self._enter(ev)
                self._prev_ts = ev.ts
            elif isinstance(ev, StepEnded):
                self._ended += 1
                self._prev_ts = None
                if ev.step is not None and ev.step % self.every == 0:
                    self._flush()
            else:
                phase = PHASE_OF.get(type(ev))
                if phase is None:
                    continue
                self._enter(ev)
                secs = getattr(ev, "device_s", None)  # CUDA time, when the phase timed it
                if secs is None:
                    secs = getattr(ev, "duration_s", None)
                if secs is None and ev.ts is not None and self._prev_ts is not None:
                    secs = (ev.ts - self._prev_ts) / 1e9
                self._prev_ts = ev.ts
                if secs is not None and phase not in self.wait_phases:
                    self._times.setdefault(phase, []).append(float(secs))

    def on_close(self) -> None:
        """Send the last window; rank 0 scores what every rank sent."""
        if not self._on:
            return
        self._flush()
        self._close_link()

    def stats(self) -> dict[str, Any]:
        """What crossed ranks and what was lost (the link's counters, on this rank)."""
        return {**self.link.stats(), "windows": self.rule.windows, "detected": self.detected}

    # -- the bus loop ------------------------------------------------------------------------

    def _enter(self, ev: Event) -> None:
        """The window of this event's step; a new one sends the one before."""
        step = ev.step
        window = (step - 1) // self.every if step is not None else self._ended // self.every
        if self._window is not None and window != self._window:
            self._flush()
        self._window = window
        if step is not None:
            self._last_step = step

    def _flush(self) -> None:
        if self._window is None or not self._times:
            self._times.clear()
            return
        medians = {p: statistics.median(ts) for p, ts in self._times.items()}
        self.link.put(("w", self._window), {"step": self._last_step, "t": medians})
        self._times = {}
        self._window = None

    # -- rank 0, the link's thread -----------------------------------------------------------

    def _ready(self, key: Key, parts: dict[int, Any], missing: tuple[int, ...]) -> None:
        times = {r: {p: float(s) for p, s in part["t"].items()} for r, part in parts.items()}
        steps = [part["step"] for part in parts.values() if part.get("step") is not None]
        step = max(steps) if steps else None
        for s in self.rule.window(times):
            self.detected += 1
            get_logger().warning(
                "a rank is slower than the others",
                straggler=s.rank,
                phase=s.phase,
                relative=s.relative,
                history=s.history,
                step=step,
            )
            if self._bus is not None:
                self._bus.publish(
                    StragglerDetected(
                        step=step,
                        straggler=s.rank,
                        phase=s.phase,
                        relative=s.relative,
                        history=s.history,
                        seconds=round(s.seconds, 6),
                        fastest_s=round(s.fastest_s, 6),
                        scores={str(r): x for r, x in s.scores.items()},
                    )
                )
