from __future__ import annotations

import dataclasses
import datetime
import math
import warnings
from typing import Any

import numpy as np
import orjson
import pytest
import torch

from eventbus import Event, EventEncodeError
from eventbus.codec import EventDecodeError, decode, encode, iter_lines, to_dict
from eventbus.events import (
    EvalEnded,
    Loss,
    RunEnded,
    RunStarted,
    Scalars,
    TensorStats,
    UnknownEvent,
)
from eventbus.logformat import FORMAT_VERSION, header
from tests.conftest import Ratio


def test_flat_line_format() -> None:
    ev = Loss(step=12, value=2.314, ts=1732269000123456789, seq=57, rank=0)
    d = orjson.loads(encode(ev))
    assert d == {
        "type": "Loss",
        "step": 12,
        "ts": 1732269000123456789,
        "seq": 57,
        "rank": 0,
        "value": 2.314,
        "split": "train",
    }
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
        b'"rank":null', b""
    )
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


# -- exact round trips (issue 14, item 7) ------------------------------------------------


@dataclasses.dataclass(slots=True, kw_only=True)
class Anything(Event):
    """A field that may hold any value (as user events often have)."""

    x: Any = None


@pytest.mark.parametrize("s", ["NaN", "Infinity", "-Infinity", "\x00", "\x00NaN", "nan", ""])
def test_strings_that_read_as_non_finite_tags_stay_strings(s: str) -> None:
    events: list[Event] = [
        RunEnded(reason=s),
        Loss(step=1, value=s),
        Anything(x=[s, {"k": s}]),
        RunStarted(config={"activation": s, "nested": {"v": [s, math.nan]}}),
    ]
    for ev in events:
        back = decode(encode(ev))
        assert back == ev or (type(ev) is RunStarted and _same(back, ev)), encode(ev)
        assert encode(back) == encode(ev)  # type: ignore[arg-type]


def _same(a: Any, b: Any) -> bool:
    return bool(orjson.dumps(to_dict(a)) == orjson.dumps(to_dict(b)))


def test_run_ended_reason_nan_replays_as_the_string() -> None:
    back = decode(encode(RunEnded(reason="NaN")))
    assert isinstance(back, RunEnded) and back.reason == "NaN"


def test_non_finite_floats_and_their_strings_stay_apart_in_one_value() -> None:
    ev = Anything(x={"f": [math.inf, -math.inf, math.nan], "s": ["Infinity", "-Infinity", "NaN"]})
    back = decode(encode(ev))
    assert isinstance(back, Anything)
    assert back.x["f"][:2] == [math.inf, -math.inf] and math.isnan(back.x["f"][2])
    assert back.x["s"] == ["Infinity", "-Infinity", "NaN"]
    assert all(type(v) is str for v in back.x["s"])


def test_int_and_str_keys_do_not_collapse() -> None:
    config = {1: "int", "1": "str", None: "none", False: "bool", 2.5: "float", "\x00k": "esc"}
    back = decode(encode(RunStarted(config=config)))
    assert isinstance(back, RunStarted)
    assert back.config == config
    assert [type(k) for k in back.config] == [type(k) for k in config]


@pytest.mark.parametrize("key", [(1, 2), frozenset({1}), math.nan])
def test_keys_without_a_json_form_are_refused_naming_the_field(key: Any) -> None:
    with pytest.raises(EventEncodeError, match=r"RunStarted\.config.*key") as info:
        encode(RunStarted(config={key: 1}))
    assert info.value.field == "config"


def test_old_logs_still_read_tags_as_floats() -> None:
    line = (
        b'{"type":"Scalars","step":1,"ts":1,"seq":1,"rank":0,"values":{"a":"NaN","b":"-Infinity"}}'
    )
    back = decode(line)
    assert isinstance(back, Scalars)
    assert math.isnan(back.values["a"]) and back.values["b"] == -math.inf


def test_the_fast_path_writes_what_the_exact_path_writes() -> None:
    """Lines without marks skip the escaping work; on every kind of value both paths agree."""
    values = [
        1.5,
        math.nan,
        "NaN",
        "plain",
        "\x00x",
        {"a": 1.0, "b": "Infinity"},
        [1, "x"],
        {1: 2},
        {"\x00": 1},
        None,
        True,
        3,
        (1, 2.5),
        np.float32(0.5),
        torch.ones(2),
    ]
    for v in values:
        for ev in (Anything(step=1, x=v), Scalars(step=1, values={"k": v})):
            line = encode(ev)
            assert line == orjson.dumps(to_dict(ev), option=orjson.OPT_APPEND_NEWLINE), v


# -- what has no exact JSON form: a clear error naming the field (items 5 and 6) ------------


def _deep(n: int) -> dict[str, Any]:
    d: dict[str, Any] = {}
    cur = d
    for _ in range(n):
        cur["a"] = {}
        cur = cur["a"]
    return d


def _cyclic() -> dict[str, Any]:
    d: dict[str, Any] = {"x": 1.0}
    d["self"] = d
    return d


class _BadToList:
    device = "cpu"

    def tolist(self) -> list[Any]:
        raise RuntimeError("tolist() not supported here")


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ({1, 2}, "set"),
        (b"raw", "bytes"),
        (bytearray(b"x"), "bytes"),
        (datetime.datetime(2024, 1, 1), "datetime"),
        (2**70, "64 bits"),
        (_deep(600), "deeper than"),
        (_deep(5000), "deeper than"),
        (_cyclic(), "cycle"),
        (_BadToList(), "tolist"),
        ({"k": [1, {2, 3}]}, "set"),
        (1j, "complex"),
    ],
    ids=[
        "set",
        "bytes",
        "bytearray",
        "datetime",
        "bigint",
        "deep600",
        "deep5000",
        "cyclic",
        "tolist-raises",
        "nested-set",
        "complex",
    ],
)
def test_unwritable_values_raise_an_encode_error_naming_the_field(value: Any, why: str) -> None:
    with pytest.raises(EventEncodeError, match=rf"Anything\.x.*{why}") as info:
        encode(Anything(step=3, x=value))
    assert (info.value.event_type, info.value.field) == ("Anything", "x")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (np.float32(0.5), 0.5),
        (np.int64(7), 7),
        (np.float64(math.inf), math.inf),
        (np.arange(3), [0, 1, 2]),
        (torch.tensor([[1.0, 0.0], [0.0, 2.0]]).to_sparse(), [[1.0, 0.0], [0.0, 2.0]]),
        (torch.tensor([0.0, 3.0]).to_sparse(), [0.0, 3.0]),
    ],
)
def test_numpy_and_sparse_values_are_written_as_numbers(value: Any, expected: Any) -> None:
    back = decode(encode(Anything(x=value)))
    assert isinstance(back, Anything) and back.x == expected


def test_quantized_tensors_are_written_dequantized() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized creation is deprecated upstream
        q = torch.quantize_per_tensor(torch.tensor([0.5, 1.0]), 0.5, 0, torch.qint8)
    back = decode(encode(Anything(x=q)))
    assert isinstance(back, Anything) and back.x == [0.5, 1.0]


@pytest.mark.parametrize("step", [np.int64(4), 4.0, torch.tensor(4)])
def test_a_numpy_float_or_tensor_step_is_written_as_an_int(step: Any) -> None:
    assert orjson.loads(encode(Loss(step=step, value=1.0)))["step"] == 4


def test_a_fractional_step_is_refused_naming_it() -> None:
    with pytest.raises(EventEncodeError, match=r"Loss\.step"):
        encode(Loss(step=1.5, value=1.0))  # type: ignore[arg-type]


# -- decoding checks each field's type (item 9) ----------------------------------------------


@pytest.mark.parametrize(
    ("line", "where"),
    [
        (b'{"type":"Loss","step":"abc","value":1.0}', "Loss.step"),
        (b'{"type":"Loss","step":1,"ts":"yesterday","value":1.0}', "Loss.ts"),
        (b'{"type":"Loss","step":1,"rank":[1],"value":1.0}', "Loss.rank"),
        (b'{"type":"Loss","step":1,"seq":1.5,"value":1.0}', "Loss.seq"),
        (b'{"type":"StepEnded","step":1,"samples":"many"}', "StepEnded.samples"),
        (b'{"type":"EvalEnded","step":1,"metrics":[1,2]}', "EvalEnded.metrics"),
        (b'{"type":"StepEnded","step":1,"duration_s":{"a":1}}', "StepEnded.duration_s"),
        (b'{"type":"RunEnded","reason":["x"]}', "RunEnded.reason"),
        (b'{"type":"StopRequested","abort":"yes"}', "StopRequested.abort"),
        (b'{"type":"TensorStats","shape":"3x4"}', "TensorStats.shape"),
        (b'{"type":"NotRegisteredAnywhere","step":"x"}', "NotRegisteredAnywhere.step"),
    ],
)
def test_a_field_of_the_wrong_type_is_a_decode_error_naming_it(line: bytes, where: str) -> None:
    with pytest.raises(EventDecodeError, match=rf"^{where} must be .* got "):
        decode(line)


def test_valid_lines_of_every_kind_still_decode() -> None:
    ok = [
        b'{"type":"Loss","step":1,"ts":5,"seq":0,"rank":0,"value":"NaN"}',
        b'{"type":"StepEnded","step":null,"samples":32.0,"duration_s":1}',
        b'{"type":"EvalEnded","metrics":{"loss":1}}',
        b'{"type":"TensorStats","shape":[3,4],"histogram":[1,2]}',
        b'{"type":"RunEnded","reason":null}',
    ]
    assert all(isinstance(decode(line), Event) for line in ok)


def test_an_event_with_a_field_its_post_init_computes_reads_back_as_its_class() -> None:
    """`__init__` refuses a value for an `init=False` field: the line read back as an
    `UnknownEvent`, so replay, `load` and the CLI lost the user's type."""
    line = encode(Ratio(step=3, num=3.0, den=4.0, seq=1))
    ev = decode(line)
    assert type(ev) is Ratio
    assert (ev.num, ev.den, ev.ratio, ev.step, ev.seq) == (3.0, 4.0, 0.75, 3, 1)
    assert encode(ev) == line
