"""`RankMonitor`: what `RankReducer` and `StragglerDetector` share. A `RankLink` on a channel
of its own, opened on every rank of a job of several (off with one rank), a rank gone silent
reported, and the link closed before the sinks, its losses logged."""

from __future__ import annotations

from typing import Any, ClassVar

from eventbus.core import BusHandle
from eventbus.events import RankUnresponsive
from eventbus.log import get_logger
from eventbus.monitors._rank_link import Key, RankLink

__all__ = ["RankMonitor"]

_instances: dict[str, int] = {}  # channel name -> monitors made in this process (the same
# order on every rank gives each its own channel)


class RankMonitor:
    """A subscriber whose rank 0 hears every rank through its `link`."""

    policy: ClassVar[str] = "drop_oldest"  # a skipped step is tolerated: never backpressure
    maxsize: ClassVar[int] = 10_000
    close_first: ClassVar[bool] = True  # it publishes its last steps at close: before sinks close
    name: str
    silent: ClassVar[str]  # the warning for a rank that sent nothing for `timeout_s`

    def __init__(
        self, channel: str, *, every_s: float, timeout_s: float, close_wait_s: float
    ) -> None:
        n = _instances[channel] = _instances.get(channel, 0) + 1
        self.link = RankLink(
            f"{channel}/{n}",
            on_ready=self._ready,
            on_lost=self._lost,
            tick_s=every_s,
            timeout_s=timeout_s,
            close_wait_s=close_wait_s,
        )
        self._bus: BusHandle | None = None
        self._on = False

    def on_start(self, bus: BusHandle) -> None:
        """Open the link on every rank of a job of several; with one rank, stay off."""
        self._bus = bus
        self._on = bus.world_size > 1
        if self._on:
            self.link.start(bus.rank, bus.world_size)

    def _close_link(self, **own: int) -> None:
        """Send the rest; rank 0 waits up to `close_wait_s` for the others'. What was lost on
        the way (and `own` counts of the monitor's) is logged."""
        self.link.close()
        st = self.link.stats()
        if st["failed"] or st["dropped"] or st["lost"] or st["error"] or any(own.values()):
            rank = self._bus.rank if self._bus is not None else 0
            get_logger().warning(f"{type(self).__name__} lost values", rank=rank, **st, **own)

    def _ready(self, key: Key, parts: dict[int, Any], missing: tuple[int, ...]) -> None:
        raise NotImplementedError

    def _lost(self, rank: int, waited: float) -> None:
        get_logger().warning(self.silent, missing_rank=rank, waited_s=round(waited, 1))
        if self._bus is not None:
            self._bus.publish(
                RankUnresponsive(missing_rank=rank, waited_s=round(waited, 3), source=self.name)
            )
