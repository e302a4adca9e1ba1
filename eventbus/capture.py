"""Zero-sync tensor capture: what `publish` does with tensor-valued fields.

On the training thread a CUDA tensor is detached and copied device->host with
`non_blocking=True` into a pinned buffer from a reusable pool, and a CUDA event is recorded
behind the copy; a CPU tensor is cloned so a later in-place change cannot alter what
subscribers see. Nothing here calls `.item()`, `.tolist()`, `.numpy()`, `float()` or
`.cpu()` on the publishing thread. The bus thread later waits for the copy without
blocking its loop (`Pending.ready()` polls the CUDA event) and turns it into a float.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from collections import deque
from typing import Any

from eventbus.events import Event

__all__ = [
    "FIELDS",
    "PLAIN",
    "Pending",
    "PinnedPool",
    "capturable_fields",
    "capture_event",
    "pending_of",
    "resolve",
    "resolve_value",
]

PLAIN: frozenset[type] = frozenset((float, int, bool, str, type(None)))


class PinnedPool:
    """Reusable pinned host buffers keyed by (dtype, shape); thread-safe (deque ops)."""

    def __init__(self, max_free_per_key: int = 256) -> None:
        self._free: dict[tuple[Any, tuple[int, ...]], deque[Any]] = {}
        self._max = max_free_per_key
        self.allocated = 0

    def get(self, dtype: Any, shape: tuple[int, ...]) -> Any:
        free = self._free.get((dtype, shape))
        if free:
            try:
                return free.pop()
            except IndexError:  # emptied by another thread in between
                pass
        import torch

        self.allocated += 1
        # Pinned (page-locked) host memory: the precondition for a truly asynchronous
        # device->host copy. Buffers are pooled and never freed (cudaFreeHost would sync).
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def put(self, buf: Any) -> None:
        key = (buf.dtype, tuple(buf.shape))
        free = self._free.get(key)
        if free is None:
            free = self._free.setdefault(key, deque())
        if len(free) < self._max:
            free.append(buf)


POOL = PinnedPool()


class Pending:
    """A tensor captured at publish; `value()` on the bus thread gives a float or CPU tensor."""

    __slots__ = ("buf", "cuda_event", "pooled")

    def __init__(self, buf: Any, cuda_event: Any = None, pooled: bool = False) -> None:
        self.buf = buf
        self.cuda_event = cuda_event
        self.pooled = pooled

    def ready(self) -> bool:
        # Event.query() asks the driver whether the copy finished; it never waits.
        return self.cuda_event is None or bool(self.cuda_event.query())

    def value(self) -> Any:
        buf = self.buf
        if buf.device.type not in ("cpu", "cuda"):
            # Devices other than CUDA (mps, xla): the host copy happens here, on the bus
            # thread, never on the training thread.
            buf = buf.cpu()
        # `buf` is a host tensor (pinned or cloned) and, for CUDA, ready() was True: .item()
        # here reads host memory and cannot synchronise a device.
        out = buf.item() if buf.numel() == 1 and buf.dim() == 0 else buf.clone()
        if self.pooled:
            POOL.put(buf)
        return out


def _capture_tensor(t: Any) -> Pending:
    t = t.detach()  # no grad graph kept alive; no copy, no sync
    dev = t.device.type
    if dev == "cpu":
        # A snapshot: later in-place updates (optimizer steps, `+=`) must not change what
        # subscribers see. A CPU copy; no device involved.
        return Pending(t.clone())
    if dev == "cuda":
        import torch

        buf = POOL.get(t.dtype, tuple(t.shape))
        # Queued on the current stream behind the kernels that produce `t`; non_blocking
        # into pinned memory returns at once: no host-device synchronisation.
        buf.copy_(t, non_blocking=True)
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        # Recording an event is asynchronous: it marks the copy's place in the stream.
        ev.record(torch.cuda.current_stream(t.device))
        return Pending(buf, ev, pooled=True)
    # Other devices (mps, xla...): a device-side clone now (asynchronous); the host copy
    # happens on the bus thread in Pending.value().
    return Pending(t.clone())


def _tensor_type() -> type | None:
    torch = sys.modules.get("torch")  # no tensors can exist before torch is imported
    return None if torch is None else typing.cast(type, torch.Tensor)


def _capture_value(v: Any, tensor: type) -> tuple[Any, bool]:
    """(captured value, whether anything in it is Pending)."""
    if isinstance(v, tensor):
        return _capture_tensor(v), True
    if type(v) is dict:
        found = False
        out = {}
        for k, x in v.items():
            if type(x) in PLAIN:
                out[k] = x
            else:
                out[k], f = _capture_value(x, tensor)
                found |= f
        return (out, True) if found else (v, False)
    if type(v) is list or type(v) is tuple:
        items = [_capture_value(x, tensor) for x in v]
        if any(f for _, f in items):
            return type(v)(x for x, _ in items), True
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
            f.name for f in dataclasses.fields(cls)
            if f.name not in skip and hints.get(f.name, Any) not in (str, int, bool)
        )
        FIELDS[cls] = names
    return names


def capture_event(ev: Event) -> bool:
    """Capture the tensors in `ev`'s fields in place; True if any needs resolving later."""
    names = FIELDS.get(type(ev))
    if names is None:
        names = capturable_fields(type(ev))
    tensor: type | None = None
    found = False
    for name in names:
        v = getattr(ev, name)
        if type(v) in PLAIN:
            continue
        if tensor is None:
            tensor = _tensor_type()
            if tensor is None:
                return False
        v2, f = _capture_value(v, tensor)
        if f:
            setattr(ev, name, v2)
            found = True
    return found


def _resolve_value(v: Any) -> Any:
    if type(v) is Pending:
        return v.value()
    if type(v) is dict:
        return {k: _resolve_value(x) for k, x in v.items()}
    if type(v) is list or type(v) is tuple:
        return type(v)(_resolve_value(x) for x in v)
    return v


def _pendings(v: Any) -> list[Pending]:
    if type(v) is Pending:
        return [v]
    if type(v) is dict:
        return [p for x in v.values() for p in _pendings(x)]
    if type(v) is list or type(v) is tuple:
        return [p for x in v for p in _pendings(x)]
    return []


def pending_of(ev: Event) -> list[Pending]:
    """Every not-yet-resolved capture in `ev` (for polling readiness)."""
    return [p for name in capturable_fields(type(ev)) for p in _pendings(getattr(ev, name))]


def resolve(ev: Event) -> None:
    """Replace captures in `ev` by floats / CPU tensors (bus thread; all must be ready)."""
    for name in capturable_fields(type(ev)):
        v = getattr(ev, name)
        if type(v) not in PLAIN:
            setattr(ev, name, _resolve_value(v))


def resolve_value(v: Any) -> Any:
    """A captured value as subscribers see it (used by replay and tests)."""
    return _resolve_value(v)
