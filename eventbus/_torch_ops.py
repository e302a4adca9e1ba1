"""The custom ops a compiled graph calls: `publish` and `watch()` inside torch.compile.

Each op is ordered (torch keeps every call, in program order, never removes one) and tagged
`cudagraph_unsafe` (its body is Python: it must run on every call, never be replayed).

`eventbus::publish`: while dynamo traces `publish`, `compiling()` reads True and
`traced_publish` runs instead: it
splits the event into tensors, ints and floats (graph inputs of the op) and everything else
(constants, kept with the event's class in a `Site` made once per trace). The op
`eventbus::publish` is ordered (torch keeps every call, in program order); when the compiled
graph runs, its eager body rebuilds the event and publishes it, so stamps, `seq`, capture and
order are exactly those of the eager run.
"""

from __future__ import annotations

import itertools
import threading
import types
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from eventbus import _compiling
from eventbus._compiling import compiling
from eventbus._event_base import rebuild
from eventbus.events import Event, event_fields
from eventbus.log import get_logger

__all__ = [
    "forget_compiled",
    "guard_twins",
    "ordered",
    "register_watcher",
    "traced_publish",
    "watch_site",
]

_TAGS = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)
_T, _I, _F, _C = 0, 1, 2, 3  # a leaf is a tensor, an int, a float (as a tensor), a constant


@dataclass(frozen=True, slots=True)
class Site:
    """One traced publish call: where its event's values go back when the graph runs."""

    bus: weakref.ref[Any]
    cls: type[Event]
    layout: tuple[tuple[str, Any], ...]  # (field name, leaf or nested list/tuple/dict of leaves)


_SITES: dict[int, Site] = {}
_WATCH_SITES: dict[int, tuple[int, tuple[Any, ...]]] = {}  # site -> (watcher id, entry meta)
_WATCHERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_ids = itertools.count()
_lock = threading.Lock()


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]
def _site(bus: Any, cls: type[Event], layout: tuple[tuple[str, Any], ...]) -> int:
    """Register a traced call site (runs once per trace; its id is a constant of the graph)."""
    with _lock:
        n = next(_ids)
        _SITES[n] = Site(weakref.ref(bus), cls, layout)
    return n


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]
def _names(cls: type[Event]) -> tuple[str, ...]:
    return tuple(f.name for f in event_fields(cls))


class _Leaves:
    """The graph inputs of one traced publish, by kind, in the order the layout reads them."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.ints: list[Any] = []

    def split(self, v: Any) -> Any:  # noqa: PLR0911 - one return per kind of value
        if isinstance(v, torch.Tensor):
            self.tensors.append(v.detach())  # publish never keeps the autograd graph
            return (_T, len(self.tensors) - 1)
        if type(v) is int or isinstance(v, torch.SymInt):
            self.ints.append(v)
            return (_I, len(self.ints) - 1)
        if type(v) is float or isinstance(v, torch.SymFloat):
            # As a float64 CPU scalar tensor: a float argument of the op (or scalar_tensor(v))
            # is specialised, one recompile per value; a product stays symbolic. Exact.
            self.tensors.append(torch.ones((), dtype=torch.float64) * v)  # type: ignore[operator]
            return (_F, len(self.tensors) - 1)
        if type(v) is dict:
            return {k: self.split(x) for k, x in v.items()}
        if type(v) is list:
            return [self.split(x) for x in v]
        if type(v) is tuple:
            return tuple(self.split(x) for x in v)
        return (_C, v)  # str, bool, None and other objects: constants of the graph


def traced_publish(bus: Any, ev: Event) -> None:
    """What `bus.publish(ev)` becomes inside a compiled function (traced, never run eagerly)."""
    if ev.seq is not None:
        raise ValueError(
            f"this {type(ev).__name__} object was already published; publish a new event object"
        )
    ev.seq = -1  # published, as eagerly: publishing this object again is refused
    leaves = _Leaves()
    layout = tuple((n, leaves.split(getattr(ev, n))) for n in _names(type(ev)) if n != "seq")
    site = _site(bus, type(ev), layout)
    torch.ops.eventbus.publish(leaves.tensors, leaves.ints, site)


def _rebuild(shape: Any, tensors: list[torch.Tensor], ints: list[int]) -> Any:
    """The field value `shape` describes, from the op's inputs (when the graph runs)."""
    if type(shape) is tuple and len(shape) == 2 and type(shape[0]) is int:  # a leaf
        kind, v = shape
        if kind == _T:
            return tensors[v]
        if kind == _F:
            return tensors[v].item()  # a float64 CPU scalar the graph made: host memory, no sync
        return ints[v] if kind == _I else v
    if type(shape) is dict:
        return {k: _rebuild(x, tensors, ints) for k, x in shape.items()}
    if type(shape) is list:
        return [_rebuild(x, tensors, ints) for x in shape]
    return tuple(_rebuild(x, tensors, ints) for x in shape)


@torch.library.custom_op("eventbus::publish", mutates_args=(), tags=_TAGS)
def _publish_op(tensors: list[torch.Tensor], ints: list[int], site: int) -> None:
    """The compiled graph's publish: rebuild the event and publish it, as eager code would."""
    s = _SITES[site]
    bus = s.bus()
    if bus is None:  # the bus is gone: nothing could receive it (as publishing to no bus)
        return
    kw = {n: _rebuild(shape, tensors, ints) for n, shape in s.layout}
    bus.publish(rebuild(s.cls, kw))  # `init=False` fields too, as traced


@_publish_op.register_fake
def _publish_fake(tensors: list[torch.Tensor], ints: list[int], site: int) -> None:
    return None


def ordered(op: Any) -> None:
    """Mark a custom op ordered: torch keeps every call, in program order, never removed."""
    try:
        from torch._library.effects import EffectType

        op.register_effect(EffectType.ORDERED)
    except (ImportError, AttributeError):  # older torch: the same registry, private spelling
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

        _register_effectful_op(op._opoverload, _EffectType.ORDERED)


@torch.compiler.substitute_in_graph(compiling)
def _compiling_traced() -> bool:
    return True  # what dynamo sees when it traces compiling()


# -- watch(): compiled code and module hooks (dynamo does not guard on hooks) ------------------

_TWIN_GUARDS: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()


def guard_twins(root: torch.nn.Module, by: int) -> None:
    """Give `root` (while a watcher holds it) an instance attribute that dynamo's graphs
    of an unwatched module of the same class are guarded against (`forward` not in its
    __dict__), so they never serve it: dynamo does not guard on hooks. The same bound method:
    nothing else changes."""
    n = _TWIN_GUARDS.get(root, 0) + by
    _TWIN_GUARDS[root] = n
    own = root.__dict__.get("forward")
    ours = getattr(own, "__func__", None) is type(root).forward
    if n > 0 and own is None:
        root.forward = types.MethodType(type(root).forward, root)
    elif n <= 0 and ours:
        del root.forward


def forget_compiled(model: torch.nn.Module, root: torch.nn.Module, why: str) -> None:
    """Drop compiled code that may call hooks as they were when it was traced.

    dynamo does not guard on module hooks: code traced before `watch()` never calls its
    hooks, and code traced before `remove()` keeps calling them. The code dropped is shared
    by modules of the same class and by every `torch.compile(module)`: those recompile once
    on their next call. Logged, never silent; nothing happens when nothing was compiled.
    """
    from torch._dynamo import external_utils

    inner = external_utils.wrap_inline(root)  # any wrapper: they share one code object
    codes = {type(root).forward.__code__, getattr(inner, "__code__", None)}
    for f in (
        getattr(getattr(model, "forward", None), "__wrapped__", None),  # OptimizedModule's
        torch.nn.Module._wrapped_call_impl,
        torch.nn.Module._call_impl,
    ):
        fn = getattr(f, "__func__", f)  # a bound method: its function
        if isinstance(fn, types.FunctionType):
            codes.add(fn.__code__)
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list, reset_code
    except ImportError:  # another torch: say what to do instead
        get_logger().warning(
            f"{why}: cannot tell whether compiled code of this model exists; if it does, "
            "it calls the hooks as they were when traced: torch._dynamo.reset() drops it"
        )
        return
    stale = [c for c in codes if c is not None and _debug_get_cache_entry_list(c)]
    for code in stale:
        reset_code(code)
    if stale:
        get_logger().warning(
            f"{why}: compiled module code was dropped and recompiles once on its next call "
            "(dynamo does not see hooks added or removed after it traced; watch() before the "
            "first compiled call avoids it)",
            model=type(root).__qualname__,
        )


# -- watch(): a watched forward's begin and end, when the compiled graph runs ----------------


def register_watcher(watcher: Any) -> int:
    """An id for `watcher` (held weakly) that compiled graphs name it by."""
    with _lock:
        n = next(_ids)
        _WATCHERS[n] = watcher
    return n


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]
def watch_site(watcher: int, meta: tuple[Any, ...]) -> int:
    """Register what a traced `watch_end` carries (once per trace; a constant of the graph)."""
    with _lock:
        n = next(_ids)
        _WATCH_SITES[n] = (watcher, meta)
    return n


@torch.library.custom_op("eventbus::watch_begin", mutates_args=(), tags=_TAGS)
def _watch_begin(watcher: int) -> None:
    """A watched model's forward starts: number the step, measure the weights (eagerly)."""
    w = _WATCHERS.get(watcher)
    if w is not None:
        w.begin(compiled=True)


@_watch_begin.register_fake
def _watch_begin_fake(watcher: int) -> None:
    return None


@torch.library.custom_op("eventbus::watch_end", mutates_args=(), tags=_TAGS)
def _watch_end(parts: list[torch.Tensor], sizes: list[int], site: int) -> None:
    """The forward ended: its activations' partials (made in the graph) are published."""
    watcher, meta = _WATCH_SITES[site]
    w = _WATCHERS.get(watcher)
    if w is None:
        return
    p, s = iter(parts), iter(sizes)
    w.end(
        [
            (label, dtype, tuple(itertools.islice(s, ndim)), tuple(itertools.islice(p, k)))
            for label, dtype, ndim, k in meta
        ]
    )


@_watch_end.register_fake
def _watch_end_fake(parts: list[torch.Tensor], sizes: list[int], site: int) -> None:
    return None


for _op in (_publish_op, _watch_begin, _watch_end):
    ordered(_op)
_compiling.TRACED.append(traced_publish)
