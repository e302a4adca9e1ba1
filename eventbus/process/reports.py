"""What comes back from the sidecar, handled on the reader thread: acknowledgements (the byte
window), its subscribers' counters, log records, the events they published, their stop and
abort requests, and the answers to requests. The channel's end, unasked, is a death.
"""

from __future__ import annotations

import pickle
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from eventbus.core.subscriber import State
from eventbus.core.worker import thread_state
from eventbus.events import Event, SaveRequested
from eventbus.log import get_logger
from eventbus.process import wire
from eventbus.stats import SubscriberStats

if TYPE_CHECKING:
    from eventbus.bus import EventBus
    from eventbus.process.channel import Channel
    from eventbus.process.remote import Remote

__all__ = ["Reports"]


class Reports:
    """The `Sidecar`'s reader side and its death (a mixin: the state is the sidecar's)."""

    name: str
    bus: EventBus
    chan: Channel
    remotes: dict[int, Remote]
    refused: int
    closing: bool
    restarts: int
    max_restarts: int
    storm_base: int
    gave_up: str | None
    gone = False  # abandoned at close: its reports are no longer counted
    _cond: threading.Condition
    _routes: dict[type, tuple[Remote, ...]]

    def _launch(self) -> Channel:
        raise NotImplementedError

    if TYPE_CHECKING:  # the sidecar's own (a stub here would shadow it in the MRO)

        def _removed_gone(self) -> None: ...

    def _died(self, chan: Channel) -> None:
        """The channel ended unasked: count what was lost, restart it (or give up)."""
        with self._cond:
            chan.dead = chan.proc.why_dead(self.name, "its channel closed")
            self._cond.notify_all()
            if self.closing or chan is not self.chan:
                return
            # A channel that broke while its process lives: end that process first, so two
            # sidecars never write the same files (SIGKILL: it ignores SIGTERM).
            chan.proc.kill()
            chan.proc.join(1.0)
            code = chan.proc.exitcode
            lost = {r.name: n for r in self.remotes.values() if (n := r.died())}
            self.storm_base += chan.storm_dropped
            self.restarts += 1
            again = self.restarts <= self.max_restarts and not sys.is_finalizing()
            get_logger().error(
                "the sidecar process died; training goes on"
                + ("; restarting it" if again else "; no restarts left, its subscribers are off"),
                pid=chan.proc.pid,
                exitcode=code,
                lost=lost,
                restarts=self.restarts - 1,
            )
            chan.stop()
            self._removed_gone()
            for r in self.remotes.values():
                if r.state is State.DISABLED and r.off is None:  # not rebuilt: counted here
                    r.off = "disabled before its sidecar died"
            if again:
                self.chan = self._launch()
            else:
                self.gave_up = f"the sidecar died {self.restarts} times"
                for r in self.remotes.values():
                    if r.state in (State.PENDING, State.RUNNING):
                        r.state, r.error = State.DISABLED, self.gave_up
                    r.off = r.off or self.gave_up
            self._routes.clear()  # once every state and `off` above is set

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
                        if msg[1] in chan.abandoned:  # its asker timed out: nobody reads it
                            chan.abandoned.discard(msg[1])
                        else:
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
        with self._cond:
            r.state, r.error = State.DISABLED, error.splitlines()[0]
            r.off = r.error  # from now on counted here, as dropped
            r.died()  # what was sent to it before: never handled
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
        storm: int,
    ) -> None:
        chan.storm_dropped = storm  # cumulative, in this sidecar
        if acked:
            self._ack(chan, acked)
        log = get_logger()
        for level, text in logs:  # the sidecar's diagnostics, logged here as ours
            log.log(level, "sidecar: " + text, sidecar_pid=chan.proc.pid)
        for r in self.remotes.values() if not self.gone else ():
            if r.name in own:
                r.own = own[r.name]
            s = stats.get(r.name)
            if s is not None:
                failures = self.bus._ending.failures  # a strict bus: the first, to raise
                if failures is not None and s.failed > (r.last.failed if r.last else 0):
                    failures.note(r.name, s.error or f"{s.failed} events failed in the sidecar")
                r.last = s
                if s.state == "closed" and r.state is not State.REMOVED and not self.closing:
                    continue  # closed unasked: the sidecar is dying, and `_died` decides
                if r.state is not State.REMOVED or s.state in ("closed", "hung"):
                    r.state = State(s.state)  # the sidecar's word (a removal it has not seen yet)
        if packed is not None:
            for ev in wire.unpack(packed):
                try:
                    self.bus.publish(ev)  # keeps the sidecar's ts; seq and rank are ours
                except Exception as e:  # never the channel's end: counted and logged
                    self._refused(ev, e)
        control = self.bus.control
        for q in reqs:
            if isinstance(q, SaveRequested):  # a sidecar subscriber asked for a checkpoint
                control.request_save(q.reason, source=q.source, step=q.step)
                continue
            ask = control.request_abort if q.abort else control.request_stop
            ask(q.reason, source=q.source, step=q.step)

    def abandon(self) -> tuple[str, ...]:
        """The close gave up on the sidecar, which never sent its last report: what each
        subscriber was sent and not reported handled is lost; those still open are named hung
        (their reports from now on are ignored: they were counted)."""
        with self._cond:
            self.gone = True
            hung = []
            for r in self.remotes.values():
                r.unhandled()
                if r.state not in (State.CLOSED, State.HUNG):
                    r.state = State.HUNG
                    hung.append(r.name)
        get_logger().error(
            "the sidecar did not answer the close in time; its subscribers were abandoned",
            hung=hung,
        )
        return tuple(hung)

    def _refused(self, ev: Event, e: Exception) -> None:
        self.refused += 1
        get_logger().error(
            "an event a sidecar subscriber published was refused here",
            event_type=type(ev).__name__,
            step=ev.step,
            error=f"{type(e).__name__}: {e}",
            refused=self.refused,
        )
