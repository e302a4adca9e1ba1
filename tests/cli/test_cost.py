"""`eventbus summary`'s instrumentation cost: from the closing stats record, else RunEnded,
else the last BusCost; the heaviest subscribers first."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest

from eventbus import Event, EventBus
from eventbus.cli import main
from eventbus.cli.cost import cost_dict, cost_lines
from eventbus.codec import encode
from eventbus.events import BusCost, Loss, RunEnded
from eventbus.sinks import JsonlWriter


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_summary_names_the_share_and_the_heaviest_subscriber(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def heavy(ev: Event) -> None:
        _burn(0.002)

    def light(ev: Event) -> None:
        return None

    bus = EventBus()
    bus.subscribe(JsonlWriter(tmp_path), placement="thread")
    bus.subscribe(heavy, events=[Loss], name="heavy")
    bus.subscribe(light, events=[Loss], name="light")
    with bus:
        for step in range(50):
            bus.publish(Loss(step=step, value=1.0))
    assert main(["summary", "--json", str(tmp_path)]) == 0
    c = orjson.loads(capsys.readouterr().out)["instrumentation_cost"]
    assert c["source"] == "stats record"
    assert c["steps"] == 50
    assert 0 < c["share"] < 1
    assert c["subscribers"][0]["name"] == "heavy"
    assert c["subscribers"][0]["cpu_ms_per_step"] >= 1.8
    assert main(["summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "instrumentation cost: " in out
    assert "of step time in publish" in out
    assert "heaviest subscribers (ms CPU/step): heavy " in out


def test_without_a_stats_record_run_ended_then_bus_cost(tmp_path: Path) -> None:
    cost = BusCost(step=9, steps=10, share=0.01, bus_cpu_s=0.5, subscriber_cpu_s={"a": 1.0})
    ended = RunEnded(step=10, cost={"steps": 20, "share": 0.02, "subscriber_cpu_s": {"b": 2.0}})
    c = cost_dict([], ended, cost)
    assert c is not None and c["source"] == "RunEnded" and c["steps"] == 20
    assert [s["name"] for s in c["subscribers"]] == ["b"]
    c = cost_dict([], None, cost)
    assert c is not None and c["source"] == "BusCost"
    assert c["bus_cpu_ms_per_step"] == pytest.approx(50.0)
    assert cost_dict([], RunEnded(step=1), None) is None
    assert "unknown" in cost_lines(None)[0]


def test_a_log_with_only_bus_cost_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A log cut short (no stats record, no RunEnded) still shows the last BusCost."""
    lines = [Loss(step=i, value=1.0, seq=i, ts=1 + i, rank=0) for i in range(3)]
    last = BusCost(step=2, steps=3, share=0.5, publish_ms_p50=0.002, seq=3, ts=9, rank=0)
    (tmp_path / "events.jsonl").write_bytes(b"".join(encode(e) for e in [*lines, last]))
    assert main(["summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "instrumentation cost: 50.00% of step time in publish (2.0 us/step p50)" in out


def test_bad_values_in_a_cost_are_left_out() -> None:
    ended = RunEnded(step=1, cost={"steps": "many", "share": None, "subscriber_cpu_s": {"x": "?"}})
    c = cost_dict([], ended, None)
    assert c is not None
    assert c["steps"] is None and c["subscribers"] == []
    assert cost_lines(c)[0].endswith("nothing measured (no steps)")
