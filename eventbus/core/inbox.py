"""`Inbox`: the thread-safe entry between publishers and the bus loop.

A deque (appends and pops are atomic in CPython) bounded in events and in bytes. `put` is the
publisher's whole cost: a length check and an append; it never wakes the loop unless the inbox
nears its bound. When full, a publisher on the training side waits (a lossless subscriber is
attached: backpressure, by choice) or drops and counts; a publisher on the bus side (a
subscriber publishing) never waits, and may fill at most half the inbox, so a subscriber that
publishes in a loop (a feedback storm) cannot freeze training or grow memory: the excess is
dropped, counted and reported. Control items (attach, detach, flush) travel in the same deque,
so they take effect in order with the events around them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import anyio

from eventbus._capture_intake import INTAKE, intake_for
from eventbus.core.worker import thread_state, worker_name
from eventbus.events import Event
from eventbus.log import RateLimiter, get_logger

if TYPE_CHECKING:
    from eventbus.core.delivery import Delivery

__all__ = ["CONTROL", "Attach", "Boxed", "Detach", "Flush", "Inbox", "InboxMode", "publisher"]

# The subscriber whose task is running (set by the loop in each delivery's task context).
publisher: ContextVar[str | None] = ContextVar("eventbus_publisher", default=None)

_storm_log = RateLimiter(10.0)

BIG = 1024  # events of at least this many bytes are counted against the byte bound


class Boxed:
    """An inbox entry for an event that is big (its bytes are counted) or holds tensors still
    being copied to the host (`captured`)."""

    __slots__ = ("captured", "ev", "nbytes")

    def __init__(self, ev: Event, nbytes: int, captured: bool) -> None:
        self.ev = ev
        self.nbytes = nbytes
        self.captured = captured


class Attach:
    """A subscribe(): takes effect in order with the events around it."""

    __slots__ = ("delivery",)

    def __init__(self, delivery: Delivery) -> None:
        self.delivery = delivery


class Detach:
    """A Subscription.remove(): no later event is routed to it; queued ones still are."""

    __slots__ = ("delivery",)

    def __init__(self, delivery: Delivery) -> None:
        self.delivery = delivery


class Flush:
    """Done when every subscriber handled what was published before it; `ok` False if a
    subscriber's `on_flush` raised (its output may not be where it should be)."""

    __slots__ = ("done", "ok", "remaining")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ok = True
        self.remaining = 0

    def one_done(self) -> None:
        self.remaining -= 1
        if self.remaining <= 0:
            self.done.set()


CONTROL = (Attach, Detach, Flush)


class InboxMode:
    """What `put` does: buffer before start, deliver while live, refuse once closed."""

    NEW, LIVE, CLOSED = "new", "live", "closed"


class Inbox:
    """The publishers' side of the bus: bounded, thread-safe, never blocks the bus side."""

    def __init__(
        self,
        maxsize: int,
        max_bytes: int,
        *,
        waits: Callable[[], bool] = lambda: False,
        drop: Callable[[Event], None] = lambda ev: None,
    ) -> None:
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self._mode = InboxMode.NEW
        self.fast_limit = 0  # publishers may append directly while fewer items wait
        self.items: deque[Any] = deque()
        # Bytes of the big events waiting (see BIG): what publishers added (under _lock) less
        # what the loop took off (its own counter, no lock). The loop never takes a lock a
        # publisher may hold: a SIGTERM handler closing the bus on a publisher's thread
        # would otherwise wait for itself.
        self._added_bytes = 0
        self._taken_bytes = 0
        self.high_water = 0
        self.blocked_ns = 0  # publishers' time waiting for room (backpressure)
        self.wakeups = 0
        self.dropped = 0  # events dropped at a full inbox (only lossy subscribers attached)
        self.feedback_dropped = 0  # events subscribers published into a half-full inbox
        self.rejected = 0  # events published after close (or in a forked child)
        self._half = max(1, maxsize // 2)  # the wake-up mark, and the bus side's share
        self._close_budget: int | None = None  # bus-side events still accepted while closing
        self.reporting = False  # set by the loop around its own report: taken up to the bound
        self._waits = waits  # whether a lossless subscriber is attached
        self._drop = drop  # count a dropped event for its subscribers
        # The byte counter and drop counters; reentrant: a signal handler that publishes runs
        # on the thread it interrupted, maybe inside `put` holding it (a Lock deadlocked there).
        self._lock = threading.RLock()
        self._space = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_loop_wake: Callable[[], None] | None = None
        self._wake_pending = False
        self._forked = False

    def __len__(self) -> int:
        return len(self.items)

    def calm(self) -> bool:
        """Under half full: the bus side's own publishes are taken, not dropped as a storm."""
        return len(self.items) < self._half

    @property
    def nbytes(self) -> int:
        """Bytes of the big events waiting now."""
        return self._added_bytes - self._taken_bytes

    @property
    def mode(self) -> str:
        """`InboxMode.NEW`, `LIVE` or `CLOSED`."""
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        self._mode = mode
        self._refresh()

    def _refresh(self) -> None:
        """The fast path is open only while live, not closing, and below the wake-up mark."""
        open_ = self._mode == InboxMode.LIVE and self._close_budget is None
        self.fast_limit = self._half if open_ else 0

    # -- publishers ---------------------------------------------------------------------

    def put(self, item: Any) -> bool:
        """Queue an event (or a `Boxed` one); waits only for a lossless subscriber's room.
        False: refused (dropped or rejected, and counted)."""
        items = self.items
        if len(items) >= self.fast_limit and not self._admit(item):
            return False
        items.append(item)
        return True

    def put_boxed(self, box: Boxed) -> None:
        """Queue a big or captured event: its bytes count against `max_bytes` once queued
        (the router takes them off when it takes the event)."""
        if box.nbytes and self.nbytes + box.nbytes > self.max_bytes and len(self.items):
            self._wake()
            if not self._admit(box, full=True):
                return
        n = box.nbytes  # read first: the router may take (and unbox) it at once
        if self.put(box) and n:
            with self._lock:
                self._added_bytes += n

    def put_sized(self, ev: Event) -> None:
        """An event holding tensors, containers or long texts: sized (host metadata only),
        its tensors captured, and counted against `max_bytes` when big."""
        # Sized from host metadata, tensors captured: detach + async copy into pinned memory
        # (CUDA) or a clone (CPU). Never .item(): no device synchronisation.
        nbytes, captured = (INTAKE.get(type(ev)) or intake_for(type(ev)))(ev)
        if nbytes >= BIG:
            self.put_boxed(Boxed(ev, nbytes, captured))
        else:  # small: counted by number only
            self.put(Boxed(ev, 0, True) if captured else ev)

    def connect(
        self,
        *,
        waits: Callable[[], bool],
        drop: Callable[[Event], None],
    ) -> None:
        """Who answers the inbox's questions: whether to wait when full (a lossless subscriber
        is attached), and whom a dropped event was for."""
        self._waits, self._drop = waits, drop

    async def wait_for_room(self) -> None:
        """For async publishers: wait (without blocking their loop) while a full inbox would
        make `put` wait."""
        while self.full() and self._waits() and self.mode == InboxMode.LIVE:
            if self.on_bus_side():
                return
            self._wake()
            await anyio.sleep(0.001)

    def put_control(self, item: Any) -> None:
        """Queue a control item (never refused, never waits) and wake the loop."""
        self.items.append(item)
        self._wake()

    def waiting(self) -> int:
        """Events waiting to be routed (control items not counted)."""
        return sum(1 for x in list(self.items) if type(x) not in CONTROL)

    def full(self) -> bool:
        """At its bound in events or in bytes."""
        return len(self.items) >= self.maxsize or self.nbytes >= self.max_bytes

    def on_bus_side(self) -> bool:
        """On this bus's loop thread or one of its subscribers' workers: waiting for this bus
        there could deadlock (another bus's subscriber may wait, like any publisher)."""
        return thread_state.owner is self  # set on the loop and its workers

    def _admit(self, item: Any, *, full: bool = False) -> bool:  # noqa: PLR0911
        """The slow path: not live, near the bound, or full. False: `item` is not queued."""
        mode = self._mode
        if (
            mode == InboxMode.LIVE
            and not full
            and len(self.items) < self.maxsize
            and self._added_bytes - self._taken_bytes < self.max_bytes
            and thread_state.owner is not self
        ):  # the common slow case: the training side, over half full, not full
            self._wake()
            return True
        if mode == InboxMode.CLOSED:
            self._reject(item)
            return False
        full = full or self.full()
        if mode == InboxMode.NEW:
            waiting = self.waiting() if full else 0
            big = type(item) is Boxed and self.nbytes + item.nbytes > self.max_bytes
            if full and (waiting >= self.maxsize or big):
                raise RuntimeError(
                    f"{waiting} events ({self.nbytes} bytes of big ones) published but the "
                    "bus was never started: call bus.start() or use `with bus:` before "
                    "publishing this much"
                )
            return True
        self._wake()
        if self.on_bus_side():
            if self._close_budget is not None:  # closing: a storm must not keep us open
                if self._close_budget <= 0:
                    self._storm(item)
                    return False
                self._close_budget -= 1
            if not full and (len(self.items) < self._half or self.reporting):
                return True
            self._storm(item)  # a subscriber publishing into a half-full inbox
            return False
        if not full:
            return True
        if self._waits():
            t0 = time.perf_counter_ns()
            while self.full() and self.mode == InboxMode.LIVE and self._waits():
                self._space.clear()
                self._wake()
                self._space.wait(0.01)
            self.blocked_ns += time.perf_counter_ns() - t0
            if self.mode == InboxMode.CLOSED:  # the loop died or closed while we waited
                self._reject(item)
                return False
            return True
        with self._lock:  # only lossy subscribers: drop rather than wait, counted for each
            self.dropped += 1
        self._drop(_event_of(item))
        return False

    def _reject(self, item: Any) -> None:
        with self._lock:
            self.rejected += 1
            first = self.rejected == 1
        if first and not self._forked:
            ev = _event_of(item)
            get_logger().warning(
                "event published after the bus closed; it is not delivered",
                event_type=type(ev).__name__,
                step=ev.step,
            )

    def _storm(self, item: Any) -> None:
        with self._lock:
            self.feedback_dropped += 1
        self._drop(_event_of(item))
        who = worker_name() or publisher.get()
        ok, held = _storm_log.allow(("storm", who))
        if ok:
            get_logger().error(
                "feedback storm: a subscriber publishes faster than the bus delivers; events "
                "published from the bus side into a half-full inbox are dropped",
                subscriber=who,
                event_type=type(_event_of(item)).__name__,
                feedback_dropped=self.feedback_dropped,
                suppressed_since_last=held,
            )

    # -- the loop -----------------------------------------------------------------------

    def bind(self, loop: asyncio.AbstractEventLoop, on_wake: Callable[[], None]) -> None:
        """Called on the loop: `wake` makes the loop call `on_wake` there."""
        self._loop, self._on_loop_wake = loop, on_wake

    def _wake(self) -> None:
        loop = self._loop
        if loop is None or self._wake_pending:
            return
        self._wake_pending = True
        self.wakeups += 1
        try:
            loop.call_soon_threadsafe(self._on_wake)
        except RuntimeError:  # the loop already closed
            self._wake_pending = False

    def wake(self) -> None:
        """Wake the loop now (a flush, a close, a subscribe)."""
        self._wake_pending = False
        self._wake()

    def _on_wake(self) -> None:
        self._wake_pending = False
        if self._on_loop_wake is not None:
            self._on_loop_wake()

    def note_high_water(self) -> int:
        """The loop is about to drain: note how full the inbox got; returns its length."""
        k = len(self.items)
        if k > self.high_water:
            self.high_water = k
        return k

    def take(self, n: int) -> list[Any]:
        """Up to `n` items, oldest first (the loop's side, or the closer once it is done)."""
        items = self.items
        popleft = items.popleft
        return [popleft() for _ in range(min(len(items), n))]

    def unbox(self, box: Boxed) -> int:
        """A boxed event left the inbox: its bytes no longer count (once). Returns them."""
        n, box.nbytes = box.nbytes, 0
        self._taken_bytes += n  # one writer: the loop (or the closer, once the loop is done)
        return n

    def begin_close(self) -> None:
        """From now on subscribers may publish at most `maxsize` more events (what they say
        while closing still arrives; a feedback storm cannot hold the close open)."""
        self._close_budget = self.maxsize
        self._refresh()  # every put takes the slow path, which counts

    def space(self) -> None:
        """Tell waiting publishers to look again (the loop drained, or ended)."""
        self._space.set()

    def close(self) -> None:
        """Refuse from now on; publishers waiting for room return (and count their event)."""
        self.mode = InboxMode.CLOSED
        self._space.set()

    def reset_after_fork(self) -> None:
        """In a forked child: nothing from the parent's inbox, and every call returns at once."""
        self.items = deque()
        self._added_bytes = self._taken_bytes = 0
        self.rejected = 0
        self._lock = threading.RLock()
        self._space = threading.Event()
        self._loop = None
        self._on_loop_wake = None
        self.mode = InboxMode.CLOSED
        self._forked = True


def _event_of(item: Any) -> Event:
    return item.ev if type(item) is Boxed else item
