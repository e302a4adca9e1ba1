"""The pipe's format: events, start records and replies survive the trip."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest

from eventbus import Event
from eventbus.events import Loss, Scalars, UnknownEvent
from eventbus.process import wire
from tests.conftest import Ratio


def test_pack_round_trip_keeps_types_and_unknowns() -> None:
    evs: list[Event] = [
        Loss(step=1, value=float("nan"), ts=5, seq=1, rank=0),
        Scalars(step=2, values={"a": 1.0}),
    ]
    out = wire.unpack(wire.pack(evs))
    assert [type(e) for e in out] == [Loss, Scalars]
    assert out[1].values == {"a": 1.0}  # type: ignore[attr-defined]
    assert out[0].ts == 5
    assert out[0].value != out[0].value  # type: ignore[attr-defined]


def _renamed(data: bytes, tname: str, module: str) -> bytes:
    """`data` as if its one event type were `module.tname`, a type this side may not know."""
    schema, order, cols = pickle.loads(data)
    ((_, _, names),) = schema
    return pickle.dumps(([(module, tname, names)], order, cols))


def test_a_mixed_batch_keeps_its_order_and_each_events_values() -> None:
    """Each type travels as one column; the order of the types puts them back."""
    evs: list[Event] = []
    for i in range(600):  # runs of one type, alternations, and a type seen once
        if i % 7 == 0:
            evs.append(Scalars(step=i, values={"i": float(i)}))
        elif i % 3 == 0 or 200 <= i < 260:
            evs.append(Loss(step=i, value=i / 10, split="eval" if i % 2 else "train"))
        else:
            evs.append(Loss(step=i, value=-1.0))
    evs.append(UnknownEvent(type_name="Mine", data={"x": 1}, step=600))
    out = wire.unpack(wire.pack(evs))
    assert [type(e) for e in out] == [type(e) for e in evs]
    assert out == evs  # every field, in order


def test_a_batch_of_more_than_255_types_still_round_trips() -> None:
    """Up to 255 types the order is bytes; beyond, a list."""
    import dataclasses

    kinds = [
        dataclasses.make_dataclass(f"K{i}", [("x", int, 0)], bases=(Event,), kw_only=True)
        for i in range(300)
    ]
    evs = [k(x=i, step=i) for i, k in enumerate(kinds)]
    out = wire.unpack(wire.pack(evs))
    assert [(type(e).__name__, e.x) for e in out] == [(type(e).__name__, e.x) for e in evs]


def test_a_type_not_known_here_arrives_as_unknown_event() -> None:
    data = _renamed(wire.pack([Loss(step=4, value=2.0, seq=9)]), "Mystery", "no_such_mod_xyz")
    (ev,) = wire.unpack(data)
    assert isinstance(ev, UnknownEvent)
    assert (ev.type_name, ev.step, ev.seq) == ("Mystery", 4, 9)
    assert ev.data == {"value": 2.0, "split": "train"}


def test_an_event_module_that_exits_on_import_only_makes_the_type_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "exits_on_import_xyz.py").write_text("import sys\nsys.exit('not a library')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = _renamed(wire.pack([Loss(step=1, value=1.0)]), "Gone", "exits_on_import_xyz")
    (ev,) = wire.unpack(data)  # SystemExit from the user's module must not end the child
    assert isinstance(ev, UnknownEvent)
    assert ev.type_name == "Gone"


def test_an_event_with_a_field_its_post_init_computes_round_trips() -> None:
    """Rebuilt through `__init__`, which refuses a value for an `init=False` field: the
    whole batch (the Loss beside it too) could not be read on the other side."""
    evs: list[Event] = [Ratio(step=1, num=3.0, den=4.0, seq=1), Loss(step=1, value=2.0, seq=2)]
    out = wire.unpack(wire.pack(evs))
    assert out == evs
    assert out[0].ratio == 0.75  # type: ignore[attr-defined]


def test_opcodes_are_distinct_single_bytes_with_names() -> None:
    ops = [wire.START, wire.ADD, wire.REMOVE, wire.BATCH, wire.FLUSH, wire.STATE, wire.LOAD]
    ops += [wire.END, wire.CLOSE]
    assert all(len(op) == 1 for op in ops)
    assert len(set(ops)) == len(ops)
    assert set(wire.OP_NAMES) == set(ops)


_REFUSE = {"now": False}


@dataclass(slots=True, kw_only=True)
class Picky(Event):
    """A user event whose `__post_init__` may refuse on the receiving side (its state)."""

    x: float = 0.0

    def __post_init__(self) -> None:
        if _REFUSE["now"]:
            raise ValueError("not here")


def test_an_event_this_side_cannot_rebuild_goes_on_as_unknown_and_is_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its __post_init__ raising ended the whole unpack: in the parent's reader that read as
    a broken channel (the sidecar killed), in the sidecar the batch was lost."""
    data = wire.pack([Loss(step=1, value=1.0, seq=1), Picky(step=1, x=2.5, seq=2)])
    _REFUSE["now"] = True
    try:
        loss, picky = wire.unpack(data)
    finally:
        _REFUSE["now"] = False
    assert loss == Loss(step=1, value=1.0, seq=1)
    assert isinstance(picky, UnknownEvent) and picky.type_name == "Picky"
    assert (picky.data, picky.step, picky.seq) == ({"x": 2.5}, 1, 2)
    assert "cannot be rebuilt here" in caplog.text and "not here" in caplog.text
