"""Which value of an event a monitor watches: one naming rule for metrics, shared by monitors.

    "loss"                      Loss(split=<the monitor's split>, "train" by default)
    "eval_loss", "eval/loss"    Loss(split="eval"), EvalEnded.metrics["loss"]
    "<split>_loss", "<s>/loss"  Loss(split=<split>) ("train/loss", "val_loss", ...)
    "grad_norm", "lr"           OptimizerStepped
    any name                    Scalars.values[name], EvalEnded.metrics[name]; and, for
                                "eval_<key>" / "eval/<key>", EvalEnded.metrics[<key>]

An evaluation's "loss" is the eval loss: metric "loss" of a split other than "eval" (the
training loss) does not read `EvalEnded.metrics["loss"]`.

`DivergenceDetector` and the stoppers read names through this one table. Values reach
monitors as host floats: tensors were captured at publish.
"""

from __future__ import annotations

from typing import Any

from eventbus.events import EvalEnded, Event, Loss, OptimizerStepped, Scalars

__all__ = ["loss_split", "metric_value"]

_EVAL_PREFIXES = ("eval_", "eval/")


def loss_split(metric: str, split: str) -> str | None:
    """The `Loss.split` a metric name stands for ("loss" -> `split`), or None if no loss."""
    if metric == "loss":
        return split
    for sep in ("_", "/"):
        head, found, tail = metric.rpartition(sep)
        if found and head and tail == "loss" and sep not in head:
            return head
    return None


def metric_value(ev: Event, metric: str, split: str = "train") -> float | None:
    """The value `ev` carries for `metric` (see the module's table), or None."""
    raw: Any = None
    if isinstance(ev, Loss):
        if ev.split == loss_split(metric, split):
            raw = ev.value
    elif isinstance(ev, Scalars):
        raw = ev.values.get(metric)
    elif isinstance(ev, EvalEnded):
        if metric == "loss" and split != "eval":
            return None  # an evaluation's loss is not the training loss
        raw = ev.metrics.get(metric)
        if raw is None and metric.startswith(_EVAL_PREFIXES):
            raw = ev.metrics.get(metric[5:])
    elif isinstance(ev, OptimizerStepped):
        raw = ev.grad_norm if metric == "grad_norm" else ev.lr if metric == "lr" else None
    if raw is None or isinstance(raw, bool):
        return None
    try:
        return float(raw)  # a host float already: tensors were resolved on the bus side
    except (TypeError, ValueError):
        return None
