"""`Subscription`: what `bus.subscribe` returns."""

from __future__ import annotations

from collections.abc import Callable

from eventbus.core.delivery import Delivery
from eventbus.core.subscriber import State
from eventbus.stats import SubscriberStats

__all__ = ["Subscription"]


class Subscription:
    """What `subscribe` returns: `.remove()` detaches, `.stats()` reads its counters."""

    def __init__(self, delivery: Delivery | None, detach: Callable[[Delivery], None]) -> None:
        self._delivery = delivery
        self._detach = detach

    @property
    def name(self) -> str | None:
        """The subscriber's unique name in `bus.stats()` (None if not active on this rank)."""
        return self._delivery.name if self._delivery else None

    @property
    def active(self) -> bool:
        """False when `ranks=` excluded this rank, or after `remove()`."""
        return self._delivery is not None and self._delivery.state in (
            State.PENDING,
            State.RUNNING,
            State.DISABLED,
        )

    @property
    def closed(self) -> bool:
        """Drained and closed (or abandoned as hung) after `remove()` or the bus's close; True
        when there was nothing to close on this rank."""
        return self._delivery is None or self._delivery.state in (State.CLOSED, State.HUNG)

    def remove(self) -> None:
        """Detach: events published from now on are not routed to it; queued ones still are."""
        if self._delivery is not None:
            self._detach(self._delivery)

    def stats(self) -> SubscriberStats | None:
        """This subscriber's `SubscriberStats` (None if not active on this rank)."""
        return self._delivery.stats() if self._delivery else None

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
