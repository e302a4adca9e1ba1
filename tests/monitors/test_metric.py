"""The metric names monitors read: which event and which value each one means."""

from __future__ import annotations

import pytest

from eventbus.events import EvalEnded, Loss, OptimizerStepped, Scalars, StepEnded
from eventbus.monitors._metric import loss_split, metric_value


@pytest.mark.parametrize(
    ("metric", "split", "want"),
    [
        ("loss", "train", "train"),
        ("loss", "val", "val"),
        ("eval_loss", "train", "eval"),
        ("eval/loss", "train", "eval"),
        ("train/loss", "eval", "train"),
        ("accuracy", "train", None),
        ("my/eval/loss", "train", None),
    ],
)
def test_loss_split(metric: str, split: str, want: str | None) -> None:
    assert loss_split(metric, split) == want


def test_values_by_name() -> None:
    assert metric_value(Loss(value=1.5), "loss") == 1.5
    assert metric_value(Loss(value=1.5, split="eval"), "loss") is None
    assert metric_value(Loss(value=1.5, split="eval"), "eval_loss") == 1.5
    assert metric_value(EvalEnded(metrics={"loss": 2.0}), "eval_loss") == 2.0
    assert metric_value(EvalEnded(metrics={"eval_loss": 3.0, "loss": 2.0}), "eval_loss") == 3.0
    assert metric_value(EvalEnded(metrics={"accuracy": 0.9}), "eval/accuracy") == 0.9
    assert metric_value(EvalEnded(metrics={"accuracy": 0.9}), "accuracy") == 0.9
    assert metric_value(Scalars(values={"eval/accuracy": 0.8}), "eval/accuracy") == 0.8
    assert metric_value(Scalars(values={"x": True}), "x") is None  # a flag is not a value
    assert metric_value(OptimizerStepped(lr=0.1, grad_norm=2.0), "grad_norm") == 2.0
    assert metric_value(OptimizerStepped(lr=0.1), "lr") == 0.1
    assert metric_value(StepEnded(step=1), "loss") is None


def test_an_evaluation_s_loss_is_not_the_training_loss() -> None:
    ev = EvalEnded(metrics={"loss": 5.0})
    assert metric_value(ev, "loss") is None  # "loss" of split "train": Loss events only
    assert metric_value(ev, "loss", split="val") is None
    assert metric_value(ev, "loss", split="eval") == 5.0
    assert metric_value(ev, "eval_loss") == 5.0
    assert metric_value(EvalEnded(metrics={"train/loss": 2.0}), "train/loss") == 2.0  # by name
