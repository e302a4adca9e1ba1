from __future__ import annotations

import dataclasses
import warnings

import pytest

from eventbus import Event
from eventbus.events import (
    DivergenceDetected,
    Loss,
    MemoryLeakSuspected,
    OptimizerStepped,
    StepEnded,
    event_type,
    registered_types,
)


def test_catalogue_defaults_allow_partial_events() -> None:
    assert StepEnded(step=3).step == 3
    ev = Loss(step=3, value=2.5)
    assert (ev.ts, ev.seq, ev.rank) == (None, None, None)
    assert OptimizerStepped(lr=0.1, grad_norm=1.0).lr == 0.1
    assert MemoryLeakSuspected(step=1, rate_mb_per_step=2.0, window=50).window == 50


def test_loss_needs_a_value_and_fields_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        Loss(step=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Loss(1, 2.0)  # type: ignore[misc]


def test_events_are_slotted_and_mutable() -> None:
    ev = DivergenceDetected(step=5, metric="loss", value=9.0, baseline=2.0, reason="x")
    assert not hasattr(ev, "__dict__")
    ev.seq = 7  # not frozen: the bus stamps in place
    assert ev.seq == 7
    assert dataclasses.fields(Event)[0].name == "step"


def test_user_subclass_registers_by_name() -> None:
    @dataclasses.dataclass(slots=True, kw_only=True)
    class GradientNoise(Event):
        scale: float = 0.0

    assert event_type("GradientNoise") is GradientNoise
    assert registered_types()["Loss"] is Loss
    assert event_type("NoSuchEvent") is None


def test_two_classes_with_one_name_warn() -> None:
    def make() -> type[Event]:
        @dataclasses.dataclass(slots=True, kw_only=True)
        class Clash(Event):
            x: int = 0

        return Clash

    make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = make()  # the same module: a re-definition (a notebook cell re-run), silent
    second.__module__ = "somewhere.else"  # now it looks like another library's class
    with pytest.warns(RuntimeWarning, match="Clash"):
        make()
