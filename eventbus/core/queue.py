"""`SubscriberQueue`: one subscriber's bounded FIFO with an overflow policy.

Named as anyio's memory streams name things: `put` waits for room, `put_nowait` never waits,
`take` hands the consumer a batch, `close` refuses what comes after, `statistics()` reads the
counters. It lives on the bus loop only (anyio events are not thread-safe); the router is its
one producer and the subscriber's delivery its one consumer.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from itertools import repeat
from operator import call
from typing import Any, NamedTuple

import anyio

from eventbus.events import Event
from eventbus.log import RateLimiter, get_logger

__all__ = ["POLICIES", "QueueStatistics", "SubscriberQueue", "check_key", "default_key"]

POLICIES: tuple[str, ...] = ("block", "drop_oldest", "drop_newest", "latest")
_key_log = RateLimiter(10.0)


def check_key(key: Any) -> Callable[[Event], Hashable] | None:
    """`key=` as given, if it is None or a function; else a TypeError saying what it takes."""
    if key is not None and not callable(key):
        raise TypeError(f"key= takes a function of one event (policy='latest'), got {key!r}")
    return key  # type: ignore[no-any-return]


def default_key(ev: Event) -> Hashable:
    """`latest` keeps the newest event per key: by default its type and, if any, its name."""
    return (type(ev), getattr(ev, "name", None), getattr(ev, "metric", None))


class QueueStatistics(NamedTuple):
    """A snapshot of one queue's counters."""

    queued: int  # events waiting now
    queued_bytes: int  # their estimated size (events of 1 KiB or more are counted)
    high_water: int  # the most events it ever held
    dropped: int  # events discarded by the policy, by `discard` or after `close`
    maxsize: int  # the bound in events
    max_bytes: int  # the bound in bytes


class SubscriberQueue:
    """A bounded FIFO (or, for `latest`, newest-per-key) queue, bounded in events and bytes."""

    def __init__(
        self,
        policy: str,
        maxsize: int,
        *,
        max_bytes: int = 1 << 30,
        key: Callable[[Event], Hashable] | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        self.policy = policy
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self.key = key or default_key
        self.dropped = 0
        self.high_water = 0  # noted when the consumer takes: the queue peaks right before
        self._fifo: deque[Event] = deque()
        self._latest: OrderedDict[Hashable, Event] = OrderedDict()
        self._is_fifo = policy != "latest"
        self._sizes: dict[int, int] = {}  # id(event) -> bytes, for the big ones only
        self._bytes = 0
        self._closed = False
        self._fast_below = maxsize if self._is_fifo else 0  # 0: every put takes the slow path
        self._readable = anyio.Event()
        self._writable = anyio.Event()

    def __len__(self) -> int:
        return len(self._fifo) if self._is_fifo else len(self._latest)

    @property
    def closed(self) -> bool:
        """True after `close()`: whatever is put from then on is dropped and counted."""
        return self._closed

    def put_nowait(self, ev: Event, nbytes: int = 0, force: bool = False) -> bool:
        """Enqueue without waiting; False only when a `block` queue is full.

        `nbytes`: the event's size when big enough to count; `force`: exceed the bounds rather
        than refuse (shutdown routes what is left without waiting on anyone).
        """
        fifo = self._fifo
        n = len(fifo)
        if not nbytes and n < self._fast_below:  # FIFO, open, small event, room
            fifo.append(ev)  # the common case: a small event, room in a FIFO queue
            if not n:  # the consumer waits only on an empty queue: wake it once
                self._readable.set()
            return True
        return self._put_slow(ev, nbytes, force)

    def fits(self, k: int) -> bool:
        """Whether `k` more small events can be put now without waiting or dropping beyond
        the policy: room in an open FIFO, or an open `latest` queue (it keeps the newest)."""
        return len(self._fifo) + k <= self._fast_below or not (self._is_fifo or self._closed)

    def put_all(self, evs: list[Event]) -> None:
        """Enqueue small events, in order: the router's run of plain events, which it puts
        only where `fits(len(evs))` (so a bound is never passed, and nothing is refused).
        Closed since (the router read captures or ran a key function meanwhile, and the bus
        gave up on this subscriber): dropped, counted, as `put_nowait` would."""
        if self._closed:
            self.dropped += len(evs)
            return
        if not self._is_fifo:
            for ev in evs:
                self._put_latest(ev, 0)
            return
        fifo = self._fifo
        if not fifo and evs:  # the consumer waits only on an empty queue: wake it once
            self._readable.set()
        fifo.extend(evs)

    def _put_slow(self, ev: Event, nbytes: int, force: bool) -> bool:
        if self._closed:
            self.dropped += 1
            return True
        if not self._is_fifo:
            return self._put_latest(ev, nbytes)
        fifo = self._fifo
        full = len(fifo) >= self.maxsize or (
            nbytes > 0 and len(fifo) > 0 and self._bytes + nbytes > self.max_bytes
        )
        if full and not force:
            self._note_high_water(len(fifo))
            if self.policy == "block":
                return False
            if self.policy == "drop_newest":
                self.dropped += 1
                return True
            old = fifo.popleft()  # drop_oldest: one makes room for a small event
            self.dropped += 1
            if self._sizes:
                self._forget(old)
            while nbytes and fifo and self._bytes + nbytes > self.max_bytes:  # a big one: more
                self._forget(fifo.popleft())
                self.dropped += 1
        if not fifo:
            self._readable.set()
        fifo.append(ev)
        if nbytes:
            self._sizes[id(ev)] = nbytes
            self._bytes += nbytes
        return True

    def _put_latest(self, ev: Event, nbytes: int) -> bool:
        try:
            k = self.key(ev)
        except BaseException as e:  # the user's key function: this event is dropped, counted
            self.dropped += 1
            ok, held = _key_log.allow(type(e))
            if ok:
                get_logger().warning(
                    "latest policy: the key function raised; event dropped",
                    event_type=type(ev).__name__,
                    error=f"{type(e).__name__}: {e}",
                    suppressed_since_last=held,
                )
            return True
        latest = self._latest
        if not latest:
            self._readable.set()
        if k in latest:
            self._forget(latest.pop(k))
            self.dropped += 1  # the older event of this key is superseded
        while latest and (
            len(latest) >= self.maxsize or (nbytes and self._bytes + nbytes > self.max_bytes)
        ):
            self._forget(latest.popitem(last=False)[1])  # the oldest key goes
            self.dropped += 1
        latest[k] = ev
        if nbytes:
            self._sizes[id(ev)] = nbytes
            self._bytes += nbytes
        return True

    def _forget(self, ev: Event) -> None:
        if self._sizes:
            self._bytes -= self._sizes.pop(id(ev), 0)

    def _note_high_water(self, n: int) -> None:
        if n > self.high_water:
            self.high_water = n

    async def put(self, ev: Event, nbytes: int = 0) -> None:
        """Enqueue, waiting for room (the `block` policy's backpressure)."""
        while not self.put_nowait(ev, nbytes):
            if self._writable.is_set():
                self._writable = anyio.Event()
            await self._writable.wait()

    def take(self, n: int) -> list[Event]:
        """Up to `n` events, oldest first."""
        self._note_high_water(len(self))
        if not self._is_fifo:
            latest = self._latest
            out = [latest.popitem(last=False)[1] for _ in range(min(n, len(latest)))]
        else:
            fifo = self._fifo
            if len(fifo) <= n:
                out = list(fifo)
                fifo.clear()
            else:
                out = list(map(call, repeat(fifo.popleft, n)))  # C calls, no loop here
        if self._sizes:
            for ev in out:
                self._forget(ev)
        self._writable.set()
        return out

    def discard(self) -> list[Event]:
        """Drop everything queued, counted as dropped; returns what it dropped."""
        gone = [*self._fifo, *self._latest.values()]
        n = len(gone)
        self._fifo.clear()
        self._latest.clear()
        self._sizes.clear()
        self._bytes = 0
        self.dropped += n
        self._writable.set()
        return gone

    def close(self) -> None:
        """Refuse what comes from now on (counted as dropped); queued events stay. Idempotent."""
        self._closed = True
        self._fast_below = 0
        self._writable.set()
        self._readable.set()

    def poke(self) -> None:
        """Wake the consumer without an event (a flush marker, a state change)."""
        self._readable.set()

    async def wait(self) -> None:
        """Wait until something was put or `poke()` was called."""
        if self._readable.is_set():
            self._readable = anyio.Event()
            if len(self):
                return
        await self._readable.wait()

    def statistics(self) -> QueueStatistics:
        """The queue's counters now."""
        return QueueStatistics(
            queued=len(self),
            queued_bytes=self._bytes,
            high_water=max(self.high_water, len(self)),
            dropped=self.dropped,
            maxsize=self.maxsize,
            max_bytes=self.max_bytes,
        )
