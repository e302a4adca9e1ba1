"""`Delivery`: the one place that calls a subscriber's code, wherever it runs (the live bus,
`replay`, the sidecar): hooks, batches or one event at a time, failures, disabling, timing, its
state. Async code runs on the loop, sync code on the subscriber's own worker thread. Anything
it raises, `BaseException` included, is counted and logged; it never ends the loop.
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

from eventbus.core.busy import Busy
from eventbus.core.cost import cpu_timed
from eventbus.core.markers import Markers
from eventbus.core.queue import SubscriberQueue, check_key
from eventbus.core.strict import FirstFailure
from eventbus.core.subscriber import (
    State,
    SubscriberGone,
    failed_part,
    is_async,
    loop_cancelled,
    takes_argument,
)
from eventbus.core.worker import ThreadWorker, call_each
from eventbus.events import Event
from eventbus.log import RateLimiter, get_logger
from eventbus.stats import SubscriberStats

__all__ = ["Delivery"]

_log_limit = RateLimiter(10.0)


class Delivery:
    """Calls one subscriber, counting, isolating and timing it; feeds it from its queue."""

    def __init__(
        self,
        sub: Any,
        *,
        name: str,
        events: tuple[type[Event], ...] = (Event,),
        policy: str = "block",
        maxsize: int = 10_000,
        max_batch: int = 512,
        max_bytes: int = 1 << 30,
        key: Callable[[Event], Hashable] | None = None,
        max_consecutive_failures: int | None = 100,
    ) -> None:
        self.sub = sub
        self.last = False  # closed after the others (the sidecar: it gets what they publish)
        self.on_abandon: Callable[[list[Event]], None] | None = None  # given what it dropped
        self.first = bool(getattr(sub, "close_first", False))  # closed before: it publishes then
        self.name = name
        self.events = events
        self.policy = policy
        self.maxsize = maxsize
        self.max_batch = max_batch
        self.max_bytes = max_bytes
        self.key = check_key(key)  # a bad one: refused where it was subscribed
        self.max_consecutive_failures = max_consecutive_failures
        self.batched = hasattr(sub, "on_events")
        self.is_async = is_async(sub.on_events if self.batched else sub)
        self.worker = ThreadWorker(name)
        self.queue: SubscriberQueue | None = None  # made on the loop (anyio events live there)
        self.state = State.PENDING
        self.removing = False  # `remove()` was called (its Detach may still be queued)
        self.routed = 0  # events the router put in its queue (or handed over, in replay)
        self.delivered = 0
        self.failed = 0
        self.failures: FirstFailure | None = None  # set by a strict bus
        self.inbox_dropped = 0  # bumped by publishers at a full inbox (lossy subscribers only)
        self.lost_at_close = 0  # still in the inbox, routed nowhere, when the bus gave up
        self.consecutive_failures = 0
        self.last_error: str | None = None
        self.in_flight = 0  # events of the call in progress
        self.lost_in_flight = 0  # the call in progress when the bus abandoned it
        self._abandoned = False
        self._batch_done = 0  # events of the batch in hand already counted
        self.busy = Busy()  # the batch or hook it is inside now
        self.started = False  # its on_start returned (or raised): a flush waits for it
        self.latencies: deque[float] = deque(maxlen=1024)
        self.cpu_ns = 0  # CPU time of its async calls, on the loop (its worker counts the rest)
        self._markers = Markers()

    @property
    def cpu_s(self) -> float:
        """CPU seconds its calls took: on the loop (async) and in its worker (sync)."""
        return (self.cpu_ns + self.worker.cpu_ns) / 1e9

    @property
    def lossless(self) -> bool:
        """Whether the router waits for room in its queue (the `block` policy)."""
        return self.policy == "block"

    @property
    def idle(self) -> bool:
        """Nothing queued and not inside the subscriber's code."""
        return self.busy_since is None and (self.queue is None or not len(self.queue))

    # -- the queue and its task (the live bus) --------------------------------------------

    def open(self) -> SubscriberQueue:
        """Make the queue (on the loop) and mark the subscriber running."""
        self.queue = SubscriberQueue(
            self.policy, self.maxsize, max_bytes=self.max_bytes, key=self.key
        )
        if self.state is State.PENDING:
            self.state = State.RUNNING
        return self.queue

    async def run(self) -> None:
        """Feed the subscriber from its queue until cancelled (the loop cancels it at the end)."""
        q = self.queue
        assert q is not None, "open() first"
        while True:
            if not len(q):
                self._check_markers()
                await q.wait()
                continue
            batch = q.take(self.max_batch)
            if self.state is State.DISABLED:  # counted, not handed over
                q.dropped += len(batch)
            else:
                try:
                    await self.deliver(batch)
                except BaseException as e:  # never the loop's death: the batch is counted
                    if loop_cancelled(e):
                        raise
                    self._failed(e, batch[0], max(0, len(batch) - self._batch_done))
            self._check_markers()

    def add_marker(self, callback: Callable[[], None]) -> None:
        """Call `callback` once everything routed to this subscriber so far was handled (and
        its `on_start` returned: `run()` checks the markers once it begins)."""
        idle = self.busy_since is None and self.started
        now = self._markers.add(self.routed, callback, done=self._processed(), idle=idle)
        if not now and self.queue is not None:
            self.queue.poke()

    def _processed(self) -> int:
        dropped = self.queue.dropped if self.queue is not None else 0
        return self.delivered + self.failed + dropped

    def _check_markers(self) -> None:
        self._markers.check(self._processed())

    def abandon(self) -> int:
        """The bus gives up on it: drop what is queued (counted lost); returns how many."""
        if self.busy_since is not None and not self._abandoned:
            # whatever it returns now is not counted; what it finished already was
            self.lost_in_flight = max(0, self.in_flight - self._batch_done)
        self._abandoned = True
        gone: list[Event] = []
        if self.queue is not None:
            gone = self.queue.discard()  # routed, then dropped: counted in the queue's `dropped`
            self.queue.close()
        if self.on_abandon is not None:  # the sidecar: it counts them for its subscribers
            self.on_abandon(gone)
        if self.busy_since is not None:
            self.state = State.HUNG
        self.worker.stop()
        self._markers.release()  # a flush waiting on it must not wait forever
        return len(gone)

    def release(self) -> None:
        """Removed and closed: the bus keeps its counters, not the subscriber object."""
        self.sub = None
        self.worker.stop()

    # -- calling the subscriber -------------------------------------------------------------

    async def deliver(self, batch: list[Event]) -> BaseException | None:
        """Hand a batch over (or each event, to a plain function); returns the first failure."""
        first_ts = batch[0].ts
        if type(first_ts) is int:  # a user may have set anything
            self.latencies.append((time.time_ns() - first_ts) / 1e6)
        token = self.busy.enter(type(batch[0]).__name__)
        self.in_flight = len(batch)
        self._batch_done = 0
        try:
            if self.batched:
                return await self._call_batch(batch)
            return await self._call_each(batch)
        finally:
            self.busy.leave(token)
            self.in_flight = 0

    async def _call_batch(self, batch: list[Event]) -> BaseException | None:
        n, first = len(batch), batch[0]  # read before: the subscriber may change its list
        try:
            call = self._call_async if self.is_async else self._call_sync
            await call(self.sub.on_events, batch)
        except BaseException as e:
            if loop_cancelled(e):
                raise
            k = failed_part(e, n)  # the rest of the batch was handled (side by side jobs)
            self._ok(n - k)
            self._failed(e, first, k)
            return e
        self._ok(n)
        return None

    async def _call_each(self, batch: list[Event]) -> BaseException | None:
        first: BaseException | None = None
        if self.is_async:
            results: list[tuple[Event, BaseException | None]] = []
            for ev in batch:
                self.busy.what = type(ev).__name__
                try:
                    await self._call_async(self.sub, ev)
                except BaseException as e:
                    if loop_cancelled(e):
                        raise
                    results.append((ev, e))
                else:
                    results.append((ev, None))
        else:
            results = await self.worker.call(call_each, self.sub, batch)
        for i, (ev, result) in enumerate(results):
            outcome = result
            if isinstance(result, Awaitable):  # `lambda ev: coro(ev)`: run what it returned
                try:
                    await self._call_async(_awaited, result)
                except BaseException as e:
                    if loop_cancelled(e):
                        for _, rest in results[i + 1 :]:  # abandoned: close, never half-run
                            if inspect.iscoroutine(rest):
                                rest.close()
                        raise
                    outcome = e
                else:
                    outcome = None
            if outcome is None:
                self._ok(1)
            else:
                self._failed(outcome, ev, 1)
                first = first or outcome
        return first

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run subscriber code: async on the loop, sync on the worker; await what it returns."""
        if is_async(fn):
            return await self._call_async(fn, *args)
        return await self._call_sync(fn, *args)

    async def _call_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Sync code on the subscriber's worker thread; a coroutine it returns runs here."""
        result = await self.worker.call(fn, *args)
        if inspect.isawaitable(result):  # a sync function that returned a coroutine
            return await self._call_async(_awaited, result)
        return result

    async def _call_async(self, fn: Callable[..., Any], *args: Any) -> Any:
        """The frame the loop's watchdog looks for when the loop is blocked: it names us."""
        aw = fn(*args)
        return await (cpu_timed(aw, self) if inspect.iscoroutine(aw) else aw)

    async def call_hook(self, hook: str, *args: Any) -> bool:
        """Call an optional hook (on_start, on_flush, on_close); False if it raised."""
        fn = getattr(self.sub, hook, None) if self.batched else None
        if fn is None or not callable(fn):
            return True
        if args and not takes_argument(fn):
            args = ()  # `on_start(self)` without the bus is fine too
        token = self.busy.enter(hook)
        try:
            await self._call(fn, *args)
        except BaseException as e:
            if loop_cancelled(e):
                raise
            self.last_error = f"{type(e).__name__}: {e}"
            if self.failures is not None:
                self.failures.note(self.name, e, hook=hook)
            self._revoke(e)
            get_logger().warning(
                "subscriber hook failed",
                subscriber=self.name,
                hook=hook,
                error=self.last_error,
                exc_info=e,
            )
            if isinstance(e, SubscriberGone):
                self.disable(self.last_error)
            return False
        finally:
            self.busy.leave(token)
        return True

    @property
    def abandoned(self) -> bool:
        """The bus gave up on it (hung, or its close ran out of time): nothing more is called."""
        return self._abandoned

    @property
    def busy_since(self) -> float | None:
        """When the call it is inside began (monotonic); None when idle."""
        return self.busy.since

    @property
    def busy_with(self) -> str | None:
        return self.busy.what

    # -- accounting -------------------------------------------------------------------------

    def _ok(self, n: int) -> None:
        if self._abandoned or not n:  # counted as lost when the bus gave up on it
            return
        self._batch_done += n
        self.delivered += n
        self.consecutive_failures = 0

    def _failed(self, exc: BaseException, ev: Event, n: int) -> None:
        if self._abandoned:
            return
        self._revoke(exc)
        self._batch_done += n
        self.failed += n
        self.consecutive_failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        if self.failures is not None:  # a strict bus raises the first on the training thread
            self.failures.note(self.name, exc, ev, n)
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
        gone = isinstance(exc, SubscriberGone)
        too_many = limit is not None and self.consecutive_failures >= limit
        if (gone or too_many) and self.state is State.RUNNING:
            self.disable(
                self.last_error
                if gone
                else f"{limit} consecutive failures; last: {self.last_error}"
            )

    def _revoke(self, exc: BaseException) -> None:
        """A sink that finds events it had accepted were lost after all (a buffered write
        failed) says how many in `exc.earlier_lost`: they move from delivered to failed."""
        n = getattr(exc, "earlier_lost", 0)
        if type(n) is int and n > 0:
            n = min(n, self.delivered)
            self.delivered -= n
            self.failed += n

    def disable(self, why: str) -> None:
        """Stop calling the subscriber; what reaches it from now on is counted as dropped."""
        self.state = State.DISABLED
        if self.queue is not None:
            if self.queue.policy == "block":
                self.queue.policy = "drop_newest"  # never hold the router up for it again
            self.queue.discard()
        get_logger().error("subscriber disabled", subscriber=self.name, reason=why)

    def stats(self) -> SubscriberStats:
        """This subscriber's counters as `bus.stats()` shows them."""
        q = self.queue.statistics() if self.queue is not None else None
        lat = sorted(self.latencies)
        return SubscriberStats(
            name=self.name,
            policy=self.policy,
            state=str(self.state),
            published=self.routed + self.inbox_dropped + self.lost_at_close,
            delivered=self.delivered,
            dropped=(q.dropped if q else 0)
            + self.inbox_dropped
            + self.lost_at_close
            + self.lost_in_flight,
            failed=self.failed,
            queued=q.queued if q else 0,
            queue_high_water=q.high_water if q else 0,
            latency_p50_ms=lat[len(lat) // 2] if lat else None,
            latency_p99_ms=lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None,
            latency_max_ms=lat[-1] if lat else None,
            error=self.last_error,
            queued_bytes=q.queued_bytes if q else 0,
            cpu_s=self.cpu_s,
        )


async def _awaited(aw: Awaitable[Any]) -> Any:
    return await aw
