"""PyTorch hooks that publish events: `watch()` for tensor statistics, `instrument()` for phases.

`watch(model, bus, every=N)` publishes a `TensorStats` per weight, gradient and module
output at every N-th step: norm, mean, std, absmax, NaN and Inf counts (and optionally a
histogram), computed with torch ops on the tensor's own device. A step's statistics are
stacked into one tensor and captured with one non-blocking copy; the bus thread unpacks it
into plain numbers. Nothing here reads a device value on the training thread.

`instrument(model, optimizer, bus)` publishes ForwardEnded, BackwardEnded and
OptimizerStepped (lr, grad_norm as a device tensor) from module and optimizer hooks.

Both return a handle whose `.remove()` takes every hook back off.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch  # absolute import: this module is eventbus.torch, torch is the library

from eventbus.capture import capture_shared
from eventbus.events import BackwardEnded, ForwardEnded, OptimizerStepped, TensorStats
from eventbus.steps import current_step

__all__ = ["KINDS", "Instrumentation", "Watcher", "instrument", "tensor_stats", "watch"]

KINDS = ("weights", "grads", "activations")
"""What `watch()` can look at: parameters, their gradients, module outputs."""

_NSTATS = 4  # norm, mean, std, absmax (floats), then nan_count, inf_count (ints)


def _queue_after_backward(fn: Callable[[], None]) -> None:
    """Run `fn` when the running backward pass ends (as DDP does); at once if none runs."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(fn)
    except RuntimeError:  # not inside a backward pass (a hook called by hand)
        fn()


def _leaves(out: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors in a module output with names: `prefix` for the first, suffixed for the rest."""
    found = 0

    def walk(v: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal found
        if isinstance(v, torch.Tensor):
            found += 1
            yield (prefix if found == 1 else path), v
        elif isinstance(v, dict):
            for k, x in v.items():
                yield from walk(x, f"{path}.{k}")
        elif isinstance(v, list | tuple):
            for i, x in enumerate(v):
                yield from walk(x, f"{path}[{i}]")

    yield from walk(out, prefix)


# -- statistics on the device ---------------------------------------------------------------


@dataclass(slots=True)
class _Entry:
    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    stats: torch.Tensor  # (4,) float32: norm, mean, std, absmax
    counts: torch.Tensor  # (2,) int64: nan, inf
    hist: torch.Tensor | None  # (bins + 2,) float32: min, max, counts


def _compute(t: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Statistics of `t` as device tensors; every op is queued on t's device, none is read."""
    x = t.detach()
    # float32 accumulation: bf16/fp16 sums lose precision and fp16 norms overflow at 65504.
    xf = x if x.dtype == torch.float32 else x.float()
    n = xf.numel()
    mean = xf.mean()
    # Two-pass std (sample, as Tensor.std): exact in float32, and ~6x faster on CPU than
    # torch.std_mean's Welford kernel. `n` is host metadata: reading it is no sync.
    std = torch.linalg.vector_norm(xf - mean) / math.sqrt(max(n - 1, 1))
    lo, hi = torch.aminmax(xf)
    stats = torch.stack([torch.linalg.vector_norm(xf), mean, std, torch.maximum(hi, -lo)])
    counts = torch.stack([torch.isnan(xf).sum(), torch.isinf(xf).sum()])
    hist = None
    if bins:
        finite = torch.isfinite(xf)
        flo = torch.where(finite, xf, torch.inf).amin()
        fhi = torch.where(finite, xf, -torch.inf).amax()
        # Rescaled to [0, 1] on the device: torch.histc with min == max would read the data's
        # range back to the host (a sync); fixed bounds never do. Non-finite values fall
        # outside [0, 1] and are not counted.
        u = (xf - flo) / (fhi - flo).clamp_min(torch.finfo(torch.float32).tiny)
        hist = torch.cat([torch.stack([flo, fhi]), torch.histc(u, bins=bins, min=0.0, max=1.0)])
    return stats, counts, hist


def tensor_stats(t: torch.Tensor, *, name: str = "", kind: str = "activations",
                 bins: int = 0, step: int | None = None) -> TensorStats:
    """One tensor's `TensorStats`, values still on its device (publish it: no sync)."""
    return _publishable([_entry(t, name, kind, bins)], step)[0]


def _entry(t: torch.Tensor, name: str, kind: str, bins: int) -> _Entry:
    stats, counts, hist = _compute(t, bins)
    return _Entry(name, kind, str(t.dtype), tuple(t.shape), stats, counts, hist)


def _publishable(entries: list[_Entry], step: int | None) -> list[TensorStats]:
    """Events for `entries` sharing one capture per device (one device->host copy)."""
    events: list[TensorStats] = []
    by_device: dict[torch.device, list[_Entry]] = {}
    for e in entries:
        by_device.setdefault(e.stats.device, []).append(e)
    for group in by_device.values():
        n = len(group)
        parts = [torch.stack([e.stats for e in group]).reshape(-1).double(),
                 torch.stack([e.counts for e in group]).reshape(-1).double()]
        hists = [e.hist for e in group if e.hist is not None]
        if len(hists) == n:
            parts.append(torch.stack(hists).reshape(-1).double())
        # One non-blocking copy of the whole group into pinned memory; float64 holds float32
        # statistics and int64 counts (up to 2**53) exactly.
        shared = capture_shared(torch.cat(parts))
        counts_at = _NSTATS * n
        hist_at = counts_at + 2 * n
        for i, e in enumerate(group):
            s = _NSTATS * i
            hist: Any = None
            if e.hist is not None and len(hists) == n:
                width = e.hist.shape[0]
                h = hist_at + width * i
                hist = {"min": shared.part(h), "max": shared.part(h + 1),
                        "counts": shared.part(h + 2, h + width, int)}
            events.append(TensorStats(
                step=step, name=e.name, kind=e.kind, dtype=e.dtype, shape=e.shape,
                norm=shared.part(s), mean=shared.part(s + 1), std=shared.part(s + 2),
                absmax=shared.part(s + 3),
                nan_count=shared.part(counts_at + 2 * i, kind=int),
                inf_count=shared.part(counts_at + 2 * i + 1, kind=int),
                histogram=hist,
            ))
    return events


# -- watch -----------------------------------------------------------------------------------


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
        self._pending: list[_Entry] = []  # this forward's weights and activations
        self._grads: list[_Entry] = []  # this backward's gradients
        self._grad_flush_queued = False
        selected = [(n, m) for n, m in model.named_modules() if modules is None or modules(n, m)]
        self._root_selected = any(m is model for _, m in selected)
        self._modules = [(n, m) for n, m in selected if m is not model]
        chosen = {id(m) for _, m in selected}
        self._params = [(n, p) for n, p in model.named_parameters()
                        if modules is None or id(model.get_submodule(n.rpartition(".")[0]))
                        in chosen]
        self._handles: list[Any] = [model.register_forward_pre_hook(self._on_forward_start),
                                    model.register_forward_hook(self._on_forward_end)]
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
            self._pending.extend(_entry(p, n, "weights", self.bins) for n, p in self._params)
        if "activations" in self.what:
            self._output_hooks.extend(m.register_forward_hook(partial(self._on_output, n))
                                      for n, m in self._modules)
        if "grads" in self.what and not self._grad_hooks:
            self._grad_hooks.extend(
                p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    partial(self._on_grad, n))
                for n, p in self._params if p.requires_grad)

    def _on_output(self, name: str, module: torch.nn.Module, args: Any, out: Any) -> None:
        if not self._active:
            return
        for label, t in _leaves(out, name):
            if t.is_floating_point() and t.numel():
                self._pending.append(_entry(t, label, "activations", self.bins))

    def _on_forward_end(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        _drop(self._output_hooks)
        if self._active and self._root_selected and "activations" in self.what:
            self._on_output("", module, args, out)
        if self._pending:
            entries, self._pending = self._pending, []
            for ev in _publishable(entries, self._step):
                self.bus.publish(ev)

    def _on_grad(self, name: str, p: torch.Tensor) -> None:
        if not self._active or p.grad is None:
            return
        self._grads.append(_entry(p.grad, name, "grads", self.bins))
        if not self._grad_flush_queued:
            self._grad_flush_queued = True
            _queue_after_backward(self._flush_grads)

    def _flush_grads(self) -> None:
        self._grad_flush_queued = False
        _drop(self._grad_hooks)  # the backward is over: nothing to watch until the next step
        entries, self._grads = self._grads, []
        if entries:
            for ev in _publishable(entries, self._step):
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
    return Watcher(model, _bus(bus), every=every, what=kinds, histogram=histogram, bins=bins,
                   modules=modules)


# -- instrument ------------------------------------------------------------------------------


class Instrumentation:
    """The hooks `instrument()` installed; `.remove()` takes every one off.

    Step numbers: the innermost open `bus.step(n)` scope's; else a count starting at
    `first_step` that advances after each optimizer step (each forward without optimizer).
    """

    def __init__(self, model: torch.nn.Module | None, optimizer: Any, bus: Any, *,
                 grad_norm: bool, first_step: int) -> None:
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
            for _, t in _leaves(out, ""):
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

        _queue_after_backward(ended)

    def _on_step_start(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._opt_t0 = time.perf_counter()
        norm, self._given_norm = self._given_norm, None
        if norm is None and self.compute_grad_norm:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"]
                     if p.grad is not None]
            # Device ops only (foreach norms, stacked): the result stays a device tensor.
            norm = torch.nn.utils.get_total_norm(grads) if grads else None
        self._opt_norm = norm

    def _on_step_end(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
        self.bus.publish(OptimizerStepped(
            step=self.step, lr=lr, grad_norm=self._opt_norm,
            duration_s=time.perf_counter() - self._opt_t0,
        ))
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
    return Instrumentation(model, optimizer, _bus(bus), grad_norm=grad_norm,
                           first_step=first_step)


def _bus(bus: Any) -> Any:
    if bus is None:
        from eventbus._globals import get_bus

        return get_bus()
    if not callable(getattr(bus, "publish", None)):
        raise TypeError(f"bus must be an EventBus; got {type(bus).__qualname__}")
    return bus
