"""`Router`: drains the inbox into each subscriber's queue, by event type, on the bus loop.

It owns the route table and the set of attached subscribers, and changes them only on the
loop thread, in order with the events around each attach or detach. Publishers read two
things from another thread: `lossless` (an int) and `deliveries` (a tuple, replaced whole).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from itertools import compress, islice, repeat
from operator import call
from typing import Any

import anyio

from eventbus.capture import RINGS, pending_of, resolve
from eventbus.core.delivery import Delivery
from eventbus.core.inbox import Attach, Boxed, Detach, Flush, Inbox
from eventbus.core.subscriber import State
from eventbus.events import Event, RunEnded, RunStarted

__all__ = ["Router"]

_LOOK_EVERY = 0.05  # seconds between looks at a hung subscriber or a close, while waiting
_RUN_MIN = 32  # a drain this long may be routed as one run (`Router._route_run`)
_ONE_AT_A_TIME = frozenset({Boxed, Attach, Detach, Flush, RunEnded, RunStarted})


class Router:
    """Type -> subscriber queues; the one writer of the route table and the lossless count."""

    def __init__(
        self,
        inbox: Inbox,
        *,
        start: Callable[[Delivery], None],
        retire: Callable[[Delivery], None],
        spawn: Callable[[Callable[[], Coroutine[Any, Any, None]]], None],
        poll_max: float,
        hang_timeout: float | None = None,
    ) -> None:
        self.inbox = inbox
        self.deliveries: tuple[Delivery, ...] = ()  # attached and not removed
        self.lossless = 0  # attached subscribers with the `block` policy
        # Subscribers subscribed but not attached yet (their Attach is queued): a drop at the
        # inbox is already theirs, and a publisher meeting a full inbox already waits for the
        # lossless ones. Changed under `_drop_lock`; set ops are atomic for `waits`.
        self.pending: set[Delivery] = set()
        self.pending_lossless: set[Delivery] = set()
        self.routed = 0  # events taken from the inbox and routed
        self.lost = 0  # events still in the inbox when the loop gave up: routed nowhere
        self.closing = False  # set by the loop: from now on routing never waits
        self.run_ended: Callable[[RunEnded], None] | None = None  # fills in the cost totals
        self.started = self.ended = False  # a RunStarted, a RunEnded routed
        self._draining = anyio.Lock()
        # The event in hand while routing waits (and the subscribers it has not reached).
        self._hand: tuple[Event, tuple[Delivery, ...] | None] | None = None
        self._routes: dict[type, tuple[Delivery, ...]] = {}
        self._drop_lock = threading.RLock()  # reentrant: a publishing signal handler (inbox)
        self._start = start
        self._retire = retire
        self._spawn = spawn
        self._poll_max = poll_max
        self._hang_timeout = hang_timeout

    def targets(self, cls: type, *, cache: bool = True) -> tuple[Delivery, ...]:
        """The subscribers that take `cls` (a base class receives subclasses), cached by type.

        Publishers call it with `cache=False` (counting a drop): only the loop writes the cache.
        """
        t = self._routes.get(cls)
        if t is None:
            t = tuple(d for d in self.deliveries if issubclass(cls, d.events))
            if cache:
                self._routes[cls] = t
        return t

    def waits(self) -> bool:
        """Whether a publisher meeting a full inbox waits: a lossless subscriber is attached
        or on its way (subscribed, its attach still queued)."""
        return self.lossless > 0 or bool(self.pending_lossless)

    def expect(self, d: Delivery) -> None:
        """`d` was subscribed and its Attach queued: what the inbox drops from now on was its."""
        with self._drop_lock:
            self.pending.add(d)
            if d.lossless:
                self.pending_lossless.add(d)

    def forget(self, d: Delivery) -> None:
        """`d` was removed before the loop attached it."""
        with self._drop_lock:
            self.pending.discard(d)
            self.pending_lossless.discard(d)

    def count_drop(self, ev: Event) -> None:
        """An event dropped at the inbox (publisher's thread): counted for every subscriber
        that would have had it, attached or on its way."""
        cls = type(ev)
        with self._drop_lock:
            for d in self.targets(cls, cache=False):
                d.inbox_dropped += 1
            for d in self.pending:
                if issubclass(cls, d.events):
                    d.inbox_dropped += 1

    async def drain(self, chunk: int = 4096, *, force: bool = False) -> None:
        """Route, in order, what the inbox holds now (at most `chunk` items).

        `force`: never wait for room in a lossless queue (shutdown: nobody may hold it up).
        """
        inbox = self.inbox
        async with self._draining:  # one drain at a time: FIFO even across the loop's tasks
            try:
                await self._route_all(inbox.items, min(inbox.note_high_water(), chunk), force)
            finally:
                inbox.space()  # publishers waiting on a full inbox look again
            if RINGS.rings:  # scalar rings whose slots only dropped events held: copy them
                RINGS.unstick()

    async def _route_all(self, items: deque[Any], n: int, force: bool) -> None:
        """Pop and route `n` items straight from the inbox: one in hand at a time, so what a
        cancellation or an abandoned loop leaves behind is still in the inbox, counted there."""
        if n >= _RUN_MIN and self._route_run(items, n):
            return
        inbox = self.inbox
        routes = self._routes
        popleft = items.popleft
        force = force or self.closing
        for _ in range(n):
            try:
                entry = popleft()
            except IndexError:  # the closer took what was left (the loop was abandoned)
                return
            item, cls, nbytes = entry, type(entry), 0
            if cls is Boxed:
                if entry.nbytes:
                    nbytes = inbox.unbox(entry)
                item = entry.ev
                cls = type(item)
                if entry.captured:
                    pending = pending_of(item)
                    if any(not p.ready() for p in pending):
                        self._hand = (item, None)  # counted lost if cancelled while waiting
                        await self._copies(pending)  # a device->host copy still in flight
                        self._hand = None
                    resolve(item)
            elif cls is Attach or cls is Detach or cls is Flush:
                await self._control(item)
                continue
            elif cls is RunEnded:
                self.ended = True
                if self.run_ended is not None:
                    self.run_ended(item)  # the bus's cost totals, before anyone sees it
            elif cls is RunStarted:
                self.started = True
            self.routed += 1
            targets = routes.get(cls)
            if targets is None:
                targets = self.targets(cls)
            for k, d in enumerate(targets):
                q = d.queue
                assert q is not None
                if not q.put_nowait(item, nbytes, force) and not (
                    self.closing and q.put_nowait(item, nbytes, True)  # closing began since
                ):
                    inbox.space()  # room in the inbox while this queue is full
                    self._hand = (item, targets[k:])  # counted lost if we never come back
                    await self._wait_for_room(d, item, nbytes)
                    self._hand = None
                d.routed += 1

    def _route_run(self, items: deque[Any], n: int) -> bool:
        """Route the next `n` items at once when all are small events (no control item, no
        big one, no run boundary; captured ones whose copies are done) and every queue they
        go to takes them without waiting: C maps over the run, no bytecode per event but for
        resolving captures. False: nothing taken; route one at a time."""
        head = list(islice(items, n))  # a copy: publishers only append meanwhile
        if len(head) < n:  # the closer took some (an abandoned loop): one at a time
            return False
        boxes = [e for e in head if type(e) is Boxed]
        if boxes:
            if any(b.nbytes or not b.captured for b in boxes):
                return False  # a big one: its bytes leave the inbox's count one at a time
            head = [e.ev if type(e) is Boxed else e for e in head]
        kinds = set(map(type, head))
        if not kinds.isdisjoint(_ONE_AT_A_TIME):
            return False
        wants: dict[Delivery, set[type]] = {}
        for cls in kinds:
            for d in self.targets(cls):
                wants.setdefault(d, set()).add(cls)
        plan = []
        for d, mine in wants.items():
            evs = head
            if len(mine) < len(kinds):  # only some of the run's types: its share, in order
                evs = list(compress(head, map(mine.__contains__, map(type, head))))
            q = d.queue
            if q is None or not q.fits(len(evs)):
                return False  # a full queue: one at a time, waiting as needed
            plan.append((d, q, evs))
        # Tensors captured at publish: are their copies done? (query() on a CUDA event)
        if boxes and not all(p.ready() for b in boxes for p in pending_of(b.ev)):
            return False  # a device->host copy in flight: waited for one at a time
        deque(map(call, repeat(items.popleft, n)), maxlen=0)  # take them: `head`, in order
        self.routed += n
        # Read the captures only now that the run left the inbox, as one at a time does:
        # reading can hold the loop (an xla/mps host copy, a log handler) and a close that
        # gives up on it takes what the inbox holds, counted lost.
        for b in boxes:
            resolve(b.ev)
        for d, q, evs in plan:
            q.put_all(evs)  # fits was checked above; a queue closed since drops them, counted
            d.routed += len(evs)
        return True

    async def _wait_for_room(self, d: Delivery, ev: Event, nbytes: int) -> None:
        """Backpressure: wait until `d` takes from its full queue. One stuck in a single call
        for `hang_timeout` is hung: disabled (what reaches it is counted dropped), so that
        no subscriber can hold the training thread forever."""
        q = d.queue
        assert q is not None
        while True:
            with anyio.move_on_after(_LOOK_EVERY):
                await q.put(ev, nbytes)
                return
            if self.closing:  # shutdown routes without waiting on anyone
                q.put_nowait(ev, nbytes, force=True)
                return
            if self._hang_timeout is None:
                continue
            since = d.busy_since
            if since is not None and time.monotonic() - since >= self._hang_timeout:
                d.disable(
                    f"hung: inside one call for over {self._hang_timeout} s while its "
                    "full queue held the bus up"
                )
                self.refresh()
                q.put_nowait(ev, nbytes)  # disabled: counted as dropped
                return

    async def _copies(self, pending: list[Any]) -> None:
        """Wait, polling and never blocking the loop, until these device->host copies are done."""
        delay = 0.0001
        for p in pending:
            while not p.ready():  # query() on a CUDA event: never waits
                await anyio.sleep(delay)  # backing off: each wake takes the GIL
                delay = min(delay * 2, self._poll_max)

    async def _control(self, item: Any) -> None:
        if type(item) is Attach:
            d = item.delivery
            with self._drop_lock:  # from pending to attached at once: a drop counts once
                self.pending.discard(d)
                self.pending_lossless.discard(d)
                if d.state is not State.PENDING:  # removed before the loop attached it
                    return
                d.open()
                d.worker.owner = self.inbox  # its thread is this bus's side
                self._set((*self.deliveries, d))
            self._start(d)
        elif type(item) is Detach:
            d = item.delivery
            if d not in self.deliveries:
                return
            d.state = State.REMOVED
            self._set(tuple(x for x in self.deliveries if x is not d))
            self._retire(d)
        else:
            self.flush(item)

    def _set(self, deliveries: tuple[Delivery, ...]) -> None:
        self.deliveries = deliveries
        self.lossless = sum(1 for d in deliveries if d.lossless and d.state is State.RUNNING)
        self._routes.clear()

    def refresh(self) -> None:
        """A subscriber changed state (disabled, closed): recount and re-route."""
        self._set(tuple(d for d in self.deliveries if d.state in (State.RUNNING, State.DISABLED)))

    def flush(self, marker: Flush) -> None:
        """Complete `marker` once every attached subscriber handled what came before it."""
        live = self.deliveries
        marker.remaining = len(live) + 1
        for d in live:
            d.add_marker(self._then_flush(d, marker))
        marker.one_done()

    def _then_flush(self, d: Delivery, marker: Flush) -> Callable[[], None]:
        def drained() -> None:  # called from its run task: the hook gets a task of its own
            self._spawn(lambda: self._flushed(d, marker))

        return drained

    async def _flushed(self, d: Delivery, marker: Flush) -> None:
        try:
            # Abandoned: its worker is stopped, so a sync hook would never return.
            if d.abandoned or (d.state is State.RUNNING and not await d.call_hook("on_flush")):
                marker.ok = False
        finally:
            marker.one_done()

    def remaining(self) -> None:
        """What is still in the inbox (shutdown gave up): count it lost for its subscribers."""
        hand, self._hand = self._hand, None
        if hand is not None:  # the event in hand when the loop stopped: not routed to these
            ev, rest = hand
            if rest is None:
                self.lost += 1
                rest = self.targets(type(ev), cache=False)
            for d in rest:
                d.lost_at_close += 1
        for entry in self.inbox.take(len(self.inbox)):
            item = entry
            if type(entry) is Boxed:
                self.inbox.unbox(entry)
                item = entry.ev
            if isinstance(item, Event):
                self.lost += 1
                for d in self.targets(type(item), cache=False):
                    d.lost_at_close += 1
            elif type(item) is Flush:
                item.done.set()  # nobody will handle it: its waiter must not wait forever
