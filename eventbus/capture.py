"""Zero-sync tensor capture: what `publish` does with tensor-valued fields.

    training thread (publish)                   bus thread (router)
    t = field.detach()
    CPU:  snap = t.clone()  ---------------->   Pending.value(): snap.item() / snap
    CUDA: buf = POOL.get(dtype, shape)  (pinned, reused)
          buf.copy_(t, non_blocking=True)       (queued on t's current stream)
          event.record(stream)   ---------->    poll Fence.done() = event.query() (never waits)
                                                then buf.item() / buf.clone(); buf -> POOL

Nothing here calls `.item()`, `.tolist()`, `.numpy()`, `float()` or `.cpu()` on the
publishing thread. One CUDA event is recorded per publish and device, behind all its copies.
A tensor with one element reaches subscribers as the Python number `.item()` gives (float,
int or bool); any other as a CPU tensor. This module holds the process-wide pools (`POOL`,
`EVENTS`): their only state.
"""

from __future__ import annotations

import sys
import threading
import typing
from collections import deque
from typing import Any

from eventbus.codec import MAX_DEPTH
from eventbus.events import Event, event_fields
from eventbus.log import RateLimiter, get_logger

__all__ = [
    "EVENTS",
    "FIELDS",
    "PLAIN",
    "POOL",
    "EventPool",
    "Part",
    "Pending",
    "PinnedPool",
    "Shared",
    "capturable_fields",
    "capture_event",
    "capture_shared",
    "capture_tensor",
    "pending_of",
    "resolve",
    "resolve_value",
]

PLAIN: frozenset[type] = frozenset((float, int, bool, str, type(None)))

_failures = RateLimiter(10.0)


class PinnedPool:
    """Reusable pinned host buffers keyed by (dtype, shape), bounded in bytes; thread-safe.

    A buffer comes back (`put`) only once its copy is finished and read. Buffers beyond the
    bounds are dropped: torch's caching host allocator keeps them, so dropping never calls
    cudaFreeHost (which would synchronise).
    """

    def __init__(self, max_bytes: int = 64 << 20, max_per_key: int = 4096) -> None:
        if max_bytes < 0 or max_per_key < 0:
            raise ValueError(f"bounds must be >= 0, got {max_bytes=}, {max_per_key=}")
        self.max_bytes = max_bytes
        self.max_per_key = max_per_key
        self._free: dict[tuple[Any, tuple[int, ...]], deque[Any]] = {}
        self._lock = threading.Lock()
        self.free_bytes = 0
        self.allocated = 0  # buffers pinned by `get` because none was free
        self.reused = 0  # buffers handed out again

    def get(self, dtype: Any, shape: tuple[int, ...]) -> Any:
        """A pinned buffer of this dtype and shape, reused when one is free."""
        with self._lock:
            free = self._free.get((dtype, shape))
            if free:
                buf = free.pop()
                self.free_bytes -= buf.numel() * buf.element_size()
                self.reused += 1
                return buf
            self.allocated += 1
        import torch

        # Pinned (page-locked) host memory: the precondition for a truly asynchronous
        # device->host copy. Served by torch's caching host allocator; no device sync.
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def put(self, buf: Any) -> None:
        """Give back a buffer whose copy finished and was read (bus thread)."""
        nbytes = buf.numel() * buf.element_size()
        key = (buf.dtype, tuple(buf.shape))
        with self._lock:
            free = self._free.setdefault(key, deque())
            if len(free) < self.max_per_key and self.free_bytes + nbytes <= self.max_bytes:
                free.append(buf)
                self.free_bytes += nbytes

    def clear(self) -> None:
        """Drop every free buffer (torch's host allocator keeps the memory cached)."""
        with self._lock:
            self._free.clear()
            self.free_bytes = 0

    def statistics(self) -> dict[str, int]:
        """allocated (pinned because none was free), reused, free (buffers), free_bytes."""
        with self._lock:
            free = sum(len(d) for d in self._free.values())
            return {"allocated": self.allocated, "reused": self.reused, "free": free,
                    "free_bytes": self.free_bytes}


class EventPool:
    """Reusable CUDA events per device (creating one costs a driver call); thread-safe."""

    def __init__(self, max_per_device: int = 1024) -> None:
        self.max_per_device = max_per_device
        self._free: dict[int, deque[Any]] = {}

    def get(self, device_index: int) -> Any:
        free = self._free.get(device_index)
        if free:
            try:
                return free.pop()  # deque.pop is atomic: safe against other publishers
            except IndexError:
                pass
        import torch

        return torch.cuda.Event()  # type: ignore[no-untyped-call]

    def put(self, device_index: int, ev: Any) -> None:
        free = self._free.setdefault(device_index, deque())
        if len(free) < self.max_per_device:
            free.append(ev)


POOL = PinnedPool()
EVENTS = EventPool()


class _Fence:
    """The CUDA event recorded behind one publish's copies on one device; shared."""

    __slots__ = ("device", "event")

    def __init__(self, event: Any, device: int) -> None:
        self.event = event
        self.device = device

    def done(self) -> bool:
        ev = self.event
        if ev is None:
            return True
        try:
            # cudaEventQuery asks whether the stream passed the event; it never waits.
            if not ev.query():
                return False
        except Exception as e:  # a CUDA error (device assert): report it when read
            self.event = None
            _log_failure("polling a device->host copy failed", e)
            return True
        self.event = None
        EVENTS.put(self.device, ev)  # every copy before it finished: safe to record again
        return True


class Pending:
    """A tensor captured at publish; `value()` on the bus thread gives a number or CPU tensor."""

    __slots__ = ("buf", "fence", "pooled")

    def __init__(self, buf: Any, fence: _Fence | None = None, pooled: bool = False) -> None:
        self.buf = buf
        self.fence = fence
        self.pooled = pooled

    def ready(self) -> bool:
        """True once the device->host copy finished (always, for CPU captures); never waits."""
        f = self.fence
        return f is None or f.done()

    def host(self) -> Any:
        """The captured CPU tensor (call once `ready()`); the pooled buffer is not given back."""
        buf = self.buf
        if buf.device.type != "cpu":
            # Devices other than CUDA (mps, xla): the host copy happens here, on the bus
            # thread, never on the training thread.
            buf = buf.cpu()
        return buf

    def value(self) -> Any:
        """A Python number for a one-element tensor (as `.item()`), else a CPU tensor."""
        buf = self.host()
        # `buf` is host memory (a clone, or a pinned buffer whose copy ready() saw finish):
        # .item() / .clone() here read host memory and cannot synchronise a device.
        out = buf.item() if buf.numel() == 1 else (buf.clone() if self.pooled else buf)
        self._release()
        return out

    def as_list(self) -> list[Any]:
        """The capture flattened to a Python list (bus thread; call once `ready()`)."""
        out: list[Any] = self.host().reshape(-1).tolist()  # host memory: no device sync
        self._release()
        return out

    def _release(self) -> None:
        if self.pooled:
            self.pooled = False
            POOL.put(self.buf)


class Shared:
    """One capture read by many fields (`watch()` batches a step's statistics in one copy)."""

    __slots__ = ("_host", "pending")

    def __init__(self, pending: Pending) -> None:
        self.pending = pending
        self._host: list[Any] | None = None

    def host(self) -> list[Any]:
        """The flattened values (read once, on the bus thread)."""
        if self._host is None:
            self._host = self.pending.as_list()
        return self._host

    def part(self, start: int, stop: int | None = None, kind: type = float) -> Part:
        """Element `start` (or the slice start:stop as a list), converted by `kind`."""
        return Part(self, start, stop, kind)


class Part:
    """A field value that is one element (or slice) of a `Shared` capture."""

    __slots__ = ("kind", "shared", "start", "stop")

    def __init__(self, shared: Shared, start: int, stop: int | None, kind: type) -> None:
        self.shared = shared
        self.start = start
        self.stop = stop
        self.kind = kind

    def ready(self) -> bool:
        return self.shared.pending.ready()

    def value(self) -> Any:
        h = self.shared.host()
        if self.stop is None:
            return self.kind(h[self.start])
        return [self.kind(x) for x in h[self.start:self.stop]]


_CAPTURED = (Pending, Part)


def _log_failure(msg: str, e: BaseException, **kw: Any) -> None:
    ok, held = _failures.allow(msg)
    if ok:
        get_logger().error(msg, error=repr(e), suppressed=held, **kw)


class _Capture:
    """One publish's captures: CUDA copies get one recorded event per device at the end."""

    __slots__ = ("cuda", "deep")

    def __init__(self) -> None:
        self.cuda: list[tuple[Pending, Any]] | None = None
        self.deep = False  # a container deeper than MAX_DEPTH (or a cycle) was met

    def tensor(self, t: Any) -> Pending:
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
            buf = POOL.get(t.dtype, tuple(t.shape))
            # Queued on the current stream of t's device behind the kernels that produce
            # `t`; non_blocking into pinned memory returns at once: no host-device sync
            # (a non-contiguous `t` is first made contiguous by a kernel on that stream).
            buf.copy_(t, non_blocking=True)
            p = Pending(buf, pooled=True)
            if self.cuda is None:
                self.cuda = []
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

        fences: dict[Any, _Fence] = {}
        for p, dev in self.cuda:
            f = fences.get(dev)
            if f is None:
                ev = EVENTS.get(dev.index)
                # Recording is asynchronous: it marks the copies' place in the stream.
                ev.record(torch.cuda.current_stream(dev))
                f = fences[dev] = _Fence(ev, dev.index)
            p.fence = f


def _tensor_type() -> type | None:
    torch = sys.modules.get("torch")  # no tensors can exist before torch is imported
    # getattr: another thread may be importing torch right now (module not yet complete).
    tensor = getattr(torch, "Tensor", None) if torch is not None else None
    return tensor if isinstance(tensor, type) else None


def _capture_value(  # noqa: PLR0911 - one return per kind
    v: Any, tensor: type, cap: _Capture, depth: int = 0
) -> tuple[Any, bool]:
    """(captured value, whether anything in it needs resolving on the bus thread)."""
    if isinstance(v, tensor):
        return cap.tensor(v), True
    if type(v) in _CAPTURED:
        return v, True
    if isinstance(v, dict):
        if depth >= MAX_DEPTH:  # kept as it is below here (a cycle ends here too)
            cap.deep = True
            return v, False
        found = False
        out = {}
        for k, x in v.items():
            if type(x) in PLAIN:
                out[k] = x
            else:
                out[k], f = _capture_value(x, tensor, cap, depth + 1)
                found |= f
        return (out, True) if found else (v, False)
    if isinstance(v, list | tuple):
        if depth >= MAX_DEPTH:  # kept as it is below here (a cycle ends here too)
            cap.deep = True
            return v, False
        items = [_capture_value(x, tensor, cap, depth + 1) for x in v]
        if any(f for _, f in items):
            vals = [x for x, _ in items]
            if hasattr(v, "_fields"):  # a namedtuple
                return type(v)(*vals), True
            return (vals if isinstance(v, list) else tuple(vals)), True
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
            f.name for f in event_fields(cls)
            if f.name not in skip and hints.get(f.name, Any) not in (str, int, bool)
        )
        FIELDS[cls] = names
    return names


def capture_event(ev: Event) -> bool:
    """Capture the tensors in `ev`'s fields in place; True if any needs resolving later.

    Training thread. Containers (dict, list, tuple) are walked; a field holding a tensor is
    replaced by a `Pending` (a container by a copy holding Pendings), never read here.
    """
    names = FIELDS.get(type(ev))
    if names is None:
        names = capturable_fields(type(ev))
    tensor: type | None = None
    cap: _Capture | None = None
    found = False
    for name in names:
        v = getattr(ev, name)
        if type(v) in PLAIN:
            continue
        if tensor is None:
            tensor = _tensor_type()
            if tensor is None:  # no torch: only already-captured values can need work
                tensor = _NoTensor
        if cap is None:
            cap = _Capture()
        v2, f = _capture_value(v, tensor, cap)
        if cap.deep:  # delivered as it is below MAX_DEPTH; the JSONL writer skips the event
            cap.deep = False
            _too_deep(ev, name)
        if f:
            setattr(ev, name, v2)
            found = True
    if cap is not None:
        cap.fence()
    return found


def _too_deep(ev: Event, name: str) -> None:
    where = f"{type(ev).__name__}.{name}"
    ok, held = _failures.allow(("too deep", where))
    if ok:
        get_logger().warning(
            f"{where} is nested deeper than {MAX_DEPTH} levels (or is cyclic): tensors below "
            "that are not captured and log writers skip the event; publish a flatter value",
            event_type=type(ev).__name__, field=name, suppressed=held)


class _NoTensor:
    """Stands in for torch.Tensor before torch is imported: nothing is an instance."""


def capture_tensor(t: Any) -> Pending:
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
    if type(v) in _CAPTURED:
        try:
            return v.value()
        except Exception as e:  # never crash the router: the field becomes None, logged
            _log_failure("a captured tensor could not be read; delivered as None", e,
                         field=where)
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
    if type(v) in _CAPTURED:
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


def resolve_value(v: Any) -> Any:
    """A captured value as subscribers see it (used by replay and tests)."""
    return _resolve_value(v, "value")
