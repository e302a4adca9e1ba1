"""How a run ended: the `RunEnded` a close publishes for a run that began and did not end.

A run begins with a `RunStarted`; if none of its events is a `RunEnded` when the bus closes,
the bus thread publishes one after everything else and before any subscriber closes, so sinks
and `eventbus summary` see a finished run. Its status says how it ended: "completed",
"failed" (the exception, from `with bus:`), "interrupted" (Ctrl-C, SIGTERM), "stopped" or
"aborted" (by whom, from `bus.control`), or "unknown" (the interpreter exited without close).

Every `RunEnded` the bus routes gets the cost totals and what was lost or failed so far
(`losses`); a strict bus raises its first subscriber failure from `close()`.
"""

from __future__ import annotations

from collections.abc import Callable

from eventbus.control import AbortRequested, Control
from eventbus.core.cost import CostMeter
from eventbus.core.strict import FirstFailure
from eventbus.events import RunEnded
from eventbus.log import get_logger
from eventbus.stats import BusStats, losses

__all__ = ["RunEnding"]


class RunEnding:
    """What the bus saw of the run's end; `event()` builds the `RunEnded` at close."""

    def __init__(
        self,
        control: Control,
        cost: CostMeter | None,
        stats: Callable[[], BusStats],
        *,
        strict: bool = False,
    ) -> None:
        self.control = control
        self.cost = cost  # the totals, and the highest step published; None: not measured
        self.stats = stats
        self.failures = FirstFailure() if strict else None  # strict: the first, to raise
        self.status: str | None = None  # set by what ended it, first one wins
        self.reason: str | None = None

    def exited(self, et: type[BaseException] | None, e: BaseException | None) -> None:
        """`with bus:` ended, with this exception if any."""
        if et is None:
            return
        if self.failures is not None:
            self.failures.settle()  # never mask the loop's own exception with a failure
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
        step = self.cost.clock.last if self.cost is not None else None
        return RunEnded(step=step, status=status or "completed", reason=reason)

    def fill(self, ev: RunEnded) -> None:
        """On the bus thread, as a `RunEnded` is routed: the cost totals and the losses so
        far, unless the event carries its own."""
        if self.cost is not None:
            self.cost.fill(ev)
        if ev.losses is None:
            try:
                ev.losses = losses(self.stats())
            except Exception as e:  # never the router's: the event goes out without them
                get_logger().error("RunEnded.losses could not be read", error=repr(e))

    def closed(self, st: BusStats) -> BusStats:
        """The bus closed with these stats; a strict bus raises its first failure here, but
        not for a signal's drain or at interpreter exit (nobody to raise it to: the close
        warning says it)."""
        if self.failures is not None and self.status not in ("interrupted", "unknown"):
            self.failures.at_close(st)
        return st

    def forget_after_fork(self) -> None:
        if self.failures is not None:
            self.failures.forget_after_fork()

    def _set(self, status: str, reason: str | None) -> None:
        if self.status is None:
            self.status, self.reason = status, reason
