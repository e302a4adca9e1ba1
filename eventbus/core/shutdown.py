"""The bus loop's ordered, bounded shutdown (`BusLoop` inherits it): the run's end, a drain
of every queue and of what subscribers publish meanwhile (the sidecar's too), then each
subscriber closed, newest first (first-closing ones before, the sidecar last), within its
share of the time left; what cannot finish is named hung, and what it held counted lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
from anyio.abc import TaskGroup

from eventbus.core.delivery import Delivery
from eventbus.core.handle import BusHandle
from eventbus.core.inbox import Inbox, publisher
from eventbus.core.router import Router
from eventbus.core.subscriber import State
from eventbus.events import Event
from eventbus.log import get_logger

__all__ = ["TICK", "Shutdown"]

TICK = 0.001  # how often shutdown looks whether a subscriber is idle


class Shutdown:
    """The closing half of `BusLoop`; the state is the loop's, declared here for the types."""

    inbox: Inbox
    router: Router
    handle: BusHandle
    ending: Callable[[], Event] | None
    deadline: float
    hung: tuple[str, ...]
    _tg: TaskGroup | None
    _shutdown_scope: anyio.CancelScope | None
    _retiring: set[Delivery]

    async def _shutdown(self) -> None:
        """Close subscribers newest first, each within a fair share of the time left."""
        assert self._tg is not None
        routing = anyio.CancelScope()
        self._tg.start_soon(self._route_while_closing, routing)
        with anyio.CancelScope() as self._shutdown_scope:
            await self._end_run()
            await self._drain_all()
            closed: set[Delivery] = set()
            while True:
                await self.router.drain(force=True)  # attaches late subscribers too
                todo = [d for d in self.router.deliveries if d not in closed]
                if not todo:
                    break
                d = ([x for x in todo if x.first] or [x for x in todo if not x.last] or todo)[-1]
                closed.add(d)
                share = (self.deadline - time.monotonic()) / (len(todo) + len(self._retiring))
                end = time.monotonic() + max(0.0, share)
                publisher.set(d.name)
                if d.last:  # the sidecar: its subscribers one by one first, in its share
                    await self._close_parts(d, end)
                await self._close_one(d, end)
            while self._retiring and time.monotonic() < self.deadline:
                await anyio.sleep(TICK)
        for d in tuple(self._retiring):
            self._hang(d)
        routing.cancel()
        self._count_losses()

    async def _end_run(self) -> None:
        """A run that began (a RunStarted) and did not end: publish its `RunEnded` now, after
        everything published before the close and before any subscriber closes."""
        while len(self.inbox) and not self.router.ended:
            await self.router.drain(force=True)
        if self.ending is not None and self.router.started and not self.router.ended:
            self.handle.publish(self.ending())

    async def _drain_all(self) -> None:
        """Let every subscriber finish its queue, and what the others publish meanwhile.

        Ends early when the only busy ones have sat in one call for a while (hung, or very
        slow): they still get their share below, and the others are not held up by them.
        """
        start = time.monotonic()
        stop = start + (self.deadline - start) / 2
        stuck_after = min(1.0, (self.deadline - start) / 10)
        while time.monotonic() < stop:
            await self.router.drain(force=True)
            now = time.monotonic()
            busy = [d for d in self.router.deliveries if not d.idle]
            quiet = not len(self.inbox) and all(
                d.busy_since is not None and now - d.busy_since >= stuck_after for d in busy
            )
            if quiet and (busy or not await self._sidecar_published(stop)):
                return
            await anyio.sleep(TICK)

    async def _sidecar_published(self, stop: float) -> bool:
        """Settle the sidecar (`last`) by `stop`: it answers once what its subscribers published
        is here. True if new events came (they reach every subscriber, its own too, first)."""
        routed = self.router.routed
        for d in [x for x in self.router.deliveries if x.last and x.state == State.RUNNING]:
            await d.call_hook("settle", max(0.0, stop - time.monotonic()))
        return len(self.inbox) > 0 or self.router.routed > routed

    async def _close_parts(self, d: Delivery, deadline: float) -> None:
        """End the parts of `d` (the sidecar's subscribers, `parts()`: newest first), each in a
        share of the time left; what one publishes at its close reaches the others (routed,
        sent and settled) before the next one ends, as in-process subscribers close."""
        parts = getattr(d.sub, "parts", None)
        todo = list(parts()) if callable(parts) else []
        for i, part in enumerate(todo):
            share = (deadline - time.monotonic()) / (len(todo) - i + 1)  # + 1: the rest after
            if share <= 0 or d.state != State.RUNNING:
                return
            end = time.monotonic() + share
            await d.call_hook("close_part", part, share)
            while time.monotonic() < end:
                await self.router.drain(force=True)
                if len(self.inbox) or not d.idle:
                    await anyio.sleep(TICK)
                elif not await self._sidecar_published(end):
                    break

    async def _route_while_closing(self, scope: anyio.CancelScope) -> None:
        with scope:
            while True:
                await self.router.drain(force=True)
                await anyio.sleep(TICK)

    async def _close_one(self, d: Delivery, deadline: float) -> None:
        """Drain `d`, then its `on_close`, by `deadline`; else name it hung and abandon it.

        Also when the whole shutdown is given up (a second Ctrl-C) while we wait here."""
        closing = closed = False
        try:
            with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                while len(self.inbox) or not d.idle:
                    await anyio.sleep(TICK)
                closing = True
                await d.call_hook("on_close")
                closed = True
                d.state = State.CLOSED
                if d.queue is not None:
                    d.queue.close()
                d.worker.stop()
        finally:
            if not closed:
                if closing or d.busy_since is not None:
                    self._hang(d)  # inside its own code: named
                else:
                    d.abandon()  # only waiting its turn: counted, not blamed
            self.router.refresh()  # nothing is routed to it any more

    def _hang(self, d: Delivery) -> None:
        """Abandon `d` inside its own code and name it, once (a removed one that hangs is
        reached twice: the close gives up on its retirement, which then ends too)."""
        if d.state is State.HUNG and d.name in self.hung:
            return
        lost = d.abandon()
        d.state = State.HUNG
        self.hung += (d.name,)
        get_logger().error(
            "subscriber did not finish before its close deadline and was abandoned",
            subscriber=d.name,
            busy_with=d.busy_with,
            queued_lost=lost,
        )

    def _count_losses(self) -> None:
        """What the inbox and the queues still hold will not be delivered: count it."""
        self.router.remaining()
        for d in self.router.deliveries + tuple(self._retiring):
            if d.state in (State.CLOSED, State.HUNG):
                continue
            if d.busy_since is not None:
                self._hang(d)  # abandoned inside its own code: named
            else:
                d.abandon()
