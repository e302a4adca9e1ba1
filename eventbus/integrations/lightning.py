"""Lightning bridge: a `Callback` that publishes a `Trainer.fit` run onto an `EventBus`.

    trainer = Trainer(..., callbacks=[EventBusCallback(bus)])

Works with `lightning.pytorch` (preferred when installed) or `pytorch_lightning`. Step
numbers are `trainer.global_step` after the optimizer step (the first update is step 1), as
in the HF bridge: `StepStarted(k)`, `StepEnded(k)`, `Loss(k)`, `OptimizerStepped(k)` all
describe the k-th update; with gradient accumulation one step spans several batches and
its `Loss` is the sum of Lightning's normalised per-batch losses (the step's mean).
Losses and metrics are published as the tensors Lightning holds: never `.item()`, no
device sync. Hooks run on every rank and publish on every rank (the bus stamps `rank`).
`bus.should_stop` becomes `trainer.should_stop` at the end of the batch in which it is seen.
"""

from __future__ import annotations

import time
from typing import Any

from eventbus import get_bus
from eventbus.bus import EventBus
from eventbus.events import (
    CheckpointLoaded,
    CheckpointSaved,
    EpochEnded,
    EpochStarted,
    EvalEnded,
    Loss,
    OptimizerStepped,
    RunEnded,
    RunStarted,
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
    from lightning.pytorch import Callback, LightningModule, Trainer

    FRAMEWORK = "lightning.pytorch"
except ImportError:
    try:
        from pytorch_lightning import Callback, LightningModule, Trainer

        FRAMEWORK = "pytorch_lightning"
    except ImportError as err:
        raise missing_framework(
            "lightning", "Lightning (lightning.pytorch or pytorch_lightning)", "lightning", err
        ) from None

__all__ = ["FRAMEWORK", "EventBusCallback"]

# Names under which users log their validation loss; the first found feeds `metrics["loss"]`.
_VAL_LOSS_KEYS = ("val_loss", "val/loss", "valid_loss", "validation_loss", "val_loss_epoch")


class EventBusCallback(Callback):  # type: ignore[misc]
    """Publishes a Lightning fit onto `bus`; stops training when the bus asks.

    `bus` defaults to the process's default bus. `manage_bus=True` starts the bus at fit
    start and closes it (draining subscribers) at fit end or on an exception.
    `grad_norm=True` publishes the total 2-norm of the gradients before each optimizer step
    as a device tensor (no sync; it costs one pass over the gradients, so it is off).
    """

    def __init__(
        self, bus: EventBus | None = None, *, manage_bus: bool = False, grad_norm: bool = False
    ) -> None:
        if bus is not None and not isinstance(bus, EventBus):
            raise TypeError(
                f"EventBusCallback(bus) takes an eventbus.EventBus, got {type(bus).__qualname__}"
            )
        self.bus = bus if bus is not None else get_bus()
        self.manage_bus = manage_bus
        self.grad_norm = grad_norm
        self._reset()

    def _reset(self) -> None:
        self._run_started = False
        self._run_ended = False
        self._epoch_t0 = 0.0
        self._step_t0: float | None = None
        self._in_step = False
        self._last_step = -1
        self._loss: Any = None  # this step's loss so far (a tensor)
        self._samples = 0
        self._optim: list[OptimizerStepped] = []
        self._val_t0: float | None = None
        self._ckpt_pending: int | None = None
        self._aborting = False
        self._stop_reason: str | None = None

    # -- run ---------------------------------------------------------------------------

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset()
        if self.manage_bus:
            self.bus.start()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Published here rather than at on_fit_start: Lightning restores global_step from a
        # checkpoint between the two, so only now is `resumed_from_step` right.
        self._publish_run_started(trainer, pl_module)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end_run(trainer, pl_module)

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        status = "aborted" if isinstance(exception, KeyboardInterrupt) else "failed"
        self._end_run(trainer, pl_module, status=status, reason=repr(exception)[:500])

    def _publish_run_started(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._run_started:
            return
        self._run_started = True
        step = trainer.global_step
        self._last_step = step
        self.bus.publish(
            RunStarted(
                step=step,
                config=_config(trainer, pl_module),
                total_steps=_total_steps(trainer),
                world_size=trainer.world_size,
                resumed_from_step=step or None,
            )
        )

    def _end_run(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        *,
        status: str | None = None,
        reason: str | None = None,
    ) -> None:
        if self._run_ended:
            return
        self._publish_run_started(trainer, pl_module)
        self._flush_checkpoint(trainer)
        self._run_ended = True
        if status is None:
            if self._aborting:
                status = "aborted"
            elif trainer.should_stop:
                status = "stopped"
            else:
                status = "completed"
            reason = self._stop_reason if status != "completed" else None
            if status == "stopped" and reason is None:
                reason = "trainer.should_stop was set"
        self.bus.publish(RunEnded(step=trainer.global_step, status=status, reason=reason))
        if self.manage_bus:
            self.bus.close()

    # -- epochs --------------------------------------------------------------------------

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush_checkpoint(trainer)
        self._epoch_t0 = time.perf_counter()
        self.bus.publish(EpochStarted(step=trainer.global_step, epoch=trainer.current_epoch))

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush_checkpoint(trainer)
        self.bus.publish(
            EpochEnded(
                step=trainer.global_step,
                epoch=trainer.current_epoch,
                duration_s=time.perf_counter() - self._epoch_t0,
            )
        )

    # -- steps ---------------------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._flush_checkpoint(trainer)
        if not self._in_step:  # the first batch of this optimizer step
            self._in_step = True
            self._step_t0 = time.perf_counter()
            self.bus.publish(StepStarted(step=trainer.global_step + 1))

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: Any
    ) -> None:
        groups = getattr(optimizer, "param_groups", None)
        # The lr this update uses (schedulers step after it): a float, or a tensor as is.
        lr = groups[0].get("lr") if groups else None
        norm = _grad_norm(groups) if self.grad_norm and groups else None
        self._optim.append(OptimizerStepped(lr=lr, grad_norm=norm))

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        loss = _loss_of(outputs)
        if loss is not None:
            # Accumulating micro-batches: a device-side add, queued, never read here.
            self._loss = loss if self._loss is None else self._loss + loss
        self._samples += _batch_size(batch)
        step = trainer.global_step
        if step > self._last_step:  # the optimizer stepped: this update is complete
            self._end_step(step)
        stop, abort = stop_state(self.bus)
        if stop:
            trainer.should_stop = True
            self._stop_reason = self.bus.control.reason or "bus.should_stop"
            self._aborting = self._aborting or abort

    def _end_step(self, step: int) -> None:
        t0 = self._step_t0
        now = time.perf_counter()
        self.bus.publish(
            StepEnded(
                step=step,
                duration_s=None if t0 is None else now - t0,
                samples=self._samples or None,
            )
        )
        if self._loss is not None:
            self.bus.publish(Loss(step=step, value=self._loss))
        for ev in self._optim:
            ev.step = step
            self.bus.publish(ev)
        self._optim = []
        self._loss = None
        self._samples = 0
        self._in_step = False
        self._last_step = step

    # -- evaluation and checkpoints --------------------------------------------------------

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._val_t0 = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return  # the pre-fit sanity check: Lightning discards its metrics too
        self._flush_checkpoint(trainer)
        t0 = self._val_t0
        self.bus.publish(
            EvalEnded(
                step=trainer.global_step,
                # Tensors as Lightning holds them: the bus snapshots them without a sync.
                metrics=eval_metrics(trainer.callback_metrics),
                duration_s=None if t0 is None else time.perf_counter() - t0,
            )
        )

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning calls this *before* writing the file and without its path: publish at
        # the next hook, when the file exists and ModelCheckpoint knows where it went.
        self._ckpt_pending = trainer.global_step

    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        step = checkpoint.get("global_step")
        path = trainer.ckpt_path
        self.bus.publish(
            CheckpointLoaded(
                step=step if isinstance(step, int) else None,
                path=str(path) if path else "",
            )
        )

    def _flush_checkpoint(self, trainer: Trainer) -> None:
        step = self._ckpt_pending
        if step is None:
            return
        self._ckpt_pending = None
        self.bus.publish(CheckpointSaved(step=step, path=_last_checkpoint_path(trainer)))


def eval_metrics(values: Any) -> dict[str, Any]:
    """`trainer.callback_metrics` (tensors kept as tensors) plus `loss` = the validation loss."""
    out = numeric_items(values)
    if "loss" not in out:
        for key in _VAL_LOSS_KEYS:
            if key in out:
                out["loss"] = out[key]
                break
    return out


def _loss_of(outputs: Any) -> Any:
    """The (detached) loss tensor in `training_step`'s output, or None."""
    if outputs is None:
        return None
    if isinstance(outputs, dict):
        outputs = outputs.get("loss")
    if hasattr(outputs, "detach"):
        return outputs.detach()  # no copy, no sync; the bus snapshots it at publish
    return metric(outputs)


def _batch_size(batch: Any) -> int:
    """The leading dimension of the batch's first tensor (a shape read: no sync), else 0."""
    stack = [batch]
    while stack:
        x = stack.pop(0)
        shape = getattr(x, "shape", None)
        if shape is not None and hasattr(x, "device"):
            return int(shape[0]) if len(shape) else 1
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list | tuple):
            stack.extend(x)
    return 0


def _grad_norm(groups: list[dict[str, Any]]) -> Any:
    """Total 2-norm of the gradients as a device tensor: queued kernels, nothing read back."""
    import torch

    grads = [p.grad for g in groups for p in g["params"] if p.grad is not None]
    if not grads:
        return None
    norms = torch._foreach_norm(grads)  # one kernel per device/dtype group; no sync
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))


def _config(trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
    conf: dict[str, Any] = {
        "trainer": jsonable(
            {
                "max_epochs": trainer.max_epochs,
                "max_steps": trainer.max_steps,
                "accumulate_grad_batches": trainer.accumulate_grad_batches,
                "gradient_clip_val": trainer.gradient_clip_val,
                "precision": trainer.precision,
                "num_devices": trainer.num_devices,
                "num_nodes": trainer.num_nodes,
                "strategy": type(trainer.strategy).__name__,
            }
        ),
        "model": type(pl_module).__name__,
    }
    conf.update(jsonable(dict(pl_module.hparams)))
    return conf


def _total_steps(trainer: Trainer) -> int | None:
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return int(trainer.max_steps)
    try:
        n = trainer.estimated_stepping_batches
    except Exception:  # no sized dataloader, or a strategy that cannot tell
        return None
    return int(n) if n != float("inf") else None


def _last_checkpoint_path(trainer: Trainer) -> str:
    """Where the newest checkpoint went, according to the ModelCheckpoint callbacks."""
    for cb in trainer.checkpoint_callbacks:
        for attr in ("_last_checkpoint_saved", "last_model_path", "best_model_path"):
            path = getattr(cb, attr, "")
            if path:
                return str(path)
    return ""
