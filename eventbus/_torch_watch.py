"""`watch()`: `TensorStats` of a model's weights, gradients and module outputs every N-th step.

The statistics are computed with torch ops on each tensor's device and a step's are captured
with one non-blocking copy per device (`eventbus._torch_stats`); the bus thread unpacks them
into plain numbers. Nothing here reads a device value on the training thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch

from eventbus._torch_hooks import leaves, queue_after_backward, resolve_bus
from eventbus._torch_stats import Entry, measure, publishable
from eventbus.steps import current_step

__all__ = ["KINDS", "Watcher", "watch"]

KINDS = ("weights", "grads", "activations")
"""What `watch()` can look at: parameters, their gradients, module outputs."""


class Watcher:
    """The hooks `watch()` installed; `.remove()` takes every one off.

    Step numbers, in order of precedence: the last `watcher.step(n)`; else the innermost open
    `bus.step(n)` scope; else a count of the model's forward calls (1, 2, ...). Statistics are
    published at steps where `step % every == 0`. Between watched steps only two hooks stay
    on the root module: the per-module and per-parameter hooks are installed when a watched
    step's forward starts and taken off when its forward (activations) and backward (grads)
    end, so an unwatched step costs two Python calls.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        bus: Any,
        *,
        every: int,
        what: Iterable[str],
        histogram: bool,
        bins: int,
        modules: Callable[[str, torch.nn.Module], bool] | None,
    ) -> None:
        self.model = model
        self.bus = bus
        self.every = every
        self.what = frozenset(what)
        self.bins = bins if histogram else 0
        self.enabled = True
        self._manual: int | None = None
        self._count = 0
        self._step: int | None = None
        self._active = False
        self._weights_step: int | None = None
        self._pending: list[Entry] = []  # this forward's weights and activations
        self._grads: list[Entry] = []  # this backward's gradients
        self._grad_flush_queued = False
        selected = [(n, m) for n, m in model.named_modules() if modules is None or modules(n, m)]
        self._root_selected = any(m is model for _, m in selected)
        self._modules = [(n, m) for n, m in selected if m is not model]
        chosen = {id(m) for _, m in selected}
        self._params = [
            (n, p)
            for n, p in model.named_parameters()
            if modules is None or id(model.get_submodule(n.rpartition(".")[0])) in chosen
        ]
        self._handles: list[Any] = [
            model.register_forward_pre_hook(self._on_forward_start),
            model.register_forward_hook(self._on_forward_end),
        ]
        self._output_hooks: list[Any] = []  # installed for a watched forward only
        self._grad_hooks: list[Any] = []  # installed for a watched backward only

    @property
    def current(self) -> int | None:
        """The step of the last forward call (None before the first)."""
        return self._step

    def step(self, n: int) -> None:
        """Number the following forward calls `n` (overrides `bus.step` and the count)."""
        if type(n) is not int:
            raise TypeError(f"watcher.step() takes an int; got {n!r:.80}")
        self._manual = n

    def remove(self) -> None:
        """Remove every hook this watcher installed (idempotent)."""
        for hooks in (self._handles, self._output_hooks, self._grad_hooks):
            _drop(hooks)
        self._pending.clear()
        self._grads.clear()
        self._active = False

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # hooks (training thread; backward hooks may run on autograd's device threads)

    def _on_forward_start(self, module: torch.nn.Module, args: Any) -> None:
        self._pending.clear()  # what a forward that raised left behind
        _drop(self._output_hooks)
        step = self._manual
        if step is None:
            step = current_step(self.bus)
        if step is None:
            self._count += 1
            step = self._count
        self._step = step
        self._active = self.enabled and step % self.every == 0
        if not self._active:
            _drop(self._grad_hooks)  # a watched forward with no backward left them on
            return
        if "weights" in self.what and self._weights_step != step:
            self._weights_step = step  # once per step, also with gradient accumulation
            self._pending.extend(measure(p, n, "weights", self.bins) for n, p in self._params)
        if "activations" in self.what:
            self._output_hooks.extend(
                m.register_forward_hook(partial(self._on_output, n)) for n, m in self._modules
            )
        if "grads" in self.what and not self._grad_hooks:
            self._grad_hooks.extend(
                p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    partial(self._on_grad, n)
                )
                for n, p in self._params
                if p.requires_grad
            )

    def _on_output(self, name: str, module: torch.nn.Module, args: Any, out: Any) -> None:
        if not self._active:
            return
        for label, t in leaves(out, name):
            if t.is_floating_point() and t.numel():
                self._pending.append(measure(t, label, "activations", self.bins))

    def _on_forward_end(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        _drop(self._output_hooks)
        if self._active and self._root_selected and "activations" in self.what:
            self._on_output("", module, args, out)
        if self._pending:
            entries, self._pending = self._pending, []
            for ev in publishable(entries, self._step):
                self.bus.publish(ev)

    def _on_grad(self, name: str, p: torch.Tensor) -> None:
        if not self._active or p.grad is None:
            return
        self._grads.append(measure(p.grad, name, "grads", self.bins))
        if not self._grad_flush_queued:
            self._grad_flush_queued = True
            queue_after_backward(self._flush_grads)

    def _flush_grads(self) -> None:
        self._grad_flush_queued = False
        _drop(self._grad_hooks)  # the backward is over: nothing to watch until the next step
        entries, self._grads = self._grads, []
        if entries:
            for ev in publishable(entries, self._step):
                self.bus.publish(ev)


def _drop(handles: list[Any]) -> None:
    """Remove hooks by their handles and forget them."""
    while handles:
        handles.pop().remove()


def watch(
    model: torch.nn.Module,
    bus: Any = None,
    *,
    every: int = 100,
    what: Iterable[str] | str = KINDS,
    histogram: bool = False,
    bins: int = 64,
    modules: Callable[[str, torch.nn.Module], bool] | None = None,
) -> Watcher:
    """Publish `TensorStats` for `model`'s weights, grads and module outputs every N-th step.

    Names are those of `named_parameters()` (weights, grads) and `named_modules()`
    (activations; the root module is ""; extra tensors of a tuple/dict output get a suffix
    such as "attn[1]"). `modules(name, module)` selects modules. `bus` defaults to
    `eventbus.get_bus()`. Returns a `Watcher`; `.remove()` takes every hook off.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"watch() takes a torch.nn.Module; got {type(model).__qualname__}")
    if type(every) is not int or every < 1:
        raise ValueError(f"every must be an int >= 1 (publish every N-th step); got {every!r}")
    kinds = (what,) if isinstance(what, str) else tuple(what)
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"what= takes some of {KINDS}; got {what!r}")
    if histogram and (type(bins) is not int or bins < 1):
        raise ValueError(f"bins must be an int >= 1; got {bins!r}")
    return Watcher(
        model,
        resolve_bus(bus),
        every=every,
        what=kinds,
        histogram=histogram,
        bins=bins,
        modules=modules,
    )
