"""Replay recorded JSONL logs through subscribers, offline and deterministically.

Events are rebuilt through the type registry (a user type must be defined, i.e. its module
imported by the caller; a log never makes us import anything) and keep their recorded
ts/seq/rank/step. Several files (one per rank) are interleaved by step, then ts, each file
keeping its own order. A small driver stands in for the bus and calls subscribers through
the bus's own delivery code (`eventbus.core.delivery`): the same hooks, filters, failure
counting and disabling. What they publish is delivered to the others and returned.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import deque
from collections.abc import Iterable
from typing import Any

import anyio

from eventbus.control import Control
from eventbus.core.delivery import Delivery
from eventbus.core.subscriber import State, check_callable, describe, event_types, unique_name
from eventbus.events import Event
from eventbus.log import get_logger
from eventbus.logformat import PathLike, log_files, log_ranks, read_log, write_events
from eventbus.stats import BusStats

__all__ = ["FEEDBACK_LIMIT", "Replayer", "replay"]

FEEDBACK_LIMIT = 65536  # events subscribers may publish while one batch of the log is fed


# -- the driver ---------------------------------------------------------------------------


class Replayer:
    """Feeds recorded events through subscribers in the caller's order; see `replay`.

    It is what the subscribers get as `bus` (`eventbus.core.BusHandle`): `publish`,
    `control`, `rank`, `world_size`.
    """

    def __init__(
        self,
        subscribers: Any,
        *,
        batch_size: int = 256,
        rank: int = 0,
        world_size: int = 1,
        max_consecutive_failures: int | None = 100,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        subs = (
            [subscribers]
            if (hasattr(subscribers, "on_events") or callable(subscribers))
            else list(subscribers)
        )
        names: set[str] = set()
        self._subs: list[Delivery] = []
        for s in subs:
            check_callable(  # what every event would fail on: refused here
                s,
                "replay()",
                "subscribers: objects with on_events(batch) or functions of one event",
            )
            self._subs.append(
                Delivery(
                    s,
                    name=unique_name(describe(s), names),
                    events=event_types(getattr(s, "events", None)),
                    max_consecutive_failures=max_consecutive_failures,
                )
            )
        self.batch_size = batch_size
        self.rank = rank
        self.local_rank = rank
        self.world_size = world_size
        self.control = Control(self.publish)
        self.published: list[Event] = []
        self._pending: deque[Event] = deque()
        self._seq = itertools.count()
        self._clock: int | None = None
        self._routed = 0
        self._running = False
        self._budget = FEEDBACK_LIMIT  # events subscribers may publish per batch of the log
        self.feedback_dropped = 0

    # -- what subscribers see as `bus` ------------------------------------------------------

    def publish(self, ev: Event) -> None:
        """Stamp (ts = the replay clock if unset, seq, rank) and deliver after the current batch."""
        if not isinstance(ev, Event):
            raise TypeError(f"publish() takes an eventbus Event, got {type(ev).__qualname__}")
        if self._budget <= 0:  # a subscriber feeding on its own output: bounded, counted
            self.feedback_dropped += 1
            if self.feedback_dropped == 1:
                get_logger().error(
                    "feedback storm in replay: subscribers published more than "
                    f"{FEEDBACK_LIMIT} events for one batch of the log; "
                    "dropping the rest",
                    event_type=type(ev).__name__,
                )
            return
        self._budget -= 1
        if ev.ts is None:
            ev.ts = self._clock
        ev.seq = next(self._seq)
        ev.rank = self.rank
        self.published.append(ev)
        self._pending.append(ev)

    async def apublish(self, ev: Event) -> None:
        """`publish` for async subscribers."""
        self.publish(ev)

    def flush(self, timeout: float | None = None) -> bool:
        """Nothing to wait for: a replay delivers each batch before the next."""
        return True

    @property
    def should_stop(self) -> bool:
        """True once a subscriber asked to stop (the replay still feeds the whole log)."""
        return self.control.should_stop

    @property
    def running(self) -> bool:
        """True while the replay runs."""
        return self._running

    def stats(self) -> BusStats:
        """Counters in the bus's shape: events routed, per-subscriber delivered/failed."""
        return BusStats(
            published=self._routed,
            rejected=0,
            inbox_size=0,
            inbox_high_water=0,
            blocked_s=0.0,
            wakeups=0,
            subscribers={d.name: d.stats() for d in self._subs},
            feedback_dropped=self.feedback_dropped,
        )

    # -- running ----------------------------------------------------------------------------

    def run(self, events: Iterable[Event]) -> list[Event]:
        """Feed `events` through the subscribers; returns the events they published."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            anyio.run(self._main, events, backend="asyncio")
            return self.published
        # Called from async code (a notebook): run the driver on a thread of its own.
        error: list[BaseException] = []

        def target() -> None:
            try:
                anyio.run(self._main, events, backend="asyncio")
            except BaseException as e:
                error.append(e)

        t = threading.Thread(target=target, name="eventbus-replay")
        t.start()
        t.join()
        if error:
            raise error[0]
        return self.published

    async def _main(self, events: Iterable[Event]) -> None:
        self._running = True
        try:
            for d in self._subs:
                d.state = State.RUNNING
                if not await d.call_hook("on_start", self):
                    d.disable("on_start raised")
            batch: list[Event] = []
            for ev in events:
                batch.append(ev)
                if len(batch) >= self.batch_size:
                    await self._route(batch)
                    batch = []
            if batch:
                await self._route(batch)
        finally:
            # Newest first, like the bus; what one publishes while closing reaches the rest.
            for d in reversed(self._subs):
                if d.state in (State.RUNNING, State.DISABLED):
                    await d.call_hook("on_close")
                    d.state = State.CLOSED
                    await self._route([])
                d.worker.stop()
            self._running = False

    async def _route(self, batch: list[Event]) -> None:
        self._budget = FEEDBACK_LIMIT
        while True:
            if batch:
                self._clock = next((e.ts for e in reversed(batch) if e.ts is not None), self._clock)
                self._routed += len(batch)
                for d in self._subs:
                    mine = [e for e in batch if isinstance(e, d.events)]
                    if not mine:
                        continue
                    if d.state is State.RUNNING:
                        d.routed += len(mine)
                        await d.deliver(mine)
                    else:
                        d.inbox_dropped += len(mine)  # disabled or closed: counted, not handed
            if not self._pending:
                return
            batch = list(self._pending)
            self._pending.clear()


def replay(
    path_or_paths: PathLike | Iterable[PathLike],
    subscribers: Any,
    *,
    out: PathLike | None = None,
    batch_size: int = 256,
) -> list[Event]:
    """Feed recorded logs through `subscribers`; return (and write to `out`) what they publish.

    `subscribers`: one subscriber or a list (objects with `on_events`, or functions of one
    event). Published events get `ts` from the replay clock (the recorded time of the batch
    being fed), so they line up with the log. A stop request is recorded, not obeyed: the
    whole log is fed.
    """
    files = log_files(path_or_paths)
    rank = log_ranks(files)[0]
    r = Replayer(subscribers, batch_size=batch_size, rank=rank)
    published = r.run(e for e in read_log(files) if isinstance(e, Event))
    if out is not None:
        write_events(out, published, replayed_from=[str(p) for p in files])
    return published
