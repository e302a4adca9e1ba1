"""`Sidecar`: the bus's one child process, hosting every subscriber placed there.

    bus thread (its loop)                                                    sidecar process
    router --> queue["sidecar"] --> on_events: keep what its subscribers    a bus of its own:
                                    want, pack the batch once, wait for     inbox, router,
                                    room in the byte window, post it  --->  queues, delivery
    reader thread (`reports`) <-- acks, counters, events published, stop requests, replies

The parent sees each sidecar subscriber as a `Remote`: its counters in `bus.stats()` are the
sidecar's, plus what the parent sent that a dead sidecar never reported handled (counted
dropped). When the sidecar dies, training goes on: the loss is counted and logged, and a new
sidecar is started (`max_restarts` times) with every subscriber rebuilt, appending to its files.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import threading
import time
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import anyio

from eventbus.core.delivery import Delivery
from eventbus.core.fork import call_after_fork
from eventbus.core.subscriber import State, SubscribeOptions, name_for
from eventbus.core.subscription import Subscription
from eventbus.events import Event
from eventbus.log import get_logger
from eventbus.process import wire
from eventbus.process.channel import Channel
from eventbus.process.closing import POLL_S, Closing
from eventbus.process.errors import RemoteTimeout
from eventbus.process.proxy import ProcessSubscriber
from eventbus.process.remote import Remote
from eventbus.process.reports import Reports
from eventbus.stats import BusStats, SidecarStats

if TYPE_CHECKING:
    from eventbus.bus import EventBus

__all__ = ["Remote", "Sidecar", "place", "spec_of"]

# A packed batch, its event count, (remotes, count) per type, and what would not pickle.
_Batch = tuple[bytes, int, list[tuple[tuple[Remote, ...], int]], list[Event]]


def spec_of(sub: Any) -> ProcessSubscriber:
    """What the sidecar builds for `sub`; raises here if it cannot go there (unpicklable)."""
    return sub if isinstance(sub, ProcessSubscriber) else ProcessSubscriber(sub)


def place(
    bus: EventBus, sub: Any, o: SubscribeOptions, name: str | None, key: Any = None
) -> Subscription:
    """Subscribe `sub` in the bus's sidecar, started at the first (overlapping the user's
    set-up); one that cannot go there fails before any process starts."""
    if key is not None:
        raise TypeError(
            "key= (the `latest` policy's key) does not cross to the sidecar: subscribe with "
            "placement='thread' to keep the newest event per key, or keep the newest per key "
            "inside the subscriber"
        )
    spec = spec_of(sub)
    unique = name_for(spec, name, bus._names)  # a bad name= refused before a process starts
    if bus._sidecar is None:
        bus._sidecar = Sidecar(bus)  # it attaches itself
    return bus._sidecar.subscribe(sub, spec, o, unique)


class Sidecar(Closing, Reports):
    """The bus's child process for `placement="process"` subscribers; on the bus side, one
    lossless subscriber (named "sidecar") that forwards what its subscribers want."""

    name = "sidecar"

    def __init__(self, bus: EventBus, *, max_restarts: int = 3) -> None:
        self.bus = bus
        # Bytes posted and not yet taken in; the sidecar's inbox and queues hold as much again.
        self.max_bytes_in_flight = min(32 << 20, bus.queue_max_bytes)
        self.max_restarts = max_restarts
        self.nice = 10  # background work: under contention training keeps the CPU
        self.remotes: dict[int, Remote] = {}
        self.restarts = 0
        self.sent_events = 0
        self.sent_bytes = 0
        self.gave_up: str | None = None
        self.refused = 0  # events its subscribers published that our bus refused
        self.storm_base = 0  # storm drops of sidecars that died
        self.hung: tuple[str, ...] = ()  # its subscribers abandoned at close
        self.late = 0  # events its subscribers published in its own close: reached no one
        self.closing = False
        self.stalled = False  # a request of the close went unanswered: the rest is its close
        self.final = False  # its answer to the close came: every report is in
        self._routes: dict[type, tuple[Remote, ...]] = {}
        self._cut: int | None = None  # the first seq a removed subscriber no longer gets
        self._held: _Batch | None = None  # a batch waiting for room in the window
        self._through = -1  # the seq of the last event sent (or wanted by no one)
        self._rest: list[Event] = []  # what follows it in the batch in hand (cut at a removal)
        self._told: set[int] = set()  # removed ones the batch in hand was counted lost for
        self._stale: int | None = None  # events below this seq may be a removed one's
        self._cond = threading.Condition()
        self._ids = 0
        self.delivery = Delivery(
            self,
            name=self.name,
            policy="block",
            maxsize=65_536,
            max_batch=8192,
            max_bytes=bus.queue_max_bytes,
            max_consecutive_failures=None,
        )
        self.delivery.last = True  # closed after every in-process subscriber: it gets theirs
        self.delivery.on_abandon = self._never_sent
        self.since_ns = time.time_ns()  # a rebuilt sink appends only to files written since
        self.chan = self._launch()  # now: overlapped with the user's set-up
        bus._attach(self.delivery)
        call_after_fork(self.forget_after_fork)

    def _launch(self) -> Channel:
        """A sidecar; after a death, with every subscriber it hosted rebuilt (appending)."""
        adds = [
            r.add_info(restarted=True)
            for r in self.remotes.values()
            if r.state in (State.PENDING, State.RUNNING)
        ]
        start = wire.START + wire.dumps(self.start_info())
        return Channel(self.name, start, adds, self.read)

    def start_info(self) -> wire.StartInfo:
        b = self.bus
        hang = b._loop.router._hang_timeout
        return {
            "rank": b.rank,
            "world_size": b.world_size,
            "local_rank": b.local_rank,
            "name": b.name,
            "ppid": os.getpid(),
            "nice": self.nice,
            "drain_interval": b.drain_interval,
            "close_timeout": b.close_timeout,
            # The sidecar finds its own hung subscriber before our router finds us waiting.
            "hang_timeout": None if hang is None else hang / 2,
            "max_consecutive_failures": b.max_consecutive_failures,
            "max_bytes": min(64 << 20, b.queue_max_bytes),
            "ack_bytes": max(1, min(1 << 20, self.max_bytes_in_flight // 4)),
            "since_ns": self.since_ns,
        }

    # -- subscribing (the caller's thread) -------------------------------------------------

    def subscribe(
        self, sub: Any, spec: ProcessSubscriber, o: SubscribeOptions, name: str
    ) -> Subscription:
        """Place `sub` in the sidecar (built there as `spec_of(sub)` says) as `name` (unique)."""
        with self._cond:
            self._ids += 1
            r = Remote(self._ids, name, spec, o, sub)
            self.remotes[r.id] = r
            self._routes.clear()
            if self.gave_up is None:
                self.chan.post(r.add_info(restarted=False))
            else:
                r.state, r.error = State.DISABLED, self.gave_up
                r.off = self.gave_up
        placed = getattr(sub, "placed_in_sidecar", None)
        if callable(placed):  # a built-in sink: its stats() read the sidecar copy's report
            placed(self.bus, lambda: r.own)
        return Subscription(r, self._remove)  # type: ignore[arg-type]

    def _remove(self, r: Any) -> None:
        """Detach `r`: what was published before still reaches it (as in the bus, where the
        detach travels through the inbox); the sidecar drops it once those are sent."""
        with self._cond:
            if r.state in (State.PENDING, State.RUNNING, State.DISABLED):
                r.state = State.REMOVED
                r.remove_at = r.cut = next(copy.copy(self.bus._seq))  # the next event's seq
                cut = self._cut
                self._cut = r.remove_at if cut is None else min(cut, r.remove_at)

    def _removed(self, upto: int | None, *, ending: int | None = None) -> None:
        """Removals whose events are all sent (up to seq `upto`; None: all): tell the sidecar.
        `ending`: that one's END tells it (a REMOVE would close it before the END's counters
        arrive, and its last stats record would lack the training process's)."""
        with self._cond:
            for r in self.remotes.values():
                if r.remove_at is not None and (upto is None or r.remove_at <= upto):
                    if upto is None:  # told early (a flush, the close): some may still come
                        self._stale = max(self._stale or 0, r.remove_at)
                    r.remove_at = None
                    if r.id != ending:
                        self.chan.post(wire.REMOVE + wire.dumps(r.id))
            pending = [r.remove_at for r in self.remotes.values() if r.remove_at is not None]
            self._cut = min(pending, default=None)
            self._routes.clear()

    def _removed_gone(self) -> None:
        """Its sidecar died: a removed subscriber is not rebuilt, so it has ended; events from
        before its removal still waiting here cannot reach it (counted lost on the way)."""
        for r in self.remotes.values():
            if r.state is State.REMOVED:
                if r.remove_at is not None:
                    self._stale = max(self._stale or 0, r.remove_at)
                    r.remove_at = None
                r.state = State.CLOSED
        self._cut = None  # no removal is pending any more

    def _wanting(self, cls: type) -> tuple[Remote, ...]:
        t = self._routes.get(cls)
        if t is None:
            t = self._routes[cls] = tuple(
                r
                for r in self.remotes.values()
                if (
                    r.state in (State.PENDING, State.RUNNING, State.DISABLED)
                    or r.remove_at is not None
                )
                and issubclass(cls, r.events)
            )
        return t

    # -- the delivery's hooks (on_events on the bus loop; the others in its worker) ------

    async def on_events(self, batch: list[Event]) -> None:
        """Keep what sidecar subscribers want, pack it once, post it within the byte window.

        On the bus loop (no hand-over to a worker thread): it never blocks; it waits for room
        in the window by sleeping, as backpressure."""
        self._told = set()
        if self._stale is not None and (batch[0].seq or 0) < self._stale:
            self._unreachable(batch)
        if await self._forward(batch, []):
            self._through = max(self._through, batch[-1].seq or 0)

    async def _forward(self, batch: list[Event], rest: list[Event]) -> bool:
        """Post `batch` (`rest` follows it); False: the close gave up on us (all counted)."""
        cut = self._cut
        if cut is not None:  # a removal waits for what was published before it
            i = next((k for k, ev in enumerate(batch) if (ev.seq or 0) >= cut), None)
            if i is not None:
                if i and not await self._forward(batch[:i], batch[i:] + rest):
                    return False
                self._removed(batch[i].seq)
                return await self._forward(batch[i:], rest)  # the next removal may cut it
        counts = Counter(map(type, batch))  # per type, at C speed: no loop per event here
        routes = {cls: self._wanting(cls) for cls in counts}
        if not any(routes.values()):
            return True
        live = {cls: any(not r.off for r in rs) for cls, rs in routes.items()}
        out = batch if all(live.values()) else [ev for ev in batch if live[type(ev)]]
        data, bad = self._pack(out) if out and not self.closing else (b"", [])
        wanted = [(routes[cls], n) for cls, n in counts.items()]
        args = (data, len(out) - len(bad), wanted, bad)
        self._rest = rest
        while not self._post(args):
            await anyio.sleep(POLL_S / 10)  # backpressure: the sidecar acknowledges as it reads
            if self._held is not args:  # the close gave up on us meanwhile: counted there
                return False
        return True

    def _pack(self, out: list[Event]) -> tuple[bytes, list[Event]]:
        """The batch packed once; an event that cannot cross (a field pickle refuses) is left
        out, counted for each subscriber that wanted it (in `_post`) and logged."""
        data, refused = wire.pack_each(out)
        for ev, e in refused:
            get_logger().error(
                "an event cannot reach the sidecar: a field cannot be pickled; it is counted "
                "dropped for the sidecar's subscribers",
                event_type=type(ev).__name__,
                step=ev.step,
                error=f"{type(e).__name__}: {e}",
            )
        return (wire.BATCH + data if data else b""), [ev for ev, _ in refused]

    def _post(self, args: _Batch) -> bool:
        """Post a packed batch if the window has room, counting it for its subscribers; what
        cannot reach one (the sidecar closing or gone, the subscriber off, a field that would
        not pickle) is counted lost for it. False: no room yet."""
        data, n, wanted, bad = args
        with self._cond:
            chan = self.chan  # a new one after a restart: the batch goes there
            gone = self.gave_up is not None or self.closing
            if data and not gone:
                if chan.in_flight and chan.in_flight + len(data) > self.max_bytes_in_flight:
                    self._held = args  # until there is room, or the close gives up on it
                    return False
                chan.in_flight += len(data)
                chan.post(data)
                self.sent_events += n
                self.sent_bytes += len(data)
            self._held = None
            for remotes, k in wanted:  # under the lock: a death counts exactly what it lost
                for r in remotes:
                    r.sent += k
                    if gone or r.off:
                        r.lost += k  # it never gets there: counted, never silent
            for ev in bad if not gone else ():
                for r in self._wanting(type(ev)):
                    if not r.off:
                        r.lost += 1
            return True

    def forget_after_fork(self) -> None:
        """In a forked child: close our copy of the socket, never touching the parent's; a
        lock of our own (a thread of the parent's may have held it at the fork, for good)."""
        self._cond = threading.Condition()
        with contextlib.suppress(OSError):
            self.chan.conn.close()  # our copy of the descriptor only: no shutdown

    def state_dicts(self) -> dict[str, Any]:
        """Each sidecar subscriber's `state_dict()`, by name."""
        if not self.remotes or self.gave_up is not None:
            return {}
        states: dict[str, Any] = self._checkpoint(wire.STATE, None)
        return states

    def load_state_dicts(self, states: dict[str, Any]) -> None:
        if states:
            self._checkpoint(wire.LOAD, states)

    def _checkpoint(self, op: bytes, arg: Any) -> Any:
        """A state request, answered within twice the bus's `close_timeout` (the sidecar
        flushes first, within one): a hung sidecar subscriber (with `hang_timeout=None`) must
        not hold the training thread for ever."""
        t = 2 * self.bus.close_timeout
        try:
            return self.request(op, arg, within=t)
        except RemoteTimeout as e:
            raise RemoteTimeout(
                f"the sidecar's subscribers did not answer a checkpoint request within {t} s "
                "(twice close_timeout): one is hung, or holds the sidecar's reading with a full "
                "queue. bus.stats() names the one that is behind; set hang_timeout to have it "
                "disabled, or save without the bus's state"
            ) from e

    def request(self, op: bytes, arg: Any, *, within: float | None = None) -> Any:
        """Ask the sidecar and wait for its answer (`within` seconds at most); raise
        `RemoteError` for its error, its death, or no answer in time."""
        chan = self.chan
        req = chan.ask(op, arg)
        end = time.monotonic() + (math.inf if within is None else within)
        with self._cond:
            while (got := chan.answer(req)) is None:
                if time.monotonic() >= end:
                    chan.forget(req)
                    raise RemoteTimeout(f"the sidecar did not answer within {within} s")
                self._cond.wait(POLL_S)
        return got[0]

    def merged(self, st: BusStats) -> BusStats:
        """`bus.stats()` with the sidecar's subscribers and its own counters."""
        subs = dict(st.subscribers)
        for r in list(self.remotes.values()):  # a copy: subscribe() may add one meanwhile
            subs[r.name] = r.stats()
        return replace(st, subscribers=subs, sidecar=self.stats(), hung=st.hung + self.hung)

    def cpu_s(self) -> dict[str, float]:
        """Each sidecar subscriber's CPU seconds, as the sidecar reported them."""
        return {r.name: r.stats().cpu_s for r in self.remotes.values()}

    def names(self) -> set[str]:
        """The names of its subscribers (for checkpoints)."""
        return {r.name for r in self.remotes.values() if r.state is not State.REMOVED}

    def stats(self) -> SidecarStats:
        chan = self.chan
        return SidecarStats(
            pid=chan.proc.pid,
            alive=chan.proc.is_alive(),
            restarts=min(self.restarts, self.max_restarts),
            spawn_s=chan.spawn_s,
            sent_events=self.sent_events,
            sent_bytes=self.sent_bytes,
            in_flight_bytes=chan.in_flight,
            lost=sum(r.lost for r in self.remotes.values()),
            error=self.gave_up,
            storm_dropped=self.storm_base + chan.storm_dropped,
            refused=self.refused,
            late=self.late,
        )
