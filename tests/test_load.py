"""`eventbus.load()`: logs as a DataFrame; NaN and +/-Inf in nested values read back as floats."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

import eventbus
from eventbus import Event, EventBus
from eventbus.codec import decode, encode
from eventbus.events import EvalEnded, Loss, RunStarted, Scalars, UnknownEvent
from eventbus.load import COLUMNS
from eventbus.logformat import LogReadError, header, write_events
from eventbus.sinks import JsonlWriter

NAN, INF = math.nan, math.inf
TS = 1_795_527_439_962_616_343  # beyond float64's exact integers: must not pass through float


@dataclass(slots=True, kw_only=True)
class Nested(Event):
    """A user event with loosely typed nested fields."""

    tree: dict[str, Any] = field(default_factory=dict)
    series: list[float] = field(default_factory=list)
    anything: Any = None


def _same(a: Any, b: Any) -> bool:
    """Equal, NaN equal to NaN, floats staying floats."""
    if isinstance(b, float):
        return type(a) is float and (a == b or (math.isnan(a) and math.isnan(b)))
    if isinstance(b, dict):
        return isinstance(a, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in b)
    if isinstance(b, list):
        return isinstance(a, list) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


NESTED = {"nan": NAN, "inf": INF, "-inf": -INF, "list": [NAN, 1.0, [-INF]], "d": {"x": NAN}}


@pytest.mark.parametrize(
    "ev",
    [
        Scalars(step=1, values=NESTED),
        EvalEnded(step=1, metrics=NESTED),
        Nested(step=1, tree=NESTED, series=[NAN, INF, -INF], anything=[{"y": NAN}]),
    ],
    ids=["Scalars", "EvalEnded", "user"],
)
def test_non_finite_floats_inside_nested_values_decode_as_floats(ev: Event) -> None:
    back = decode(encode(ev))
    for name in ("values", "metrics", "tree", "series", "anything"):
        if hasattr(ev, name):
            assert _same(getattr(back, name), getattr(ev, name)), name


def test_non_finite_floats_stay_apart_from_null_and_strings() -> None:
    values = {"nan": NAN, "none": None, "text": "NaN", "inf_text": "-Infinity"}
    back = decode(encode(Nested(tree=values, anything=values)))
    assert isinstance(back, Nested)
    for got in (back.tree, back.anything):
        assert _same(got, values)
    # a type this process does not know keeps them too
    line = encode(Nested(tree=values)).replace(b'"Nested"', b'"NotRegisteredHere"')
    unknown = decode(line)
    assert isinstance(unknown, UnknownEvent)
    assert _same(unknown.data["tree"], values)


def _log(path: Path, *events: Event) -> Path:
    return write_events(path, events)


def test_load_gives_one_row_per_event_with_flat_columns(tmp_path: Path) -> None:
    log = _log(
        tmp_path / "exp1" / "events.jsonl",
        RunStarted(step=None, ts=TS, seq=0, rank=0, config={"lr": 0.1}),
        Loss(step=1, ts=TS + 1, seq=1, rank=0, value=2.5),
        Scalars(step=1, ts=TS + 2, seq=2, rank=0, values={"acc": 0.5, "gn": NAN}),
        EvalEnded(step=2, ts=TS + 3, seq=3, rank=0, metrics={"loss": INF, "n": {"a": -INF}}),
    )
    df = eventbus.load(log)
    assert isinstance(df, pd.DataFrame)
    assert (
        tuple(df.columns[: len(COLUMNS)]) == COLUMNS == ("type", "step", "ts", "seq", "rank", "run")
    )
    assert list(df["type"]) == ["RunStarted", "Loss", "Scalars", "EvalEnded"]
    assert list(df["run"]) == ["exp1"] * 4
    assert str(df["step"].dtype) == "Int64" and df["step"].isna().tolist() == [True] + [False] * 3
    assert list(df["ts"]) == [TS, TS + 1, TS + 2, TS + 3]  # exact: not via float64
    assert df["value"][1] == 2.5
    assert df["config.lr"][0] == 0.1
    assert df["values.acc"][2] == 0.5 and math.isnan(df["values.gn"][2])
    assert df["metrics.loss"][3] == INF and df["metrics.n.a"][3] == -INF
    assert {"values", "metrics", "config"}.isdisjoint(df.columns)  # flattened, not kept whole
    assert df["metrics.loss"].dtype == float  # NaN/Inf never came back as strings


def test_load_concatenates_runs_with_a_run_column(tmp_path: Path) -> None:
    a = _log(tmp_path / "a" / "events.jsonl", Loss(step=1, value=1.0), Loss(step=2, value=0.5))
    _log(tmp_path / "b" / "events.jsonl", Loss(step=1, value=3.0))
    _log(tmp_path / "b" / "run-2" / "events.jsonl", Loss(step=1, value=4.0))
    df = eventbus.load([a, tmp_path / "b"])  # a file, and a directory holding two runs
    assert list(df["run"]) == ["a", "a", "b", "run-2"]
    assert list(df["value"]) == [1.0, 0.5, 3.0, 4.0]
    assert list(df.index) == [0, 1, 2, 3]
    # two runs of one name are told apart by their paths
    _log(tmp_path / "x" / "a" / "events.jsonl", Loss(step=1, value=5.0))
    runs = eventbus.load([a, tmp_path / "x"])["run"].unique().tolist()
    assert runs == [str((tmp_path / "a").resolve()), str((tmp_path / "x" / "a").resolve())]


def test_load_interleaves_the_ranks_of_one_run(tmp_path: Path) -> None:
    for rank in (0, 1):
        events = [Loss(step=s, rank=rank, value=float(s)) for s in (1, 2)]
        write_events(tmp_path / f"events.rank{rank}.jsonl", events, rank=rank)
    df = eventbus.load(tmp_path)
    assert list(zip(df["step"], df["rank"], strict=True)) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert set(df["run"]) == {tmp_path.name}


def test_load_reads_what_a_bus_wrote(tmp_path: Path) -> None:
    bus = EventBus()
    bus.subscribe(JsonlWriter(tmp_path / "run"))
    with bus:
        bus.publish(Loss(step=1, value=torch.tensor(NAN)))
        bus.publish(Scalars(step=1, values={"gn": torch.tensor(INF), "lr": 0.1}))
    df = eventbus.load(tmp_path / "run")
    loss = df[df["type"] == "Loss"]
    assert len(loss) == 1 and math.isnan(loss["value"].iloc[0])
    assert df[df["type"] == "Scalars"]["values.gn"].iloc[0] == INF
    assert (df["seq"].dropna() >= 0).all() and (df["rank"].dropna() == 0).all()


def test_load_of_a_log_without_events_is_an_empty_frame(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").write_bytes(header(rank=0))
    df = eventbus.load(tmp_path)
    assert df.empty and tuple(df.columns) == COLUMNS


def test_load_names_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(LogReadError, match="no such file"):
        eventbus.load(tmp_path / "nope")
    with pytest.raises(LogReadError, match=r"no \*\.jsonl files"):
        eventbus.load(tmp_path)
    monkeypatch.setitem(sys.modules, "pandas", None)  # as if pandas were not installed
    with pytest.raises(ImportError, match=r"pip install 'eventbus\[pandas\]'"):
        eventbus.load(tmp_path)
