"""Publishing a CUDA scalar without a copy of its own: a preallocated device ring per stream.

    training thread: publish of a one-element t         bus thread (router)
    ring = RINGS[(device, current stream, dtype)]
    ring.buf[i:i+1].copy_(t)  (one device-side write,    RingSlot.ready(), first poll of a slot
      queued on t's stream behind its producers)           not yet copied: ONE copy of every slot
    -> RingSlot(batch, i)  ----------------------------->    written so far into pinned host memory,
                                                             on the writes' stream, and one event
                                                           later polls: event.query() (never waits)
                                                           value(): host[:n].tolist()[i - start]

A publish costs one write into device memory; the copy to the host and the CUDA event are paid
once per drain for every slot written since the last one. Stream order makes it exact: the copy
is queued behind the writes it reads, and a slot is written again only after the copy that reads
it was queued (before any later write on that stream). A full ring (the bus thread has not
copied yet) makes `put` return None: the caller takes the pinned per-publish path. Nothing here
reads device memory on the training thread, and the bus thread reads only host memory whose
copy the event showed finished. The logic is the same on the CPU (a host buffer, a plain copy,
no event), which is how the tests exercise it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any

from eventbus._capture_pools import EVENTS

__all__ = ["RINGS", "SIZE", "Batch", "RingSlot", "Rings", "ScalarRing"]

SIZE = 4096  # slots per ring: scalars published between two drains before `put` falls back
_FREE_HOSTS = 4  # host buffers a ring keeps for its next copies
_WAIT_S = 0.0001  # the longest a writer waits for another one before taking the pinned path


class Batch:
    """The slots [start, end) that one bus-thread copy reads; shared by their `RingSlot`s."""

    __slots__ = ("end", "error", "event", "host", "ring", "start", "values")

    def __init__(self, ring: ScalarRing, start: int) -> None:
        self.ring = ring
        self.start = start
        self.end: int | None = None  # set once the copy is queued (or failed): closed
        self.host: Any = None  # the host buffer the copy writes to
        self.event: Any = None  # recorded behind the copy (CUDA); None once it finished
        self.values: list[Any] | None = None
        self.error: BaseException | None = None

    def done(self) -> bool:
        """Whether the copy finished (call once closed); never waits."""
        ev = self.event
        if ev is None:
            return True
        try:
            # cudaEventQuery asks whether the stream passed the event; it never waits.
            if not ev.query():
                return False
        except Exception as e:  # a CUDA error (device assert): reported by value()
            self.error = e
            self.event = None
            return True
        ring = self.ring
        with ring.bus_lock:  # several buses may poll one batch: give the event back once
            mine = self.event is ev
            self.event = None
        if mine:
            EVENTS.put(ring.device.index, ev)  # the copy before it finished: safe to reuse
        return True

    def read(self) -> list[Any]:
        """Every value of the batch as Python numbers (bus thread; call once `done()`)."""
        ring = self.ring
        with ring.bus_lock:
            if self.values is None:
                if self.error is not None:
                    raise RuntimeError(f"copying published scalars failed: {self.error!r}")
                host = self.host
                assert self.end is not None
                # Host memory whose copy finished: .tolist() reads no device, syncs nothing,
                # and gives exactly what .item() gives (float, int or bool).
                self.values = host[: self.end - self.start].tolist()
                self.host = None
                ring.give_back_host(host)
            return self.values


class RingSlot:
    """One published scalar in a ring; `value()` on the bus thread gives it as `.item()` would."""

    __slots__ = ("batch", "seq")

    def __init__(self, batch: Batch, seq: int) -> None:
        self.batch = batch
        self.seq = seq

    def ready(self) -> bool:
        """True once the copy holding this slot finished; the first poll queues it. Never waits."""
        b = self.batch
        if b.end is None and not b.ring.drain(b):
            return False
        return b.done()

    def value(self) -> Any:
        b = self.batch
        vals = b.values
        if vals is None:
            vals = b.read()
        return vals[self.seq - b.start]

    def as_list(self) -> list[Any]:
        """The value as a one-element list (what `Shared` reads)."""
        return [self.value()]


class ScalarRing:
    """`size` one-element slots of one dtype on one device, written on one stream.

    Writers (`put`, training threads) and the bus thread's snapshot share `lock`. A writer
    waits for it at most `_WAIT_S`, then takes the pinned path; the bus thread never waits for
    it (it polls again). `bus_lock` orders the bus threads (several buses may share a ring).
    """

    def __init__(
        self, dtype: Any = None, device: Any = "cpu", size: int = SIZE, stream: Any = None
    ) -> None:
        import torch

        if size < 1 or size & (size - 1):
            raise ValueError(f"size must be a power of two, got {size}")
        dev = torch.device(device)
        self.cuda = dev.type == "cuda"
        if self.cuda and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.dtype = torch.float32 if dtype is None else dtype
        self.size = size
        self.mask = size - 1
        if self.cuda and stream is None:
            stream = torch.cuda.current_stream(dev)
        self.stream = stream  # where the writes are queued, so where the copies must go
        # inference_mode(False): a ring first made inside inference mode must still take
        # writes outside it (an inference tensor refuses in-place updates there). On CUDA the
        # buffer is allocated on its stream: the caching allocator ties a block to one stream.
        on = torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()
        with torch.inference_mode(False), on:
            self.buf = torch.empty(size, dtype=self.dtype, device=dev)
        self.views: list[Any] = [None] * size  # buf[i:i+1], made on first use (one dispatch)
        self.written = 0  # slots written, ever; slot of the n-th write: n & mask
        self.copied = 0  # slots a queued copy reads, ever; written - copied <= size
        self.copies = 0
        self.fallbacks = 0
        self.open = Batch(self, self.copied)  # the batch the next writes belong to
        self.lock = threading.Lock()
        self.bus_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._hosts: list[Any] = []

    def put(self, t: Any) -> RingSlot | None:
        """Training thread: write `t` (detached, this dtype, shape () or (1,)) into the next slot.

        One device-side copy queued on the current stream; reads no value. None, counted in
        `fallbacks`, when the ring is full or its lock is held: the caller copies as before.
        """
        lock = self.lock
        # Held by another writer (for one copy_) or by the bus thread's snapshot (a few
        # attribute reads): wait that long, not longer. Held longer (this very thread, e.g. a
        # torch mode publishing from inside our copy_; a holder waiting for the GIL): fall back.
        if not lock.acquire(False) and not lock.acquire(True, _WAIT_S):
            self._fell_back()
            return None
        try:
            n = self.written
            if n - self.copied >= self.size:  # would overwrite a slot no copy has read yet
                full = True
            else:
                full = False
                i = n & self.mask
                v = self.views[i]
                if v is None:
                    v = self.views[i] = self.buf[i : i + 1]
                v.copy_(t)  # queued on the current stream; a 0-d `t` broadcasts to (1,)
                self.written = n + 1  # after the write is queued: a copy may now read it
                batch = self.open
        finally:
            lock.release()
        if full:
            self._fell_back()
            return None
        return RingSlot(batch, n)

    def _fell_back(self) -> None:
        with self._stats_lock:
            self.fallbacks += 1

    def drain(self, batch: Batch) -> bool:
        """Bus thread: queue one copy of every slot written so far; whether `batch` is closed.

        Never waits: if another bus thread is draining, or a writer holds the lock, it returns
        False and the router polls again.
        """
        if not self.bus_lock.acquire(False):
            return batch.end is not None
        try:
            if batch.end is not None:  # another poll closed it
                return True
            if not self.cuda:
                return self._copy(batch)
            import torch

            try:
                # The copy goes on the stream the writes went on: stream order puts it behind
                # them, and before any later write that reuses their slots.
                with torch.cuda.stream(self.stream):
                    # A copy queued on a stream that is capturing a graph would be recorded
                    # into the graph instead of running: wait until the capture ends.
                    if torch.cuda.is_current_stream_capturing():
                        return False
                    return self._copy(batch)
            except Exception as e:  # a CUDA error around the copy: never raise into the router
                return batch.end is not None or self._copy(batch, e)
        finally:
            self.bus_lock.release()

    def _copy(self, batch: Batch, error: BaseException | None = None) -> bool:
        """Close `batch` with a copy of [copied, written) (bus_lock held; CUDA: stream set).

        With `error`, close it without copying: its values are lost, reported by value().
        """
        lock = self.lock
        if not lock.acquire(False):  # a writer is mid-write: the next poll copies
            return False
        try:
            assert batch is self.open  # only a drain closes the open batch
            a, b = self.copied, self.written
            self.open = Batch(self, b)  # writes from here on belong to the next copy
        finally:
            lock.release()
        n = b - a
        try:
            if error is not None:
                raise error
            host = self._hosts.pop() if self._hosts else self._new_host()
            i = a & self.mask
            j = i + n
            buf, nb = self.buf, self.cuda  # non_blocking into pinned memory: no sync
            if j <= self.size:
                host[:n].copy_(buf[i:j], non_blocking=nb)
            else:  # across the end of the buffer: two pieces
                k = self.size - i
                host[:k].copy_(buf[i:], non_blocking=nb)
                host[k:n].copy_(buf[: j - self.size], non_blocking=nb)
            batch.host = host
            if self.cuda:
                ev = EVENTS.get(self.device.index)
                ev.record(self.stream)  # asynchronous: marks the copy's place in the stream
                batch.event = ev
        except Exception as e:  # a CUDA error: these slots' values are lost, reported by value()
            batch.error = e
        batch.end = b
        self.copied = b  # after the copy is queued: writers may reuse [a, b) from now on
        self.copies += 1
        return True

    def _new_host(self) -> Any:
        import torch

        # Pinned host memory (CUDA): the precondition for an asynchronous device->host copy.
        # Made on the bus thread, never in inference mode. A ring's copies are at most `size`.
        return torch.empty(self.size, dtype=self.dtype, pin_memory=self.cuda)

    def give_back_host(self, host: Any) -> None:
        """A host buffer whose copy finished and was read (bus_lock held)."""
        if len(self._hosts) < _FREE_HOSTS:
            self._hosts.append(host)


class Rings:
    """The process's scalar rings, one per (device, stream, dtype); thread-safe.

    `put(t)` takes a one-element tensor of a ring dtype and gives a `RingSlot`, or None: the
    caller then captures `t` as before (statistics count it in `fallbacks`).
    """

    DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "int32", "int64", "bool")

    def __init__(self, size: int = SIZE, max_rings: int = 64) -> None:
        self.size = size
        self.max_rings = max_rings
        self.rings: dict[tuple[int, int, Any], ScalarRing] = {}
        self._lock = threading.Lock()
        self._tensor: Any = None  # torch.Tensor, once a tensor was seen
        self._dtypes: frozenset[Any] = frozenset()
        self._raw_stream: Any = None
        self.unplaced = 0  # scalars that found no ring (max_rings reached)

    def _setup(self) -> Any:
        torch = sys.modules["torch"]  # a tensor exists: torch is imported
        self._dtypes = frozenset(getattr(torch, n) for n in self.DTYPE_NAMES)
        # The raw cudaStream_t of this thread's current stream on a device, as an int: a
        # C call (no Python Stream object, unlike torch.cuda.current_stream(), ~1 us). It is
        # the stream copy_ queues on (the current stream of the source tensor's device), and
        # it names the stream for as long as the stream exists: torch's pool and default
        # streams are never destroyed. The fallback is for a build that lacks the function.
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda d: torch.cuda.current_stream(d).cuda_stream
        )
        self._tensor = torch.Tensor
        return torch.Tensor

    def put(self, t: Any) -> RingSlot | None:
        """Training thread: `t` (detached; CUDA, or CPU in tests) into its ring; never syncs."""
        tensor = self._tensor
        if tensor is None:
            tensor = self._setup()
        # A subclass (a parameter, a wrapper tensor) keeps its own copy_ semantics: not here.
        if type(t) is not tensor:
            return None
        d = t.dim()  # 0 for the usual scalar (a loss, a norm): no numel() call then
        if d:
            if t.numel() != 1:
                return None
            if d > 1:
                t = t.reshape(1)  # (1, 1)...: a view that copies into a (1,) slot
        dev = t.get_device()  # an int (-1 on the CPU); t.device would build an object
        key = (dev, self._raw_stream(dev) if dev >= 0 else 0, t.dtype)
        ring = self.rings.get(key)
        if ring is None:
            ring = self._new(key)  # or None: a dtype no ring takes, or too many rings
            if ring is None:
                return None
        return ring.put(t)

    def _new(self, key: tuple[int, int, Any]) -> ScalarRing | None:
        import torch

        dev, _, dtype = key
        if dtype not in self._dtypes:
            return None
        with self._lock:
            ring = self.rings.get(key)
            if ring is not None:
                return ring
            if len(self.rings) >= self.max_rings:
                self.unplaced += 1
                return None
            if dev < 0:
                ring = ScalarRing(dtype, "cpu", self.size)
            else:
                # On this thread, now: the current stream is the one `key` names. The buffer
                # is allocated on it, where it is written; made once per ring.
                stream = torch.cuda.current_stream(dev)
                ring = ScalarRing(dtype, torch.device("cuda", dev), self.size, stream)
            self.rings[key] = ring
            return ring

    def unstick(self) -> int:
        """Bus thread: queue the copy of every full ring, so its writers stop falling back.

        A ring's slots are copied when a routed event's slot is first polled; if every event
        holding one was dropped before routing (an inbox storm), nothing polls it and, once
        full, it would stay full. Never waits; returns how many rings it copied.
        """
        n = 0
        for ring in list(self.rings.values()):
            if ring.written - ring.copied >= ring.size and ring.drain(ring.open):
                n += 1
        return n

    def statistics(self) -> dict[str, int]:
        """rings; written (scalars put in a ring); fallbacks (full, busy, or no ring); copies."""
        rings = list(self.rings.values())
        return {
            "rings": len(rings),
            "written": sum(r.written for r in rings),
            "fallbacks": sum(r.fallbacks for r in rings) + self.unplaced,
            "copies": sum(r.copies for r in rings),
        }

    def clear(self) -> None:
        """Forget every ring (slots already handed out keep theirs until read)."""
        with self._lock:
            self.rings = {}
            self.unplaced = 0


RINGS = Rings()
