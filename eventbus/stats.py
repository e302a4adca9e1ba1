"""What `bus.stats()` returns: every counter a user needs to trust the bus."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from eventbus.log import get_logger

__all__ = ["BusStats", "CostStats", "SidecarStats", "SubscriberStats", "log_close", "losses"]


@dataclass(frozen=True, slots=True)
class SubscriberStats:
    """Counters of one subscriber.

    published == delivered + failed + dropped + queued (+ the batch in flight).
    """

    name: str
    policy: str
    state: str  # "pending", "running", "disabled", "hung", "removed" or "closed"
    published: int  # events routed to this subscriber
    delivered: int  # events it handled without raising
    dropped: int  # events discarded: overflow policy, a full inbox, disabled, or lost at close
    failed: int  # events whose handling raised
    queued: int  # events waiting in its queue now
    queue_high_water: int  # the most events its queue ever held
    latency_p50_ms: float | None  # publish -> start of delivery, over recent batches
    latency_p99_ms: float | None
    latency_max_ms: float | None
    error: str | None = None  # the last exception, as "Type: message"
    queued_bytes: int = 0  # bytes of the big events (1 KiB or more) in its queue now
    cpu_s: float = 0.0  # CPU seconds its calls took (in the sidecar process, if placed there)


@dataclass(frozen=True, slots=True)
class SidecarStats:
    """The sidecar process that hosts `placement="process"` subscribers (one per bus)."""

    pid: int | None  # the live sidecar's process id
    alive: bool
    restarts: int  # times it died and was started again
    spawn_s: float | None  # from launch to ready (overlapped with the user's set-up)
    sent_events: int  # events sent to it (each once, whatever number of subscribers want it)
    sent_bytes: int
    in_flight_bytes: int  # sent and not yet taken in by it (bounded: backpressure beyond)
    lost: int  # events sidecar subscribers never handled because a sidecar died (summed)
    error: str | None = None  # why it is gone for good, if it is
    storm_dropped: int = 0  # events its subscribers published faster than we took them
    refused: int = 0  # events its subscribers published that this bus refused (logged)
    late: int = 0  # events its subscribers published in its own close: no subscriber left


@dataclass(frozen=True, slots=True)
class CostStats:
    """What the bus cost the training process (`EventBus(cost_every=None)`: not measured).

    A step is told from the next by the events' `step` field; the per-step figures are over
    the last 4096 steps, `share` over every closed step.
    """

    steps: int  # steps seen
    publish_calls: int
    publish_s: float  # time spent inside publish (tensor capture and backpressure included)
    publish_ms_p50: float | None  # publish time per step
    publish_ms_p99: float | None
    step_ms_p50: float | None  # wall time per step: first event to the next step's first
    share: float | None  # publish time over step wall time
    bus_cpu_s: float  # the bus thread's CPU (routing, packing for the sidecar, async subscribers)
    bus_cpu_ms_per_step: float | None


@dataclass(frozen=True, slots=True)
class BusStats:
    """Bus-wide counters plus one `SubscriberStats` per subscriber, by name."""

    published: int  # events accepted by publish()
    rejected: int  # events published after close or in a forked child (not delivered)
    inbox_size: int  # events waiting to be routed now
    inbox_high_water: int  # the most events the inbox held when the router drained it
    blocked_s: float  # seconds publishers spent waiting on a lossless subscriber (backpressure)
    wakeups: int  # times the bus thread was woken before its timer (a nearly full inbox, a
    # flush, a subscribe, a close)
    subscribers: dict[str, SubscriberStats] = field(default_factory=dict)
    hung: tuple[str, ...] = ()  # subscribers abandoned at close because they did not return
    feedback_dropped: int = 0  # events subscribers published into a half-full inbox (a storm)
    inbox_bytes: int = 0  # bytes of the big events (1 KiB or more) waiting in the inbox
    error: str | None = None  # what killed the bus thread, if it died
    sidecar: SidecarStats | None = None  # the child process of placement="process", if any
    cost: CostStats | None = None  # what the bus cost the training process

    def __getitem__(self, name: str) -> SubscriberStats:
        return self.subscribers[name]

    @property
    def dropped(self) -> int:
        """Events dropped, summed over subscribers."""
        return sum(s.dropped for s in self.subscribers.values())

    @property
    def failed(self) -> int:
        """Events whose handling raised, summed over subscribers."""
        return sum(s.failed for s in self.subscribers.values())

    def as_dict(self) -> dict[str, Any]:
        """Plain dicts and lists, ready for JSON."""
        return dataclasses.asdict(self)


def losses(st: BusStats) -> dict[str, Any] | None:
    """What the bus lost, saw fail or gave up on, in plain values (the close warning's and
    `RunEnded.losses`); None when nothing. A `latest` subscriber's drops are superseded
    events, by design: not losses."""
    side = st.sidecar
    subs = {
        n: {"dropped": s.dropped, "failed": s.failed, "state": s.state, "error": s.error}
        for n, s in st.subscribers.items()
        if s.failed or s.state == "hung" or (s.dropped and s.policy != "latest")
    }
    out: dict[str, Any] = {
        "failed": st.failed,
        "dropped": sum(s["dropped"] for s in subs.values()),
        "rejected": st.rejected,
        "feedback_dropped": st.feedback_dropped,
        "hung": list(st.hung),
        "error": st.error,
        "sidecar_lost": side.lost if side is not None else 0,
        "sidecar_error": side.error if side is not None else None,
        "sidecar_storm_dropped": side.storm_dropped if side is not None else 0,
        "sidecar_late": side.late if side is not None else 0,
        "subscribers": subs,
    }
    return out if any(out.values()) else None


def log_close(st: BusStats) -> None:
    """The close report: a warning naming every loss, failure and hang; info if only
    `latest` subscribers dropped superseded events (by design)."""
    lost = losses(st)
    counts = {
        n: {"dropped": s.dropped, "failed": s.failed, "state": s.state}
        for n, s in st.subscribers.items()
        if s.dropped or s.failed or s.state == "hung"
    }
    if lost is not None or counts:
        log = get_logger().warning if lost is not None else get_logger().info
        log(
            "eventbus closed with losses" if lost is not None else "eventbus closed",
            dropped=st.dropped,
            failed=st.failed,
            rejected=st.rejected,
            feedback_dropped=st.feedback_dropped,
            hung=list(st.hung),
            error=st.error,
            sidecar_lost=st.sidecar.lost if st.sidecar is not None else 0,
            sidecar_late=st.sidecar.late if st.sidecar is not None else 0,
            subscribers=counts,
        )
