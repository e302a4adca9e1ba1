"""Zero-sync tensor capture: what `publish` does with tensor-valued fields.

    training thread (publish)                   bus thread (router)
    t = field.detach()
    CPU:  snap = t.clone()  ---------------->   Pending.value(): snap.item() / snap
    CUDA: buf = POOL.get(dtype, shape)  (pinned, reused)
          buf.copy_(t, non_blocking=True)       (queued on t's current stream)
          event.record(stream)   ---------->    poll Fence.done() = event.query() (never waits)
                                                then buf.item() / buf.clone(); buf -> POOL
    CUDA scalar (one element): RINGS.put(t), one device-side write into a ring slot; the
          bus thread copies every slot written so far at once (`eventbus._capture_ring`)

Nothing here calls `.item()`, `.tolist()`, `.numpy()`, `float()` or `.cpu()` on the
publishing thread. One CUDA event is recorded per publish and device, behind its pinned
copies (none for scalars written into a ring).
A tensor with one element reaches subscribers as the Python number `.item()` gives (float,
int or bool); any other as a CPU tensor. This module has no state: the process-wide pools
(`POOL`, `EVENTS`) are in `eventbus._capture_pools`. What a capture is until the bus
thread reads it (`Pending`, `Shared`, `Part`) is in `eventbus._capture_pending`.
"""

from __future__ import annotations

import sys
import typing
from typing import Any

from eventbus._capture_pending import CAPTURED, Fence, Part, Pending, Shared, log_failure
from eventbus._capture_pools import EVENTS, POOL, EventPool, PinnedPool
from eventbus._capture_ring import RINGS, RingSlot
from eventbus.codec import MAX_DEPTH
from eventbus.events import Event, event_fields
from eventbus.log import RateLimiter, get_logger

__all__ = [
    "EVENTS",
    "FIELDS",
    "PLAIN",
    "POOL",
    "RINGS",
    "EventPool",
    "Part",
    "Pending",
    "PinnedPool",
    "RingSlot",
    "Shared",
    "capturable_fields",
    "capture_event",
    "capture_shared",
    "capture_tensor",
    "pending_of",
    "resolve",
]

PLAIN: frozenset[type] = frozenset((float, int, bool, str, type(None)))

_too_deep_limit = RateLimiter(10.0)


class _Capture:
    """One publish's captures: CUDA copies get one recorded event per device at the end."""

    __slots__ = ("cuda", "deep")

    def __init__(self) -> None:
        self.cuda: list[tuple[Pending, Any]] | None = None
        self.deep = False  # a container deeper than MAX_DEPTH (or a cycle) was met

    def tensor(self, t: Any) -> Pending | RingSlot:
        if t.requires_grad:
            t = t.detach()  # no grad graph kept alive; a view, no copy, no sync
        # is_cpu / is_cuda: flag reads (~0.1 us); `t.device` builds an object (~0.5 us).
        if t.is_cpu:
            # A snapshot: later in-place updates (optimizer steps, `+=`) must not change what
            # subscribers see. A host memcpy; no device involved.
            return Pending(t.clone())
        if t.is_cuda:
            if t.layout is not sys.modules["torch"].strided or t.is_quantized:
                # Sparse or quantized: no pinned buffer has that layout. A device-side clone
                # now (asynchronous); the host copy happens on the bus thread (Pending.host).
                return Pending(t.clone())
            if self.cuda is None:  # checked once per publish (a ring write is recorded too)
                if _capturing():
                    raise RuntimeError(
                        "publish() of a CUDA tensor while a CUDA graph is being captured: the "
                        "copy would be recorded once and every replay would overwrite one "
                        "buffer, so subscribers would see nothing or wrong values. Publish after "
                        "graph.replay(), outside the captured region (return the value from it)"
                    )
                self.cuda = []  # fence() records no event while it stays empty
            # A one-element tensor of a common dtype: one device-side write into a ring on the
            # current stream; the bus thread copies every slot written so far at once. None
            # (full ring, other shape or dtype): a pinned copy of its own, below.
            slot = RINGS.put(t)
            if slot is not None:
                return slot
            buf = POOL.get(t.dtype, tuple(t.shape))
            # Queued on the current stream of t's device behind the kernels that produce
            # `t`; non_blocking into pinned memory returns at once: no host-device sync
            # (a non-contiguous `t` is first made contiguous by a kernel on that stream).
            buf.copy_(t, non_blocking=True)
            p = Pending(buf, pooled=True)
            self.cuda.append((p, t.device))
            return p
        if t.is_meta:
            raise TypeError(
                "a meta tensor has no values to publish; publish a real tensor or a number"
            )
        # Other devices (mps, xla...): a device-side clone now (asynchronous); the host copy
        # happens on the bus thread in Pending.host().
        return Pending(t.clone())

    def fence(self) -> None:
        """Record one CUDA event per device behind this publish's copies."""
        if not self.cuda:
            return
        import torch

        fences: dict[Any, Fence] = {}
        for p, dev in self.cuda:
            f = fences.get(dev)
            if f is None:
                ev = EVENTS.get(dev.index)
                # Recording is asynchronous: it marks the copies' place in the stream.
                ev.record(torch.cuda.current_stream(dev))
                f = fences[dev] = Fence(ev, dev.index)
            p.fence = f


def _capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph (a flag read; no sync)."""
    return bool(sys.modules["torch"].cuda.is_current_stream_capturing())


def _tensor_type() -> type | None:
    torch = sys.modules.get("torch")  # no tensors can exist before torch is imported
    # getattr: another thread may be importing torch right now (module not yet complete).
    tensor = getattr(torch, "Tensor", None) if torch is not None else None
    return tensor if isinstance(tensor, type) else None


def _capture_value(  # noqa: PLR0911 - one return per kind
    v: Any, tensor: type, cap: _Capture, depth: int = 0
) -> tuple[Any, bool]:
    """(captured value, whether anything in it needs resolving on the bus thread).

    A plain dict or list is copied (the walk builds the copy anyway): one the caller fills
    anew each step must not change the events already published, as a tensor does not."""
    if isinstance(v, tensor):
        return cap.tensor(v), True
    if type(v) in CAPTURED:
        return v, True
    if isinstance(v, dict):
        if depth >= MAX_DEPTH:  # kept as it is below here (a cycle ends here too)
            cap.deep = True
            return v, False
        if PLAIN.issuperset(map(type, v.values())):  # nothing to capture (a Scalars): C loops
            return (dict(v), False) if type(v) is dict else (v, False)
        found = False
        out = {}
        for k, x in v.items():
            if type(x) in PLAIN:
                out[k] = x
            else:
                out[k], f = _capture_value(x, tensor, cap, depth + 1)
                found |= f
        return (out, found) if found or type(v) is dict else (v, False)
    if isinstance(v, list | tuple):
        if depth >= MAX_DEPTH:  # kept as it is below here (a cycle ends here too)
            cap.deep = True
            return v, False
        items = [_capture_value(x, tensor, cap, depth + 1) for x in v]
        found = any(f for _, f in items)
        copied = any(x is not y for (x, _), y in zip(items, v, strict=True))
        if found or copied or type(v) is list:
            vals = [x for x, _ in items]
            if hasattr(v, "_fields"):  # a namedtuple
                return type(v)(*vals), found
            return (vals if isinstance(v, list) else tuple(vals)), found
    return v, False


FIELDS: dict[type, tuple[str, ...]] = {}


def capturable_fields(cls: type) -> tuple[str, ...]:
    """Fields that might hold a tensor: all but those declared str/int/bool (cached)."""
    names = FIELDS.get(cls)
    if names is None:
        try:
            hints = typing.get_type_hints(cls)
        except Exception:
            hints = {}
        skip = {"step", "ts", "seq", "rank"}
        names = tuple(
            f.name
            for f in event_fields(cls)
            if f.name not in skip and hints.get(f.name, Any) not in (str, int, bool)
        )
        FIELDS[cls] = names
    return names


def capture_event(ev: Event) -> bool:
    """Capture the tensors in `ev`'s fields in place; True if any needs resolving later.

    Training thread. Containers (dict, list, tuple) are walked; a field holding a tensor is
    replaced by a `Pending` (a container by a copy holding Pendings), never read here; a plain
    dict or list by a copy (the caller may fill it again for the next step).
    """
    names = FIELDS.get(type(ev))
    if names is None:
        names = capturable_fields(type(ev))
    cap: _Capture | None = None
    found = False
    for name in names:
        v = getattr(ev, name)
        if type(v) in PLAIN:
            continue
        if cap is None:
            cap = _Capture()
        found = _capture_field(ev, name, v, cap) or found
    if cap is not None:
        cap.fence()
    return found


def _capture_field(ev: Event, name: str, v: Any, cap: _Capture) -> bool:
    """Capture field `name` (holding `v`, not a plain value) in place; True if anything in
    it needs resolving on the bus thread."""
    # No torch imported: only already-captured values can need work.
    v2, found = _capture_value(v, _tensor_type() or _NoTensor, cap)
    if cap.deep:  # delivered as it is below MAX_DEPTH; the JSONL writer skips the event
        cap.deep = False
        _too_deep(ev, name)
    if v2 is not v:  # tensors captured, or a container copied
        setattr(ev, name, v2)
    return found


def _too_deep(ev: Event, name: str) -> None:
    where = f"{type(ev).__name__}.{name}"
    ok, held = _too_deep_limit.allow(("too deep", where))
    if ok:
        get_logger().warning(
            f"{where} is nested deeper than {MAX_DEPTH} levels (or is cyclic): tensors below "
            "that are not captured and log writers skip the event; publish a flatter value",
            event_type=type(ev).__name__,
            field=name,
            suppressed=held,
        )


class _NoTensor:
    """Stands in for torch.Tensor before torch is imported: nothing is an instance."""


def capture_tensor(t: Any) -> Pending | RingSlot:
    """Capture one tensor now, as `publish` would (training thread; never syncs)."""
    cap = _Capture()
    p = cap.tensor(t)
    cap.fence()
    return p


def capture_shared(t: Any) -> Shared:
    """Capture one tensor whose elements many event fields will read (see `Shared.part`)."""
    return Shared(capture_tensor(t))


def _resolve_value(v: Any, where: str, depth: int = 0) -> Any:  # noqa: PLR0911
    if depth > MAX_DEPTH:  # capture never goes deeper: nothing to resolve (a cycle ends here)
        return v
    if type(v) in CAPTURED:
        try:
            return v.value()
        except Exception as e:  # never crash the router: the field becomes None, logged
            log_failure("a captured tensor could not be read; delivered as None", e, field=where)
            return None
    if type(v) is dict:
        return {k: _resolve_value(x, where, depth + 1) for k, x in v.items()}
    if type(v) is list:
        return [_resolve_value(x, where, depth + 1) for x in v]
    if isinstance(v, tuple):
        vals = [_resolve_value(x, where, depth + 1) for x in v]
        return type(v)(*vals) if hasattr(v, "_fields") else tuple(vals)
    return v


def _pendings(v: Any, out: list[Any], depth: int = 0) -> None:
    if type(v) in CAPTURED:
        out.append(v)
    elif depth > MAX_DEPTH:  # capture never goes deeper (a cycle ends here)
        return
    elif type(v) is dict:
        for x in v.values():
            _pendings(x, out, depth + 1)
    elif isinstance(v, list | tuple):
        for x in v:
            _pendings(x, out, depth + 1)


def pending_of(ev: Event) -> list[Any]:
    """Every not-yet-resolved capture in `ev` (each has a non-waiting `ready()`)."""
    out: list[Any] = []
    for name in capturable_fields(type(ev)):
        v = getattr(ev, name)
        if type(v) not in PLAIN:
            _pendings(v, out)
    return out


def resolve(ev: Event) -> None:
    """Replace captures in `ev` by numbers / CPU tensors (bus thread; all must be ready).

    Never raises: a capture that cannot be read becomes None and is logged with its field.
    """
    for name in capturable_fields(type(ev)):
        v = getattr(ev, name)
        if type(v) not in PLAIN:
            setattr(ev, name, _resolve_value(v, f"{type(ev).__name__}.{name}"))
