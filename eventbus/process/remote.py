"""`Remote`: a subscriber in the sidecar, as the parent sees it: its options and counters."""

from __future__ import annotations

from typing import Any

from eventbus.core.subscriber import State, SubscribeOptions
from eventbus.events import Event
from eventbus.process import wire
from eventbus.process.proxy import ProcessSubscriber
from eventbus.stats import SubscriberStats

__all__ = ["Remote"]


class Remote:
    """A subscriber in the sidecar as the parent sees it: name, options, counters."""

    def __init__(
        self, rid: int, name: str, spec: ProcessSubscriber, o: SubscribeOptions, sub: Any = None
    ) -> None:
        self.id = rid
        self.sub = sub  # the object subscribed (subscribing it again is refused while active)
        self.removing = False  # as a Delivery's: `remove()` takes effect at once
        self.name = name
        self.spec = spec
        self.events = o.events
        self.policy = o.policy
        self.maxsize = o.maxsize
        self.max_batch = o.max_batch
        self.state = State.PENDING
        self.error: str | None = None
        self.sent = 0  # events the parent sent it (all sidecars together)
        self.lost = 0  # of those, never reported handled by a sidecar that died
        self.base = _Counts()  # what earlier (dead) sidecars reported handled
        self.last: SubscriberStats | None = None  # the live sidecar's latest report
        self.off: str | None = None  # why the parent stopped sending to it (counted lost)
        self.remove_at: int | None = None  # removed: events from this seq on are not its
        self.cut: int | None = None  # that seq, kept once the sidecar was told of the removal
        self.own: Any = None  # the subscriber's own `stats()`, as last reported

    def add_info(self, *, restarted: bool) -> bytes:
        info: wire.AddInfo = {
            "id": self.id,
            "name": self.name,
            "target": self.spec.target,
            "main": self.spec.main,
            "events": wire.dumps(self.events),
            "policy": self.policy,
            "maxsize": self.maxsize,
            "max_batch": self.max_batch,
            "restarted": restarted,
        }
        return wire.ADD + wire.dumps(info)

    def wants(self, ev: Event) -> bool:
        """Whether `ev` was routed for it (a removed one: published before the removal)."""
        if not isinstance(ev, self.events):
            return False
        if self.cut is None:
            return self.state in (State.PENDING, State.RUNNING, State.DISABLED)
        return (ev.seq or 0) < self.cut

    def never_reaches(self, events: list[Event]) -> None:
        """Of `events`, those it wanted (`wants`) cannot be sent to it any more: counted sent
        and lost, as `_post` counts a batch the sidecar will never get."""
        k = sum(map(self.wants, events))
        self.sent, self.lost = self.sent + k, self.lost + k

    def died(self) -> int:
        """Its sidecar died: keep what it reported handled; the rest it was sent is lost."""
        if self.last is not None:
            self.base = self.base.plus(self.last)
            self.last = None
        lost = self.sent - self.lost - self.base.handled
        self.lost += max(0, lost)
        return max(0, lost)

    def _counts(self) -> _Counts:
        """What its sidecars reported handled: the dead ones' and the live one's latest."""
        return self.base.plus(self.last) if self.last is not None else self.base

    def unhandled(self) -> int:
        """Its sidecar is done (closed, or given up at close): what it never reported handled
        is lost (counted here, and returned)."""
        lost = max(0, self.sent - self.lost - self._counts().handled)
        self.lost += lost
        return lost

    def stats(self) -> SubscriberStats:
        """Its counters: the sidecar's report, plus what the parent knows was lost."""
        c = self._counts()
        dropped = c.dropped + self.lost
        last = self.last
        return SubscriberStats(
            name=self.name,
            policy=self.policy,
            state=str(self.state),
            published=self.sent,
            delivered=c.delivered,
            dropped=dropped,
            failed=c.failed,
            queued=max(0, self.sent - c.delivered - dropped - c.failed),  # in flight included
            queue_high_water=last.queue_high_water if last else 0,
            latency_p50_ms=last.latency_p50_ms if last else None,
            latency_p99_ms=last.latency_p99_ms if last else None,
            latency_max_ms=last.latency_max_ms if last else None,
            error=self.error or (last.error if last else None),
            queued_bytes=last.queued_bytes if last else 0,
            cpu_s=c.cpu_s,
        )


class _Counts:
    """Events handled: delivered, failed, dropped."""

    def __init__(
        self, delivered: int = 0, failed: int = 0, dropped: int = 0, cpu_s: float = 0.0
    ) -> None:
        self.delivered, self.failed, self.dropped = delivered, failed, dropped
        self.cpu_s = cpu_s  # CPU seconds, in the sidecars it ran in

    @property
    def handled(self) -> int:
        return self.delivered + self.failed + self.dropped

    def plus(self, s: SubscriberStats) -> _Counts:
        d, f, x = self.delivered + s.delivered, self.failed + s.failed, self.dropped + s.dropped
        return _Counts(d, f, x, self.cpu_s + s.cpu_s)
