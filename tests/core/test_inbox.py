"""core.inbox: bounded in events and bytes; the bus side can never flood it or block on it."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from eventbus import Event, EventBus
from eventbus.core.inbox import BIG, Inbox, InboxMode
from eventbus.events import Loss, Scalars
from tests.conftest import Recorder
from tests.core.helpers import until


@dataclass(slots=True, kw_only=True)
class BigText(Event):
    """An event carrying a big payload."""

    text: str = ""


def test_a_feedback_storm_neither_freezes_training_nor_grows_memory() -> None:
    """A lossless subscriber publishing two events for every event it receives."""
    bus = EventBus(drain_interval=0.002, inbox_maxsize=1024)

    class Echo:
        policy = "block"

        def on_events(self, batch: list[Event]) -> None:
            for ev in batch:
                bus.publish(Scalars(step=ev.step, values={"a": 1.0}))
                bus.publish(Scalars(step=ev.step, values={"b": 1.0}))

    rec = Recorder(events=[Loss])
    bus.subscribe(rec)
    bus.subscribe(Echo(), name="echo")
    done = threading.Event()

    def train() -> None:
        for i in range(20_000):
            bus.publish(Loss(step=i, value=1.0))
        done.set()

    with bus:
        t = threading.Thread(target=train, daemon=True)
        t.start()
        assert done.wait(60), "training froze behind its own subscriber's output"
        st = bus.stats()
        assert st.inbox_high_water <= 1024  # bounded: the storm is dropped, not queued
    st = bus.close()
    assert [e.seq for e in rec.got] == sorted(e.seq for e in rec.got)
    assert len(rec.got) == 20_000  # training's own events all arrived
    assert st.feedback_dropped > 0
    echo = st["echo"]
    assert echo.published == echo.delivered + echo.failed + echo.dropped + echo.queued


def test_big_events_are_bounded_in_bytes_with_backpressure() -> None:
    release = threading.Event()
    got: list[int] = []

    class SlowWriter:
        policy = "block"

        def on_events(self, batch: list[Event]) -> None:
            release.wait(60)
            got.extend(e.seq or 0 for e in batch)

    limit = 1 << 20  # 1 MiB in the inbox and 1 MiB in the queue
    bus = EventBus(drain_interval=0.002, inbox_max_bytes=limit, queue_max_bytes=limit)
    sub = bus.subscribe(SlowWriter(), max_batch=1)
    payload = "x" * (64 << 10)  # 64 KiB events: 200 of them are 12.8 MiB
    done = threading.Event()
    peak = {"inbox": 0, "queue": 0}

    def publish() -> None:
        for i in range(200):
            bus.publish(BigText(step=i, text=payload))
        done.set()

    with bus:
        t = threading.Thread(target=publish, daemon=True)
        t.start()
        assert until(lambda: bus.stats().blocked_s > 0 or done.is_set())
        assert not done.is_set()  # the publisher waits: backpressure by bytes
        st = bus.stats()
        s = sub.stats()
        assert s is not None
        peak["inbox"], peak["queue"] = st.inbox_bytes, s.queued_bytes
        release.set()
        assert done.wait(60)
    assert peak["inbox"] <= limit + (65 << 10)
    assert peak["queue"] <= limit + (65 << 10)
    assert got == list(range(200))  # nothing lost, in order


def test_small_events_do_not_count_bytes() -> None:
    inbox = Inbox(16, 1 << 20, waits=lambda: False, drop=lambda ev: None)
    inbox.mode = InboxMode.LIVE
    inbox.put(Loss(step=1, value=1.0))
    assert inbox.nbytes == 0 and len(inbox) == 1 and BIG == 1024


def test_a_full_inbox_without_lossless_subscribers_drops_and_counts() -> None:
    dropped: list[Any] = []
    inbox = Inbox(4, 1 << 20, waits=lambda: False, drop=dropped.append)
    inbox.mode = InboxMode.LIVE
    for i in range(10):
        inbox.put(Loss(step=i, value=1.0))
    assert len(inbox) == 4 and inbox.dropped == 6 and len(dropped) == 6


def test_a_closed_inbox_refuses_and_counts() -> None:
    inbox = Inbox(4, 1 << 20, waits=lambda: True, drop=lambda ev: None)
    inbox.close()
    inbox.put(Loss(step=1, value=1.0))
    assert len(inbox) == 0 and inbox.rejected == 1


def test_a_publish_re_entered_on_the_same_thread_does_not_deadlock() -> None:
    """A signal handler runs on the thread it interrupted: one that publishes (a "preempted"
    event on SIGTERM) may land while `publish` holds the inbox's lock, counting a big event's
    bytes. The lock is reentrant; a plain Lock deadlocked the training thread there."""
    bus = EventBus(drain_interval=0.002)
    rec = Recorder(events=[BigText])
    bus.subscribe(rec, placement="thread")
    bus.start()
    done = threading.Event()

    def interrupted() -> None:
        with bus._inbox._lock:  # where the signal landed: inside put_boxed's count
            bus.publish(BigText(step=1, text="x" * 4 * BIG))  # what the handler publishes
        done.set()

    threading.Thread(target=interrupted, daemon=True).start()
    assert done.wait(10), "a publish re-entered from the same thread deadlocked"
    bus.close()
    assert [ev.step for ev in rec.got] == [1]
