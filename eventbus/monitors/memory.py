"""`MemoryProfiler`: per-step memory from the bus side, leak suspicion, OOM snapshots.

It runs as a subscriber (a sync one: its own worker thread, off the event loop) and never
touches the training thread. When it handles `StepEnded(step=N)` it reads process RSS and,
with CUDA, the caching allocator's host-side counters (allocated, reserved, peak since the
last reading, which it then resets; allocation retries; OOMs). None of that syncs the device.

The reading is taken when the event is *handled*, `lag_s` after the step ended (the bus
drains every few ms): the training thread may already be in step N+1. `peak_allocated_mb`
therefore covers the time between two readings (no peak is ever lost, one at a step boundary
may be counted in the next step), and `allocated_mb` may include step N+1's first tensors.
For exact per-step figures call `profiler.snapshot(step)` on the training thread at the step's
end (a host-side read, ~tens of us): it publishes `MemorySample(source="training")`, which
the profiler then uses instead of reading late. See docs/monitors.md.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import anyio
import torch

from eventbus.core import BusHandle
from eventbus.events import (
    BackwardEnded,
    Event,
    ForwardEnded,
    MemorySample,
    MemorySnapshotSaved,
    OptimizerStepped,
    StepEnded,
)
from eventbus.log import get_logger
from eventbus.monitors._memory_leaks import LeakWatch
from eventbus.monitors._memory_read import (
    MB,
    CudaReader,
    cuda_initialized,
    resolve_cuda_device,
    rss_bytes,
    rss_peak_bytes,
)
from eventbus.monitors._memory_samples import due, lag, phase_of, phase_sample, step_sample
from eventbus.monitors._memory_summary import Reading, RunMemory
from eventbus.monitors._oom_snapshots import UNAVAILABLE, OomSnapshots

__all__ = ["MemoryProfiler"]

_START_WAIT_S = 2.0


class MemoryProfiler:
    """Per-step RSS and CUDA allocator figures as `MemorySample`s, leak suspicion, OOM dumps.

    `every`: publish a per-step sample at each multiple of N steps (every step is still read
    and fed to the leak rule). `leak_window`/`leak_min_growth_mb`/`leak_cooldown` tune the
    leak rule (see `eventbus.monitors._leak_rule`). `record_history=True` records the
    allocator's history from construction to close (bounded by `max_entries`) so that an OOM
    dumps a snapshot under `snapshot_dir`. Construct it on the training thread: the CUDA
    device watched is that thread's current one (or `device=`).
    """

    events: ClassVar[tuple[type[Event], ...]] = (
        StepEnded,
        ForwardEnded,
        BackwardEnded,
        OptimizerStepped,
        MemorySample,
    )
    policy: ClassVar[str] = "drop_oldest"
    maxsize: ClassVar[int] = 4096
    name = "memory"

    def __init__(
        self,
        *,
        every: int = 1,
        device: int | str | torch.device | None = None,
        reset_peak: bool = True,
        leak_window: int = 100,
        leak_min_growth_mb: float = 32.0,
        leak_cooldown: int | None = None,
        leak_warmup: int = 10,
        record_history: bool = False,
        max_entries: int = 100_000,
        snapshot_dir: str | os.PathLike[str] = "memory_snapshots",
    ) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int (publish every N steps), got {every!r}")
        if not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be a positive int, got {max_entries!r}")
        self.every = every
        self.reset_peak = reset_peak
        self.record_history = record_history
        self.max_entries = max_entries
        self.snapshot_dir = Path(snapshot_dir)
        self._device_arg = device
        # The device of the constructing (training) thread, if CUDA is up already: the bus
        # thread's current device is always 0. is_initialized() is a Python flag.
        if device is None and cuda_initialized():
            self._device_arg = torch.cuda.current_device()
        self._leak = LeakWatch(
            window=leak_window,
            min_growth_mb=leak_min_growth_mb,
            cooldown=leak_cooldown,
            warmup=leak_warmup,
        )
        self._bus: BusHandle | None = None
        self._cuda: CudaReader | None = None
        self._oom: OomSnapshots | None = None  # with record_history and CUDA
        self._device_name: str = "cpu"
        self._started = threading.Event()  # set by on_start: the bus to publish on is known
        self._training_source = False  # training-thread snapshots seen: stop reading late
        self._train_phase_peak = 0.0  # snapshot(): phase peaks since the last step snapshot
        self._phase_peaks: dict[str, tuple[float, float | None]] = {}  # phase -> (MB, lag_s)
        self._last_published: int | None = None
        self._run = RunMemory()
        self._coalesced = 0
        self._dump_due: int | None = None  # OOMs counted in this batch, for a missed dump
        # Decided once, here, on the constructing (training) thread: its current device is the
        # one to watch, and history recording must run before the first step can OOM.
        self._decide_cuda()

    # -- lifecycle ---------------------------------------------------------------------

    def __reduce__(self) -> Any:
        """Refused: it reads the memory of the process it runs in, so in the sidecar it would
        report the sidecar's. Its samples reach the sidecar's sinks as any event does."""
        raise TypeError(
            "MemoryProfiler reads the memory of the process it runs in: keep it in the "
            "training process (placement='thread', the default); its samples still reach "
            "the sinks in the sidecar"
        )

    def on_start(self, bus: BusHandle) -> None:
        """Keep the bus to publish on."""
        self._bus = bus
        self._started.set()

    def _decide_cuda(self) -> None:
        if torch.cuda.is_available():  # ~1.6 us a call: decided once, here
            local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
            index = resolve_cuda_device(self._device_arg, local_rank)
            self._cuda = CudaReader(index)
            self._device_name = f"cuda:{index}"
            if self.record_history:
                self._start_history(index)
        elif self.record_history:
            get_logger().warning(UNAVAILABLE, monitor="MemoryProfiler")
        elif self._device_arg is not None:
            get_logger().warning(
                "MemoryProfiler(device=...) ignored: CUDA is not available",
                device=str(self._device_arg),
            )

    async def on_events(self, batch: list[Event]) -> None:
        """Read memory for the newest step (and phase) events; publish samples and leaks.

        On the bus loop: a reading is host-side counters (a /proc read, the allocator's
        statistics), tens of microseconds, cheaper than waking a worker thread for it; the
        rare snapshot dump after a missed OOM runs in a thread."""
        self._scan(batch)
        ooms, self._dump_due = self._dump_due, None
        if ooms is not None:
            await anyio.to_thread.run_sync(self._maybe_dump_missed_oom, ooms)

    def _scan(self, batch: list[Event]) -> None:
        last_step_i = max((i for i, ev in enumerate(batch) if type(ev) is StepEnded), default=-1)
        last_i = len(batch) - 1
        for i, ev in enumerate(batch):
            cls = type(ev)
            if isinstance(ev, MemorySample):
                if ev.source == "training":
                    self._take_training(ev)
            elif self._training_source:
                continue
            elif isinstance(ev, StepEnded):
                if i == last_step_i:
                    self._on_step_end(ev)
                else:
                    self._coalesced += 1  # a later step is in this batch: read once, for it
            elif i == last_i:  # a phase read is only meaningful if nothing came after it
                phase = phase_of(cls)
                if phase is not None:
                    self._on_phase_end(ev, phase)

    def on_close(self) -> None:
        """Dump a snapshot if an OOM slipped past us, stop recording, publish the summary."""
        self._maybe_dump_missed_oom()
        if self._oom is not None:
            self._oom.stop()
        self._publish_summary()

    # -- readings ----------------------------------------------------------------------

    def _read(self, step: int, *, reset_peak: bool) -> Reading:
        cuda = self._cuda.read(reset_peak=reset_peak) if self._cuda is not None else None
        return Reading(step, rss_bytes() / MB, cuda)

    def _on_phase_end(self, ev: Event, phase: str) -> None:
        if self._cuda is None or ev.step is None:
            return
        # Host-side allocator counters: no device sync (see _memory_read).
        cuda = self._cuda.read(reset_peak=self.reset_peak)
        if cuda is not None:
            self._phase_peaks[phase] = (cuda.peak_allocated / MB, lag(ev))

    def _on_step_end(self, ev: Event) -> None:
        if ev.step is None:
            return
        r = self._read(ev.step, reset_peak=self.reset_peak)
        phases, self._phase_peaks = self._phase_peaks, {}
        if r.peak_allocated is not None and phases:
            r.peak_allocated = max(r.peak_allocated, *(mb for mb, _ in phases.values()))
        self._record(r, source="bus", lag_s=lag(ev), phases=phases)

    def _take_training(self, ev: MemorySample) -> None:
        """A snapshot taken on the training thread: the exact figures for its step."""
        if ev.step is None:
            return
        if ev.phase not in (None, "step"):
            return  # a phase snapshot: already on the bus, and folded into its step's peak
        self._training_source = True
        r = Reading(ev.step, ev.rss_mb or 0.0, None)
        r.allocated, r.reserved = ev.allocated_mb, ev.reserved_mb
        r.peak_allocated, r.alloc_retries, r.ooms = ev.peak_allocated_mb, ev.alloc_retries, ev.ooms
        self._phase_peaks = {}  # snapshot() already folded the phase peaks into the step's
        self._record(r, source=None, lag_s=0.0, phases={})  # already on the bus: no re-publish

    def _record(
        self,
        r: Reading,
        *,
        source: str | None,
        lag_s: float | None,
        phases: dict[str, tuple[float, float | None]],
    ) -> None:
        self._run.add(r)
        if r.ooms:
            self._dump_due = r.ooms  # dumped off the loop, after this batch
        if source is not None and due(r.step, self._last_published, self.every):
            self._last_published = r.step
            self._publish_sample(r, source=source, lag_s=lag_s, phases=phases)
        self._leak.check(r, self._publish)

    def _publish_sample(
        self,
        r: Reading,
        *,
        source: str,
        lag_s: float | None,
        phases: dict[str, tuple[float, float | None]],
    ) -> None:
        peak = rss_peak_bytes()
        peak_rss = self._run.peak_rss
        for phase, (mb, phase_lag) in phases.items():
            self._publish(
                phase_sample(
                    r.step, phase, mb, device=self._device_name, source=source, lag_s=phase_lag
                )
            )
        self._publish(
            step_sample(
                r,
                rss_peak_mb=max(
                    r.rss, peak_rss[0] if peak_rss else 0.0, peak / MB if peak is not None else 0.0
                ),
                device=self._device_name,
                source=source if self._cuda is not None else None,
                lag_s=lag_s,
            )
        )

    def _publish_summary(self) -> None:
        if self._run.last is None:
            return
        for ev in self._run.summary(
            device=self._device_name,
            hwm=rss_peak_bytes(),
            leaks=len(self._leak.verdicts),
            snapshots=len(self.snapshots),
        ):
            self._publish(ev)

    def _publish(self, ev: Event) -> None:
        if self._bus is not None:
            self._bus.publish(ev)

    # -- on the training thread ----------------------------------------------------------

    def snapshot(self, step: int, *, phase: str = "step") -> MemorySample:
        """Read memory now, on the calling (training) thread, and publish it as the exact
        figures of `step` (`phase`: "step" at the step's end, or "forward"/"backward"/
        "optimizer"). Host-side reads only (~tens of us): never syncs the device."""
        # on_start runs on the bus side just after `bus.start()` returns: wait for it once.
        # (A threading.Event read: ~50 ns once set.)
        started = self._started.is_set() or self._started.wait(_START_WAIT_S)
        bus = self._bus  # set before `_started`
        if not started or bus is None:
            raise RuntimeError(
                "MemoryProfiler.snapshot(): subscribe the profiler to a started "
                "bus first (bus.subscribe(profiler); with bus: ...)"
            )
        # Host-side allocator counters: no device sync (see _memory_read).
        cuda = self._cuda.read(reset_peak=self.reset_peak) if self._cuda is not None else None
        peak_mb = cuda.peak_allocated / MB if cuda else None
        if phase == "step":
            if peak_mb is not None:  # the step's peak is also that of its phases
                peak_mb = max(peak_mb, self._train_phase_peak)
            self._train_phase_peak = 0.0
            peak = rss_peak_bytes()
            r = Reading(step, rss_bytes() / MB, cuda)
            r.peak_allocated = peak_mb
            rss_peak_mb = max(r.rss, peak / MB) if peak is not None else r.rss
            ev = step_sample(
                r, rss_peak_mb=rss_peak_mb, device=self._device_name, source="training", lag_s=0.0
            )
        else:
            if peak_mb is not None:
                self._train_phase_peak = max(self._train_phase_peak, peak_mb)
            ev = phase_sample(
                step, phase, peak_mb, device=self._device_name, source="training", lag_s=0.0
            )
        bus.publish(ev)
        return ev

    # -- OOM snapshots (the files: eventbus.monitors._oom_snapshots) --------------------------

    @contextlib.contextmanager
    def oom_guard(self) -> Iterator[None]:
        """`with profiler.oom_guard():` — on `torch.OutOfMemoryError`, dump a memory snapshot
        (with `record_history=True` and CUDA), publish `MemorySnapshotSaved`, re-raise."""
        try:
            yield
        except torch.OutOfMemoryError:
            if self._oom is None or not self._oom.recording:
                get_logger().warning(
                    UNAVAILABLE
                    if self._cuda is None and self._bus is not None
                    else "no memory snapshot written on OOM: pass MemoryProfiler("
                    "record_history=True) and subscribe it to a started bus",
                    monitor="MemoryProfiler",
                )
            else:
                self.dump_snapshot("oom")
            raise

    def dump_snapshot(self, reason: str) -> str | None:
        """Write the allocator's recorded history to a file, publish its path; None without
        CUDA or history recording. Safe from any thread."""
        oom = self._oom
        if oom is None or not oom.recording:
            return None
        path, new = oom.dump(reason, self.snapshot_dir, self._bus.rank if self._bus else 0)
        if new:
            last = self._run.last
            self._publish(
                MemorySnapshotSaved(path=path, reason=reason, step=last.step if last else None)
            )
        return path

    @property
    def snapshots(self) -> list[str]:
        """Paths of the snapshot files written so far."""
        return list(self._oom.paths) if self._oom is not None else []

    def _start_history(self, index: int) -> None:
        self._oom = OomSnapshots(index, self.max_entries)
        ref = weakref.ref(self)  # the allocator's observer has no detach: let a profiler go

        def on_oom() -> None:
            prof = ref()
            if prof is not None:
                prof.dump_snapshot("oom")

        self._oom.start(on_oom)

    def _maybe_dump_missed_oom(self, ooms: int | None = None) -> None:
        """An OOM the observer and `oom_guard` did not see (e.g. raised inside `with bus:`
        with no guard on an older torch): dump what the history still holds."""
        if self._oom is not None and self._oom.missed(ooms):
            with contextlib.suppress(Exception):
                self.dump_snapshot("oom")

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Leak-rule windows, so a resumed run keeps its evidence."""
        return {"leak_rules": self._leak.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self._leak.load_state_dict(state.get("leak_rules", {}))
