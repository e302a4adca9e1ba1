"""One subscription: its bounded queue with an overflow policy, and the task that feeds it.

Everything here lives on the bus thread's event loop (no locks: anyio primitives are not
thread-safe, and only the loop touches them), except the counters the publisher bumps when
the inbox itself is full.
"""

from __future__ import annotations

import inspect
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Literal

import anyio

from eventbus._log import RateLimiter, get_logger
from eventbus._threads import ThreadWorker
from eventbus.events import Event
from eventbus.stats import SubscriberStats

__all__ = ["POLICIES", "Policy", "Runner", "SubscriberQueue", "describe", "takes_argument"]

Policy = Literal["block", "drop_oldest", "drop_newest", "latest"]
POLICIES: tuple[str, ...] = ("block", "drop_oldest", "drop_newest", "latest")

_log_limit = RateLimiter(10.0)


def default_key(ev: Event) -> Hashable:
    """`latest` keeps the newest event per key: by default its type and, if any, its name."""
    return (type(ev), getattr(ev, "name", None), getattr(ev, "metric", None))


class SubscriberQueue:
    """A bounded FIFO with an overflow policy. Counts every event in and every one dropped."""

    def __init__(self, policy: str, maxsize: int, key: Callable[[Event], Hashable] | None) -> None:
        self.policy = policy
        self.maxsize = maxsize
        self.key = key or default_key
        self._fifo: deque[Event] = deque()
        self._latest: OrderedDict[Hashable, Event] = OrderedDict()
        self._is_fifo = policy != "latest"  # fixed for the queue's life (disable() keeps it)
        self.dropped = 0
        self.high_water = 0  # updated when the consumer takes: the queue peaks right before
        self._readable = anyio.Event()
        self._writable = anyio.Event()

    def __len__(self) -> int:
        return len(self._fifo) if self._is_fifo else len(self._latest)

    def offer(self, ev: Event) -> bool:
        """Enqueue without waiting; False only when a `block` queue is full (caller awaits)."""
        fifo = self._fifo
        n = len(fifo)
        if n < self.maxsize and self._is_fifo:  # the common case: room in a FIFO queue
            fifo.append(ev)
            if not n:  # the consumer waits only on an empty queue: wake it once
                self._readable.set()
            return True
        return self._offer_slow(ev)

    def _offer_slow(self, ev: Event) -> bool:
        if not self._is_fifo:
            k = self.key(ev)
            latest = self._latest
            if not latest:
                self._readable.set()
            if k in latest:
                del latest[k]
                self.dropped += 1  # the older event of this key is superseded
            elif len(latest) >= self.maxsize:
                latest.popitem(last=False)
                self.dropped += 1
            latest[k] = ev
            return True
        fifo = self._fifo  # full
        self._note_high_water(len(fifo))
        if self.policy == "block":
            return False
        self.dropped += 1
        if self.policy != "drop_newest":  # drop_oldest
            fifo.popleft()
            fifo.append(ev)
        return True

    def _note_high_water(self, n: int) -> None:
        if n > self.high_water:
            self.high_water = n

    async def put(self, ev: Event) -> None:
        """Enqueue, waiting for room (the `block` policy's backpressure)."""
        while not self.offer(ev):
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
                out = [fifo.popleft() for _ in range(n)]
        self._writable.set()
        return out

    def discard_all(self) -> int:
        """Drop everything queued (a disabled subscriber, or events lost at close)."""
        n = len(self)
        self._fifo.clear()
        self._latest.clear()
        self.dropped += n
        self._writable.set()
        return n

    def poke(self) -> None:
        """Wake the consumer without an event (a flush marker, a state change)."""
        self._readable.set()

    async def wait(self) -> None:
        """Wait until something was offered or `poke()` was called."""
        if self._readable.is_set():
            self._readable = anyio.Event()
            if len(self):
                return
        await self._readable.wait()


def describe(sub: Any) -> str:
    """A readable default name: the object's `name`, its class, or the function's name."""
    name = getattr(sub, "name", None)
    if isinstance(name, str) and name:
        return name
    if inspect.isroutine(sub):  # functions, methods, builtins such as `list.append`
        return str(getattr(sub, "__qualname__", None) or getattr(sub, "__name__", "function"))
    return type(sub).__name__


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
    )


class _Marker:
    """Done once a subscriber has handled every event routed to it before the marker."""

    __slots__ = ("callback", "target")

    def __init__(self, target: int, callback: Callable[[], None]) -> None:
        self.target = target
        self.callback = callback


class Runner:
    """Delivers one subscriber's queue in batches, counting, isolating and timing it."""

    def __init__(
        self,
        sub: Any,
        *,
        name: str,
        events: tuple[type[Event], ...],
        policy: str,
        maxsize: int,
        max_batch: int,
        key: Callable[[Event], Hashable] | None,
        max_consecutive_failures: int | None,
    ) -> None:
        self.sub = sub
        self.name = name
        self.events = events
        self.policy = policy
        self.maxsize = maxsize
        self.max_batch = max_batch
        self.key = key
        self.max_consecutive_failures = max_consecutive_failures
        self.batched = hasattr(sub, "on_events")
        target = sub.on_events if self.batched else sub
        self.is_async = _is_async(target)
        self.worker = ThreadWorker(name)
        self.queue: SubscriberQueue | None = None  # made on the loop (anyio events live there)
        self.state = "pending"
        self.published = 0
        self.delivered = 0
        self.failed = 0
        self.inbox_dropped = 0  # bumped by publishers when the inbox is full (lossy only)
        self.lost_at_close = 0
        self.consecutive_failures = 0
        self.last_error: str | None = None
        self.busy_since: float | None = None
        self.busy_with: str | None = None
        self.latencies: deque[float] = deque(maxlen=1024)
        self.markers: list[_Marker] = []

    # -- counters --------------------------------------------------------------------

    @property
    def lossless(self) -> bool:
        return self.policy == "block"

    def processed(self) -> int:
        dropped = self.queue.dropped if self.queue is not None else 0
        return self.delivered + self.failed + dropped

    def stats(self) -> SubscriberStats:
        q = self.queue
        lat = sorted(self.latencies)
        return SubscriberStats(
            name=self.name,
            policy=self.policy,
            state=self.state,
            published=self.published + self.inbox_dropped,
            delivered=self.delivered,
            dropped=(q.dropped if q is not None else 0) + self.inbox_dropped + self.lost_at_close,
            failed=self.failed,
            queued=len(q) if q is not None else 0,
            queue_high_water=max(q.high_water, len(q)) if q is not None else 0,
            latency_p50_ms=lat[len(lat) // 2] if lat else None,
            latency_p99_ms=lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None,
            latency_max_ms=lat[-1] if lat else None,
            error=self.last_error,
        )

    # -- routing (called by the router on the loop) ------------------------------------

    def open(self) -> None:
        """Create the queue; must run on the bus loop."""
        self.queue = SubscriberQueue(self.policy, self.maxsize, self.key)
        if self.state == "pending":
            self.state = "running"

    def add_marker(self, callback: Callable[[], None]) -> None:
        m = _Marker(self.published, callback)
        if self.processed() >= m.target and self.busy_since is None:
            callback()
        else:
            self.markers.append(m)
            if self.queue is not None:
                self.queue.poke()

    def _check_markers(self) -> None:
        done = self.processed()
        while self.markers and self.markers[0].target <= done:
            self.markers.pop(0).callback()

    # -- the subscriber's task ---------------------------------------------------------

    async def run(self) -> None:
        """Feed the subscriber until cancelled (the bus cancels it once drained)."""
        q = self.queue
        assert q is not None, "open() first"
        while True:
            if not len(q):
                self._check_markers()
                await q.wait()
                continue
            batch = q.take(self.max_batch)
            if self.state == "disabled":  # count, do not call
                q.dropped += len(batch)
                self._check_markers()
                continue
            await self.deliver(batch)
            self._check_markers()

    async def deliver(self, batch: list[Event]) -> None:
        first_ts = batch[0].ts
        if first_ts is not None:
            self.latencies.append((time.time_ns() - first_ts) / 1e6)
        self.busy_since = time.monotonic()
        self.busy_with = type(batch[0]).__name__
        try:
            if self.batched:
                await self._call_batch(batch)
            elif self.is_async:
                for ev in batch:
                    self.busy_with = type(ev).__name__
                    try:
                        await self.sub(ev)
                    except Exception as e:
                        self._failed(e, ev, 1)
                    else:
                        self._ok(1)
            else:
                for ok, ev, exc in await self.worker.call(_call_each, self.sub, batch):
                    if ok:
                        self._ok(1)
                    else:
                        self._failed(exc, ev, 1)
        finally:
            self.busy_since = None
            self.busy_with = None

    async def _call_batch(self, batch: list[Event]) -> None:
        try:
            if self.is_async:
                await self.sub.on_events(batch)
            else:
                await self.worker.call(self.sub.on_events, batch)
        except Exception as e:
            self._failed(e, batch[0], len(batch))
        else:
            self._ok(len(batch))

    def _ok(self, n: int) -> None:
        self.delivered += n
        self.consecutive_failures = 0

    def _failed(self, exc: BaseException, ev: Event, n: int) -> None:
        self.failed += n
        self.consecutive_failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        ok, held = _log_limit.allow((self.name, type(exc)))
        if ok:
            get_logger().warning(
                "subscriber failed",
                subscriber=self.name,
                event_type=type(ev).__name__,
                step=ev.step,
                error=self.last_error,
                suppressed_since_last=held,
                failed_total=self.failed,
                exc_info=exc,
            )
        limit = self.max_consecutive_failures
        if limit is not None and self.consecutive_failures >= limit and self.state == "running":
            self.disable(f"{limit} consecutive failures; last: {self.last_error}")

    def disable(self, why: str) -> None:
        """Stop calling the subscriber; what reaches it from now on is counted as dropped."""
        self.state = "disabled"
        if self.queue is not None:
            self.queue.policy = "drop_newest" if self.queue.policy == "block" else self.queue.policy
            self.queue.discard_all()
        get_logger().error("subscriber disabled", subscriber=self.name, reason=why)

    async def call_hook(self, hook: str, *args: Any) -> bool:
        """Call an optional hook (on_start, on_flush, on_close); False if it raised."""
        fn = getattr(self.sub, hook, None) if self.batched or hook != "on_events" else None
        if fn is None or not callable(fn):
            return True
        if args and not takes_argument(fn):
            args = ()  # `on_start(self)` without the bus is fine too
        self.busy_since = time.monotonic()
        self.busy_with = hook
        try:
            if _is_async(fn):
                await fn(*args)
            else:
                await self.worker.call(fn, *args)
        except Exception as e:
            self.last_error = f"{type(e).__name__}: {e}"
            get_logger().warning(
                "subscriber hook failed", subscriber=self.name, hook=hook,
                error=self.last_error, exc_info=e,
            )
            return False
        finally:
            self.busy_since = None
            self.busy_with = None
        return True


def takes_argument(fn: Callable[..., Any]) -> bool:
    """Whether a hook accepts a positional argument (`on_start(self, bus)` vs `on_start(self)`)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
               for p in params)


def _call_each(fn: Callable[[Event], Any], batch: Iterable[Event]) -> list[tuple[bool, Event, Any]]:
    """Worker-thread side of a plain sync function: one call per event, errors kept apart."""
    out: list[tuple[bool, Event, Any]] = []
    for ev in batch:
        try:
            fn(ev)
        except Exception as e:
            out.append((False, ev, e))
        else:
            out.append((True, ev, None))
    return out
