from __future__ import annotations

import dataclasses
import math

import orjson
import pytest

from eventbus import Event, EventEncodeError
from eventbus.codec import EventDecodeError, decode, encode, iter_lines
from eventbus.events import EvalEnded, Loss, Scalars, TensorStats, UnknownEvent
from eventbus.logformat import FORMAT_VERSION, header


def test_flat_line_format() -> None:
    ev = Loss(step=12, value=2.314, ts=1732269000123456789, seq=57, rank=0)
    d = orjson.loads(encode(ev))
    assert d == {"type": "Loss", "step": 12, "ts": 1732269000123456789, "seq": 57, "rank": 0,
                 "value": 2.314, "split": "train"}
    assert next(iter(d)) == "type"
    assert encode(ev).endswith(b"\n")


@pytest.mark.parametrize("x", [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, 5e-324])
def test_float_round_trip_keeps_non_finite_apart(x: float) -> None:
    back = decode(encode(Loss(step=1, value=x)))
    assert isinstance(back, Loss)
    assert type(back.value) is float
    if math.isnan(x):
        assert math.isnan(back.value)
    else:
        assert back.value == x and math.copysign(1, back.value) == math.copysign(1, x)


def test_nan_is_not_written_as_null() -> None:
    line = encode(Loss(step=1, value=math.nan))
    assert b"null" not in line.replace(b'"ts":null', b"").replace(b'"seq":null', b"").replace(
        b'"rank":null', b"")
    assert orjson.loads(encode(Loss(step=1, value=-math.inf)))["value"] == "-Infinity"


def test_non_finite_inside_dicts_round_trip() -> None:
    ev = Scalars(step=2, values={"a": math.inf, "b": math.nan, "c": 1.0})
    back = decode(encode(ev))
    assert isinstance(back, Scalars)
    assert back.values["a"] == math.inf and math.isnan(back.values["b"]) and back.values["c"] == 1
    ev2 = EvalEnded(step=3, metrics={"loss": -math.inf})
    back2 = decode(encode(ev2))
    assert isinstance(back2, EvalEnded) and back2.metrics["loss"] == -math.inf


def test_string_fields_named_like_nan_stay_strings() -> None:
    back = decode(encode(Loss(step=1, value=1.0, split="NaN")))
    assert isinstance(back, Loss) and back.split == "NaN"


def test_tuple_shape_round_trips() -> None:
    back = decode(encode(TensorStats(step=1, name="w", shape=(3, 4), norm=1.5)))
    assert isinstance(back, TensorStats) and back.shape == (3, 4)


def test_unserialisable_field_names_type_and_field() -> None:
    @dataclasses.dataclass(slots=True, kw_only=True)
    class WithObject(Event):
        payload: object = None

    with pytest.raises(EventEncodeError, match=r"WithObject\.payload.*set"):
        encode(WithObject(step=1, payload={1, 2}))


def test_unknown_type_decodes_and_encodes_back_identically() -> None:
    line = b'{"type":"NotRegisteredAnywhere","step":4,"ts":1,"seq":2,"rank":0,"x":"Infinity"}\n'
    ev = decode(line)
    assert isinstance(ev, UnknownEvent) and ev.type_name == "NotRegisteredAnywhere"
    assert ev.data["x"] == math.inf
    assert orjson.loads(encode(ev)) == orjson.loads(line)


def test_header_is_skipped_and_versioned() -> None:
    h = header(rank=0, world_size=2)
    assert orjson.loads(h)["version"] == FORMAT_VERSION
    assert decode(h) is None
    evs = list(iter_lines([h, encode(Loss(step=1, value=1.0)), b"\n"]))
    assert [type(e) for e in evs] == [Loss]


@pytest.mark.parametrize("bad", [b"{not json", b"[1,2]", b'{"step": 1}'])
def test_bad_lines_raise_a_decode_error(bad: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode(bad)
