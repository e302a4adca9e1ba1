"""`EventBus(strict=True)`: the first subscriber failure, raised on the training thread.

A subscriber that raises is counted and logged, and training goes on: right for a long run,
wrong for a test or a CI run, where a broken sink should fail the job. A strict bus keeps the
first failure (in-thread, in a worker or in the sidecar) and raises it once as
`SubscriberFailed` from the next `publish` (after queueing that event: nothing is lost) or,
if none came, from `close()` (after everything was drained), unless the loop is already
unwinding with an exception of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from eventbus._compiling import compiling
from eventbus.core.worker import thread_state
from eventbus.events import Event
from eventbus.stats import BusStats

__all__ = ["FirstFailure", "SubscriberFailed"]


class SubscriberFailed(RuntimeError):
    """A subscriber of a strict bus raised; `subscriber`, `error` say who and what; `events`,
    `event_type` and `step` the batch it failed on (its first event). The original exception
    is the `__cause__` when it ran in this process."""

    def __init__(
        self,
        subscriber: str,
        error: str,
        event_type: str | None = None,
        step: int | None = None,
        events: int = 0,
    ) -> None:
        self.subscriber, self.error = subscriber, error
        self.event_type, self.step, self.events = event_type, step, events
        where = ""
        if event_type is not None:
            at = f" at step {step}" if step is not None else ""
            where = f" on {event_type}{at}" + (f" (a batch of {events})" if events > 1 else "")
        super().__init__(
            f"subscriber {subscriber!r} failed{where}: {error} "
            "(EventBus(strict=True) raises the first failure; see the log for the others)"
        )


class FirstFailure:
    """The first failure a strict bus saw; `take()` hands it out once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._first: SubscriberFailed | None = None
        self._taken = False
        self.pending = False  # a failure waits to be raised: publish looks at this only

    def note(
        self,
        subscriber: str,
        exc: BaseException | str,
        ev: Event | None = None,
        events: int = 1,
        hook: str | None = None,
    ) -> None:
        """A subscriber failed on `events` events from `ev` (or in `hook`), on any thread; the
        first is kept."""
        with self._lock:
            if self._first is not None:
                return
            text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
            text = f"in {hook}: {text}" if hook else text
            step = ev.step if ev is not None and type(ev.step) is int else None
            self._first = SubscriberFailed(
                subscriber, text, None if ev is None else type(ev).__name__, step, events
            )
            if isinstance(exc, BaseException):
                self._first.__cause__ = exc
            self.pending = not self._taken

    def take(self) -> SubscriberFailed | None:
        """The first failure, the first time it is asked for; then None."""
        with self._lock:
            if self._taken or self._first is None:
                return None
            self._taken, self.pending = True, False
            return self._first

    def forget_after_fork(self) -> None:
        """In a forked child: nothing to raise there (its lock may have been held at the fork)."""
        self._lock = threading.Lock()
        self.settle()

    def settle(self) -> None:
        """Never raise: the caller is unwinding with an exception of its own."""
        with self._lock:
            self._taken, self.pending = True, False

    def checked(self, publish: Callable[[Event], None]) -> Callable[[Event], None]:
        """`publish`, then the pending failure raised (the event is queued first), only on
        the user's threads: never on a bus side (this bus's or another's) or on a thread of
        eventbus's own (a watchdog, a listener), where it would be caught and lost."""

        def strict_publish(ev: Event) -> None:
            publish(ev)
            if compiling():  # traced: the op's eager body calls this wrapper again at run time
                return
            if self.pending and _users_thread():
                first = self.take()
                if first is not None:
                    raise first

        return strict_publish

    def at_close(self, st: BusStats) -> None:
        """Raise the first failure, or one only the final counters show (a sidecar
        subscriber's last report), unless it was raised already."""
        if not self._taken:
            for name, s in st.subscribers.items():
                if s.failed:
                    self.note(name, s.error or f"{s.failed} events failed")
                    break
        first = self.take()
        if first is not None:
            raise first


def _users_thread() -> bool:
    """Not the bus side of any bus (a subscriber of another bus, publishing here), and not a
    thread of eventbus's own (a watchdog, a listener: all named "eventbus-...")."""
    return thread_state.owner is None and not threading.current_thread().name.startswith("eventbus")
