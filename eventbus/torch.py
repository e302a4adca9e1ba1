"""PyTorch hooks that publish events: `watch()` for tensor statistics, `instrument()` for phases.

`watch(model, bus, every=N)` publishes a `TensorStats` per weight, gradient and module
output at every N-th step: norm, mean, std, absmax, NaN and Inf counts (and optionally a
histogram), computed with torch ops on the tensor's own device. A step's statistics are
stacked into one tensor and captured with one non-blocking copy; the bus thread unpacks it
into plain numbers. Nothing here reads a device value on the training thread.

`profile(bus, schedule=...)` drives `torch.profiler` windows from `bus.step()` scopes and
writes each window's trace and table off the training thread (`ProfileSaved`).

`instrument(model, optimizer, bus)` publishes ForwardEnded, BackwardEnded and
OptimizerStepped (lr, grad_norm as a device tensor) from module and optimizer hooks.

`watch` and `instrument` return a handle whose `.remove()` takes every hook back off.
"""

from __future__ import annotations

import time
from collections import deque
from functools import partial
from typing import Any

import torch  # absolute import: this module is eventbus.torch, torch is the library

from eventbus._torch_hooks import leaves, queue_after_backward, resolve_bus
from eventbus._torch_profile import ProfileWindows, profile
from eventbus._torch_stats import tensor_stats
from eventbus._torch_watch import KINDS, Watcher, watch
from eventbus.events import BackwardEnded, ForwardEnded, OptimizerStepped
from eventbus.steps import current_step

__all__ = [
    "KINDS",
    "Instrumentation",
    "ProfileWindows",
    "Watcher",
    "instrument",
    "profile",
    "tensor_stats",
    "watch",
]


class Instrumentation:
    """The hooks `instrument()` installed; `.remove()` takes every one off.

    Step numbers: the innermost open `bus.step(n)` scope's; else a count starting at
    `first_step` that advances after each optimizer step (each forward without optimizer).
    """

    def __init__(
        self,
        model: torch.nn.Module | None,
        optimizer: Any,
        bus: Any,
        *,
        grad_norm: bool,
        first_step: int,
    ) -> None:
        self.bus = bus
        self.model = model
        self.optimizer = optimizer
        self.compute_grad_norm = grad_norm
        self.count = first_step
        self._given_norm: Any = None
        self._fwd_t0 = 0.0
        self._opt_t0 = 0.0
        self._opt_norm: Any = None
        self._handles: list[Any] = []
        self._out_hooks: deque[Any] = deque(maxlen=64)  # hooks on outputs not yet backwarded
        if model is not None:
            self._handles.append(model.register_forward_pre_hook(self._on_forward_start))
            self._handles.append(model.register_forward_hook(self._on_forward_end))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._on_step_start))
            self._handles.append(optimizer.register_step_post_hook(self._on_step_end))

    @property
    def step(self) -> int:
        """The step events are numbered with now."""
        s = current_step(self.bus)
        return self.count if s is None else s

    def record_grad_norm(self, norm: Any) -> None:
        """Publish `norm` (e.g. what clip_grad_norm_ returned; a tensor) at the next step."""
        self._given_norm = norm

    def remove(self) -> None:
        """Remove every hook this instrumentation installed (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        while self._out_hooks:
            self._out_hooks.pop().remove()

    def __enter__(self) -> Instrumentation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _on_forward_start(self, module: torch.nn.Module, args: Any) -> None:
        self._fwd_t0 = time.perf_counter()  # host wall time; kernels may still be queued

    def _on_forward_end(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        step = self.step
        self.bus.publish(ForwardEnded(step=step, duration_s=time.perf_counter() - self._fwd_t0))
        if torch.is_grad_enabled():
            for _, t in leaves(out, ""):
                if t.requires_grad:
                    # Fires when backward reaches the output: the start of the model's backward.
                    hook = partial(self._on_backward_start, step)
                    self._out_hooks.append(t.register_hook(hook))  # type: ignore[no-untyped-call]
                    break
        if self.optimizer is None and current_step(self.bus) is None:
            self.count += 1

    def _on_backward_start(self, step: int, grad: torch.Tensor) -> None:
        t0 = time.perf_counter()

        def ended() -> None:
            self.bus.publish(BackwardEnded(step=step, duration_s=time.perf_counter() - t0))

        queue_after_backward(ended)

    def _on_step_start(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._opt_t0 = time.perf_counter()
        norm, self._given_norm = self._given_norm, None
        if norm is None and self.compute_grad_norm:
            grads = [
                p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None
            ]
            # Device ops only (foreach norms, stacked): the result stays a device tensor.
            norm = torch.nn.utils.get_total_norm(grads) if grads else None
        self._opt_norm = norm

    def _on_step_end(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
        self.bus.publish(
            OptimizerStepped(
                step=self.step,
                lr=lr,
                grad_norm=self._opt_norm,
                duration_s=time.perf_counter() - self._opt_t0,
            )
        )
        self._opt_norm = None
        if current_step(self.bus) is None:
            self.count += 1


def instrument(
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    bus: Any = None,
    *,
    grad_norm: bool = True,
    first_step: int = 1,
) -> Instrumentation:
    """Hooks that publish ForwardEnded, BackwardEnded and OptimizerStepped; no boilerplate.

    OptimizerStepped carries `lr` (param_groups[0]) and `grad_norm`: the tensor given to
    `record_grad_norm()` for that step, else (grad_norm=True) the total 2-norm of the
    gradients computed on the device before the step. Durations are host wall time.
    """
    if model is None and optimizer is None:
        raise TypeError("instrument() needs a model, an optimizer, or both")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__qualname__}")
    if optimizer is not None and not hasattr(optimizer, "register_step_post_hook"):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__qualname__}"
        )
    if type(first_step) is not int:
        raise TypeError(f"first_step must be an int; got {first_step!r}")
    return Instrumentation(
        model, optimizer, resolve_bus(bus), grad_norm=grad_norm, first_step=first_step
    )
