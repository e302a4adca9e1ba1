"""`Busy`: what a subscriber is inside now. A batch and a hook can overlap (a flush's
`on_flush` runs in a task of its own while the next batch is delivered); one ending must not
make the subscriber look idle while the other still runs."""

from __future__ import annotations

import time

__all__ = ["Busy"]


class Busy:
    """The calls into one subscriber in progress: since when, and in what."""

    __slots__ = ("_calls", "_n", "since", "what")

    def __init__(self) -> None:
        self._calls: dict[int, str] = {}
        self._n = 0
        self.since: float | None = None  # the earliest call still running began (monotonic)
        self.what: str | None = None  # the event type (or hook) it is handling

    def enter(self, what: str) -> int:
        """A call begins; returns its token for `leave`."""
        self._n += 1
        self._calls[self._n] = what
        if self.since is None:  # else the running one stays the one a hang is timed by
            self.since, self.what = time.monotonic(), what
        return self._n

    def leave(self, token: int) -> None:
        """The call `token` ended: idle if it was the last; else the clock restarts for
        the others (never an early hang verdict for a call that overlapped)."""
        self._calls.pop(token, None)
        if not self._calls:
            self.since = self.what = None
        else:
            self.since, self.what = time.monotonic(), next(reversed(self._calls.values()))
