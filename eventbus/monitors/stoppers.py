"""`ThresholdStopper` and `EarlyStopper`: stop the run on a metric, through `bus.control`.

Both read one metric named as in `eventbus.monitors._metric` ("loss", "eval_loss",
"eval/accuracy", a `Scalars` key, ...), from `Loss`, `Scalars` or `EvalEnded`, on the bus side.
When their rule holds they call `bus.control.request_stop(reason, source=name, step=step)`:
the loop sees `bus.should_stop` at its next check. Their state (best value, values without
improvement) survives `bus.state_dict()` / `load_state_dict()`, so a resumed run goes on counting.
A metric that never shows up is said in the log (at the first evaluation without it, and at
close), with the names that did show up: a misspelt name must not pass for a run that never
needed stopping.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from eventbus.core import BusHandle
from eventbus.events import EvalEnded, Event, Loss, OptimizerStepped, Scalars
from eventbus.log import get_logger
from eventbus.monitors._metric import loss_split, metric_value

__all__ = ["EarlyStopper", "ThresholdStopper"]

Mode = Literal["min", "max"]
_MODES = ("min", "max")
_STATE_VERSION = 1


def _number(name: str, v: Any, *, least: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    if least is not None and v < least:
        raise ValueError(f"{name} must be >= {least:g}, got {v!r}")
    return float(v)


def _state_int(
    cls: str,
    state: Mapping[str, Any],
    key: str,
    default: int | None,
    *,
    none: bool = False,
    least: int | None = None,
) -> int | None:
    """`state[key]` as an int (>= `least`, or None if `none`); else a ValueError naming it."""
    v = state.get(key, default)
    if v is None and none:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)  # through a format that keeps numbers as floats
    if isinstance(v, bool) or not isinstance(v, int) or (least is not None and v < least):
        kind = "an int" + ("" if least is None else f" >= {least}") + (" or None" if none else "")
        raise ValueError(f"{cls} state: {key} must be {kind}, got {v!r}")
    return v


def _g(v: float | None) -> str:
    return "none" if v is None else f"{v:.6g}"


class _Stopper:
    """What both stoppers share: the metric, its steps, the stop request, the state."""

    events: tuple[type[Event], ...] = (Loss, Scalars, EvalEnded, OptimizerStepped)
    policy: ClassVar[str] = "block"  # counting values: every one must arrive
    _one_per_step: ClassVar[bool] = False

    def __init__(self, metric: str, mode: Mode, split: str) -> None:
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"metric must be a non-empty name such as 'eval_loss'; got {metric!r}")
        if mode not in _MODES:
            raise ValueError(
                f"mode must be 'min' (lower is better, a loss) or 'max' (higher is better, "
                f"an accuracy); got {mode!r}"
            )
        if not isinstance(split, str) or not split:
            raise ValueError(f"split must be a non-empty name such as 'train'; got {split!r}")
        self.metric = metric
        # Only the types that can carry this metric reach it (a lossless queue costs a copy).
        self.events = tuple(
            t
            for t in type(self).events
            if t in (Scalars, EvalEnded)
            or (t is Loss and loss_split(metric, split) is not None)
            or (t is OptimizerStepped and metric in ("grad_norm", "lr"))
        )
        self.mode: Mode = mode
        self.split = split
        self.bus: BusHandle | None = None
        self.best: float | None = None
        self.best_step: int | None = None
        self.stopped_at: int | None = None  # the step of the first stop request
        self.stop_reason: str | None = None
        self._auto_step = 0
        self._values = 0  # values of the metric this run (not state: a resume counts afresh)
        self._names: set[str] = set()  # names that did show up, while the metric did not
        self._told = False

    def on_start(self, bus: BusHandle) -> None:
        """Keep the bus to request a stop through."""
        self.bus = bus

    async def on_events(self, batch: list[Event]) -> None:
        """Feed each value of the metric to the rule; request a stop when it says so."""
        for ev in batch:
            value = metric_value(ev, self.metric, self.split)
            if value is not None:
                self._values += 1
                if self._one_per_step and ev.step is not None and ev.step + 1 == self._auto_step:
                    continue  # this step's value again, from another event (see EarlyStopper)
                self.update(value, ev.step)
            elif not self._values:
                self._note_names(ev)

    def on_close(self) -> None:
        """Say so if the metric never showed up: this stopper could not have stopped the run."""
        if not self._values:
            self._missing("no value of the metric arrived in this run")

    def _note_names(self, ev: Event) -> None:
        names = ev.values if isinstance(ev, Scalars) else getattr(ev, "metrics", None) or ()
        if len(self._names) < 50:
            self._names.update(k for k in names if isinstance(k, str))
        if isinstance(ev, Loss):
            self._names.add("loss" if ev.split == "train" else f"{ev.split}_loss")
        if isinstance(ev, EvalEnded) and not self._told:
            self._told = True  # once: an evaluation is where an eval metric would be
            self._missing(f"an EvalEnded at step {ev.step} did not carry it")

    def _missing(self, what: str) -> None:
        get_logger().warning(
            f"{getattr(self, 'name', type(self).__name__)}: metric {self.metric!r} not found: "
            f"{what}; check its name (docs/monitors.md, 'Metric names')",
            metric=self.metric,
            split=self.split,
            names_seen=sorted(self._names)[:50],
        )

    def update(self, value: float, step: int | None = None) -> bool:
        """Add one value (at `step`, else one past the last); True if it asks to stop."""
        if step is None:
            step = self._auto_step
        self._auto_step = step + 1
        reason = self._rule(step, value)
        if reason is None:
            return False
        self._stop(step, reason)
        return True

    def _better(self, value: float, than: float, delta: float = 0.0) -> bool:
        if self.mode == "min":
            return value < than - delta
        return value > than + delta

    def _note_best(self, step: int, value: float) -> None:
        """Record `value` if it is the best so far (finite values only)."""
        if math.isfinite(value) and (self.best is None or self._better(value, self.best)):
            self.best, self.best_step = value, step

    def _rule(self, step: int, value: float) -> str | None:
        raise NotImplementedError

    def _stop(self, step: int, reason: str) -> None:
        name = getattr(self, "name", type(self).__name__)
        if self.stopped_at is None:
            self.stopped_at, self.stop_reason = step, reason
            get_logger().warning("stop requested", source=name, step=step, reason=reason)
        if self.bus is not None:  # idempotent: the control publishes StopRequested once
            self.bus.control.request_stop(reason, source=name, step=step)

    def state_dict(self) -> dict[str, Any]:
        """Best value and where, the step count, the first stop (JSON-friendly)."""
        return {
            "version": _STATE_VERSION,
            "kind": type(self).__name__,
            "metric": self.metric,
            "mode": self.mode,
            "best": self.best,
            "best_step": self.best_step,
            "auto_step": self._auto_step,
            "stopped_at": self.stopped_at,
            "stop_reason": self.stop_reason,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned; refuse state of another metric, mode or kind,
        or a malformed one (a `ValueError` naming the key: nothing of it is loaded)."""
        self._restore(self._checked(state))

    def _checked(self, state: Any) -> dict[str, Any]:
        """Every field of `state`, checked before any is restored."""
        cls = type(self).__name__
        if not isinstance(state, Mapping):
            raise TypeError(f"{cls} state must be a dict (from state_dict()), got {state!r:.80}")
        for key in ("metric", "mode"):
            if state.get(key, getattr(self, key)) != getattr(self, key):
                raise ValueError(
                    f"state is for {key} {state.get(key)!r}, this {cls} has "
                    f"{getattr(self, key)!r}: construct {cls}({key}={state.get(key)!r}, ...)"
                )
        if state.get("kind", cls) != cls:  # older states carry no kind: taken as they are
            raise ValueError(
                f"state is of a {state['kind']}, not of this {cls}: load it into a "
                f"{state['kind']} (subscribers' states are matched by name)"
            )
        version = _state_int(cls, state, "version", _STATE_VERSION, least=0)
        if version is not None and version > _STATE_VERSION:
            raise ValueError(f"{cls} state version {version} is newer than this eventbus")
        best = state.get("best")
        if best is not None and (
            isinstance(best, bool) or not isinstance(best, int | float) or not math.isfinite(best)
        ):
            raise ValueError(f"{cls} state: best must be a finite number or None, got {best!r}")
        reason = state.get("stop_reason")
        if reason is not None and not isinstance(reason, str):
            raise ValueError(f"{cls} state: stop_reason must be a str or None, got {reason!r}")
        return {
            "best": None if best is None else float(best),
            "best_step": _state_int(cls, state, "best_step", None, none=True),
            "auto_step": _state_int(cls, state, "auto_step", 0),
            "stopped_at": _state_int(cls, state, "stopped_at", None, none=True),
            "stop_reason": reason,
        }

    def _restore(self, fields: dict[str, Any]) -> None:
        """Set what `_checked` returned."""
        self.best, self.best_step = fields["best"], fields["best_step"]
        self._auto_step = fields["auto_step"]
        self.stopped_at, self.stop_reason = fields["stopped_at"], fields["stop_reason"]


class ThresholdStopper(_Stopper):
    """Stops once `metric` reaches `threshold`: at or below it in mode "min" (a loss low
    enough), at or above it in mode "max" (an accuracy high enough). NaN and ±Inf never
    reach it: a loss of -inf is broken, not low enough.

    `split` is the `Loss.split` that metric "loss" means (docs/monitors.md names the rest).
    """

    name = "ThresholdStopper"

    def __init__(
        self, metric: str, threshold: float, mode: Mode = "min", *, split: str = "train"
    ) -> None:
        super().__init__(metric, mode, split)
        self.threshold = _number("threshold", threshold)

    def _rule(self, step: int, value: float) -> str | None:
        self._note_best(step, value)
        reached = value <= self.threshold if self.mode == "min" else value >= self.threshold
        if not reached or not math.isfinite(value):
            return None
        op = "<=" if self.mode == "min" else ">="
        return f"{self.metric} reached {value:.6g} ({op} {self.threshold:.6g}) at step {step}"


class EarlyStopper(_Stopper):
    """Stops when `metric` has not improved for `patience` values in a row.

    An improvement beats the best so far by more than `min_delta` (lower in mode "min",
    higher in mode "max"); NaN and Inf never improve. `patience` counts values of the
    metric: evaluations for an eval metric, steps for a per-step training loss. A step
    counts once: the same evaluation often arrives twice (the HF Trainer logs "eval_loss",
    published as `Scalars`, then reports it, published as `EvalEnded`).
    """

    name = "EarlyStopper"
    _one_per_step = True

    def __init__(
        self,
        metric: str,
        patience: int,
        min_delta: float = 0.0,
        mode: Mode = "min",
        *,
        split: str = "train",
    ) -> None:
        super().__init__(metric, mode, split)
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(
                f"patience must be an int >= 1 (values without improvement before stopping); "
                f"got {patience!r}"
            )
        self.patience = patience
        self.min_delta = _number("min_delta", min_delta, least=0.0)
        self.bad = 0  # values since the last improvement

    def _rule(self, step: int, value: float) -> str | None:
        if math.isfinite(value) and (
            self.best is None or self._better(value, self.best, self.min_delta)
        ):
            self.best, self.best_step, self.bad = value, step, 0
            return None
        # Not an improvement (the reference stays: small gains add up until they count, as
        # in Keras' EarlyStopping).
        self.bad += 1
        if self.bad < self.patience:
            return None
        return (
            f"{self.metric} did not improve by more than {self.min_delta:g} for {self.bad} "
            f"value(s) (best {_g(self.best)} at step {self.best_step}; now {value:.6g})"
        )

    def state_dict(self) -> dict[str, Any]:
        """The shared state and the count of values without improvement."""
        return {**super().state_dict(), "bad": self.bad}

    def _checked(self, state: Any) -> dict[str, Any]:
        """The shared fields and `bad`, checked before any is restored."""
        return {
            **super()._checked(state),
            "bad": _state_int(type(self).__name__, state, "bad", 0, least=0),
        }

    def _restore(self, fields: dict[str, Any]) -> None:
        super()._restore(fields)
        self.bad = fields["bad"]
