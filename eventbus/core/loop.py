"""`BusLoop`: the bus thread, its anyio loop, and shutdown with deadlines.

The loop routes the inbox on a timer (or when woken), runs one task per subscriber, and at
close gives each subscriber, newest first, a fair share of the time left to drain its queue and
run `on_close`; what one publishes while closing still reaches the older ones. A subscriber
that does not finish in its share is named hung and abandoned (what it had queued is counted
lost); the others still drain and close. When the loop itself is blocked (sync code inside
`async def`), `culprit()` reads the loop thread's stack to name the subscriber responsible.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import anyio
from anyio.abc import TaskGroup

from eventbus.core.cost import CostMeter
from eventbus.core.delivery import Delivery
from eventbus.core.handle import BusHandle
from eventbus.core.inbox import Inbox, publisher
from eventbus.core.router import Router
from eventbus.core.shutdown import Shutdown
from eventbus.core.subscriber import State
from eventbus.core.worker import thread_state
from eventbus.events import Event
from eventbus.log import get_logger
from eventbus.stats import BusStats

__all__ = ["BusLoop"]


class BusLoop(Shutdown):
    """Owns the bus thread: routing while running, then the ordered, bounded shutdown."""

    def __init__(
        self,
        inbox: Inbox,
        handle: BusHandle,
        *,
        name: str,
        interval: float,
        hang_timeout: float | None = None,
        cost: CostMeter | None = None,
    ) -> None:
        self.inbox = inbox
        self.cost = cost  # what the bus costs the training process; None: not measured
        self.ending: Callable[[], Event] | None = None  # the RunEnded a close publishes
        self.handle = handle
        self.name = name
        self.interval = interval
        self.router = Router(
            inbox,
            start=self._start,
            retire=self._retire,
            spawn=self._spawn,
            poll_max=interval,
            hang_timeout=hang_timeout,
        )
        inbox.connect(
            waits=self.router.waits,
            drop=self.router.count_drop,
        )
        if cost is not None:
            cost.published = self.published
        self.thread: threading.Thread | None = None
        self.thread_id: int | None = None
        self.error: BaseException | None = None  # what ended the loop, if not a close
        self.hung: tuple[str, ...] = ()
        self._ready = threading.Event()
        self._done = threading.Event()
        self.deadline = math.inf
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tg: TaskGroup | None = None
        self._wake_evt: anyio.Event | None = None
        self._shutdown_scope: anyio.CancelScope | None = None
        self._retiring: set[Delivery] = set()

    # -- the caller's side --------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        """Start the thread; return once the loop runs."""
        self.thread = threading.Thread(target=self._thread_main, name=self.name, daemon=True)
        self.thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"the eventbus thread did not start within {timeout} s")
        if self.error is not None and self._tg is None:
            raise RuntimeError("the eventbus thread failed to start") from self.error

    @property
    def alive(self) -> bool:
        """Started and not finished."""
        return self.thread is not None and not self._done.is_set()

    def close(self, deadline: float) -> None:
        """Begin the shutdown; everything must be done by `deadline` (time.monotonic)."""
        self.deadline = deadline
        self.router.closing = True
        self.inbox.begin_close()
        self.inbox.wake()

    def give_up(self) -> None:
        """Stop waiting for anyone now: count what is left as lost (a second Ctrl-C)."""
        self.deadline = time.monotonic()
        self.router.closing = True
        loop, scope = self._loop, self._shutdown_scope
        if loop is not None and scope is not None:  # else the shutdown has not begun
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(scope.cancel)
        self.inbox.wake()

    def wait(self, timeout: float | None) -> bool:
        """Wait for the thread to finish; False on timeout. Not `Thread.join`: on CPython 3.11
        an interrupted join marks a running thread as stopped."""
        return self._done.wait(timeout)

    def wait_closed(self, deadline: float) -> KeyboardInterrupt | None:
        """Wait for the shutdown; a first Ctrl-C keeps draining, a second gives up (what is
        lost is counted). Returns the interrupt, for the caller to raise once closed."""
        interrupt: KeyboardInterrupt | None = None
        while True:
            try:
                self.wait(max(0.0, deadline - time.monotonic()) + 0.25)
                return interrupt
            except KeyboardInterrupt as e:
                if interrupt is None:
                    interrupt = e
                    get_logger().warning(
                        "interrupted while closing: still draining lossless subscribers; "
                        "interrupt again to give up (what is lost is counted)",
                        seconds_left=round(max(0.0, deadline - time.monotonic()), 1),
                    )
                else:
                    self.give_up()
                    deadline = min(deadline, time.monotonic() + 1.0)

    def abandon_blocked(self) -> None:
        """The loop thread is stuck in someone's code: count everything it held as lost and
        name the subscriber whose code it is running."""
        culprit = self.culprit()
        self.inbox.close()
        self.router.remaining()
        for d in self.router.deliveries:
            d.abandon()
        if culprit is not None:
            culprit.state = State.HUNG
            self.hung += (culprit.name,)
        get_logger().error(
            "the bus loop is blocked (sync code inside `async def`?); abandoned it",
            culprit=culprit.name if culprit else None,
            busy_with=culprit.busy_with if culprit else None,
        )

    def stats(self, deliveries: Iterable[Delivery]) -> BusStats:
        """Every counter: the inbox's, the router's, and each subscriber's."""
        inbox, error = self.inbox, self.error
        waiting = inbox.waiting()
        return BusStats(
            published=self.published(),
            rejected=inbox.rejected,
            inbox_size=waiting,
            inbox_high_water=inbox.high_water,
            blocked_s=inbox.blocked_ns / 1e9,
            wakeups=inbox.wakeups,
            subscribers={d.name: d.stats() for d in deliveries},
            hung=self.hung,
            feedback_dropped=inbox.feedback_dropped,
            inbox_bytes=inbox.nbytes,
            error=f"{type(error).__name__}: {error}" if error is not None else None,
            cost=self.cost.stats() if self.cost is not None else None,
        )

    def published(self) -> int:
        """Events accepted by publish: routed, dropped on the way, or waiting."""
        inbox, router = self.inbox, self.router
        return (
            router.routed + router.lost + inbox.dropped + inbox.feedback_dropped + inbox.waiting()
        )

    def culprit(self) -> Delivery | None:
        """The subscriber whose async code the loop thread is executing now (when blocked)."""
        frame = sys._current_frames().get(self.thread_id or -1)
        code = Delivery._call_async.__code__
        while frame is not None:
            if frame.f_code is code:
                d = frame.f_locals.get("self")
                return d if isinstance(d, Delivery) else None
            frame = frame.f_back
        return None

    # -- the loop thread ----------------------------------------------------------------

    def _thread_main(self) -> None:
        self.thread_id = threading.get_ident()
        thread_state.owner = self.inbox  # this thread is the bus side: it never waits on it
        try:
            anyio.run(self._main, backend="asyncio")
        except BaseException as e:  # never silently: reported here, in stats and at close
            while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
                e = e.exceptions[0]  # the task group's wrapping: name what really happened
            self.error = e
            self.inbox.close()  # first: nothing may arrive after the count below
            get_logger().error(
                "eventbus thread crashed; publishing no longer blocks and what "
                "it held is counted lost",
                exc_info=e,
            )
            self._count_losses()
        finally:
            if self.cost is not None:
                self.cost.sample()  # the bus thread's CPU, all of it
            self.inbox.close()  # publishers never wait on a loop that is gone
            self._ready.set()
            self._done.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake_evt = anyio.Event()
        self.inbox.bind(self._loop, self._on_wake)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            self._ready.set()
            await self._route_until_closing()
            await self._shutdown()
            tg.cancel_scope.cancel()

    def _on_wake(self) -> None:
        if self._wake_evt is not None:
            self._wake_evt.set()

    async def _route_until_closing(self) -> None:
        while not self.router.closing:
            await self.router.drain()
            if self.cost is not None and self.inbox.calm():  # else at a calmer wake
                # A publisher may fill the inbox past half before the report is in: one event
                # a second at most, it is taken up to the bound, never dropped as a storm.
                self.inbox.reporting = True
                try:
                    self.cost.tick(self.handle.publish)
                finally:
                    self.inbox.reporting = False
            if len(self.inbox):
                await anyio.sleep(0)  # more arrived while routing: let subscribers run first
                continue
            evt = self._wake_evt
            assert evt is not None
            with anyio.move_on_after(self.interval):
                await evt.wait()  # at once if set
            if evt.is_set():
                self._wake_evt = anyio.Event()

    def _spawn(self, fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
        assert self._tg is not None
        self._tg.start_soon(fn)

    def _start(self, d: Delivery) -> None:
        assert self._tg is not None
        self._tg.start_soon(self._run, d, name=f"eventbus:{d.name}")

    async def _run(self, d: Delivery) -> None:
        publisher.set(d.name)  # this task's context: names it if it floods the inbox
        if not await d.call_hook("on_start", self.handle) and d.state is State.RUNNING:
            d.disable("on_start raised")
            self.router.refresh()
        d.started = True  # a flush from now on completes as the queue empties
        await d.run()

    def _retire(self, d: Delivery) -> None:
        """A removed subscriber: deliver what was queued, then `on_close`, in its own task."""
        self._retiring.add(d)

        async def retire() -> None:
            publisher.set(d.name)
            try:
                await self._close_one(d, self.deadline if self.router.closing else math.inf)
                if d.state is State.CLOSED:
                    d.release()  # a subscribe/remove per evaluation must not pile up objects
            finally:
                self._retiring.discard(d)

        self._spawn(retire)
