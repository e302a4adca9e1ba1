"""The bus thread's side: the router that drains the inbox into per-subscriber queues,
starts and retires subscriber tasks, and closes them in order at shutdown.

`EventBus` inherits `LoopSide`; everything here runs on the bus thread's event loop, except
`_thread_main`, the thread's entry point. The inbox carries events and a few control items,
processed in order with them, so "published after subscribe() returned" is exact.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import Any

import anyio
from anyio.abc import TaskGroup

from eventbus._log import get_logger
from eventbus.capture import pending_of, resolve
from eventbus.events import Event
from eventbus.subscription import Runner

__all__ = ["CONTROL", "Attach", "Captured", "Detach", "Flush", "LoopSide"]


class Captured:
    """An inbox entry whose event holds tensors still being copied to the host."""

    __slots__ = ("ev",)

    def __init__(self, ev: Event) -> None:
        self.ev = ev


class Attach:
    """A subscribe() while running: takes effect in order with the events around it."""

    __slots__ = ("runner",)

    def __init__(self, runner: Runner) -> None:
        self.runner = runner


class Detach:
    """A Subscription.remove(): no later event is routed to it; queued ones still are."""

    __slots__ = ("runner",)

    def __init__(self, runner: Runner) -> None:
        self.runner = runner


class Flush:
    """Done when every subscriber handled what was published before it."""

    __slots__ = ("done", "remaining")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.remaining = 0

    def one_done(self) -> None:
        self.remaining -= 1
        if self.remaining <= 0:
            self.done.set()


CONTROL = (Attach, Detach, Flush)


class LoopSide:
    """The router and the subscribers' lifecycle, on the bus thread (mixed into EventBus)."""

    # State shared with the publishing side (set in EventBus.__init__).
    drain_interval: float
    close_timeout: float
    _inbox: deque[Any]
    _inbox_maxsize: int
    _inbox_high_water: int
    _runners: list[Runner]
    _routes: dict[type, tuple[Runner, ...]]
    _lossless: int
    _published: int
    _accepting: bool
    _closing: bool
    _close_deadline: float
    _hung: tuple[str, ...]
    _thread_id: int | None
    _loop: asyncio.AbstractEventLoop | None
    _wake_evt: anyio.Event | None
    _loop_error: BaseException | None
    _ready: threading.Event
    _space: threading.Event

    def _targets(self, cls: type, *, cache: bool = True) -> tuple[Runner, ...]:
        raise NotImplementedError  # EventBus: the routing table

    def _thread_main(self) -> None:
        self._thread_id = threading.get_ident()
        try:
            anyio.run(self._main, backend="asyncio")
        except BaseException as e:  # never silently: the close report names it
            self._loop_error = e
            get_logger().error("eventbus thread crashed", exc_info=e)
        finally:
            self._ready.set()
            self._space.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake_evt = anyio.Event()
        async with anyio.create_task_group() as tg:
            initial = list(self._runners)  # later ones arrive through Attach in the inbox
            for r in initial:
                r.open()
            self._ready.set()
            for r in initial:
                await self._start_runner(tg, r)
            await self._route_until_closing(tg)
            await self._shutdown(tg)
            tg.cancel_scope.cancel()

    async def _start_runner(self, tg: TaskGroup, r: Runner) -> None:
        if not await r.call_hook("on_start", self):
            r.disable("on_start raised")
        tg.start_soon(r.run, name=f"eventbus:{r.name}")

    async def _route_until_closing(self, tg: TaskGroup) -> None:
        interval = self.drain_interval
        while not self._closing:
            await self._drain(tg)
            if self._inbox:
                await anyio.sleep(0)  # more arrived while routing: let subscribers run first
                continue
            evt = self._wake_evt
            assert evt is not None
            if not evt.is_set():
                with anyio.move_on_after(interval):
                    await evt.wait()
            if evt.is_set():
                self._wake_evt = anyio.Event()

    async def _drain(self, tg: TaskGroup, chunk: int = 4096) -> None:
        """Route, in order, what the inbox holds now (at most `chunk` events)."""
        inbox = self._inbox
        n = len(inbox)
        if n > self._inbox_high_water:
            self._inbox_high_water = n
        popleft = inbox.popleft
        routes = self._routes
        for _ in range(min(n, chunk)):
            item = popleft()
            cls = type(item)
            if cls is Captured:
                ev = item.ev
                delay = 0.0001
                for p in pending_of(ev):
                    while not p.ready():  # a device->host copy still in flight: poll
                        await anyio.sleep(delay)  # backing off: each wake takes the GIL
                        delay = min(delay * 2, self.drain_interval)
                resolve(ev)
                item, cls = ev, type(ev)
            elif cls in CONTROL:
                await self._control(tg, item)
                continue
            self._published += 1
            targets = routes.get(cls)
            if targets is None:
                targets = self._targets(cls)
            for i, r in enumerate(targets):
                q = r.queue
                if not q.offer(item):  # type: ignore[union-attr]
                    self._space.set()  # room in the inbox while this queue is full
                    try:
                        await q.put(item)  # type: ignore[union-attr]
                    except anyio.get_cancelled_exc_class():  # the close deadline passed
                        for lost in targets[i:]:
                            lost.lost_at_close += 1
                        raise
                r.published += 1
        self._space.set()  # publishers waiting on a full inbox poll this (and time out)

    async def _control(self, tg: TaskGroup, item: Any) -> None:
        if type(item) is Attach:
            r = item.runner
            r.open()
            self._routes.clear()
            await self._start_runner(tg, r)
        elif type(item) is Detach:
            r = item.runner
            r.state = "removed"
            self._routes.clear()
            if r.lossless:
                self._lossless -= 1
            tg.start_soon(self._retire, r)
        else:
            live = [r for r in self._runners if r.queue is not None and r.state != "removed"]
            item.remaining = len(live) + 1
            for r in live:
                r.add_marker(item.one_done)
            item.one_done()

    async def _retire(self, r: Runner) -> None:
        """A removed subscriber: deliver what was queued, then `on_close`."""
        await self._wait_idle([r], self._close_deadline or (time.monotonic() + self.close_timeout))
        await r.call_hook("on_close")
        r.state = "closed"

    async def _wait_idle(self, runners: list[Runner], deadline: float) -> bool:
        """Wait until these runners' queues are empty and none is busy; False at the deadline."""
        while time.monotonic() < deadline:
            if _idle(runners):
                return True
            await anyio.sleep(0.001)
        return False

    async def _shutdown(self, tg: TaskGroup) -> None:
        """Drain, then close subscribers newest first; what they publish while closing
        still reaches those not yet closed. Whatever is still busy at the deadline is hung."""
        deadline = self._close_deadline
        while await self._drain_until_idle(tg, deadline):
            # Recomputed each round: a subscribe() just before close() is attached by the
            # drain above, and must be drained and closed like the others.
            live = [r for r in self._open_runners() if r.state in ("running", "disabled")]
            if not live:
                # Removed subscribers finish in their own _retire task: wait for them.
                while any(r.state == "removed" for r in self._runners):
                    if time.monotonic() >= deadline:
                        break
                    await anyio.sleep(0.001)
                break
            r = live[-1]
            with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                await r.call_hook("on_close")
            if r.busy_since is not None:
                break  # its on_close hung: the deadline passed
            r.state = "closed"
            self._routes.clear()
        self._accepting = False
        hung = []
        for r in self._runners:
            if r.queue is None:
                continue
            if r.busy_since is not None:
                r.state = "hung"
                hung.append(r.name)
            lost = len(r.queue)
            if lost:
                r.queue.discard_all()
        for item in list(self._inbox):  # routed nowhere: count as lost for their targets
            if type(item) not in CONTROL:
                ev = item.ev if type(item) is Captured else item
                for r in self._targets(type(ev)):
                    r.lost_at_close += 1
        self._inbox.clear()
        self._hung = tuple(hung)
        if hung:
            get_logger().error(
                "subscribers did not finish before the close deadline and were abandoned",
                subscribers=hung,
                busy_with={r.name: r.busy_with for r in self._runners if r.name in hung},
            )

    def _open_runners(self) -> list[Runner]:
        """Runners attached on the loop and not closed yet (removed ones still draining too)."""
        return [r for r in self._runners if r.queue is not None and r.state != "closed"]

    async def _drain_until_idle(self, tg: TaskGroup, deadline: float) -> bool:
        """Route the inbox and let every open runner finish its queue; False at the deadline."""
        while time.monotonic() < deadline:
            with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                await self._drain(tg)
            if self._inbox:
                await anyio.sleep(0)
            elif _idle(self._open_runners()):  # recomputed: the drain may attach runners
                return True
            else:
                await anyio.sleep(0.001)
        return False


def _idle(runners: list[Runner]) -> bool:
    return all(
        r.queue is None or (not len(r.queue) and r.busy_since is None) for r in runners
    )
