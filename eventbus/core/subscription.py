"""`Subscription`: what `bus.subscribe` returns."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from eventbus.core.delivery import Delivery
from eventbus.core.subscriber import State
from eventbus.stats import SubscriberStats

__all__ = ["Subscription", "refuse_twice"]


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
        return self._delivery is not None and _active(self._delivery)

    @property
    def closed(self) -> bool:
        """Drained and closed (or abandoned as hung) after `remove()` or the bus's close; True
        when there was nothing to close on this rank."""
        return self._delivery is None or self._delivery.state in (State.CLOSED, State.HUNG)

    def remove(self) -> None:
        """Detach: events published from now on are not routed to it; queued ones still are."""
        if self._delivery is not None:
            self._delivery.removing = True
            self._detach(self._delivery)

    def stats(self) -> SubscriberStats | None:
        """This subscriber's `SubscriberStats` (None if not active on this rank)."""
        return self._delivery.stats() if self._delivery else None

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _active(d: Any) -> bool:
    return not d.removing and d.state in (State.PENDING, State.RUNNING, State.DISABLED)


def refuse_twice(sub: Any, deliveries: Iterable[Delivery], sidecar: Any = None) -> None:
    """An object with `on_events` subscribed again while its first subscription is active
    would get every event twice (a sink: each line written twice; two copies in the sidecar
    writing one file): a clear ValueError. `sidecar`: the bus's, whose subscribers count too."""
    if not hasattr(sub, "on_events"):
        return  # a function may be subscribed for other events again
    remotes = sidecar.remotes.values() if sidecar is not None else ()
    for d in [*deliveries, *remotes]:
        if d.sub is sub and _active(d):
            raise ValueError(
                f"this {type(sub).__qualname__} is already subscribed to this bus (as "
                f"{d.name!r}); it would get every event twice: remove() that subscription "
                "first, or subscribe a new instance"
            )
