"""What a captured tensor is until the bus thread reads it: `Pending`, `Shared` and `Part`.

A `Pending` holds a CPU snapshot or a pinned buffer whose device->host copy is in flight, and
the `Fence` (one CUDA event per publish and device) that tells, without waiting, when the copy
is done. Everything here that reads a value runs on the bus thread, after `ready()`.
"""

from __future__ import annotations

from typing import Any

from eventbus._capture_pools import EVENTS, POOL
from eventbus._capture_ring import RingSlot
from eventbus.log import RateLimiter, get_logger

__all__ = ["CAPTURED", "DeviceSpan", "Fence", "Part", "Pending", "Shared", "log_failure"]

_failures = RateLimiter(10.0)


def log_failure(msg: str, e: BaseException, **kw: Any) -> None:
    """Log a capture that failed, at most once per 10 s per message."""
    ok, held = _failures.allow(msg)
    if ok:
        get_logger().error(msg, error=repr(e), suppressed=held, **kw)


class Fence:
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
            log_failure("polling a device->host copy failed", e)
            return True
        self.event = None
        EVENTS.put(self.device, ev)  # every copy before it finished: safe to record again
        return True


class Pending:
    """A tensor captured at publish; `value()` on the bus thread gives a number or CPU tensor."""

    __slots__ = ("buf", "fence", "pooled")

    def __init__(self, buf: Any, fence: Fence | None = None, pooled: bool = False) -> None:
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

    def __init__(self, pending: Pending | RingSlot) -> None:
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
        return [self.kind(x) for x in h[self.start : self.stop]]


class DeviceSpan:
    """The device time between two CUDA events a phase recorded on its stream
    (`bus.phase(..., device_time=True)`): seconds, read on the bus thread once the second
    event completed. Neither the recording nor the reading waits for the device."""

    __slots__ = ("end", "start")

    def __init__(self, start: Any, end: Any) -> None:
        self.start, self.end = start, end

    def ready(self) -> bool:
        try:
            return self.end is None or bool(self.end.query())  # cudaEventQuery: never waits
        except Exception as e:  # a CUDA error: the field becomes None, logged
            self.end = None
            log_failure("polling a phase's CUDA event failed", e)
            return True

    def value(self) -> float | None:
        if self.end is None:
            return None
        return float(self.start.elapsed_time(self.end)) / 1000.0  # both done: no wait; ms


CAPTURED = (Pending, Part, RingSlot, DeviceSpan)
"""The types a captured field value has until it is resolved (a `RingSlot`: a CUDA scalar;
a `DeviceSpan`: a phase's device time)."""
