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
from typing import Any

from eventbus.events import Event, Loss, ReducedMetric
from eventbus.monitors._rank_link import Key, decode_float, encode_float
from eventbus.monitors._rank_monitor import RankMonitor

__all__ = ["OPS", "RankReducer"]

OPS: dict[str, Callable[[Sequence[float]], float]] = {
    "mean": lambda xs: math.fsum(xs) / len(xs),
    "sum": math.fsum,
    "min": min,
    "max": max,
}


class RankReducer(RankMonitor):
    """Publishes, on rank 0, `ReducedMetric(step, name, op, value, ranks, missing)` for each step
    of `events` once every rank sent its value: a `value` field (`Loss`), or each key of a
    `values` dict (`Scalars`, named "Scalars.<key>"). `op`: mean, sum, min or max."""

    name = "rank_reducer"
    silent = (
        "a rank sent no value to reduce for too long: it may be dead or hung; no longer "
        "waiting for it"
    )

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
        super().__init__(channel, every_s=every_s, timeout_s=timeout_s, close_wait_s=close_wait_s)
        self.published = 0  # ReducedMetric events (rank 0)
        self.skipped = 0  # events without a step, or with a value that is not a number

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
        if self._on:
            self._close_link(skipped=self.skipped)

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
