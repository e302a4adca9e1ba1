"""`eventbus.bench.inline`: the bare variant's no-op bus and the inline variant's direct calls."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from eventbus.bench.inline import FEEDBACK_LIMIT, InlineBus, NullBus
from eventbus.events import Event, Loss, Scalars, StepEnded, StepStarted


class Recorder:
    """Records each event, the thread it ran on, and what on_start was given."""

    events = (Loss,)

    def __init__(self) -> None:
        self.got: list[Event] = []
        self.threads: set[int] = set()
        self.started_with: Any = None
        self.closed = False

    def on_start(self, bus: Any) -> None:
        self.started_with = bus

    def on_events(self, batch: list[Event]) -> None:
        self.got += batch
        self.threads.add(threading.get_ident())

    def on_close(self) -> None:
        self.closed = True


def test_publish_hands_the_event_over_before_it_returns_on_the_calling_thread() -> None:
    rec = Recorder()
    bus = InlineBus(rec)
    bus.start()
    ev = Loss(step=1, value=2.0)
    bus.publish(ev)
    assert rec.got == [ev]  # already there: no thread, no queue
    assert rec.threads == {threading.get_ident()}
    assert rec.started_with is bus
    assert (ev.seq, ev.rank, type(ev.ts)) == (0, 0, int)  # stamped as the bus stamps
    bus.publish(StepEnded(step=1))  # not a type it asked for
    assert len(rec.got) == 1
    bus.close()
    assert rec.closed
    assert (bus.delivered, bus.failed, bus.dropped) == (1, 0, 0)


def test_async_subscribers_and_plain_functions_are_called_too() -> None:
    got: list[tuple[str, Event]] = []

    class Async:
        async def on_events(self, batch: list[Event]) -> None:
            got.extend(("batch", e) for e in batch)

    async def afn(ev: Event) -> None:
        got.append(("async fn", ev))

    for sub in (Async(), afn, lambda ev: got.append(("fn", ev))):
        bus = InlineBus(sub)
        bus.publish(Loss(step=1, value=1.0))
        bus.close()
        assert bus.delivered == 1
    assert [k for k, _ in got] == ["batch", "async fn", "fn"]


def test_a_failure_is_counted_not_raised() -> None:
    def boom(ev: Event) -> None:
        raise SystemExit("even this")

    bus = InlineBus(boom)
    bus.publish(Loss(step=1, value=1.0))
    bus.publish(Loss(step=2, value=1.0))
    assert (bus.delivered, bus.failed) == (0, 2)
    assert bus.error == "SystemExit: even this"


def test_a_failing_on_start_disables_it_and_its_events_are_counted_dropped() -> None:
    class BadStart(Recorder):
        def on_start(self, bus: Any) -> None:
            raise ValueError("no")

    sub = BadStart()
    bus = InlineBus(sub)
    bus.start()
    bus.publish(Loss(step=1, value=1.0))
    assert (sub.got, bus.dropped) == ([], 1)
    assert bus.error == "on_start: ValueError: no"


def test_events_a_subscriber_publishes_reach_it_after_the_current_one_and_are_bounded() -> None:
    order: list[int | None] = []
    bus: InlineBus

    def echo(ev: Event) -> None:
        order.append(ev.step)
        bus.publish(Loss(step=(ev.step or 0) + 1, value=1.0))  # feeds on its own output

    bus = InlineBus(echo)
    bus.publish(Loss(step=0, value=1.0))
    assert order[:3] == [0, 1, 2]
    assert bus.delivered == FEEDBACK_LIMIT + 1
    assert bus.dropped == 1  # the one published past the limit


def test_tensor_fields_reach_it_as_numbers() -> None:
    rec = Recorder()
    rec.events = (Loss, Scalars)  # type: ignore[assignment]
    bus = InlineBus(rec)
    bus.publish(Loss(step=1, value=torch.tensor(2.5)))
    bus.publish(Scalars(step=1, values={"a": torch.tensor([1.0, 2.0])}))
    loss, sc = rec.got
    assert isinstance(loss, Loss)
    assert loss.value == 2.5
    assert type(loss.value) is float
    assert isinstance(sc, Scalars)
    assert isinstance(sc.values["a"], torch.Tensor)


def test_publish_refuses_what_the_bus_refuses() -> None:
    bus = InlineBus(Recorder())
    with pytest.raises(TypeError, match="publish"):
        bus.publish("loss")  # type: ignore[arg-type]
    ev = Loss(step=1, value=1.0)
    bus.publish(ev)
    with pytest.raises(ValueError, match="already published"):
        bus.publish(ev)


def test_the_null_bus_does_nothing_but_offers_the_bus_surface() -> None:
    bus = NullBus()
    ev = Loss(step=1, value=1.0)
    bus.publish(ev)
    assert ev.seq is None  # not even stamped
    with bus.step(3), bus.phase("forward"):
        pass
    assert not bus.should_stop
    bus.control.request_stop("test")
    assert bus.should_stop


def test_step_scopes_publish_through_the_inline_bus() -> None:
    rec = Recorder()
    rec.events = (StepStarted, StepEnded)  # type: ignore[assignment]
    bus = InlineBus(rec)
    with bus.step(7):
        pass
    assert [(type(e).__name__, e.step) for e in rec.got] == [
        ("StepStarted", 7),
        ("StepEnded", 7),
    ]
