"""core.router: by type (a base class receives subclasses), in order, attach/detach in order."""

from __future__ import annotations

from eventbus import Event, EventBus
from eventbus.events import Loss, Scalars, StepEnded
from tests.conftest import Recorder


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
