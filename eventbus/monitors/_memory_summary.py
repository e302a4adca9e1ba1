"""What `MemoryProfiler` keeps of a run: its readings' first, last and peaks, and the summary.

Pure bookkeeping on numbers already read (`eventbus.monitors._memory_read` reads them): no
torch call, no device.
"""

from __future__ import annotations

from typing import Any

from eventbus.events import Event, MemorySample, Scalars
from eventbus.monitors._memory_read import MB, CudaReading

__all__ = ["Reading", "RunMemory"]


class Reading:
    """One point of the run: RSS and, with CUDA, the allocator counters (MB)."""

    __slots__ = (
        "alloc_retries",
        "allocated",
        "ooms",
        "peak_allocated",
        "reserved",
        "rss",
        "step",
    )

    def __init__(self, step: int, rss: float, cuda: CudaReading | None) -> None:
        self.step = step
        self.rss = rss
        self.allocated = cuda.allocated / MB if cuda else None
        self.reserved = cuda.reserved / MB if cuda else None
        self.peak_allocated = cuda.peak_allocated / MB if cuda else None
        self.alloc_retries = cuda.alloc_retries if cuda else None
        self.ooms = cuda.ooms if cuda else None


class RunMemory:
    """The readings so far: how many, the first and the last, and each peak with its step."""

    def __init__(self) -> None:
        self.readings = 0
        self.first: Reading | None = None
        self.last: Reading | None = None
        self.peak_rss: tuple[float, int] | None = None
        self.peak_alloc: tuple[float, int] | None = None
        self.peak_reserved: tuple[float, int] | None = None

    def add(self, r: Reading) -> None:
        self.readings += 1
        if self.first is None:
            self.first = r
        self.last = r
        if self.peak_rss is None or r.rss > self.peak_rss[0]:
            self.peak_rss = (r.rss, r.step)
        if r.peak_allocated is not None and (
            self.peak_alloc is None or r.peak_allocated > self.peak_alloc[0]
        ):
            self.peak_alloc = (r.peak_allocated, r.step)
        if r.reserved is not None and (
            self.peak_reserved is None or r.reserved > self.peak_reserved[0]
        ):
            self.peak_reserved = (r.reserved, r.step)

    def summary(self, *, device: str, hwm: int | None, leaks: int, snapshots: int) -> list[Event]:
        """The run's `MemorySample(phase="summary")` and its `Scalars` (none before a reading).

        `hwm`: the process's RSS high-water mark in bytes, if known.
        """
        first, last = self.first, self.last
        if first is None or last is None:
            return []
        peak_rss, peak_rss_step = self.peak_rss or (last.rss, last.step)
        values: dict[str, Any] = {
            "memory/steps_read": self.readings,
            "memory/peak_rss_mb": peak_rss,
            "memory/peak_rss_step": peak_rss_step,
            "memory/rss_growth_mb": last.rss - first.rss,
            "memory/leaks_suspected": leaks,
        }
        if hwm is not None:
            values["memory/rss_hwm_mb"] = hwm / MB
        if self.peak_alloc is not None:
            values["memory/peak_allocated_mb"] = self.peak_alloc[0]
            values["memory/peak_allocated_step"] = self.peak_alloc[1]
        if self.peak_reserved is not None:
            values["memory/peak_reserved_mb"] = self.peak_reserved[0]
            values["memory/peak_reserved_step"] = self.peak_reserved[1]
        if first.allocated is not None and last.allocated is not None:
            values["memory/allocated_growth_mb"] = last.allocated - first.allocated
        if first.reserved is not None and last.reserved is not None:
            values["memory/reserved_growth_mb"] = last.reserved - first.reserved
        if last.ooms is not None:
            values["memory/ooms"] = last.ooms
            values["memory/alloc_retries"] = last.alloc_retries
        if snapshots:
            values["memory/snapshots_saved"] = snapshots
        return [
            MemorySample(
                step=last.step,
                phase="summary",
                rss_mb=last.rss,
                rss_peak_mb=max(peak_rss, hwm / MB if hwm is not None else 0.0),
                allocated_mb=last.allocated,
                reserved_mb=last.reserved,
                peak_allocated_mb=self.peak_alloc[0] if self.peak_alloc else None,
                alloc_retries=last.alloc_retries,
                ooms=last.ooms,
                device=device,
            ),
            Scalars(step=last.step, values=values),
        ]
