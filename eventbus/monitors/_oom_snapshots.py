"""CUDA memory snapshots for OOMs: the allocator's history recording and the files dumped from it.

With history recording on, the caching allocator keeps its recent allocations with their stacks
(a bounded ring, on the host); a snapshot pickles that history to a file that
https://pytorch.org/memory_viz shows. The allocator's OOM observer dumps at the OOM itself,
before the error is raised; `MemoryProfiler` catches one it missed. Every call here is
host-side bookkeeping of the allocator: none syncs the device.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from eventbus.log import get_logger

__all__ = ["UNAVAILABLE", "OomSnapshots"]

UNAVAILABLE = (
    "CUDA memory snapshots are unavailable: CUDA is not available in this process "
    "(record_history needs a CUDA build of torch and a visible GPU)"
)


class OomSnapshots:
    """History recording on one CUDA device and the snapshot files dumped from it; thread-safe.

    `paths` lists the files written so far; `recording` is True from `start()` to `stop()`.
    """

    def __init__(self, device: int, max_entries: int) -> None:
        self.device = device
        self.max_entries = max_entries
        self.recording = False
        self.paths: list[str] = []
        self._dumped_ooms = 0  # the allocator's num_ooms when we last dumped
        self._lock = threading.Lock()  # training thread (OOM, snapshot) vs the worker thread

    def start(self, on_oom: Callable[[], object]) -> None:
        """Record the allocator's history from now on; call `on_oom` at each OOM on this device.

        `on_oom` runs on the thread that ran out of memory, before the error is raised; what it
        raises is suppressed. The observer cannot be detached: `on_oom` should hold its owner
        through a weak reference, so that a finished owner can go.
        """
        # Host-side: turns on stack recording in the allocator (bounded ring of entries).
        torch.cuda.memory._record_memory_history(max_entries=self.max_entries, device=self.device)
        self.recording = True
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is not None:
            # Called by the allocator on the thread that ran out of memory, before it raises
            # (its lock released): the snapshot shows the state at the OOM itself.
            index = self.device

            def observer(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
                if device == index:
                    with contextlib.suppress(Exception):  # never mask the OOM itself
                        on_oom()

            attach(observer)

    def stop(self) -> None:
        """Stop recording (idempotent)."""
        if self.recording:
            self.recording = False
            with contextlib.suppress(Exception):
                torch.cuda.memory._record_memory_history(enabled=None)

    def ooms(self) -> int:
        """The allocator's count of OOMs on this device."""
        # Host-side allocator counter: no device sync.
        return int(torch.cuda.memory_stats_as_nested_dict(self.device).get("num_ooms", 0))

    def missed(self, ooms: int | None = None) -> bool:
        """Whether, while recording, the allocator counted an OOM that no snapshot covers
        (`ooms`: the count, if already read)."""
        if not self.recording:
            return False
        if ooms is None:
            ooms = self.ooms()
        return ooms > self._dumped_ooms

    def dump(self, reason: str, directory: Path, rank: int) -> tuple[str, bool]:
        """Write the recorded history to a file under `directory`: (its path, whether it is
        new). An OOM already dumped (by the observer) gives the last file again."""
        with self._lock:
            ooms = self.ooms()
            if reason == "oom" and ooms <= self._dumped_ooms and self.paths:
                return self.paths[-1], False  # the OOM observer already dumped this one
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / (
                f"memory_snapshot_{reason}_rank{rank}_"
                f"{time.strftime('%Y%m%d-%H%M%S')}_{len(self.paths)}.pickle"
            )
            # Pickles the allocator's host-side records: no device sync.
            torch.cuda.memory._dump_snapshot(str(path))  # type: ignore[no-untyped-call]
            self._dumped_ooms = max(self._dumped_ooms, ooms)
            self.paths.append(str(path))
        get_logger().warning(
            "CUDA memory snapshot written",
            path=str(path),
            reason=reason,
            view="https://pytorch.org/memory_viz",
        )
        return str(path), True
