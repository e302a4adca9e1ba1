"""ThresholdStopper and EarlyStopper: stop on a metric through bus.control; state survives."""

from __future__ import annotations

import math

import pytest
import structlog
import torch

from eventbus import EventBus
from eventbus.config import subscriber_from_spec
from eventbus.events import EvalEnded, Loss, OptimizerStepped, Scalars, StopRequested
from eventbus.monitors import EarlyStopper, ThresholdStopper
from tests.conftest import Recorder


def _bus() -> EventBus:
    return EventBus(drain_interval=0.002, close_timeout=10)


def test_threshold_stopper_stops_the_loop_once_eval_accuracy_is_reached() -> None:
    bus, rec = _bus(), Recorder(events=[StopRequested])
    bus.subscribe(rec)
    stopper = ThresholdStopper("eval/accuracy", 0.9, mode="max")
    bus.subscribe(stopper)
    stopped_at = None
    with bus:
        for step, acc in enumerate([0.5, 0.7, 0.85, 0.91, 0.95], start=1):
            bus.publish(EvalEnded(step=step * 100, metrics={"accuracy": acc}))
            bus.flush()  # the stopper has seen it
            if bus.should_stop:
                stopped_at = step * 100
                break
    assert stopped_at == 400
    (req,) = rec.got
    assert isinstance(req, StopRequested)
    assert (req.step, req.source) == (400, "ThresholdStopper")
    assert "eval/accuracy reached 0.91 (>= 0.9)" in req.reason
    assert stopper.best == 0.91 and stopper.stopped_at == 400


def test_threshold_mode_min_on_train_loss_and_nan_never_reaches() -> None:
    s = ThresholdStopper("loss", 0.1)  # mode "min": a loss low enough
    assert not s.update(math.nan, 1)
    assert not s.update(0.5, 2)
    assert s.update(0.1, 3)  # at the threshold counts
    s = ThresholdStopper("train/loss", 0.1)
    assert s.events == (Loss, Scalars, EvalEnded)  # no OptimizerStepped copies
    assert not s.update(0.2, 1)


def test_early_stopper_counts_values_without_improvement() -> None:
    s = EarlyStopper("eval_loss", patience=3)
    # two values without improvement, then 0.7 improves (the count restarts), then two more
    values = [1.0, 0.8, 0.9, 0.85, 0.7, 0.75, 0.7]
    assert not any(s.update(v, i) for i, v in enumerate(values))
    assert (s.best, s.best_step, s.bad) == (0.7, 4, 2)
    assert s.update(0.71, 7)  # the third value without improvement
    assert s.stopped_at == 7
    assert "for 3 value(s) (best 0.7 at step 4; now 0.71)" in str(s.stop_reason)


def test_min_delta_needs_a_real_gain_and_small_gains_add_up() -> None:
    s = EarlyStopper("loss", patience=2, min_delta=0.1)
    s.update(1.0, 1)
    assert not s.update(0.95, 2)  # better by 0.05: not an improvement
    assert s.best == 1.0 and s.bad == 1
    assert not s.update(0.85, 3)  # 0.15 below the kept reference: it counts
    assert s.best == 0.85 and s.bad == 0


def test_mode_max_and_nan_is_never_an_improvement() -> None:
    s = EarlyStopper("accuracy", patience=2, mode="max")
    s.update(0.5, 1)
    assert not s.update(0.6, 2)
    assert not s.update(math.nan, 3)
    assert s.update(math.inf, 4)  # non-finite values never improve
    assert s.best == 0.6


def test_metric_sources_loss_split_scalars_and_eval_metrics() -> None:
    bus = _bus()
    train = EarlyStopper("loss", patience=100)
    val = EarlyStopper("val/loss", patience=100)
    ev = EarlyStopper("eval_loss", patience=100)
    key = ThresholdStopper("custom/score", 10.0, mode="max")
    for s in (train, val, ev, key):
        bus.subscribe(s)
    with bus:
        bus.publish(Loss(step=1, value=torch.tensor(2.0)))
        bus.publish(Loss(step=1, value=3.0, split="val"))
        bus.publish(EvalEnded(step=1, metrics={"loss": 4.0}))
        bus.publish(Scalars(step=1, values={"custom/score": 5.0}))
        bus.publish(OptimizerStepped(step=1, lr=0.1, grad_norm=1.0))
    assert (train.best, val.best, ev.best, key.best) == (2.0, 3.0, 4.0, 5.0)


def test_state_survives_a_resume_through_the_bus_state_dict() -> None:
    values = [1.0, 0.9, 0.95, 0.96, 0.97, 0.98]
    whole = EarlyStopper("eval_loss", patience=3)
    stops = [whole.update(v, i) for i, v in enumerate(values)]
    assert stops.index(True) == 4

    first_bus = _bus()
    first_bus.subscribe(EarlyStopper("eval_loss", patience=3))
    with first_bus:
        for i, v in enumerate(values[:3]):
            first_bus.publish(EvalEnded(step=i, metrics={"loss": v}))
        state = first_bus.state_dict()
    assert state["EarlyStopper"]["best"] == 0.9 and state["EarlyStopper"]["bad"] == 1

    resumed = EarlyStopper("eval_loss", patience=3)
    second = _bus()
    second.subscribe(resumed)
    second.load_state_dict(state)
    with second:
        second.publish(EvalEnded(step=3, metrics={"loss": values[3]}))
        second.flush()
        assert not second.should_stop
        second.publish(EvalEnded(step=4, metrics={"loss": values[4]}))
        second.flush()
        assert second.should_stop  # as the uninterrupted run: at the same value
    assert resumed.stopped_at == 4
    with pytest.raises(ValueError, match="mode"):
        EarlyStopper("eval_loss", patience=3, mode="max").load_state_dict(state["EarlyStopper"])
    with pytest.raises(ValueError, match="metric"):
        ThresholdStopper("loss", 1.0).load_state_dict(state["EarlyStopper"])


def test_bad_arguments_are_clear() -> None:
    with pytest.raises(ValueError, match="patience must be an int >= 1"):
        EarlyStopper("loss", patience=0)
    with pytest.raises(ValueError, match="patience"):
        EarlyStopper("loss", patience=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_delta must be >= 0"):
        EarlyStopper("loss", patience=2, min_delta=-1)
    with pytest.raises(ValueError, match="mode must be 'min'"):
        EarlyStopper("loss", patience=2, mode="lowest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threshold must be a finite number"):
        ThresholdStopper("loss", math.nan)
    with pytest.raises(ValueError, match="metric must be a non-empty name"):
        ThresholdStopper("", 1.0)


def test_short_names_build_them_from_a_spec() -> None:
    s = subscriber_from_spec("early_stop:metric=eval_loss,patience=3,min_delta=0.01")
    assert isinstance(s, EarlyStopper)
    assert (s.metric, s.patience, s.min_delta, s.mode) == ("eval_loss", 3, 0.01, "min")
    t = subscriber_from_spec("threshold_stop:metric=eval/accuracy,threshold=0.9,mode=max")
    assert isinstance(t, ThresholdStopper) and t.threshold == 0.9 and t.mode == "max"


def test_a_training_loss_stopper_ignores_the_evaluation_s_loss() -> None:
    bus = _bus()
    train = ThresholdStopper("loss", 1.0)
    patient = EarlyStopper("loss", patience=1)
    for s in (train, patient):
        bus.subscribe(s)
    with bus:
        bus.publish(Loss(step=1, value=2.0))
        bus.publish(EvalEnded(step=1, metrics={"loss": 0.5}))  # below the threshold: not ours
        bus.publish(EvalEnded(step=2, metrics={"loss": 9.0}))  # worse: not counted either
        bus.flush()
        assert not bus.should_stop
    assert (train.best, train.stopped_at) == (2.0, None)
    assert (patient.best, patient.bad, patient.stopped_at) == (2.0, 0, None)


def test_a_metric_that_never_shows_up_is_said_with_the_names_that_did() -> None:
    bus = _bus()
    typo = EarlyStopper("eval_acc", patience=2, mode="max")
    found = ThresholdStopper("accuracy", 0.99, mode="max")
    bus.subscribe(typo)
    bus.subscribe(found)
    with structlog.testing.capture_logs() as logs, bus:
        bus.publish(Loss(step=1, value=2.0))
        bus.publish(EvalEnded(step=1, metrics={"accuracy": 0.5}))
        bus.publish(EvalEnded(step=2, metrics={"accuracy": 0.6}))
    missing = [e for e in logs if "not found" in e["event"]]
    assert [e["event"].split(": ", 2)[2] for e in missing] == [
        "an EvalEnded at step 1 did not carry it; check its name (docs/monitors.md, "
        "'Metric names')",
        "no value of the metric arrived in this run; check its name (docs/monitors.md, "
        "'Metric names')",
    ]
    assert all(e["metric"] == "eval_acc" and e["log_level"] == "warning" for e in missing)
    assert missing[-1]["names_seen"] == ["accuracy"]
    assert found.best == 0.6  # the one whose metric arrived says nothing


def test_infinities_never_reach_a_threshold() -> None:
    low = ThresholdStopper("loss", 0.1)
    assert not low.update(-math.inf, 1)  # a broken loss, not a low enough one
    high = ThresholdStopper("eval/accuracy", 0.9, mode="max")
    assert not high.update(math.inf, 1)
    assert (low.stopped_at, high.stopped_at) == (None, None)
    assert high.update(0.95, 2)


def test_an_evaluation_published_twice_counts_once() -> None:
    # The HF bridge publishes an evaluation as Scalars (the Trainer's log) and as EvalEnded.
    bus = _bus()
    s = EarlyStopper("eval_loss", patience=3)
    bus.subscribe(s)
    with bus:
        for step, v in ((100, 1.0), (200, 1.1), (300, 1.2)):
            bus.publish(Scalars(step=step, values={"eval_loss": v, "epoch": 1.0}))
            bus.publish(EvalEnded(step=step, metrics={"eval_loss": v, "loss": v}))
        bus.flush()
        assert not bus.should_stop  # two evaluations without improvement, not four values
    assert (s.best, s.bad, s.stopped_at) == (1.0, 2, None)


def test_a_state_of_another_kind_of_stopper_is_refused() -> None:
    """Subscribers' states are matched by name: a ThresholdStopper's state given to an
    EarlyStopper of the same metric and mode is refused, naming both."""
    threshold = ThresholdStopper("loss", 0.5)
    threshold.update(1, 0.4)
    early = EarlyStopper("loss", patience=3)
    with pytest.raises(ValueError, match="of a ThresholdStopper, not of this EarlyStopper"):
        early.load_state_dict(threshold.state_dict())
    early.load_state_dict(EarlyStopper("loss", patience=3).state_dict())  # its own kind: fine


@pytest.mark.parametrize(
    ("bad", "key"),
    [
        ({"best": 0.5, "auto_step": None}, "auto_step"),
        ({"best": 0.2, "bad": "x"}, "bad"),
        ({"best": 0.2, "bad": -1}, "bad"),
        ({"best": 0.2, "bad": 2.7}, "bad"),
        ({"best": math.nan}, "best"),
        ({"best": "abc"}, "best"),
        ({"best": 0.2, "best_step": "3"}, "best_step"),
        ({"best": 0.2, "version": "1"}, "version"),
    ],
)
def test_a_malformed_state_is_refused_naming_the_key_and_nothing_is_loaded(
    bad: dict[str, object], key: str
) -> None:
    s = EarlyStopper("loss", patience=3)
    s.update(1.0, 1)
    s.update(1.1, 2)
    before = s.state_dict()
    with pytest.raises(ValueError, match=f"EarlyStopper state: {key}"):
        s.load_state_dict({**before, **bad})
    assert s.state_dict() == before  # not half loaded: it goes on counting as it was
    with pytest.raises(TypeError, match="EarlyStopper state must be a dict"):
        s.load_state_dict(None)  # type: ignore[arg-type]
