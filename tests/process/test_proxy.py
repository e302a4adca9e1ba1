"""`ProcessSubscriber`: what to build in the sidecar, checked where it is made."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from eventbus import Event, EventBus
from eventbus.events import Loss
from eventbus.process import ProcessSubscriber
from tests.process.subs import Tally, on_one

NewBus = Callable[..., EventBus]


def test_an_import_path_keeps_the_factorys_class_options() -> None:
    sub = ProcessSubscriber("tests.process.subs:Tally", kwargs={"path": "x"})
    assert sub.policy == "block"  # type: ignore[attr-defined]
    assert sub.events == (Loss,)
    assert sub.name == "Tally"
    assert sub.placement == "process"
    assert sub.target == ("factory", ("tests.process.subs:Tally", (), {"path": "x"}))


def test_a_built_subscriber_travels_pickled_with_its_options() -> None:
    sub = ProcessSubscriber(Tally("x"), events=[Loss], name="mine")
    assert sub.target[0] == "pickled"
    assert sub.main is None  # a module's class: the script need not be imported there
    assert (sub.name, sub.events, sub.batched) == ("mine", (Loss,), True)
    with pytest.raises(RuntimeError, match="runs in the sidecar"):
        sub(Loss(step=1, value=1.0))


def test_unpicklable_subscriber_fails_where_it_is_made(new_bus: NewBus) -> None:
    lock = threading.Lock()

    class Local:
        def __init__(self) -> None:
            self.lock = lock

        async def on_events(self, batch: list[Event]) -> None:
            return None

    with pytest.raises(TypeError, match=r"needs a picklable subscriber.*import path"):
        new_bus().subscribe(Local(), placement="process")
    with pytest.raises(TypeError, match="args/kwargs are for an import path"):
        ProcessSubscriber(on_one, kwargs={"x": 1})
