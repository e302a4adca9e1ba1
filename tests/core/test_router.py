"""core.router: by type (a base class receives subclasses), in order, attach/detach in order."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import pytest
import torch

from eventbus import Event, EventBus
from eventbus.core import router as router_module
from eventbus.events import Loss, Scalars, StepEnded
from tests.conftest import Recorder
from tests.core.helpers import identity


def test_routes_by_type_and_base_class_and_attaches_in_order() -> None:
    everything, losses = Recorder(), Recorder(events=[Loss])
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(everything)
    with bus:
        bus.publish(Loss(step=1, value=1.0))
        bus.subscribe(losses)  # in order with the events around it
        bus.publish(Loss(step=2, value=1.0))
        bus.publish(StepEnded(step=2))
    assert [type(e).__name__ for e in everything.got] == ["Loss", "Loss", "StepEnded"]
    assert [e.step for e in losses.got] == [2]


def test_detach_takes_effect_in_order_and_queued_events_still_arrive() -> None:
    rec = Recorder()
    bus = EventBus(drain_interval=0.002)
    handle = bus.subscribe(rec)
    with bus:
        for i in range(100):
            bus.publish(Scalars(step=i, values={}))
        handle.remove()
        bus.publish(Scalars(step=100, values={}))
    assert [e.step for e in rec.got] == list(range(100))
    st = handle.stats()
    assert st is not None and st.state == "closed" and not handle.active


def test_subscribed_and_removed_before_start_never_runs() -> None:
    calls: list[Event] = []
    bus = EventBus(drain_interval=0.002)
    handle = bus.subscribe(calls.append)
    handle.remove()
    with bus:
        bus.publish(Loss(step=1, value=1.0))
    assert calls == [] and not handle.active


def test_a_hung_lossless_subscriber_cannot_hold_training_forever() -> None:
    import threading

    release = threading.Event()

    class Hangs:
        policy = "block"

        def on_events(self, batch: list[Event]) -> None:
            release.wait(60)

    rec = Recorder()
    bus = EventBus(drain_interval=0.002, hang_timeout=0.5, inbox_maxsize=64, cost_every=None)
    bus.subscribe(rec)
    hung = bus.subscribe(Hangs(), name="hung", maxsize=8, max_batch=1)
    done = threading.Event()

    def train() -> None:
        for i in range(2000):  # far more than its queue and the inbox hold
            bus.publish(Loss(step=i, value=1.0))
        done.set()

    bus.start()
    try:
        threading.Thread(target=train, daemon=True).start()
        assert done.wait(30), "training blocked forever behind a hung lossless subscriber"
        st = hung.stats()
        assert st is not None and st.state == "disabled"
    finally:
        release.set()
        total = bus.close(timeout=5)
    assert len(rec.got) == 2000  # the innocent lossless one lost nothing
    h = total["hung"]
    assert h.published == h.delivered + h.failed + h.dropped + h.queued
    assert h.dropped > 0


def test_a_drop_before_the_loop_attached_a_subscriber_is_still_its() -> None:
    """A publisher meeting a full inbox while a new subscriber's Attach is still queued:
    the drop is counted for it (it was subscribed before the publish), once."""
    bus = EventBus(cost_every=None)
    bus.subscribe(lambda ev: None, policy="drop_newest", name="late", events=[Loss])
    router = bus._loop.router
    router.count_drop(Loss(step=1, value=0.0))  # what the inbox does when full
    router.count_drop(Loss(step=2, value=0.0))
    router.count_drop(StepEnded(step=2))  # not a type it takes
    with bus:
        bus.publish(Loss(step=3, value=0.0))
    st = bus.stats()["late"]
    assert (st.published, st.delivered, st.dropped) == (3, 1, 2)


# -- a run of plain events, routed at once ---------------------------------------------------


def _mixed(n: int) -> list[Event]:
    return [
        Loss(step=i, value=float(i)) if i % 3 else Scalars(step=i, values={"i": float(i)})
        for i in range(n)
    ]


def _spy_runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    runs: list[tuple[int, bool]] = []
    real = router_module.Router._route_run

    def spy(self: router_module.Router, items: deque[Any], n: int) -> bool:
        done = real(self, items, n)
        runs.append((n, done))
        return done

    monkeypatch.setattr(router_module.Router, "_route_run", spy)
    return runs


def test_a_run_reaches_each_subscriber_its_share_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """500 events waiting at once (the loop asleep: a long drain interval) are one run,
    routed without a per-event loop: each subscriber gets exactly the types it takes, in
    order, counted once."""
    runs = _spy_runs(monkeypatch)
    everything, losses, scalars = Recorder(), Recorder(events=[Loss]), Recorder(events=[Scalars])
    bus = EventBus(drain_interval=30, cost_every=None)
    for name, sub in (("all", everything), ("losses", losses), ("scalars", scalars)):
        bus.subscribe(sub, name=name)
    evs = _mixed(500)
    with bus:
        assert bus.flush()  # the attaches are done; the loop sleeps until the close
        for ev in evs:
            bus.publish(ev)
    assert (500, True) in runs  # the run path was taken
    assert everything.got == evs
    assert losses.got == [e for e in evs if isinstance(e, Loss)]
    assert scalars.got == [e for e in evs if isinstance(e, Scalars)]
    st = bus.stats()
    assert st.subscribers["all"].published == st.subscribers["all"].delivered == 500
    assert st.subscribers["losses"].published == len(losses.got)
    identity(st)


def test_a_run_of_tensor_events_is_resolved_and_routed_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A loop that publishes its loss as a tensor: every such event was routed one at a
    time (its capture boxed it), a Python loop over each subscriber per event. Captures
    whose copies are done are resolved and the run goes at once; values arrive as numbers."""
    runs = _spy_runs(monkeypatch)
    rec, losses = Recorder(), Recorder(events=[Loss])
    bus = EventBus(drain_interval=30, cost_every=None)
    bus.subscribe(rec, name="all")
    bus.subscribe(losses, name="losses")
    with bus:
        assert bus.flush()
        for i in range(300):
            if i % 2:
                bus.publish(Loss(step=i, value=torch.tensor(float(i))))
            else:
                bus.publish(StepEnded(step=i, duration_s=0.1))
    assert (300, True) in runs
    assert [e.step for e in rec.got] == list(range(300))
    assert [e.value for e in losses.got] == [float(i) for i in range(1, 300, 2)]
    assert all(type(e.value) is float for e in losses.got)
    identity(bus.stats())


def test_a_run_reaches_a_latest_subscriber_which_keeps_the_newest_per_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `latest` subscriber (a slow dashboard) made every run go one at a time; it takes
    the run now, superseding older events of a key as it would one by one."""
    runs = _spy_runs(monkeypatch)
    everything = Recorder()
    newest = Recorder()
    newest.policy = "latest"
    bus = EventBus(drain_interval=30, cost_every=None)
    bus.subscribe(everything, name="all")
    bus.subscribe(newest, name="newest")
    evs = _mixed(400)
    with bus:
        assert bus.flush()
        for ev in evs:
            bus.publish(ev)
    assert (400, True) in runs
    assert everything.got == evs
    assert newest.got == [evs[-2], evs[-1]]  # the newest Loss, the newest Scalars
    st = bus.stats().subscribers["newest"]
    assert (st.published, st.delivered, st.dropped) == (400, 2, 398)
    identity(bus.stats())


@pytest.mark.timeout(30)
def test_a_run_abandoned_while_its_captures_are_read_does_not_crash_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading a capture can hold the loop (an xla/mps tensor is copied to the host there).
    A close that gives up on the blocked loop counts what the inbox holds as lost; the run
    must already have taken its events, as one at a time does: when the loop comes back it
    found them gone (IndexError: the bus thread crashed) and counted them twice."""
    import threading

    from eventbus.capture import Pending

    runs = _spy_runs(monkeypatch)
    release, reading = threading.Event(), threading.Event()

    class Xla:
        type = "xla"

    class Buf:  # a device tensor whose host copy the bus thread makes: it waits here
        device = Xla()

        def cpu(self) -> torch.Tensor:
            reading.set()
            release.wait(10)
            return torch.tensor(0.0)

    rec = Recorder()
    bus = EventBus(drain_interval=30, cost_every=None)
    bus.subscribe(rec, name="rec")
    bus.start()
    try:
        assert bus.flush()
        bus.publish(Loss(step=0, value=Pending(Buf())))
        for i in range(1, 40):
            bus.publish(Loss(step=i, value=torch.tensor(float(i))))
        bus.close(timeout=0.3)  # the loop is blocked reading step 0: abandoned
        assert reading.is_set()
    finally:
        release.set()
    assert bus._loop.wait(10)
    st = bus.stats()
    assert st.error is None, st.error
    assert (40, True) in runs
    s = st.subscribers["rec"]
    assert (s.published, s.delivered, s.dropped, s.queued) == (40, 0, 40, 0), s
    identity(st)


def test_a_queue_without_room_for_the_run_gets_it_one_at_a_time() -> None:
    """A lossless subscriber with room for 8: the run falls back, and backpressure keeps
    every event, in order, for it and for the others."""
    small, big = Recorder(), Recorder()
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(small, maxsize=8, name="small")
    bus.subscribe(big, name="big")
    evs = _mixed(300)
    for ev in evs:
        bus.publish(ev)
    with bus:
        pass
    assert small.got == evs and big.got == evs
    assert bus.stats().subscribers["small"].dropped == 0


def test_a_run_with_a_flush_or_an_attach_inside_goes_one_at_a_time_in_order() -> None:
    first, later = Recorder(), Recorder()
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(first)
    evs = _mixed(200)
    for ev in evs[:100]:
        bus.publish(ev)
    bus.subscribe(later)  # an Attach in the middle of what the first drain takes
    for ev in evs[100:]:
        bus.publish(ev)
    with bus:
        pass
    assert first.got == evs
    assert later.got == evs[100:]


def test_counting_a_drop_re_entered_on_the_same_thread_does_not_deadlock() -> None:
    """A publishing signal handler may land while the publisher counts a drop (the inbox
    full, only lossy subscribers): the count's lock is reentrant."""
    import threading

    bus = EventBus()
    bus.subscribe(Recorder(), placement="thread")
    router = bus._loop.router
    done = threading.Event()

    def interrupted() -> None:
        with router._drop_lock:
            router.count_drop(Loss(step=1, value=1.0))
        done.set()

    threading.Thread(target=interrupted, daemon=True).start()
    assert done.wait(10), "a drop counted re-entrantly deadlocked"
    bus.close()


class _SyncFlush:
    """A sync subscriber with an `on_flush` (run on its worker thread)."""

    def __init__(self) -> None:
        self.flushes = 0

    def on_events(self, batch: list[Event]) -> None:
        pass

    def on_flush(self) -> None:
        self.flushes += 1


def test_a_flush_reaching_an_abandoned_subscriber_fails_at_once_and_leaves_it_idle() -> None:
    """`abandon()` releases the flushes waiting on it: `on_flush` then went to its stopped
    worker and never returned, so the flush waited its whole timeout and the subscriber
    stayed busy, to be named hung at close."""
    sub = _SyncFlush()
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(sub)
    (d,) = bus._deliveries
    with bus:
        assert bus.flush(timeout=10) and sub.flushes == 1
        d.abandon()  # as the close does to one only waiting its turn
        start = time.monotonic()
        assert bus.flush(timeout=20) is False
        assert time.monotonic() - start < 10
        assert d.busy_since is None and sub.flushes == 1
    assert d.name not in bus.stats().hung
