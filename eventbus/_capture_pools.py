"""Capture's process-wide pools: pinned host buffers and CUDA events, reused across publishes.

Their only state is these two pools (`POOL`, `EVENTS`), shared by every bus in the process and
thread-safe. Re-exported by `eventbus.capture`, their public home.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

__all__ = ["EVENTS", "POOL", "EventPool", "PinnedPool"]


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
            return {
                "allocated": self.allocated,
                "reused": self.reused,
                "free": free,
                "free_bytes": self.free_bytes,
            }


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
