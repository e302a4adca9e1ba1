"""Reading memory without a device sync: process RSS, and the CUDA caching allocator's counters.

Every CUDA figure here is a host-side counter the caching allocator keeps as it serves
`malloc`/`free` on the host, in program order: reading or resetting one takes the allocator's
mutex and never waits for the device. Kernels may still be running; the counters already
include every allocation the host has issued.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import psutil
import torch

__all__ = [
    "MB",
    "CudaReader",
    "CudaReading",
    "cuda_initialized",
    "resolve_cuda_device",
    "rss_bytes",
    "rss_bytes_procfs",
    "rss_peak_bytes",
    "rss_procfs_available",
]

MB = 1024.0 * 1024.0

_PROCESS = psutil.Process()
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident set size of this process now (psutil: portable; /proc/self/statm on Linux)."""
    return int(_PROCESS.memory_info().rss)


def rss_procfs_available() -> bool:
    """Whether /proc/self/statm can be read (Linux)."""
    return os.path.exists("/proc/self/statm")


def rss_bytes_procfs() -> int:
    """RSS from /proc/self/statm (resident pages x page size): the Linux cross-check."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE


def rss_peak_bytes() -> int | None:
    """The kernel's high-water mark of RSS over the process's life (catches peaks between
    our readings), or None where the platform does not keep one."""
    try:
        import resource
    except ImportError:  # Windows
        peak = getattr(_PROCESS.memory_info(), "peak_wset", None)
        return int(peak) if peak is not None else None
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024  # Linux: KiB


def cuda_initialized() -> bool:
    """Whether this process already set up CUDA (a Python flag: no driver call, no init)."""
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


@dataclass(slots=True)
class CudaReading:
    """One read of the caching allocator's counters for one device, in bytes."""

    allocated: int
    reserved: int
    peak_allocated: int  # since the last reset of the peak stats
    alloc_retries: int
    ooms: int


class CudaReader:
    """Reads (and resets the peak of) one device's caching-allocator counters; never syncs."""

    def __init__(self, device: int) -> None:
        self.device = device

    def read(self, *, reset_peak: bool) -> CudaReading | None:
        """The counters now, or None before the program touched CUDA (reading then would
        initialise a CUDA context on this thread)."""
        if not cuda_initialized():
            return None
        # Host-side counters of the caching allocator (its mutex, no device sync). The nested
        # form skips memory_stats()'s flattening and sorting of ~150 keys.
        stats: dict[str, Any] = torch.cuda.memory_stats_as_nested_dict(self.device)
        if not stats:
            return None
        allocated = stats["allocated_bytes"]["all"]
        reading = CudaReading(
            allocated=int(allocated["current"]),
            # Host-side counter (bytes cudaMalloc'ed by the allocator): no device sync.
            reserved=int(stats["reserved_bytes"]["all"]["current"]),
            peak_allocated=int(allocated["peak"]),
            # Host-side counters of allocator events (retry after freeing cache, OOM raised).
            alloc_retries=int(stats.get("num_alloc_retries", 0)),
            ooms=int(stats.get("num_ooms", 0)),
        )
        if reset_peak:
            # Host-side: sets each "peak" counter to "current" under the allocator's mutex;
            # no device sync. Allocations between the read above and this reset (microseconds)
            # can only raise the next window's peak, never be lost from both.
            torch.cuda.reset_peak_memory_stats(self.device)
        return reading


def resolve_cuda_device(device: Any, local_rank: int) -> int:
    """The CUDA device index to watch: `device` if given, else the current device of an
    initialised CUDA runtime, else `local_rank` (torchrun) when in range, else 0."""
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise ValueError(f"device must be a CUDA device index >= 0, got {device!r}")
        return device
    if device is not None:
        d = torch.device(device)
        if d.type != "cuda":
            raise ValueError(f"device must be a CUDA device (e.g. 'cuda:0' or 0), got {device!r}")
        return d.index if d.index is not None else 0
    if cuda_initialized():
        return int(torch.cuda.current_device())
    n = torch.cuda.device_count()
    return local_rank if 0 <= local_rank < n else 0
