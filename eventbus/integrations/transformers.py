"""Hugging Face `Trainer` bridge: a `TrainerCallback` that publishes the run onto an `EventBus`.

    trainer = Trainer(..., callbacks=[EventBusCallback(bus)])

Step numbers are the Trainer's `state.global_step` *after* the optimizer step, so the first
optimizer step is step 1 and they match `state.log_history[i]["step"]`: `StepStarted(k)`,
`OptimizerStepped(k)`, `StepEnded(k)` and `Loss(k)` all describe the same k-th update.
Every value comes from what the Trainer already computed (its logs are Python floats it
synced itself); nothing here calls `.item()` and a tensor, if one appears, is published as
is. Hooks run on every rank and so publish on every rank: the bus stamps `rank` (use a
subscriber's `ranks=` to keep one rank's view). `bus.should_stop` becomes
`control.should_training_stop` at the end of the step in which it is first seen.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from eventbus import get_bus
from eventbus.bus import EventBus
from eventbus.events import (
    CheckpointSaved,
    EpochEnded,
    EpochStarted,
    EvalEnded,
    Loss,
    OptimizerStepped,
    RunEnded,
    RunStarted,
    Scalars,
    StepEnded,
    StepStarted,
)
from eventbus.integrations._common import (
    jsonable,
    metric,
    missing_framework,
    numeric_items,
    stop_state,
)

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as err:
    raise missing_framework(
        "transformers", "Hugging Face transformers", "transformers", err
    ) from None

__all__ = ["EventBusCallback"]

# Log keys published as their own events; everything else numeric goes into `Scalars`.
_OWN_KEYS = frozenset(("loss", "learning_rate", "grad_norm"))


class EventBusCallback(TrainerCallback):  # type: ignore[misc,unused-ignore]
    """Publishes the Trainer's lifecycle onto `bus`; stops training when the bus asks.

    `bus` defaults to the process's default bus (`eventbus.get_bus()`). With
    `manage_bus=True` the callback starts the bus at train begin and closes it (draining
    every subscriber) at train end; leave it False when you already use `with bus:`.
    """

    def __init__(self, bus: EventBus | None = None, *, manage_bus: bool = False) -> None:
        if bus is not None and not isinstance(bus, EventBus):
            raise TypeError(
                f"EventBusCallback(bus) takes an eventbus.EventBus, got {type(bus).__qualname__}"
            )
        self.bus = bus if bus is not None else get_bus()
        self.manage_bus = manage_bus
        self._epoch = 0
        self._epoch_t0 = 0.0
        self._step_t0: float | None = None
        self._opt_t0: float | None = None
        self._tokens_seen = 0
        # OptimizerStepped of the current step, completed by on_log (grad norm) if it logs.
        self._pending: OptimizerStepped | None = None
        self._aborting = False
        self._stop_reason: str | None = None

    # -- run ---------------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.manage_bus:
            self.bus.start()
        self._aborting = False
        self._stop_reason = None
        self._pending = None
        self._tokens_seen = state.num_input_tokens_seen or 0
        self.bus.publish(
            RunStarted(
                step=state.global_step,
                config=jsonable(args.to_dict()),  # type: ignore[no-untyped-call,unused-ignore]
                run_id=args.run_name,
                total_steps=state.max_steps,
                world_size=args.world_size,
                resumed_from_step=state.global_step or None,
            )
        )

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._flush_pending()
        if self._aborting:
            status = "aborted"
        elif state.max_steps > 0 and state.global_step < state.max_steps:
            status = "stopped"
        else:
            status = "completed"
        reason = self._stop_reason
        if status == "stopped" and reason is None:
            reason = "control.should_training_stop was set"
        self.bus.publish(RunEnded(step=state.global_step, status=status, reason=reason))
        if self.manage_bus:
            self.bus.close()

    # -- epochs --------------------------------------------------------------------------

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        # state.epoch is fractional (epochs done); the epoch now starting is its floor,
        # 0-based like the Trainer's loop variable. The epsilon absorbs float round-off.
        self._epoch = math.floor((state.epoch or 0.0) + 1e-6)
        self._epoch_t0 = time.perf_counter()
        self.bus.publish(EpochStarted(step=state.global_step, epoch=self._epoch))

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._flush_pending()
        if self._aborting:  # runs after DefaultFlowCallback: undo its end-of-epoch save/eval
            control.should_save = control.should_evaluate = False
        self.bus.publish(
            EpochEnded(
                step=state.global_step,
                epoch=self._epoch,
                duration_s=time.perf_counter() - self._epoch_t0,
            )
        )

    # -- steps ---------------------------------------------------------------------------

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._flush_pending()
        self._step_t0 = time.perf_counter()
        # global_step counts finished updates: the one starting now is global_step + 1.
        self.bus.publish(StepStarted(step=state.global_step + 1))

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._opt_t0 = time.perf_counter()

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        optimizer = kw.get("optimizer")
        lr = None
        if optimizer is not None and getattr(optimizer, "param_groups", None):
            # The lr this update used (the scheduler steps after this hook). A float, or a
            # tensor when the user made it one: published as is, never read here.
            lr = optimizer.param_groups[0].get("lr")
        t0 = self._opt_t0
        self._pending = OptimizerStepped(
            step=state.global_step + 1,  # incremented right after this hook
            lr=lr,
            # Host time of optimizer.step(): on a GPU, the time to queue its kernels.
            duration_s=None if t0 is None else time.perf_counter() - t0,
        )
        self._opt_t0 = None

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        tokens = None
        seen = state.num_input_tokens_seen or 0
        if seen > self._tokens_seen:  # counted (and gathered) by the Trainer when enabled
            tokens, self._tokens_seen = seen - self._tokens_seen, seen
        t0 = self._step_t0
        self.bus.publish(
            StepEnded(
                step=state.global_step,
                duration_s=None if t0 is None else time.perf_counter() - t0,
                samples=args.per_device_train_batch_size * args.gradient_accumulation_steps,
                tokens=tokens,
            )
        )
        self._step_t0 = None
        stop, abort = stop_state(self.bus)
        if stop:
            control.should_training_stop = True
            self._stop_reason = self.bus.control.reason or "bus.should_stop"
            if abort:
                # Abort: no final checkpoint or evaluation for this step or the epoch end.
                self._aborting = True
                control.should_save = control.should_evaluate = False

    # -- metrics -------------------------------------------------------------------------

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        if not logs:
            return
        step = state.global_step
        loss = metric(logs.get("loss"))
        if loss is not None:
            # The Trainer's own mean over the logging window (already a float it synced).
            self.bus.publish(Loss(step=step, value=loss))
        lr, grad_norm = metric(logs.get("learning_rate")), metric(logs.get("grad_norm"))
        pending = self._pending
        if pending is not None and pending.step == step:
            if lr is not None:
                pending.lr = lr
            pending.grad_norm = grad_norm
            self._flush_pending()
        elif lr is not None or grad_norm is not None:
            # No on_optimizer_step hook in this transformers: the logs are all we have.
            self.bus.publish(OptimizerStepped(step=step, lr=lr, grad_norm=grad_norm))
        rest = numeric_items(logs, skip=_OWN_KEYS)
        if rest:
            self.bus.publish(Scalars(step=step, values=rest))

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        self.bus.publish(
            EvalEnded(
                step=state.global_step,
                metrics=eval_metrics(metrics or {}),
                duration_s=_runtime(metrics or {}),
            )
        )

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        path = os.path.join(args.output_dir or "", f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        self.bus.publish(CheckpointSaved(step=state.global_step, path=path))

    def _flush_pending(self) -> None:
        if self._pending is not None:
            self.bus.publish(self._pending)
            self._pending = None


def eval_metrics(values: dict[str, Any]) -> dict[str, Any]:
    """The Trainer's metrics (numeric ones, keys unchanged) plus `loss` = its `<prefix>_loss`.

    `EvalEnded.metrics["loss"]` is what monitors read; the Trainer names it `eval_loss`
    (or `<prefix>_loss`), so the alias is added when exactly one such key exists.
    """
    out = numeric_items(values)
    if "loss" not in out:
        losses = [k for k in out if k.endswith("_loss")]
        if len(losses) == 1:
            out["loss"] = out[losses[0]]
    return out


def _runtime(metrics: dict[str, Any]) -> float | None:
    for k, v in metrics.items():
        if k.endswith("_runtime") and isinstance(v, int | float) and not isinstance(v, bool):
            return float(v)
    return None
