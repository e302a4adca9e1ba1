"""What both bridges share: config cleaning, metric values, the missing-framework error."""

from __future__ import annotations

import enum
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch

from eventbus import EventBus
from eventbus.integrations._common import (
    jsonable,
    metric,
    missing_framework,
    numeric_items,
    stop_state,
)


class Mode(enum.Enum):
    FAST = "fast"


def test_jsonable_keeps_json_types_and_names_everything_else() -> None:
    conf = {
        "lr": 0.1,
        "mode": Mode.FAST,
        "dir": Path("/tmp/x"),
        "sizes": (1, 2),
        "nested": {3: {None}},
        "t": torch.ones(2),
        "fn": print,
    }
    out = jsonable(conf)
    assert out["lr"] == 0.1
    assert out["mode"] == "fast"
    assert out["dir"] == "/tmp/x"
    assert out["sizes"] == [1, 2]
    assert out["nested"] == {"3": [None]}
    assert isinstance(out["t"], str)
    assert isinstance(out["fn"], str)
    orjson.dumps(out)  # would raise on anything JSON cannot hold


def test_metric_passes_numbers_and_tensors_and_drops_the_rest() -> None:
    t = torch.tensor(1.5)
    assert metric(2) == 2
    assert metric(0.5) == 0.5
    assert metric(t) is t  # published as is: the bus captures it without a sync
    assert type(metric(np.float32(0.25))) is float
    assert type(metric(np.int64(3))) is int
    assert metric(True) is None
    assert metric("text") is None
    assert metric(None) is None
    assert numeric_items(
        {"a": 1, "b": "x", "c": np.float64(2.0), "loss": 3.0}, skip=frozenset({"loss"})
    ) == {"a": 1, "c": 2.0}


def test_missing_framework_error_is_one_line_naming_the_extra() -> None:
    err = missing_framework("lightning", "Lightning", "lightning", ImportError("nope"))
    assert str(err).endswith("pip install 'eventbus[lightning]'")
    assert "nope" in str(err)
    assert "\n" not in str(err)


def test_stop_state_reads_stop_then_abort() -> None:
    bus = EventBus()
    assert stop_state(bus) == (False, False)
    bus.control.request_stop("x")
    assert stop_state(bus) == (True, False)
    bus.control.request_abort("y")
    assert stop_state(bus) == (True, True)
    bus.close()


@pytest.mark.parametrize("leaf", ["runs/x", 3])
def test_jsonable_depth_is_bounded(leaf: object) -> None:
    deep: object = leaf
    for _ in range(20):
        deep = [deep]
    orjson.dumps(jsonable(deep))
