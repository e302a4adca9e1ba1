"""`Sidecar`: the bus's one child process, hosting every subscriber placed there.

    bus thread                     sidecar's delivery (a worker thread)      sidecar process
    router --> queue["sidecar"] --> on_events: keep what its subscribers    a bus of its own:
                                    want, pack the batch once, wait for     inbox, router,
                                    room in the byte window, post it  --->  queues, delivery
    reader thread  <-- acks (the window), counters, events published, stop requests, replies

The parent sees each sidecar subscriber as a `Remote`: its counters in `bus.stats()` are the
sidecar's, plus what the parent sent that a dead sidecar never reported handled (counted
dropped). When the sidecar dies, training goes on: the loss is counted and logged, and a new
sidecar is started (`max_restarts` times) with every subscriber rebuilt, appending to its files.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import anyio

from eventbus.core.delivery import Delivery
from eventbus.core.fork import call_after_fork
from eventbus.core.subscriber import State, SubscribeOptions, unique_name
from eventbus.core.subscription import Subscription
from eventbus.core.worker import thread_state
from eventbus.events import Event
from eventbus.log import get_logger
from eventbus.process import wire
from eventbus.process.channel import Channel
from eventbus.process.errors import RemoteError
from eventbus.process.proxy import ProcessSubscriber
from eventbus.process.remote import Remote
from eventbus.stats import BusStats, SidecarStats, SubscriberStats

if TYPE_CHECKING:
    from eventbus.bus import EventBus

__all__ = ["Remote", "Sidecar"]

_POLL_S = 0.05  # how often a waiting caller looks whether the sidecar still lives


class Sidecar:
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
        self.closing = False
        self._routes: dict[type, tuple[Remote, ...]] = {}
        self._cond = threading.Condition()
        self._req = 0
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
        self.chan = self._launch(restarted=False)  # now: overlapped with the user's set-up
        bus._attach(self.delivery)
        call_after_fork(self.forget_after_fork)

    def _launch(self, restarted: bool) -> Channel:
        adds = [
            r.add_info() for r in self.remotes.values() if r.state in (State.PENDING, State.RUNNING)
        ]
        start = wire.START + wire.dumps(self.start_info(restarted))
        return Channel(self.name, start, adds, self.read)

    def start_info(self, restarted: bool) -> wire.StartInfo:
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
            # The sidecar finds its own hung subscriber before our router finds us waiting.
            "hang_timeout": None if hang is None else hang / 2,
            "max_consecutive_failures": b.max_consecutive_failures,
            "restarted": restarted,
            "max_bytes": min(64 << 20, b.queue_max_bytes),
            "ack_bytes": max(1, min(1 << 20, self.max_bytes_in_flight // 4)),
        }

    # -- subscribing (the caller's thread) -------------------------------------------------

    def subscribe(self, sub: Any, o: SubscribeOptions, name: str | None) -> Subscription:
        """Place `sub` in the sidecar (built there from its pickle or import path)."""
        spec = sub if isinstance(sub, ProcessSubscriber) else ProcessSubscriber(sub)
        with self._cond:
            self._ids += 1
            r = Remote(self._ids, unique_name(name or spec.name, self.bus._names), spec, o)
            self.remotes[r.id] = r
            self._routes.clear()
            if self.gave_up is None:
                self.chan.post(r.add_info())
            else:
                r.state, r.error = State.DISABLED, self.gave_up
        placed = getattr(sub, "placed_in_sidecar", None)
        if callable(placed):  # a built-in sink: its stats() read the sidecar copy's report
            placed(self.bus, lambda: r.own)
        return Subscription(r, self._remove)  # type: ignore[arg-type]

    def _remove(self, r: Any) -> None:
        with self._cond:
            if r.state in (State.PENDING, State.RUNNING, State.DISABLED):
                r.state = State.REMOVED
                self._routes.clear()
                self.chan.post(wire.REMOVE + wire.dumps(r.id))

    def _wanting(self, cls: type) -> tuple[Remote, ...]:
        t = self._routes.get(cls)
        if t is None:
            t = self._routes[cls] = tuple(
                r
                for r in self.remotes.values()
                if r.state in (State.PENDING, State.RUNNING) and issubclass(cls, r.events)
            )
        return t

    # -- the delivery's hooks (its worker thread) ------------------------------------------

    async def on_events(self, batch: list[Event]) -> None:
        """Keep what sidecar subscribers want, pack it once, post it within the byte window.

        On the bus loop (no hand-over to a worker thread): it never blocks; it waits for room
        in the window by sleeping, as backpressure."""
        counts = Counter(map(type, batch))  # per type, at C speed: no loop per event here
        routes = {cls: self._routes.get(cls) or self._wanting(cls) for cls in counts}
        out = batch if all(routes.values()) else [ev for ev in batch if routes[type(ev)]]
        if not out:
            return
        data = wire.BATCH + wire.pack(out) if self.gave_up is None else b""
        wanted = [(routes[cls], n) for cls, n in counts.items()]
        while not self._post(data, len(out), wanted):
            await anyio.sleep(_POLL_S / 10)  # backpressure: the sidecar acknowledges as it reads

    def _post(self, data: bytes, n: int, wanted: list[tuple[tuple[Remote, ...], int]]) -> bool:
        """Post a packed batch if the window has room, counting it for its subscribers (all
        lost if the sidecar is gone for good); False: no room yet."""
        with self._cond:
            chan = self.chan  # a new one after a restart: the batch goes there
            gone = self.gave_up is not None
            if not gone:
                if chan.in_flight and chan.in_flight + len(data) > self.max_bytes_in_flight:
                    return False
                chan.in_flight += len(data)
                chan.post(data)
                self.sent_events += n
                self.sent_bytes += len(data)
            for remotes, k in wanted:  # under the lock: a death counts exactly what it lost
                for r in remotes:
                    r.sent += k
                    if gone:
                        r.lost += k  # no sidecar any more: counted, never silent
            return True

    def on_flush(self) -> None:
        """Every sidecar subscriber handled what came before, and ran its `on_flush`."""
        self.request(wire.FLUSH, self.bus.close_timeout)

    def on_close(self) -> None:
        """Close the sidecar's bus (its subscribers drain and close), then let it exit."""
        self.closing = True
        if self.gave_up is None:
            with contextlib.suppress(RemoteError):
                parent = self.bus._loop.stats(self.bus._deliveries)  # final but for us
                # The bus's close deadline, less a margin for the answer to come back: a
                # sidecar subscriber that hangs is then abandoned there, and named.
                left = min(self.bus._loop.deadline - time.monotonic(), 1e6)
                hung = self.request(wire.CLOSE, (max(0.1, left - max(0.5, left / 10)), parent))
                for name in hung or ():
                    get_logger().error("sidecar subscriber hung at close", subscriber=name)
        self.release()

    def release(self) -> None:
        """Let go of the sidecar (it drains, closes its files and exits by itself)."""
        self.closing = True
        self.chan.stop()
        self.chan.finalizer.detach()

    def forget_after_fork(self) -> None:
        """In a forked child: close our copy of the socket, never touching the parent's."""
        with contextlib.suppress(OSError):
            self.chan.conn.close()  # our copy of the descriptor only: no shutdown

    def state_dicts(self) -> dict[str, Any]:
        """Each sidecar subscriber's `state_dict()`, by name."""
        if not self.remotes or self.gave_up is not None:
            return {}
        states: dict[str, Any] = self.request(wire.STATE, None)
        return states

    def load_state_dicts(self, states: dict[str, Any]) -> None:
        if states:
            self.request(wire.LOAD, states)

    def request(self, op: bytes, arg: Any) -> Any:
        """Ask the sidecar and wait for its answer; raise `RemoteError` for its error or death."""
        with self._cond:
            self._req += 1
            req, chan = self._req, self.chan
            chan.post(op + wire.dumps((req, arg)))
            while req not in chan.replies:
                if chan.dead is not None:
                    raise RemoteError(f"the sidecar died: {chan.dead}")
                self._cond.wait(_POLL_S)
            error, value = chan.replies.pop(req)
        if error is not None:
            raise RemoteError(error)
        return value

    # -- the reader thread -----------------------------------------------------------------

    def read(self, chan: Channel) -> None:
        """Handle what the sidecar sends until it closes; then its death, if unasked."""
        thread_state.owner = self.bus._inbox  # bus side: publishing here never waits
        handlers: dict[str, Callable[..., None]] = {
            "ack": self._ack,
            "status": self._status,
            "added": self._added,
            "ready": self._ready,
        }
        try:
            while True:
                msg = pickle.loads(chan.conn.recv_bytes())
                if msg[0] == "reply":
                    with self._cond:
                        chan.replies[msg[1]] = (msg[2], msg[3])
                        self._cond.notify_all()
                else:
                    handlers[msg[0]](chan, *msg[1:])
        except (EOFError, OSError):
            pass  # the sidecar exited (or shut its side): unasked, a death
        except BaseException as e:  # a message we cannot read: the channel is unusable
            get_logger().error("sidecar channel broken", error=f"{type(e).__name__}: {e}")
        chan.finish()
        self._died(chan)

    def _ready(self, chan: Channel, spawn_s: float) -> None:
        chan.spawn_s = spawn_s

    def _ack(self, chan: Channel, nbytes: int) -> None:
        with self._cond:
            chan.in_flight -= nbytes
            self._cond.notify_all()

    def _added(self, chan: Channel, rid: int, error: str | None) -> None:
        r = self.remotes[rid]
        if error is None:
            if r.state is State.PENDING:
                r.state = State.RUNNING
            return
        r.state, r.error = State.DISABLED, error.splitlines()[0]
        with self._cond:
            self._routes.clear()
        get_logger().error(
            "building a sidecar subscriber failed; it is disabled", subscriber=r.name, error=error
        )

    def _status(  # noqa: PLR0917 - the message's fields, in order
        self,
        chan: Channel,
        acked: int,
        stats: dict[str, SubscriberStats],
        packed: Any,
        reqs: Any,
        own: Any,
        logs: list[tuple[int, str]],
    ) -> None:
        if acked:
            self._ack(chan, acked)
        log = get_logger()
        for level, text in logs:  # the sidecar's diagnostics, logged here as ours
            log.log(level, "sidecar: " + text, sidecar_pid=chan.proc.pid)
        for r in self.remotes.values():
            if r.name in own:
                r.own = own[r.name]
            s = stats.get(r.name)
            if s is not None:
                r.last = s
                if r.state is not State.REMOVED or s.state in ("closed", "hung"):
                    r.state = State(s.state)  # the sidecar's word (a removal it has not seen yet)
        if packed is not None:
            for ev in wire.unpack(packed):
                self.bus.publish(ev)  # keeps the sidecar's ts; seq and rank are ours
        control = self.bus.control
        for q in reqs:
            ask = control.request_abort if q.abort else control.request_stop
            ask(q.reason, source=q.source, step=q.step)

    def _died(self, chan: Channel) -> None:
        code = chan.proc.exitcode if not chan.proc.is_alive() else None
        with self._cond:
            chan.dead = chan.proc.why_dead(self.name, "its channel closed")
            self._cond.notify_all()
            if self.closing or chan is not self.chan:
                return
            lost = {r.name: n for r in self.remotes.values() if (n := r.died())}
            self.restarts += 1
            again = self.restarts <= self.max_restarts
            get_logger().error(
                "the sidecar process died; training goes on"
                + ("; restarting it" if again else "; no restarts left, its subscribers are off"),
                pid=chan.proc.pid,
                exitcode=code,
                lost=lost,
                restarts=self.restarts - 1,
            )
            chan.stop()
            if again:
                self.chan = self._launch(restarted=True)
            else:
                self.gave_up = f"the sidecar died {self.restarts} times"
                for r in self.remotes.values():
                    if r.state in (State.PENDING, State.RUNNING):
                        r.state, r.error = State.DISABLED, self.gave_up
                self._routes.clear()

    def merged(self, st: BusStats) -> BusStats:
        """`bus.stats()` with the sidecar's subscribers and its own counters."""
        subs = dict(st.subscribers)
        for r in self.remotes.values():
            subs[r.name] = r.stats()
        return replace(st, subscribers=subs, sidecar=self.stats())

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
        )
