"""Cerebras-style global registration on the default bus."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import eventbus
from eventbus import Event, Subscriber
from eventbus.events import Loss
from tests.conftest import Recorder


@pytest.fixture(autouse=True)
def fresh_default() -> Iterator[None]:
    old = eventbus.set_bus(None)
    yield
    bus = eventbus.set_bus(old)
    if bus is not None:
        bus.close(timeout=5)


def test_get_bus_is_one_started_bus() -> None:
    bus = eventbus.get_bus()
    assert bus is eventbus.get_bus()
    assert bus.running


def test_register_global_and_remove() -> None:
    rec = Recorder()
    handle = eventbus.register_global(rec)
    bus = eventbus.get_bus()
    bus.publish(Loss(step=1, value=1.0))
    assert bus.flush(5)
    handle.remove()
    bus.publish(Loss(step=2, value=1.0))
    assert bus.flush(5)
    assert [e.step for e in rec.got] == [1]


def test_subscriber_as_context_manager_attaches_to_default_bus() -> None:
    class Counter(Subscriber):
        policy = "block"

        def __init__(self) -> None:
            self.steps: list[int | None] = []

        async def on_events(self, batch: list[Event]) -> None:
            self.steps.extend(ev.step for ev in batch)

    bus = eventbus.get_bus()
    with Counter() as c:
        bus.publish(Loss(step=1, value=1.0))
        assert bus.flush(5)
    bus.publish(Loss(step=2, value=1.0))
    assert bus.flush(5)
    assert c.steps == [1]


def test_a_closed_default_bus_is_replaced() -> None:
    first = eventbus.get_bus()
    first.close()
    second = eventbus.get_bus()
    assert second is not first and second.running
