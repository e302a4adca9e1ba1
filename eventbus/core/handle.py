"""`BusHandle`: what a subscriber receives in `on_start(bus)`, wherever it runs.

The live bus, `replay` and a process-placed subscriber's child each hand their subscribers
an object of this shape: publish back onto the bus, read or request a stop, know the rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from eventbus.control import Control
    from eventbus.events import Event

__all__ = ["BusHandle"]


@runtime_checkable
class BusHandle(Protocol):
    """The bus as a subscriber sees it: `publish`, `control`, `rank`, `world_size`."""

    rank: int
    local_rank: int
    world_size: int
    control: Control

    def publish(self, ev: Event) -> None:
        """Publish an event from the subscriber side (never blocks on a full inbox)."""

    @property
    def should_stop(self) -> bool:
        """True once a stop (or abort) was requested."""
