"""The pipe's format: events, start records and replies survive the trip."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from eventbus import Event
from eventbus.events import Loss, Scalars, StopRequested, UnknownEvent
from eventbus.process import wire


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
    schema, rows = pickle.loads(data)
    ((_, (_, _, names)),) = schema.items()
    return pickle.dumps(({tname: (module, tname, names)}, [(tname, v) for _, v in rows]))


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


def test_reply_carries_events_and_control_requests() -> None:
    req = StopRequested(step=7, reason="diverged", abort=True, source="div")
    reply = wire.decode_reply(
        wire.encode_reply("boom", {"k": 1}, published=[Loss(step=1, value=0.5)], requests=[req])
    )
    assert reply["error"] == "boom"
    assert reply["value"] == {"k": 1}
    assert reply["published"] is not None
    assert [(type(e), e.step) for e in wire.unpack(reply["published"])] == [(Loss, 1)]
    assert reply["requests"] == [req]
    empty = wire.decode_reply(wire.encode_reply())
    assert (empty["error"], empty["published"], empty["requests"]) == (None, None, [])


def test_start_record_round_trip() -> None:
    info: wire.StartInfo = {
        "rank": 1,
        "world_size": 4,
        "local_rank": 1,
        "name": "x",
        "main": ("path", "/tmp/train.py"),
        "nice": 10,
    }
    target: wire.Target = ("factory", ("pkg.mod:make", (1,), {"k": 2}))
    assert wire.decode_start(wire.encode_start(target, 123, info)) == (target, 123, info)
