"""`bus.control`: how monitors and users ask the training loop to stop, abort or save."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from eventbus.events import SaveRequested, StopRequested

__all__ = ["AbortRequested", "Control"]


class AbortRequested(RuntimeError):
    """Raised by `bus.control.check()` once an abort was requested."""


class Control:
    """Stop / abort / save flags shared by every thread; reading them costs an attribute lookup.

    `relay=True`: the events it publishes are requests replayed on another `Control` (a
    sidecar's, replayed on the training process's), which coalesces saves and is the one the
    loop clears: this one forwards every save request and keeps none pending.
    """

    def __init__(self, publish: Callable[[Any], None], *, relay: bool = False) -> None:
        self._publish = publish
        self._relay = relay
        self._lock = threading.Lock()
        self.stop_requested = False  # asked on this process
        self.abort_requested = False
        self.reason: str | None = None
        self.source: str | None = None
        self._save_asking = False  # asked: its SaveRequested is being published
        self._save_pending = False  # asked on this process, not yet agreed
        self._save_agreed = False  # agreed (by every rank at the same check): the loop saves
        # The SaveRequested of the save pending now (or of the last one): a CheckpointSaved
        # published after it (a higher seq) answers it, whoever else asked meanwhile.
        self.save_event: SaveRequested | None = None
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

    def request_save(
        self, reason: str = "", *, source: str | None = None, step: int | None = None
    ) -> bool:
        """Ask the loop to save a checkpoint at its next check; publishes `SaveRequested`.

        Requests coalesce: while one is pending (asked, or agreed and not yet `save_done()`)
        another does nothing and returns False. A relay forwards each one (True): the
        control it reaches coalesces.
        """
        with self._lock:
            if self._save_asking or self._save_pending or self._save_agreed:
                return False
            ev = self.save_event = SaveRequested(step=step, reason=reason, source=source)
            self._save_asking = not self._relay
        try:  # published first: a CheckpointSaved answering it comes after it in seq
            self._publish(ev)
        finally:
            with self._lock:
                if self._save_asking:  # not reset meanwhile
                    self._save_asking, self._save_pending = False, True
        return True

    @property
    def save_requested(self) -> bool:
        """True from the check that agreed a save until the loop calls `save_done()`.

        With several ranks a save is agreed at a `should_stop` check (every rank sees it at
        the same one); in one process it is seen at once. Reading it runs no collective.
        """
        return self._save_agreed or (self._save_pending and self.agree is None)

    @property
    def save_pending(self) -> bool:
        """True while a save asked on this process waits for the ranks to agree on it (in
        one process, where nothing needs agreeing: until `save_done()`)."""
        return self._save_pending

    def save_agreed(self, *, asked_on: int | None = None) -> None:
        """The ranks agreed on a save: `save_requested` reads True until `save_done()`.

        Called by the agreement; `asked_on` (the rank that asked) is recorded as a
        `SaveRequested` here when this rank did not ask, so every rank's log says why it saved.
        """
        with self._lock:
            asked_here, already = self._save_pending, self._save_agreed
            self._save_pending, self._save_agreed = False, True
        if asked_on is not None and not (asked_here or already):
            reason = f"save requested on rank {asked_on}"
            ev = self.save_event = SaveRequested(reason=reason, source=f"rank {asked_on}")
            self._publish(ev)

    def save_done(self) -> None:
        """The loop saved: clear the request (a later `request_save` asks again)."""
        with self._lock:
            self._save_agreed = False
            if self.agree is None:
                self._save_pending = False  # one process: seen at once, nothing to agree

    def check(self) -> None:
        """Raise `AbortRequested` if an abort was requested; a one-line guard for loops."""
        if self.should_abort:
            raise AbortRequested(self.reason or "abort requested")

    def reset(self) -> None:
        """Clear the flags (a new run on the same bus)."""
        with self._lock:
            self.stop_requested = self.abort_requested = False
            self._save_asking = self._save_pending = self._save_agreed = False
            self.save_event = None
            self.reason = self.source = None
