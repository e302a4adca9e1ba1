"""What the bus costs the training process: time inside `publish`, per step, and bus-side CPU.

    publish (any thread)  --> PublishClock: one clock read more than the stamp's, an add
    bus thread, each drain --> CostMeter.tick: a `BusCost` event every `every` steps
    stats() / close        --> CostMeter.stats: `CostStats`, and the totals `RunEnded` carries

Steps are told apart by the events' `step` field: the first event of a higher step than any
before closes the last step's totals (its publish time and its wall time, first event to first
event). Two threads publishing at once may lose an update of the totals: a measurement, not a
count anything depends on.
"""

from __future__ import annotations

import dataclasses
import math
import time
import types
from collections import deque
from collections.abc import Callable, Coroutine, Generator, Iterable, Mapping
from itertools import pairwise
from typing import TYPE_CHECKING, Any, Protocol

from eventbus.events import BusCost, Event, RunEnded
from eventbus.stats import CostStats

if TYPE_CHECKING:
    from eventbus.core.checkpoint import Remotes
    from eventbus.core.delivery import Delivery

__all__ = ["CostMeter", "CpuMeter", "PublishClock", "cpu_of", "cpu_timed", "totals"]

RECENT = 4096  # steps kept for the per-step quantiles
MIN_GAP_S = 1.0  # at most one BusCost a second: a loop of 100k tiny steps/s pays no more
_NO_STEP = -(1 << 62)


class PublishClock:
    """Written by `publish`: time spent inside it, in total and where each step began.

    On the first event of a higher step, `roll` appends a mark (the publish time so far, the
    clock); the per-step figures are differences of marks, taken when asked for."""

    __slots__ = ("first", "marks", "ns", "step", "steps")

    def __init__(self) -> None:
        self.ns = 0  # time inside publish, in total
        self.step = _NO_STEP  # the highest step seen
        self.steps = 0  # steps seen (each a higher `step` than any before)
        self.first: tuple[int, int] | None = None  # (`ns`, clock) when the first step began
        self.marks: deque[tuple[int, int]] = deque(maxlen=RECENT + 1)  # the same, recent steps

    @property
    def last(self) -> int | None:
        """The highest step published (None before the first)."""
        return None if self.step == _NO_STEP else self.step

    def roll(self, step: int, now: int) -> None:
        """The first event of `step`, a higher step than any before, at `now` (`time_ns`)."""
        self.step = step
        if self.first is None:
            self.first = (self.ns, now)
        self.marks.append((self.ns, now))
        self.steps += 1


def _quantile(sorted_values: list[int], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))] / 1e6


class CostMeter:
    """Turns the clock, the bus thread's CPU and the subscribers' CPU into reports."""

    def __init__(
        self,
        clock: PublishClock,
        every: int | None,
        subscriber_cpu: Callable[[], Mapping[str, float]] = dict,
        min_gap_s: float | None = None,
    ) -> None:
        self.clock = clock
        self.every = every  # steps between `BusCost` events; None: none
        self.subscriber_cpu = subscriber_cpu  # each subscriber's CPU seconds, by name
        self.min_gap_s = MIN_GAP_S if min_gap_s is None else min_gap_s
        self.published: Callable[[], int] = int  # events published (set by the bus loop)
        self.bus_cpu_s = 0.0  # the bus thread's CPU, as it read it at its last wake
        self._reported = _NO_STEP
        self._last = -math.inf  # when the last report went out (monotonic)

    def sample(self) -> None:
        """On the bus thread: read its CPU time. (Reading another thread's clock races with
        its exit: `pthread_getcpuclockid` on a finished thread crashes the process.)"""
        self.bus_cpu_s = time.thread_time()

    def stats(self) -> CostStats:
        """A snapshot of the totals."""
        c = self.clock
        marks = list(c.marks)  # a copy: publishers append while we read (`first` is set first)
        steps, first = c.steps, c.first
        closed = list(pairwise(marks))  # each closed step: its mark and the next
        pub = sorted(b[0] - a[0] for a, b in closed)
        wall = sorted(b[1] - a[1] for a, b in closed)
        span = marks[-1][1] - first[1] if marks and first else 0  # first event to first event
        bus = self.bus_cpu_s
        return CostStats(
            steps=steps,
            publish_calls=self.published(),
            publish_s=c.ns / 1e9,
            publish_ms_p50=_quantile(pub, 0.5) if pub else None,
            publish_ms_p99=_quantile(pub, 0.99) if pub else None,
            step_ms_p50=_quantile(wall, 0.5) if wall else None,
            share=(marks[-1][0] - first[0]) / span if span > 0 and first else None,
            bus_cpu_s=bus,
            bus_cpu_ms_per_step=bus * 1e3 / steps if steps else None,
        )

    def event(self) -> BusCost:
        """The totals as an event, at the last step seen."""
        s = dataclasses.asdict(self.stats())
        return BusCost(
            step=self.clock.last,
            subscriber_cpu_s=dict(self.subscriber_cpu()),
            **{k: s[k] for k in _TOTALS if k in s},
        )

    def tick(self, publish: Callable[[Event], None]) -> None:
        """After a drain, on the bus thread: read its CPU; publish a `BusCost` when the step
        passed a multiple of `every` (at most one a second)."""
        self.sample()
        step = self.clock.step
        if self.every is None or step == _NO_STEP:
            return
        passed = step // self.every  # multiples of `every` passed
        now = time.monotonic()
        if self._reported == _NO_STEP:  # the first step seen: no report for steps before it
            self._reported = passed
        elif passed > self._reported and now - self._last >= self.min_gap_s:
            self._reported, self._last = passed, now
            publish(self.event())

    def fill(self, ev: RunEnded) -> None:
        """Give a `RunEnded` that has none the totals (on the bus thread, before delivery)."""
        if ev.cost is None:
            ev.cost = totals(self.event())


def cpu_of(deliveries: Iterable[Delivery], remotes: Remotes | None) -> dict[str, float]:
    """Each subscriber's CPU seconds, by name (cheap: no stats snapshot)."""
    out = {d.name: d.cpu_s for d in deliveries}
    if remotes is not None:
        out.update(remotes.cpu_s())
    return out


_TOTALS = tuple(f for f in BusCost.__dataclass_fields__ if f not in Event.__dataclass_fields__)


def totals(b: BusCost) -> dict[str, Any]:
    """A `BusCost`'s figures as plain data: what `RunEnded.cost` holds."""
    return {k: getattr(b, k) for k in _TOTALS}


@types.coroutine
def cpu_timed(coro: Coroutine[Any, Any, Any], meter: CpuMeter) -> Generator[Any, Any, Any]:
    """Await `coro`, adding this thread's CPU time during each of its steps to `meter.cpu_ns`:
    the time it spends suspended (other tasks' work) is not its own."""
    clock = time.thread_time_ns
    send, throw = coro.send, coro.throw
    value: Any = None
    error: BaseException | None = None
    while True:
        t0 = clock()
        try:
            yielded = send(value) if error is None else throw(error)
        except StopIteration as e:
            meter.cpu_ns += clock() - t0
            return e.value
        except BaseException:
            meter.cpu_ns += clock() - t0
            raise
        meter.cpu_ns += clock() - t0
        try:
            value, error = (yield yielded), None
        except BaseException as e:  # a cancellation or a close: the coroutine handles it
            value, error = None, e


class CpuMeter(Protocol):
    """Something that adds up CPU nanoseconds."""

    cpu_ns: int
