from __future__ import annotations

import dataclasses
import warnings
from typing import ClassVar

import pytest

from eventbus import Event, EventBus
from eventbus.capture import capturable_fields
from eventbus.codec import encode
from eventbus.events import (
    DivergenceDetected,
    Loss,
    MemoryLeakSuspected,
    OptimizerStepped,
    StepEnded,
    event_fields,
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


class _Undecorated(Event):  # no @dataclass: `gain` would be a class attribute, not a field
    gain: float = 0.0


def test_a_subclass_without_dataclass_is_refused_where_it_is_first_used() -> None:
    hint = r"_Undecorated .*gain.*decorate it with @dataclass\(slots=True, kw_only=True\)"
    with pytest.raises(TypeError, match=hint):
        event_fields(_Undecorated)
    with pytest.raises(TypeError, match=hint):
        encode(_Undecorated(step=1))
    with pytest.raises(TypeError, match=hint):
        capturable_fields(_Undecorated)
    with pytest.raises(TypeError, match=hint):
        EventBus().publish(_Undecorated(step=1))  # the first publish of the class


@dataclasses.dataclass(slots=True, kw_only=True)
class _TypeField(Event):
    type: str = "Loss"  # would overwrite the line's "type": replayed as a Loss
    value: float = 1.0


def test_a_field_named_type_is_refused_where_the_class_is_first_used() -> None:
    hint = r"_TypeField.*field named 'type'.*rename it"
    with pytest.raises(TypeError, match=hint):
        event_fields(_TypeField)
    with pytest.raises(TypeError, match=hint):
        encode(_TypeField(step=1))
    with pytest.raises(TypeError, match=hint):
        EventBus().publish(_TypeField(step=1))  # the first publish of the class


def test_decorated_subclasses_class_vars_and_field_less_aliases_are_fine() -> None:
    @dataclasses.dataclass(slots=True, kw_only=True)
    class Tuned(Event):
        gain: float = 0.0
        unit: ClassVar[str] = "dB"

    class Alias(Tuned):  # adds no field: nothing would be lost
        pass

    assert [f.name for f in event_fields(Alias)][-1] == "gain"
    assert b'"gain":2.0' in encode(Alias(gain=2.0))
