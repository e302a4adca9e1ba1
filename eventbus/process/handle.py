"""`SidecarHandle`: the `bus` a sidecar subscriber gets. What it publishes, and the stop, abort
and save requests of its `control`, are held for the parent (sent with the next status),
which stamps and routes them like any subscriber's; bounded, so a storm is dropped, counted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

from eventbus.control import Control
from eventbus.core.inbox import publisher
from eventbus.core.sizing import not_an_event, published_twice
from eventbus.core.worker import worker_name
from eventbus.events import Event, StopRequested
from eventbus.log import RateLimiter, get_logger
from eventbus.process import wire
from eventbus.stats import BusStats

__all__ = ["HELD", "SidecarHandle"]

HELD = 32_768  # events the sidecar's subscribers published, held for the parent at most
_storm_log = RateLimiter(10.0)


class SidecarHandle:
    """What a sidecar subscriber gets as `bus` (a `BusHandle`): what it publishes and the
    stop/abort requests of its `control` go to the parent bus, which stamps and routes them."""

    def __init__(self, info: wire.StartInfo, wake: threading.Event) -> None:
        self.rank = info["rank"]
        self.world_size = info["world_size"]
        self.local_rank = info["local_rank"]
        self.rebuilt: set[str] = set()  # subscribers rebuilt after a death, by name
        self.since_ns = info["since_ns"]  # the bus's first sidecar started (`rebuilt_on`)
        self.parent_stats: BusStats | None = None  # sent with the close
        self.host_stats: Callable[[], BusStats] = lambda: BusStats(0, 0, 0, 0, 0.0, 0)
        self._wake = wake
        self._lock = threading.Lock()
        self._published: list[Event] = []
        self.dropped = 0  # published beyond HELD before the parent took them: a storm
        self.closing = False  # the sidecar's own close began: nothing can take an event now
        self.late = 0  # published after that: counted, not sent
        self._requests: list[StopRequested] = []
        # The one Control class: the StopRequested events it publishes are the requests the
        # parent replays on its own control (which publishes them on the bus). A relay: the
        # parent's control holds a save pending until its loop's save_done(), not this one.
        self.control = Control(self._request, relay=True)

    def publish(self, ev: Event) -> None:
        """Queue `ev` for the parent bus (sent within a status interval)."""
        if not isinstance(ev, Event):
            raise not_an_event(ev)
        if ev.seq is not None:  # as the training process's bus would say, to the subscriber
            raise published_twice(ev)
        if ev.ts is None:
            ev.ts = time.time_ns()
        with self._lock:
            if self.closing:  # the parent's subscribers closed, this sidecar's are closing
                self.late += 1
                return
            if len(self._published) >= HELD:  # a storm: bounded, as a bus side's share is
                self.dropped += 1
                drop = True
            else:
                self._published.append(ev)
                drop = False
        self._wake.set()
        if drop:
            ok, held = _storm_log.allow("storm")
            if ok:
                get_logger().error(
                    "feedback storm in the sidecar: a subscriber publishes faster than the "
                    "training process takes its events; dropped",
                    event_type=type(ev).__name__,
                    dropped=self.dropped,
                    suppressed_since_last=held,
                )

    @property
    def restarted(self) -> bool:
        """True for a subscriber rebuilt after its sidecar died (asked from its own hooks):
        it appends to its files and resumes nothing."""
        return (worker_name() or publisher.get()) in self.rebuilt

    def _request(self, ev: StopRequested) -> None:
        if ev.source is None:  # the asking subscriber: its worker thread, or its loop task
            ev.source = worker_name() or publisher.get()
        with self._lock:
            self._requests.append(ev)
        self._wake.set()

    @property
    def should_stop(self) -> bool:
        """True once a subscriber here requested a stop or an abort."""
        return self.control.should_stop

    def stats(self) -> BusStats:
        """The parent's counters as sent with the close (in-process subscribers final by then)
        with this sidecar's own subscribers' counters (for a writer's last record)."""
        here = self.host_stats()
        if self.parent_stats is None:
            return here
        both = {**self.parent_stats.subscribers, **here.subscribers}
        return replace(self.parent_stats, subscribers=both)

    def take(self) -> tuple[list[Event], list[StopRequested]]:
        """What was published and requested since the last call."""
        with self._lock:
            out = self._published, self._requests
            self._published, self._requests = [], []
        return out
