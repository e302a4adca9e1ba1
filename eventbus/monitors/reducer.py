"""`RankReducer`: a metric of every rank reduced on rank 0, off the training thread.

    every rank, bus loop: Loss(step=s, value=v) -> link.put(("Loss", s), v)   (a deque append)
    link thread, every tick_s: rank r > 0 pushes what it has to the rendezvous store's queue;
    rank 0 pops, and once every rank sent step s: ReducedMetric(step=s, name="Loss", op="mean")

The training thread runs no collective for it: publishing a `Loss` is all it does. A rank that
falls behind delays the reduced event (rank 0 waits for its part), never training; one that
sent nothing for `timeout_s` is reported (`RankUnresponsive`, a warning) and the steps go out
reduced over the ranks that sent them (`ranks`, `missing`). With one rank, it publishes nothing.
It closes before the other subscribers (`close_first`), so what it publishes at close reaches
every sink, whatever the order they were subscribed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

from eventbus.core import BusHandle
from eventbus.events import Event, Loss, RankUnresponsive, ReducedMetric
from eventbus.log import get_logger
from eventbus.monitors._rank_link import Key, RankLink, decode_float, encode_float

__all__ = ["OPS", "RankReducer"]

OPS: dict[str, Callable[[Sequence[float]], float]] = {
    "mean": lambda xs: math.fsum(xs) / len(xs),
    "sum": math.fsum,
    "min": min,
    "max": max,
}

_instances: dict[str, int] = {}  # channel name -> reducers made in this process (the same
# order on every rank gives each its own channel)


class RankReducer:
    """Publishes, on rank 0, `ReducedMetric(step, name, op, value, ranks, missing)` for each step
    of `events` once every rank sent its value: a `value` field (`Loss`), or each key of a
    `values` dict (`Scalars`, named "Scalars.<key>"). `op`: mean, sum, min or max."""

    policy: ClassVar[str] = "drop_oldest"  # a skipped step is tolerated: never backpressure
    maxsize: ClassVar[int] = 10_000
    close_first: ClassVar[bool] = True  # its last steps go out at close: before the sinks close
    name = "rank_reducer"

    def __init__(
        self,
        events: Iterable[type[Event]] = (Loss,),
        *,
        op: str = "mean",
        every_s: float = 0.05,
        timeout_s: float = 300.0,
        close_wait_s: float = 10.0,
        channel: str = "reduce",
    ) -> None:
        self.events = tuple(events)
        for cls in self.events:
            if not (isinstance(cls, type) and issubclass(cls, Event)):
                raise TypeError(f"events= takes Event subclasses (e.g. [Loss]); got {cls!r}")
            if issubclass(cls, ReducedMetric):
                raise ValueError("RankReducer cannot reduce its own ReducedMetric events")
        if not self.events:
            raise ValueError("events= is empty: name the event types to reduce, e.g. [Loss]")
        if op not in OPS:
            raise ValueError(f"op must be one of {', '.join(OPS)}; got {op!r}")
        if every_s <= 0 or timeout_s <= 0 or close_wait_s < 0:
            raise ValueError("every_s and timeout_s must be > 0 and close_wait_s >= 0")
        self.op = op
        n = _instances[channel] = _instances.get(channel, 0) + 1
        self.link = RankLink(
            f"{channel}/{n}",
            on_ready=self._ready,
            on_lost=self._lost,
            tick_s=every_s,
            timeout_s=timeout_s,
            close_wait_s=close_wait_s,
        )
        self.published = 0  # ReducedMetric events (rank 0)
        self.skipped = 0  # events without a step, or with a value that is not a number
        self._bus: BusHandle | None = None
        self._on = False

    def on_start(self, bus: BusHandle) -> None:
        """Open the link on every rank of a job of several; with one rank, stay off."""
        self._bus = bus
        self._on = bus.world_size > 1
        if self._on:
            self.link.start(bus.rank, bus.world_size)

    async def on_events(self, batch: list[Event]) -> None:
        """Queue this rank's values (bus loop; a few appends per event)."""
        if not self._on:
            return
        for ev in batch:
            if ev.step is None:
                self.skipped += 1
                continue
            for name, value in _values(ev):
                if value is None:
                    self.skipped += 1
                else:
                    self.link.put((name, ev.step), encode_float(value))

    def on_close(self) -> None:
        """Send the rest; rank 0 waits up to `close_wait_s` for the others' last values."""
        if not self._on:
            return
        self.link.close()
        st = self.link.stats()
        if st["failed"] or st["dropped"] or st["lost"] or self.skipped or st["error"]:
            get_logger().warning(
                "RankReducer lost values",
                rank=self._bus.rank if self._bus else 0,
                **st,
                skipped=self.skipped,
            )

    def stats(self) -> dict[str, Any]:
        """What crossed ranks and what was lost (counters of the link, on this rank)."""
        return {**self.link.stats(), "published": self.published, "skipped": self.skipped}

    # -- rank 0, the link's thread -----------------------------------------------------------

    def _ready(self, key: Key, parts: dict[int, Any], missing: tuple[int, ...]) -> None:
        name, step = key
        values = [decode_float(v) for _, v in sorted(parts.items())]
        if self._bus is None or not values:
            return
        self.published += 1
        self._bus.publish(
            ReducedMetric(
                step=step,
                name=name,
                op=self.op,
                value=OPS[self.op](values),
                ranks=len(values),
                missing=list(missing),
            )
        )

    def _lost(self, rank: int, waited: float) -> None:
        get_logger().warning(
            "a rank sent no value to reduce for too long: it may be dead or hung; no longer "
            "waiting for it",
            missing_rank=rank,
            waited_s=round(waited, 1),
        )
        if self._bus is not None:
            self._bus.publish(
                RankUnresponsive(missing_rank=rank, waited_s=round(waited, 3), source=self.name)
            )


def _values(ev: Event) -> Iterator[tuple[str, float | None]]:
    """(name, value) of each number an event carries; None for one that is not a number."""
    name = type(ev).__name__
    split = getattr(ev, "split", "train")
    if split != "train":
        name = f"{name}[{split}]"
    value = getattr(ev, "value", None)
    if value is not None:
        yield name, _number(value)
    values = getattr(ev, "values", None)
    if isinstance(values, dict):
        for k, v in values.items():
            yield f"{name}.{k}", _number(v)


def _number(v: Any) -> float | None:
    try:
        return float(v)  # a float, an int, or a one-element CPU tensor (already captured)
    except (TypeError, ValueError, RuntimeError):
        return None
