"""How a run ended: the `RunEnded` a close publishes for a run that began and did not end.

A run begins with a `RunStarted`; if none of its events is a `RunEnded` when the bus closes,
the bus thread publishes one after everything else and before any subscriber closes, so sinks
and `eventbus summary` see a finished run. Its status says how it ended: "completed",
"failed" (the exception, from `with bus:`), "interrupted" (Ctrl-C, SIGTERM), "stopped" or
"aborted" (by whom, from `bus.control`), or "unknown" (the interpreter exited without close).
"""

from __future__ import annotations

from eventbus.control import AbortRequested, Control
from eventbus.core.cost import PublishClock
from eventbus.events import RunEnded

__all__ = ["RunEnding"]


class RunEnding:
    """What the bus saw of the run's end; `event()` builds the `RunEnded` at close."""

    def __init__(self, control: Control, clock: PublishClock | None) -> None:
        self.control = control
        self.clock = clock  # the highest step published, if the cost report is on
        self.status: str | None = None  # set by what ended it, first one wins
        self.reason: str | None = None

    def exited(self, et: type[BaseException] | None, e: BaseException | None) -> None:
        """`with bus:` ended, with this exception if any."""
        if et is None:
            return
        if issubclass(et, KeyboardInterrupt):
            self._set("interrupted", "KeyboardInterrupt")
        elif issubclass(et, AbortRequested):
            self._set("aborted", str(e) or None)
        elif issubclass(et, SystemExit) and getattr(e, "code", None) in (None, 0):
            return  # sys.exit(0) in the loop: it completed
        else:
            self._set("failed", f"{et.__name__}: {e}" if str(e) else et.__name__)

    def signalled(self, name: str) -> None:
        """A signal (SIGTERM) closes the bus."""
        self._set("interrupted", name)

    def at_exit(self) -> None:
        """The interpreter exits with the bus still open: finished or crashed, we cannot tell."""
        self._set("unknown", "the interpreter exited without close(): finished or crashed")

    def event(self) -> RunEnded:
        """The `RunEnded` for this run, as of now."""
        status, reason = self.status, self.reason
        c = self.control
        if status is None and c.stop_requested:  # the local flags: no collective from here
            status = "aborted" if c.abort_requested else "stopped"
            reason = " by ".join(x for x in (c.reason, c.source) if x) or None
        step = self.clock.last if self.clock is not None else None
        return RunEnded(step=step, status=status or "completed", reason=reason)

    def _set(self, status: str, reason: str | None) -> None:
        if self.status is None:
            self.status, self.reason = status, reason
