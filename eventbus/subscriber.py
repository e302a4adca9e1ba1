"""`Subscriber`: an optional base class for subscriber objects.

Subclassing is never required (any object with `on_events` works); it gives the class
attributes the bus reads, no-op hooks, and the Cerebras-style context manager:
`with MySubscriber():` attaches it to the default bus for the block (for objects that do
not subclass it, such as the built-in sinks: `register_global(JsonlWriter("runs/x"))`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from eventbus.bus import Subscription
from eventbus.events import Event

__all__ = ["Subscriber"]


class Subscriber:
    """Base for subscriber objects: override `on_events`; the rest is optional."""

    events: ClassVar[tuple[type[Event], ...]] = (Event,)
    policy: ClassVar[str] = "drop_oldest"
    maxsize: ClassVar[int] = 10_000
    _global_handle: Subscription | None = None

    async def on_events(self, batch: list[Event]) -> None:
        """Handle a batch of events, oldest first."""
        raise NotImplementedError

    def __enter__(self) -> Any:
        from eventbus._globals import register_global

        self._global_handle = register_global(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._global_handle is not None:
            self._global_handle.remove()
            self._global_handle = None
