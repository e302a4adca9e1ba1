"""How the sidecar ends, driven by the bus's close: a settle (a flush round trip: what its
subscribers published is back before the answer), each subscriber ended on its own, newest
first (what one publishes in `on_close` still reaches the older ones, as in the bus), then the
sidecar's bus closed, and the process let go. Also `flush()` of the sidecar's subscribers,
and what a close that gives up on the sidecar counts as never sent.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from typing import TYPE_CHECKING, Any

import anyio

from eventbus.core.subscriber import State
from eventbus.log import get_logger
from eventbus.process import wire
from eventbus.process.errors import RemoteError, RemoteTimeout

if TYPE_CHECKING:
    from eventbus.bus import EventBus
    from eventbus.core.delivery import Delivery
    from eventbus.events import Event
    from eventbus.process.channel import Channel
    from eventbus.process.remote import Remote

__all__ = ["POLL_S", "Closing"]

POLL_S = 0.05  # how often a waiting caller looks whether the sidecar still lives
_STALLED = object()  # no answer to a request of the close


class Closing:
    """The `Sidecar`'s ending (a mixin: the state is the sidecar's)."""

    bus: EventBus
    chan: Channel
    remotes: dict[int, Remote]
    gave_up: str | None
    closing: bool
    stalled: bool
    hung: tuple[str, ...]
    late: int
    final: bool
    gone: bool
    _cond: threading.Condition
    _through: int
    _held: Any
    _rest: list[Event]
    _told: set[int]
    _stale: int | None
    delivery: Delivery

    if TYPE_CHECKING:  # the sidecar's own (a stub here would shadow Reports' in the MRO)

        def request(self, op: bytes, arg: Any, *, within: float | None = None) -> Any: ...
        def abandon(self) -> tuple[str, ...]: ...
        def _remove(self, r: Any) -> None: ...
        def _removed(self, upto: int | None, *, ending: int | None = None) -> None: ...
        def _post(self, args: Any) -> bool: ...

    async def on_flush(self) -> None:
        """Every sidecar subscriber handled what came before, and ran its `on_flush`; raises
        (so `bus.flush()` says False) when they did not within the bus's close timeout.

        On the bus loop, waiting by sleeping: a flush a hung subscriber holds never holds our
        worker thread, where the close settles and closes the sidecar."""
        if self.gave_up is not None:
            return
        self._removed(self._sent_through() + 1)  # removals whose events were all sent
        chan, router = self.chan, self.bus._loop.router
        req = chan.ask(wire.FLUSH, self.bus.close_timeout)
        while (got := chan.answer(req)) is None:
            if router.closing:  # the close settles the sidecar itself; this wait must end
                with self._cond:
                    chan.forget(req)
                raise TimeoutError("the bus closed before the sidecar's subscribers flushed")
            await anyio.sleep(POLL_S / 10)
        if got[0] is False:
            raise TimeoutError(
                f"the sidecar's subscribers did not flush within {self.bus.close_timeout} s"
            )

    def _sent_through(self) -> int:
        """The seq up to which every event that can still reach us was sent: the last one
        sent, or, with nothing here (queued, in hand, held, in the inbox), every seq given out
        so far: some never reach us (published before we attached, dropped at the inbox), and
        waiting for them would leave a removal untold until the next event."""
        d, loop = self.delivery, self.bus._loop
        q = d.queue
        if d.in_flight or self._held is not None or (q is not None and len(q)):
            return self._through
        if loop.router._hand is not None or loop.inbox.waiting():
            return self._through
        return max(self._through, next(copy.copy(self.bus._seq)) - 1)

    def settle(self, timeout: float) -> None:
        """At close, before any subscriber closes: the sidecar's subscribers handle what they
        were sent (within `timeout`), and what they published for it is in our inbox when this
        returns (their status goes before the answer), to reach every subscriber."""
        if self.gave_up is None and self.remotes and not self.stalled:
            self._removed(None)
            self._ask_closing(wire.FLUSH, timeout, timeout)

    def parts(self) -> list[int]:
        """Its subscribers still open, newest first: the bus's close ends them one by one."""
        live = (State.PENDING, State.RUNNING, State.DISABLED)
        return sorted((r.id for r in self.remotes.values() if r.state in live), reverse=True)

    def close_part(self, rid: int, timeout: float) -> None:
        """At close: end one subscriber (no later event is its; it drains and closes there)
        within `timeout`; what it published, in `on_close` too, is in our inbox on return."""
        r = self.remotes.get(rid)
        if r is None or self.gave_up is not None or self.stalled:
            return  # stalled: the sidecar's own close ends it, with all the time left
        was = r.state
        with self._cond:  # at once: a flush or a batch telling removals between (on the bus
            self._remove(r)  # loop) would send it a REMOVE, closing it before the END's counters
            self._removed(None, ending=rid)  # all before was sent (the close drained us)
        parent = self.bus._loop.stats(self.bus._deliveries)  # final: in-process ones closed
        answer = self._ask_closing(wire.END, (rid, timeout, parent), timeout)
        if answer is None and r.state is State.REMOVED:  # not ended meanwhile (its sidecar
            r.state, r.cut = was, None  # died: not rebuilt); never built there: nothing to end

    def _ask_closing(self, op: bytes, arg: Any, within: float) -> Any:
        """A request of the close; `_STALLED` if the sidecar is dead (counted) or did not
        answer in time: its reading is held (a hung lossless subscriber), so the rest of the
        close goes to its own close, not to more requests it cannot read."""
        try:
            return self.request(op, arg, within=within)
        except RemoteTimeout:
            self.stalled = True
        except RemoteError:
            pass
        return _STALLED

    def on_close(self) -> None:
        """Close the sidecar's bus (its subscribers drain and close), then let it exit."""
        self._removed(None)
        self.closing = True
        if self.gave_up is None:
            with contextlib.suppress(RemoteError):
                parent = self.bus._loop.stats(self.bus._deliveries)  # final but for us
                # The bus's close deadline, less a margin for the answer to come back: a
                # sidecar subscriber that hangs is then abandoned there, and named.
                left = min(self.bus._loop.deadline - time.monotonic(), 1e6)
                t = (max(0.1, left - max(0.5, left / 10)), parent)
                within = max(0.05, left - min(0.25, left / 10))
                hung, self.late = self.request(wire.CLOSE, t, within=within)
                self.hung, self.final = tuple(hung), True
                with self._cond:  # the loop may be counting what it never sent (`_hang`)
                    for r in self.remotes.values():  # every report is in: the rest never came
                        r.unhandled()
                for name in self.hung:
                    get_logger().error("sidecar subscriber hung at close", subscriber=name)
                if self.late:  # ended out of time: they published while all else closed
                    get_logger().error(
                        "sidecar subscribers published while the sidecar closed, after every "
                        "subscriber that could take the events had closed; counted, not sent",
                        events=self.late,
                    )
        self.release()

    def release(self) -> None:
        """Let go of the sidecar (it drains, closes its files and exits by itself). A bus that
        never ran asked it nothing: none of its subscribers went unanswered (none is hung)."""
        self.closing = True
        ran = self.bus._loop.thread is not None
        if not self.final and self.gave_up is None and self.remotes and ran:
            self.final = True  # counted once: the bus's finish lets go again
            if self.chan.dead is None:
                self.hung += self.abandon()  # it never answered the close: counted, named
            else:
                self._died_closing(self.chan.dead)
        self.chan.stop()
        self.chan.finalizer.detach()

    def _died_closing(self, why: str) -> None:
        """It died during the close (no restart then): what it never reported handled is
        lost; its subscribers still open are disabled, not hung."""
        with self._cond:
            self.gone = True  # nothing more comes from it
            lost = {r.name: n for r in self.remotes.values() if (n := r.unhandled())}
            for r in self.remotes.values():
                if r.state not in (State.CLOSED, State.HUNG):
                    r.state, r.error = State.DISABLED, why
        get_logger().error("the sidecar process died during the close", error=why, lost=lost)

    def _never_sent(self, queued: list[Event]) -> None:
        """The close gave up on our delivery: what it still held (queued, and a batch waiting
        for room) is lost for the sidecar subscribers that wanted it, and counted so."""
        with self._cond:
            self.closing = True
            held, self._held = self._held, None
            rest = self._rest if held is not None else []  # its coroutine ends at the wake
            if held is not None:
                self._post((b"", 0, held[2], held[3]))  # closing: counted lost, never sent
            for r in self.remotes.values():
                r.never_reaches(queued)
                if r.id not in self._told:  # else `_unreachable` counted the batch for it
                    r.never_reaches(rest)

    def _unreachable(self, batch: list[Event]) -> None:
        """Events published before a removal the sidecar was told of early (the close ended
        the subscriber before its queue here drained): they cannot reach it; counted lost."""
        with self._cond:
            for r in self.remotes.values():
                if r.cut is not None and r.remove_at is None:
                    self._told.add(r.id)
                    r.never_reaches(batch)
            if (batch[-1].seq or 0) >= (self._stale or 0) - 1:
                self._stale = None
