"""How the sidecar ends, driven by the bus's close: a settle (a flush round trip: what its
subscribers published is back before the answer), each subscriber ended on its own, newest
first (what one publishes in `on_close` still reaches the older ones, as in the bus), then the
sidecar's bus closed, and the process let go. Also `flush()` of the sidecar's subscribers.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any

from eventbus.core.subscriber import State
from eventbus.log import get_logger
from eventbus.process import wire
from eventbus.process.errors import RemoteError

if TYPE_CHECKING:
    from eventbus.bus import EventBus
    from eventbus.process.channel import Channel
    from eventbus.process.remote import Remote

__all__ = ["Closing"]


class Closing:
    """The `Sidecar`'s ending (a mixin: the state is the sidecar's)."""

    bus: EventBus
    chan: Channel
    remotes: dict[int, Remote]
    gave_up: str | None
    closing: bool
    hung: tuple[str, ...]
    late: int
    _cond: threading.Condition

    def request(self, op: bytes, arg: Any) -> Any:
        raise NotImplementedError

    def _remove(self, r: Any) -> None:
        raise NotImplementedError

    def _removed(self, upto: int | None) -> None:
        raise NotImplementedError

    def on_flush(self) -> None:
        """Every sidecar subscriber handled what came before, and ran its `on_flush`; raises
        (so `bus.flush()` says False) when they did not within the bus's close timeout."""
        if self.gave_up is not None:
            return
        self._removed(None)  # everything before the flush was sent
        if self.request(wire.FLUSH, self.bus.close_timeout) is False:
            raise TimeoutError(
                f"the sidecar's subscribers did not flush within {self.bus.close_timeout} s"
            )

    def settle(self, timeout: float) -> None:
        """At close, before any subscriber closes: the sidecar's subscribers handle what they
        were sent (within `timeout`), and what they published for it is in our inbox when this
        returns (their status goes before the answer), to reach every subscriber."""
        if self.gave_up is None and self.remotes:
            self._removed(None)
            with contextlib.suppress(RemoteError):  # it died: its loss is counted already
                self.request(wire.FLUSH, timeout)

    def parts(self) -> list[int]:
        """Its subscribers still open, newest first: the bus's close ends them one by one."""
        live = (State.PENDING, State.RUNNING, State.DISABLED)
        return sorted((r.id for r in self.remotes.values() if r.state in live), reverse=True)

    def close_part(self, rid: int, timeout: float) -> None:
        """At close: end one subscriber (no later event is its; it drains and closes there)
        within `timeout`; what it published, in `on_close` too, is in our inbox on return."""
        r = self.remotes.get(rid)
        if r is None or self.gave_up is not None:
            return
        was = r.state
        self._remove(r)
        self._removed(None)  # everything before was sent (the close drained us first)
        with contextlib.suppress(RemoteError):  # it died: its loss is counted already
            if self.request(wire.END, (rid, timeout)) is None:
                r.state = was  # never built there (disabled): nothing to end

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
                hung, self.late = self.request(
                    wire.CLOSE, (max(0.1, left - max(0.5, left / 10)), parent)
                )
                self.hung = tuple(hung)
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
        """Let go of the sidecar (it drains, closes its files and exits by itself)."""
        self.closing = True
        self.chan.stop()
        self.chan.finalizer.detach()
