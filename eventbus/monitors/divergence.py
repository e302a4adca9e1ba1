"""`DivergenceDetector`: catches a run going bad from its events, on the bus side.

It never touches the training thread: values arrive as floats (tensors were captured at
publish without a sync), the decision is `DivergenceRule` (docs/divergence.md), and on
detection it publishes `DivergenceDetected` and warns, stops or aborts through `bus.control`.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from eventbus.core import BusHandle
from eventbus.events import DivergenceDetected, EvalEnded, Event, Loss, OptimizerStepped, Scalars
from eventbus.log import get_logger
from eventbus.monitors._divergence_rule import Detection, DivergenceRule
from eventbus.monitors._metric import metric_value

__all__ = ["DivergenceDetector"]

Action = Literal["warn", "stop", "abort"]
_ACTIONS = ("warn", "stop", "abort")


class DivergenceDetector:
    """Watches one metric and reports divergence: NaN/Inf at once, a sustained rise in ~3 steps.

    `metric`: a name as the stoppers read it (monitors/_metric.py): "loss" (`Loss` of
    `split`), "grad_norm" / "lr" (`OptimizerStepped`), "eval_loss" or "eval/loss"
    (`Loss(split="eval")`, `EvalEnded.metrics`), "<split>_loss" / "<split>/loss", or any
    name in `Scalars.values` and `EvalEnded.metrics`. `action`: "warn" (log only), "stop"
    (`bus.control.request_stop`) or "abort" (`bus.control.request_abort`). Other keyword
    arguments tune `DivergenceRule`; the defaults work at any loss scale.
    """

    events: ClassVar[tuple[type[Event], ...]] = (Loss, OptimizerStepped, EvalEnded, Scalars)
    policy: ClassVar[str] = "block"  # a monitor that misses the diverging step is no monitor
    name = "DivergenceDetector"

    def __init__(
        self,
        metric: str = "loss",
        action: Action = "warn",
        *,
        split: str = "train",
        **rule: Any,
    ) -> None:
        if action not in _ACTIONS:
            raise ValueError(f"action must be one of {', '.join(_ACTIONS)}; got {action!r}")
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"metric must be a non-empty name such as 'loss'; got {metric!r}")
        self.metric = metric
        self.action: Action = action
        self.split = split
        try:
            self.rule = DivergenceRule(**rule)
        except TypeError as e:
            raise TypeError(f"DivergenceDetector: unknown option ({e})") from None
        self.detections: list[DivergenceDetected] = []
        self.bus: BusHandle | None = None
        self._auto_step = 0

    def on_start(self, bus: BusHandle) -> None:
        """Keep the bus to publish detections on and to request a stop through."""
        self.bus = bus

    async def on_events(self, batch: list[Event]) -> None:
        for ev in batch:
            value = metric_value(ev, self.metric, self.split)
            if value is None:
                continue
            step = ev.step
            if step is None:
                step = self._auto_step
            self._auto_step = step + 1
            found = self.rule.update(step, value)
            if found is not None:
                self._report(found)

    def _report(self, d: Detection) -> None:
        ev = DivergenceDetected(
            step=d.step, metric=self.metric, value=d.value, baseline=d.baseline, reason=d.reason
        )
        self.detections.append(ev)
        get_logger().warning(
            "divergence detected",
            metric=self.metric,
            step=d.step,
            value=d.value if math.isfinite(d.value) else repr(d.value),
            baseline=d.baseline,
            reason=d.reason,
            action=self.action,
        )
        bus = self.bus
        if bus is None:
            return
        bus.publish(ev)
        reason = f"{self.metric} diverged at step {d.step}: {d.reason}"
        if self.action == "stop":
            bus.control.request_stop(reason, source=self.name, step=d.step)
        elif self.action == "abort":
            bus.control.request_abort(reason, source=self.name, step=d.step)

    def state_dict(self) -> dict[str, Any]:
        """The rule's windows and baseline, so a resumed run keeps its reference."""
        return {"metric": self.metric, "auto_step": self._auto_step, "rule": self.rule.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("metric", self.metric) != self.metric:
            raise ValueError(
                f"state is for metric {state.get('metric')!r}, this detector watches "
                f"{self.metric!r}: construct DivergenceDetector(metric={state.get('metric')!r})"
            )
        self._auto_step = int(state.get("auto_step", 0))
        self.rule.load_state_dict(state["rule"])
