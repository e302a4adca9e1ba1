"""SpeedMonitor: step time, throughput and MFU from StepEnded, as Scalars every N steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from eventbus import EventBus
from eventbus.events import RunStarted, Scalars, StepEnded, TimeEstimate
from eventbus.monitors import SpeedMonitor
from tests.conftest import Recorder

T0 = 1_700_000_000_000_000_000  # ns


def feed(mon: SpeedMonitor, events: list[StepEnded]) -> list[dict[str, float]]:
    return [v for ev in events if (v := mon.update(ev)) is not None]


def test_from_duration_samples_tokens_and_mfu() -> None:
    mon = SpeedMonitor(every=10, flops_per_step=2e12, peak_flops=1e14)
    out = feed(
        mon, [StepEnded(step=s, duration_s=0.1, samples=32, tokens=4096) for s in range(1, 21)]
    )
    assert len(out) == 2  # steps 10 and 20
    v = out[-1]
    assert v["speed/step_time_s"] == pytest.approx(0.1)
    assert v["speed/steps_per_s"] == pytest.approx(10.0)
    assert v["speed/samples_per_s"] == pytest.approx(320.0)
    assert v["speed/tokens_per_s"] == pytest.approx(40960.0)
    assert v["speed/flops_per_s"] == pytest.approx(2e13)
    assert v["speed/mfu"] == pytest.approx(0.2)


def test_mfu_from_flops_per_token() -> None:
    mon = SpeedMonitor(every=5, flops_per_token=6 * 1e8, peak_flops=1e15)
    v = feed(mon, [StepEnded(step=s, duration_s=0.5, tokens=10_000) for s in range(1, 6)])[-1]
    assert v["speed/tokens_per_s"] == pytest.approx(20_000)
    assert v["speed/mfu"] == pytest.approx(6e8 * 20_000 / 1e15)


def test_from_ts_gaps_when_no_duration() -> None:
    mon = SpeedMonitor(every=10, warmup_steps=0)
    evs = [StepEnded(step=s, ts=T0 + s * 50_000_000, samples=8) for s in range(1, 11)]
    v = feed(mon, evs)[-1]
    assert v["speed/step_time_s"] == pytest.approx(0.05)
    assert v["speed/samples_per_s"] == pytest.approx(160.0)
    assert "speed/tokens_per_s" not in v  # never given: not invented
    assert "speed/mfu" not in v


def test_missed_steps_share_the_gap() -> None:
    """A dropped StepEnded (a lossy queue) must not double the step time."""
    mon = SpeedMonitor(every=10, warmup_steps=0)
    steps = [s for s in range(1, 21) if s not in (5, 6, 13)]
    v = feed(mon, [StepEnded(step=s, ts=T0 + s * 100_000_000) for s in steps])[-1]
    assert v["speed/step_time_s"] == pytest.approx(0.1)
    assert v["speed/steps_per_s"] == pytest.approx(10.0)


def test_robust_to_a_slow_first_step() -> None:
    durations = [30.0] + [0.2] * 29  # compilation on step 1
    evs = [StepEnded(step=s, duration_s=d) for s, d in enumerate(durations, start=1)]
    v = feed(SpeedMonitor(every=10, window=20), evs)[0]
    assert v["speed/step_time_s"] == pytest.approx(0.2)  # warm-up step dropped
    with_first = feed(SpeedMonitor(every=10, window=20, warmup_steps=0), evs)
    assert with_first[0]["speed/step_time_median_s"] == pytest.approx(0.2)
    assert with_first[0]["speed/step_time_s"] > 2  # the mean sees it while in the window...
    assert with_first[-1]["speed/step_time_s"] == pytest.approx(0.2)  # ...and then forgets


def test_window_follows_a_change_of_speed() -> None:
    evs = [StepEnded(step=s, duration_s=0.1 if s <= 50 else 0.4) for s in range(1, 101)]
    v = feed(SpeedMonitor(every=10, window=20), evs)[-1]
    assert v["speed/step_time_s"] == pytest.approx(0.4)


def test_restarts_when_steps_go_back() -> None:
    mon = SpeedMonitor(every=5, warmup_steps=0)
    feed(mon, [StepEnded(step=s, ts=T0 + s * 10**9) for s in range(1, 11)])
    later = T0 + 100 * 10**9
    v = feed(mon, [StepEnded(step=s, ts=later + s * 10**8) for s in range(1, 11)])[-1]
    assert v["speed/step_time_s"] == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"every": 0}, "every"),
        ({"window": 0}, "window"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"flops_per_step": 1e12}, "peak_flops"),
        ({"peak_flops": 1e15}, "peak_flops"),
        ({"flops_per_step": 1.0, "flops_per_token": 1.0, "peak_flops": 1.0}, "not both"),
        ({"flops_per_step": -1.0, "peak_flops": 1.0}, "positive"),
        ({"flops_per_step": float("nan"), "peak_flops": 1.0}, "positive"),
    ],
)
def test_bad_settings_fail_where_made(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SpeedMonitor(**kw)


def test_publishes_scalars_on_a_bus_every_n_steps_and_at_close() -> None:
    rec = Recorder(events=(Scalars,))
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(rec)  # older: closed after the monitor, so it sees the final Scalars
    bus.subscribe(SpeedMonitor(every=5, flops_per_step=1e9, peak_flops=1e12))
    with bus:
        for s in range(1, 13):
            tokens: Any = torch.tensor(512)  # a tensor count: captured, seen as a float
            bus.publish(StepEnded(step=s, duration_s=0.01, samples=16, tokens=tokens))
    got = [e for e in rec.got if isinstance(e, Scalars)]
    assert [e.step for e in got] == [5, 10, 12]
    for e in got:
        assert set(e.values) >= {
            "speed/step_time_s",
            "speed/steps_per_s",
            "speed/samples_per_s",
            "speed/tokens_per_s",
            "speed/mfu",
        }
        assert e.values["speed/mfu"] == pytest.approx(0.1)
        assert e.values["speed/tokens_per_s"] == pytest.approx(51_200)


# -- the time estimate ---------------------------------------------------------------------


def test_eta_from_the_wall_clock_rate_with_the_total_given() -> None:
    mon = SpeedMonitor(every=10, total_steps=100)
    # 0.1 s inside each step, 0.2 s from one StepEnded to the next: loading data counts too
    feed(mon, [StepEnded(step=s, ts=T0 + s * 200_000_000, duration_s=0.1) for s in range(1, 21)])
    est = mon.last_estimate
    assert est is not None and est.step == 20 and est.total_steps == 100
    assert est.steps_per_s == pytest.approx(5.0)
    assert est.eta_s == pytest.approx(80 / 5.0)


def test_no_estimate_without_a_total() -> None:
    mon = SpeedMonitor(every=10)
    feed(mon, [StepEnded(step=s, ts=T0 + s * 100_000_000) for s in range(1, 21)])
    assert mon.last_estimate is None


def test_time_estimate_is_published_from_run_started_total() -> None:
    bus = EventBus(drain_interval=0.002)
    rec = Recorder(events=[TimeEstimate])
    bus.subscribe(rec)
    bus.subscribe(SpeedMonitor(every=5))
    with bus:
        bus.publish(RunStarted(total_steps=50))
        for s in range(1, 11):
            bus.publish(StepEnded(step=s, ts=T0 + s * 250_000_000))  # 4 steps/s
    assert [e.step for e in rec.got] == [5, 10]
    assert [e.total_steps for e in rec.got] == [50, 50]
    assert rec.got[-1].eta_s == pytest.approx(40 / 4.0)
    assert rec.got[0].eta_s == pytest.approx(45 / 4.0)


def test_total_steps_argument_is_checked() -> None:
    with pytest.raises(ValueError, match="total_steps must be an int >= 1"):
        SpeedMonitor(total_steps=0)


@pytest.mark.parametrize("total", [0, -1])
def test_a_run_total_of_zero_or_less_gives_no_estimate(total: int) -> None:
    bus = EventBus(drain_interval=0.002)
    rec = Recorder(events=[TimeEstimate])
    bus.subscribe(rec)
    bus.subscribe(SpeedMonitor(every=5))
    with bus:
        bus.publish(RunStarted(total_steps=total))  # not "0 s left of 0 steps"
        for s in range(1, 11):
            bus.publish(StepEnded(step=s, ts=T0 + s * 250_000_000))
        bus.publish(RunStarted(total_steps=20))  # a known total later still counts
        for s in range(11, 16):
            bus.publish(StepEnded(step=s, ts=T0 + s * 250_000_000))
    assert [(e.step, e.total_steps) for e in rec.got] == [(15, 20)]
