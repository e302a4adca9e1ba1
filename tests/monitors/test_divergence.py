"""DivergenceDetector on the bus: events in, DivergenceDetected out, stop through control."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import structlog
import torch

from eventbus import EventBus
from eventbus.events import (
    DivergenceDetected,
    EvalEnded,
    Loss,
    OptimizerStepped,
    StopRequested,
)
from eventbus.monitors.divergence import DivergenceDetector
from tests.conftest import Recorder

FIXTURES = Path(__file__).parent.parent / "fixtures" / "divergence"


def _run(name: str) -> dict:  # type: ignore[type-arg]
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _replay_losses(det: DivergenceDetector, losses: list[float | None]) -> Recorder:
    rec = Recorder(events=(DivergenceDetected, StopRequested))
    bus = EventBus()
    bus.subscribe(det)
    bus.subscribe(rec)
    with bus:
        for step, v in enumerate(losses):
            bus.publish(Loss(step=step, value=math.nan if v is None else v))
    return rec


def test_recorded_lr_jump_is_detected_after_onset_and_stops() -> None:
    run = _run("tune_char_mlp_lr_jump_127")
    det = DivergenceDetector(action="stop")
    rec = _replay_losses(det, run["loss"])
    found = [e for e in rec.got if isinstance(e, DivergenceDetected)]
    assert len(found) == 1
    assert run["onset"] <= found[0].step <= run["departure"] + 3
    assert found[0].metric == "loss" and found[0].value > found[0].baseline
    stops = [e for e in rec.got if isinstance(e, StopRequested)]
    assert stops and stops[0].source == "DivergenceDetector" and not stops[0].abort


def test_healthy_run_with_spikes_is_left_alone() -> None:
    run = _run("tune_char_mlp_spikes_110")
    rec = _replay_losses(DivergenceDetector(action="stop"), run["loss"])
    assert rec.got == []


def test_nan_tensor_fires_at_once_and_abort_action() -> None:
    det = DivergenceDetector(action="abort")
    bus = EventBus()
    bus.subscribe(det)
    with bus:
        for s in range(5):
            bus.publish(Loss(step=s, value=torch.tensor(2.0)))
        bus.publish(Loss(step=5, value=torch.tensor(float("nan"))))
        bus.flush(5)
        assert bus.should_abort and bus.should_stop
    assert [d.step for d in det.detections] == [5]


def test_warn_only_logs() -> None:
    det = DivergenceDetector(action="warn")
    bus = EventBus()
    bus.subscribe(det)
    with structlog.testing.capture_logs() as logs, bus:
        bus.publish(Loss(step=1, value=math.inf))
        bus.flush(5)
        assert not bus.should_stop
    assert det.detections
    warned = [e for e in logs if e["event"] == "divergence detected"]
    assert warned and warned[0]["step"] == 1 and warned[0]["action"] == "warn"


def test_other_metrics_and_splits() -> None:
    gn = DivergenceDetector(metric="grad_norm")
    ev = DivergenceDetector(metric="eval_loss")
    bus = EventBus()
    bus.subscribe(gn)
    bus.subscribe(ev)
    with bus:
        bus.publish(Loss(step=1, value=math.nan))  # neither watches training loss
        bus.publish(OptimizerStepped(step=2, lr=0.1, grad_norm=math.inf))
        bus.publish(EvalEnded(step=3, metrics={"loss": math.nan}))
    assert [d.step for d in gn.detections] == [2]
    assert [d.step for d in ev.detections] == [3]


def test_metric_names_are_the_stoppers_names() -> None:
    # monitors/_metric.py: "<split>_loss" and "<split>/loss" read Loss of that split, and
    # "eval_<key>" / "eval/<key>" read EvalEnded.metrics under either name.
    names = ["val_loss", "train/loss", "eval/loss", "eval_loss"]
    dets = {n: DivergenceDetector(metric=n) for n in names}
    bus = EventBus()
    for det in dets.values():
        bus.subscribe(det)
    with bus:
        bus.publish(Loss(step=1, value=math.nan, split="val"))
        bus.publish(Loss(step=2, value=math.nan))
        bus.publish(EvalEnded(step=3, metrics={"loss": math.nan}))
        bus.publish(EvalEnded(step=4, metrics={"eval_loss": math.inf}))
    assert {n: [d.step for d in det.detections] for n, det in dets.items()} == {
        "val_loss": [1],
        "train/loss": [2],
        "eval/loss": [3],
        "eval_loss": [3],
    }
    late = DivergenceDetector(metric="eval_loss")
    bus = EventBus()
    bus.subscribe(late)
    with bus:
        bus.publish(EvalEnded(step=4, metrics={"eval_loss": math.inf}))
    assert [d.step for d in late.detections] == [4]


def test_state_dict_keeps_the_baseline_across_a_resume() -> None:
    run = _run("tune_reg_mlp_lr_jump_227")
    losses = run["loss"]
    cut = run["onset"] - 5
    first = DivergenceDetector()
    _replay_losses(first, losses[:cut])
    assert first.detections == []
    resumed = DivergenceDetector()
    resumed.load_state_dict(first.state_dict())
    bus = EventBus()
    bus.subscribe(resumed)
    with bus:
        for step in range(cut, len(losses)):
            bus.publish(Loss(step=step, value=losses[step]))
    whole = DivergenceDetector()
    _replay_losses(whole, losses)
    assert [d.step for d in resumed.detections] == [d.step for d in whole.detections]
    with pytest.raises(ValueError, match="metric"):
        DivergenceDetector(metric="grad_norm").load_state_dict(first.state_dict())


def test_bad_arguments_are_clear() -> None:
    with pytest.raises(ValueError, match="action must be one of"):
        DivergenceDetector(action="explode")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unknown option"):
        DivergenceDetector(no_such_knob=3)
    with pytest.raises(ValueError, match="metric"):
        DivergenceDetector(metric="")


def test_detector_stops_a_real_training_loop_within_one_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(256, 8)
    y = x[:, :1] * 2
    det = DivergenceDetector(action="stop")
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(det)
    last = -1
    with bus:
        for step in range(400):
            if step == 150:
                for g in opt.param_groups:
                    g["lr"] = 40.0  # blow it up
            idx = torch.randint(0, 256, (32,))
            loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            bus.publish(Loss(step=step, value=loss))
            time.sleep(0.01)  # a step longer than the bus's drain interval
            last = step
            if bus.should_stop:
                break
    assert det.detections, "the LR blow-up was not detected"
    d = det.detections[0]
    assert d.step >= 150
    assert last <= d.step + 1  # the loop saw should_stop within one step of detection
