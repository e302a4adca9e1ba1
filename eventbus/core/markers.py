"""`Markers`: one subscriber's pending flushes, each due once it handled what came before."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

__all__ = ["Markers"]


class Markers:
    """Callbacks due once the subscriber has handled a given number of routed events."""

    def __init__(self) -> None:
        self._due: deque[tuple[int, Callable[[], None]]] = deque()

    def add(self, target: int, callback: Callable[[], None], *, done: int, idle: bool) -> bool:
        """Call `callback` now if `target` events were handled and nothing is in flight,
        else once `check` sees them; True if it was called now."""
        if done >= target and idle:
            callback()
            return True
        self._due.append((target, callback))
        return False

    def check(self, done: int) -> None:
        """Call every callback whose target `done` has reached, in order."""
        due = self._due
        while due and due[0][0] <= done:
            due.popleft()[1]()

    def release(self) -> None:
        """The subscriber was abandoned: nobody waiting on it may wait forever."""
        while self._due:
            self._due.popleft()[1]()
