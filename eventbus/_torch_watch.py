"""`watch()`: `TensorStats` of a model's weights, gradients and module outputs every N-th step.

One code path, eager or under torch.compile (either order of compile and watch):
- the root module's hooks and a forward hook per selected module stay installed; on an
  unwatched step each returns at once (`self.active` is False);
- weights are measured when a watched forward starts and gradients when they are accumulated,
  in eager code, with foreach ops (`measure_many`);
- activations are reduced where they are made (`reduce_tensor`). Compiled, that is inside the
  graph, where inductor fuses it, and the partial results leave it through one ordered op
  (`eventbus::watch_end`) that publishes them when the graph runs.
Under compile the graph is chosen when the forward is called, so `active` must be known by
then: it is set for the next forward when a forward ends, by `watcher.step(n)` and by
`bus.step(n)` scopes. dynamo makes two graphs (watched and not). Nothing here reads a device
value; `what="dtype"` reads host metadata only (`TensorLayout` events).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch

from eventbus import _torch_ops as ops
from eventbus._compiling import compiling
from eventbus._torch_hooks import leaves, queue_after_backward, resolve_bus
from eventbus._torch_stats import Entry, entry, measure_many, publishable, reduce_tensor
from eventbus.events import TensorLayout
from eventbus.log import get_logger
from eventbus.steps import current_step, on_step_change

__all__ = ["KINDS", "Watcher", "watch"]

KINDS = ("weights", "grads", "activations")
"""What `watch()` can look at: parameters, their gradients, module outputs."""

_INPUT = "\x00in:"  # marks a module's input among its traced outputs (what="dtype" only)


class Watcher:
    """The hooks `watch()` installed; `.remove()` takes every one off.

    Step numbers, in order of precedence: the last `watcher.step(n)`; else the innermost open
    `bus.step(n)` scope; else a count of the model's forward calls (1, 2, ...). Statistics are
    published at steps where `step % every == 0`. `missed` counts compiled watched forwards
    that ran without (some of) their activation hooks: logged, never silent.
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
        root = _uncompiled(model)
        self.model = model
        self.bus = bus
        self.every = every
        kinds = frozenset(what)
        self.layout_only = "dtype" in kinds
        self.what = (kinds - {"dtype"}) or frozenset(KINDS)
        self.bins = bins if histogram else 0
        self._enabled = True
        self.missed = 0
        self.active = False  # read by the hooks; under compile, a guard of the graph
        self._id = ops.register_watcher(self)
        self._manual: int | None = None
        self._count = 0
        self._step: int | None = None
        self._watched = False  # whether the forward running now is watched (eager truth)
        self._compiled_run = False  # whether it runs compiled (begin called by the op)
        self._most = 0  # the most activations a compiled watched forward gave
        self._weights_step: int | None = None
        self._pending: list[Entry] = []  # this forward's weights (and eager activations)
        self._traced: list[tuple[str, str, tuple[Any, ...], tuple[torch.Tensor, ...]]] = []
        self._grads: list[tuple[str, torch.Tensor]] = []
        self._grad_flush_queued = False
        self._seen: dict[str, tuple[str, tuple[int, ...]]] = {}  # layout last published
        self._layout_buf: list[Any] = []  # this step's weights, published with activations
        selected = [(n, m) for n, m in root.named_modules() if modules is None or modules(n, m)]
        self._root_selected = any(m is root for _, m in selected)
        chosen = {id(m) for _, m in selected}
        self._params = [
            (n, p)
            for n, p in root.named_parameters()
            if modules is None or id(root.get_submodule(n.rpartition(".")[0])) in chosen
        ]
        self._handles: list[Any] = [
            root.register_forward_pre_hook(self._on_forward_start),
            root.register_forward_hook(self._on_forward_end),
        ]
        if "activations" in self.what:
            self._handles += [
                m.register_forward_hook(partial(self._on_output, n))
                for n, m in selected
                if m is not root
            ]
        self._grad_hooks: list[Any] = []  # installed for a watched backward only
        self._root = root
        ops.guard_twins(root, +1)
        on_step_change(bus, self._predict)
        self._predict()
        ops.forget_compiled(model, root, "watch()")

    @property
    def enabled(self) -> bool:
        """False pauses watching (e.g. around evaluation); takes effect at the next forward."""
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        self._enabled = bool(on)
        self._predict()  # a compiled model's next graph is chosen by it

    @property
    def current(self) -> int | None:
        """The step of the last forward call (None before the first)."""
        return self._step

    def step(self, n: int) -> None:
        """Number the following forward calls `n` (overrides `bus.step` and the count)."""
        if type(n) is not int:
            raise TypeError(f"watcher.step() takes an int; got {n!r:.80}")
        self._manual = n
        self._predict()

    def remove(self) -> None:
        """Remove every hook this watcher installed (idempotent)."""
        if self._handles:  # the first remove(): compiled code may hold the hooks, traced
            ops.forget_compiled(self.model, self._root, "watcher.remove()")
            ops.guard_twins(self._root, -1)
        _drop(self._handles)
        _drop(self._grad_hooks)
        self._pending.clear()
        self._traced.clear()
        self._grads.clear()
        self.active = False
        self._enabled = False

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # hooks: traced into the graph under torch.compile, so only tensor ops and the two ops

    def _on_forward_start(self, module: torch.nn.Module, args: Any) -> None:
        if compiling():
            torch.ops.eventbus.watch_begin(self._id)  # runs `begin` when the graph runs
        else:
            self.begin(compiled=False)

    def _on_output(self, name: str, module: torch.nn.Module, args: Any, out: Any) -> None:
        if not self.active:  # under compile: a guard; the unwatched graph has no hook code
            return
        if self.layout_only:  # inputs too, integer ones included (token ids): metadata only
            for label, t in leaves(args, name):
                self._traced.append((_INPUT + label, str(t.dtype), tuple(t.shape), ()))
        for label, t in leaves(out, name):
            if not t.is_floating_point() or not t.numel():
                continue
            if self.layout_only:
                parts: tuple[torch.Tensor, ...] = ()
            else:
                parts = reduce_tensor(t.detach(), self.bins)  # queued on t's device; no read
            # Shapes and dtypes are metadata: reading them never touches the device.
            self._traced.append((label, str(t.dtype), tuple(t.shape), parts))

    def _on_forward_end(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if self._root_selected and "activations" in self.what:
            self._on_output("", module, args, out)
        items = list(self._traced)
        self._traced.clear()
        if compiling():
            meta = tuple((label, dt, len(shape), len(parts)) for label, dt, shape, parts in items)
            flat = [p for *_, parts in items for p in parts]
            sizes = [d for _, _, shape, _ in items for d in shape]  # ints, or symbolic sizes
            site = ops.watch_site(self._id, meta)
            torch.ops.eventbus.watch_end(flat, sizes, site)  # publishes when the graph runs
        else:
            self.end(items)

    # eager: called by the hooks, or by the ops when the compiled graph runs

    def begin(self, *, compiled: bool) -> None:
        """A forward starts: number it, decide whether it is watched, measure the weights."""
        self._pending.clear()  # what a forward that raised left behind
        step, counted = self._next_step()
        if counted:
            self._count = step
        self._step = step
        watched = self._watches(step)
        if compiled and watched and not self.active and "activations" in self.what:
            self._missed(step)
        self._compiled_run = compiled
        self._watched = watched
        if not compiled:
            self.active = watched
        if not watched:
            _drop(self._grad_hooks)  # a watched forward with no backward left them on
            return
        if "weights" in self.what and self._weights_step != step:
            self._weights_step = step  # once per step, also with gradient accumulation
            if self.layout_only:  # published with the activations, at the forward's end
                self._layout_buf = _layout("weights", self._params)
            else:  # foreach ops on the parameters' devices; nothing is read
                self._pending += measure_many(self._params, "weights", self.bins)
        if "grads" in self.what and not self._grad_hooks:
            self._grad_hooks.extend(
                p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    partial(self._on_grad, n)
                )
                for n, p in self._params
                if p.requires_grad
            )

    def end(self, items: list[tuple[str, str, tuple[Any, ...], tuple[torch.Tensor, ...]]]) -> None:
        """A forward ended: publish what it measured; decide whether the next one is watched."""
        if self._watched and self._compiled_run and "activations" in self.what:
            if len(items) < self._most:  # the graph that ran had fewer (or no) hooks
                self._missed(self._step)
            self._most = max(self._most, len(items))
        if self._watched and self.layout_only:
            layout, self._layout_buf = self._layout_buf, []
            self._publish_layout(layout + [(_layout_key(n), d, s) for n, d, s, _ in items])
        elif self._watched:
            self._pending += [
                entry(label, "activations", dtype, shape, parts)
                for label, dtype, shape, parts in items
            ]
        entries, self._pending = self._pending, []
        if entries:
            for ev in publishable(entries, self._step):
                self.bus.publish(ev)
        self._predict()

    def _next_step(self) -> tuple[int, bool]:
        """The next forward's step: `watcher.step`, else `bus.step`, else the count (True)."""
        step = self._manual if self._manual is not None else current_step(self.bus)
        return (self._count + 1, True) if step is None else (step, False)

    def _watches(self, step: int) -> bool:
        return self._enabled and step % self.every == 0

    def _predict(self) -> None:
        """Set `active` for the next forward (compiled graphs are chosen by it at the call)."""
        self.active = self._watches(self._next_step()[0])

    def _missed(self, step: int | None) -> None:
        self.missed += 1
        if self.missed == 1:
            get_logger().warning(
                "watch(): a compiled forward of a watched step ran without (some of) its "
                "activation hooks: the step was decided after the call (number steps before "
                "the forward with bus.step(n) or watcher.step(n)), or dynamo ran a graph "
                "compiled for an unwatched model of the same class (it does not guard on "
                "hooks: watch that model too, or give the watched one a class of its own)",
                step=step,
            )

    def _on_grad(self, name: str, p: torch.Tensor) -> None:
        if not self._watched or p.grad is None:
            return
        self._grads.append((name, p.grad))
        if not self._grad_flush_queued:
            self._grad_flush_queued = True
            queue_after_backward(self._flush_grads)

    def _flush_grads(self) -> None:
        self._grad_flush_queued = False
        _drop(self._grad_hooks)  # the backward is over: nothing to watch until the next step
        grads, self._grads = self._grads, []
        if not grads:
            return
        if self.layout_only:
            self._publish_layout(_layout("grads", grads))
            return
        for ev in publishable(measure_many(grads, "grads", self.bins), self._step):
            self.bus.publish(ev)

    def _publish_layout(self, items: list[tuple[str, str, tuple[Any, ...]]]) -> None:
        """One `TensorLayout` of what changed since last published (host metadata only)."""
        changed: dict[str, Any] = {}
        for key, dtype, shape in items:
            now = (dtype, tuple(int(d) for d in shape))
            if self._seen.get(key) != now:
                self._seen[key] = now
                changed[key] = {"dtype": dtype, "shape": list(now[1])}
        if changed:
            self.bus.publish(TensorLayout(step=self._step, changed=changed, tensors=len(items)))


def _layout(kind: str, named: Sequence[tuple[str, torch.Tensor]]) -> list[Any]:
    """("kind/name", dtype, shape) of each tensor: metadata, never a device read."""
    return [(f"{kind}/{n}", str(t.dtype), tuple(t.shape)) for n, t in named]


def _layout_key(label: str) -> str:
    """ "inputs/<module>" for a module's input, "activations/<module>" for its output."""
    if label.startswith(_INPUT):
        return "inputs/" + label[len(_INPUT) :]
    return "activations/" + label


def _uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module `torch.compile` wrapped (names without `_orig_mod.`), else `model`."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else model


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
    such as "attn[1]"), the same for a compiled model. `what="dtype"` (alone or with kinds)
    publishes `TensorLayout` (dtypes and shapes that changed, module inputs included) instead:
    no device work.
    `modules(name, module)` selects modules. `bus` defaults to `eventbus.get_bus()`.
    Returns a `Watcher`; `.remove()` takes every hook off.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"watch() takes a torch.nn.Module; got {type(model).__qualname__}")
    if type(every) is not int or every < 1:
        raise ValueError(f"every must be an int >= 1 (publish every N-th step); got {every!r}")
    kinds = (what,) if isinstance(what, str) else tuple(what)
    bad = [k for k in kinds if k not in (*KINDS, "dtype")]
    if bad or not kinds:
        raise ValueError(f"what= takes some of {(*KINDS, 'dtype')}; got {what!r}")
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
