"""`bus.control`: how monitors and users ask the training loop to stop or abort."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from eventbus.events import StopRequested

__all__ = ["AbortRequested", "Control"]


class AbortRequested(RuntimeError):
    """Raised by `bus.control.check()` once an abort was requested."""


class Control:
    """Stop / abort flags shared by every thread; reading them costs an attribute lookup."""

    def __init__(self, publish: Callable[[Any], None]) -> None:
        self._publish = publish
        self._lock = threading.Lock()
        self.stop_requested = False  # asked on this process
        self.abort_requested = False
        self.reason: str | None = None
        self.source: str | None = None
        # Set by the distributed layer: takes (local stop, local abort) and returns what all
        # ranks agreed. None in a single process.
        self.agree: Callable[[bool, bool], tuple[bool, bool]] | None = None

    def request_stop(
        self, reason: str, *, source: str | None = None, step: int | None = None
    ) -> None:
        """Ask the loop to stop at its next `bus.should_stop` check (idempotent).

        `step`: the step that prompted it (recorded on the `StopRequested` event).
        """
        self._request(reason, source, step, abort=False)

    def request_abort(
        self, reason: str, *, source: str | None = None, step: int | None = None
    ) -> None:
        """Ask the loop to stop now, without a final checkpoint; implies a stop."""
        self._request(reason, source, step, abort=True)

    def _request(self, reason: str, source: str | None, step: int | None, *, abort: bool) -> None:
        with self._lock:
            first = not (self.abort_requested if abort else self.stop_requested)
            if abort:
                self.abort_requested = True
            if first and (self.reason is None or abort):
                self.reason, self.source = reason, source
            self.stop_requested = True
        if first:
            self._publish(StopRequested(step=step, reason=reason, abort=abort, source=source))

    @property
    def should_stop(self) -> bool:
        """True once a stop or an abort was requested (agreed across ranks when distributed)."""
        if self.agree is not None:
            return self.agree(self.stop_requested, self.abort_requested)[0]
        return self.stop_requested

    @property
    def should_abort(self) -> bool:
        """True once an abort was requested (agreed across ranks when distributed)."""
        if self.agree is not None:
            return self.agree(self.stop_requested, self.abort_requested)[1]
        return self.abort_requested

    def check(self) -> None:
        """Raise `AbortRequested` if an abort was requested; a one-line guard for loops."""
        if self.should_abort:
            raise AbortRequested(self.reason or "abort requested")

    def reset(self) -> None:
        """Clear the flags (a new run on the same bus)."""
        with self._lock:
            self.stop_requested = self.abort_requested = False
            self.reason = self.source = None
