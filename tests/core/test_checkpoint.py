"""Checkpoint calls into subscribers: `state_dict()` / `load_state_dict()` through the bus.

They run the subscriber's code on the caller's thread. What it raises names the subscriber;
a `SystemExit` or any other `BaseException` of its own never ends the training process; a
Ctrl-C (KeyboardInterrupt) is the user's and passes as it is.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from eventbus import Event, EventBus
from eventbus.events import Loss
from tests.core.helpers import identity


class Custom(BaseException):
    pass


BASE = [SystemExit, GeneratorExit, asyncio.CancelledError, Custom]


class Stateful:
    """A lossless subscriber whose `state_dict` or `load_state_dict` raises `exc`."""

    policy = "block"

    def __init__(self, where: str, exc: type[BaseException]) -> None:
        self.where, self.exc = where, exc
        self.got: list[Event] = []

    def on_events(self, batch: list[Event]) -> None:
        self.got.extend(batch)

    def state_dict(self) -> dict[str, Any]:
        if self.where == "state_dict":
            raise self.exc("broken state")
        return {"n": len(self.got)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.where == "load_state_dict":
            raise self.exc("broken state")


def _checkpoint(bus: EventBus, where: str) -> None:
    if where == "state_dict":
        bus.state_dict()
    else:
        bus.load_state_dict({"culprit": {"n": 1}})


@pytest.mark.parametrize("exc", BASE, ids=lambda e: e.__name__)
@pytest.mark.parametrize("where", ["state_dict", "load_state_dict"])
def test_a_base_exception_in_a_checkpoint_hook_is_a_clear_error_naming_it(
    where: str, exc: type[BaseException]
) -> None:
    bus = EventBus(handle_signals=False)
    sub = Stateful(where, exc)
    bus.subscribe(sub, name="culprit")
    with bus:
        bus.publish(Loss(step=1, value=1.0))
        with pytest.raises(RuntimeError, match=rf"'culprit'.*{where}.*{exc.__name__}") as info:
            _checkpoint(bus, where)
        assert isinstance(info.value.__cause__, exc)
        assert bus.running
        bus.publish(Loss(step=2, value=1.0))  # the bus goes on
    assert [e.step for e in sub.got] == [1, 2]
    identity(bus.stats())


@pytest.mark.parametrize("where", ["state_dict", "load_state_dict"])
def test_an_exception_in_a_checkpoint_hook_keeps_its_type_and_names_the_subscriber(
    where: str,
) -> None:
    bus = EventBus(handle_signals=False)
    bus.subscribe(Stateful(where, ValueError), name="culprit")
    with bus:
        with pytest.raises(ValueError, match="broken state") as info:
            _checkpoint(bus, where)
        assert any("'culprit'" in n and where in n for n in info.value.__notes__)


def test_a_ctrl_c_in_a_checkpoint_hook_is_the_users() -> None:
    bus = EventBus(handle_signals=False)
    bus.subscribe(Stateful("state_dict", KeyboardInterrupt), name="culprit")
    with bus, pytest.raises(KeyboardInterrupt):
        bus.state_dict()


@pytest.mark.parametrize("state", [None, [("culprit", {})], "culprit"])
def test_load_state_dict_of_something_not_a_dict_says_what_it_takes(state: Any) -> None:
    bus = EventBus(handle_signals=False)
    bus.subscribe(Stateful("", ValueError), name="culprit")
    with bus, pytest.raises(TypeError, match=r"load_state_dict\(\) takes the dict"):
        bus.load_state_dict(state)
