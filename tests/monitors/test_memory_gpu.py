"""MemoryProfiler's CUDA paths: per-step allocator figures, peak reset, no sync, OOM snapshots.

Skipped without CUDA. Run on a GPU machine: `python -m pytest -q -m gpu tests/monitors`.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from eventbus import Event, EventBus
from eventbus.events import (
    BackwardEnded,
    ForwardEnded,
    MemoryLeakSuspected,
    MemorySample,
    MemorySnapshotSaved,
    OptimizerStepped,
    StepEnded,
)
from eventbus.monitors import MemoryProfiler
from eventbus.monitors._memory_read import MB, CudaReader
from tests.conftest import Recorder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MiB = 1024 * 1024


@pytest.fixture(autouse=True)
def _quiet_device() -> Iterator[None]:
    torch.cuda.init()  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    yield
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def cuda_bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, device="cuda")


def busy_gpu() -> None:
    """Queue a ~0.5 s spin kernel: a read that synced would wait for it."""
    cycles = 1_000_000_000  # ~0.5-0.7 s at 1.4-2 GHz
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]


def no_sync(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run `fn` while the GPU is busy and sync debug mode raises on any synchronisation."""
    busy_gpu()
    torch.cuda.set_sync_debug_mode("error")
    try:
        t0 = time.perf_counter()
        out = fn()
        took = time.perf_counter() - t0
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not torch.cuda.current_stream().query(), "the spin kernel ended: cannot judge"
    return out, took


def test_reads_and_resets_the_peak_without_syncing() -> None:
    reader = CudaReader(torch.cuda.current_device())
    keep = cuda_bytes(8 * MiB)
    reader.read(reset_peak=True)
    transient = cuda_bytes(64 * MiB)
    del transient
    (r1, r2), took = no_sync(lambda: (reader.read(reset_peak=True), reader.read(reset_peak=True)))
    assert took < 0.1  # did not wait for the 0.5 s kernel
    assert r1 is not None
    assert r2 is not None
    assert r1.allocated == torch.cuda.memory_allocated()
    assert r1.reserved == torch.cuda.memory_reserved()
    assert r1.peak_allocated - r1.allocated >= 64 * MiB  # the transient is in this window
    assert r2.peak_allocated - r2.allocated < MiB  # ...and not in the next: the reset worked
    assert r1.allocated >= keep.numel()


def run_steps(prof: MemoryProfiler, steps: int, body: Callable[[int, EventBus], None]) -> Recorder:
    rec = Recorder()
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(rec)
    bus.subscribe(prof)
    with bus:
        assert bus.flush(5)
        for step in range(1, steps + 1):
            body(step, bus)
            bus.publish(StepEnded(step=step))
            assert bus.flush(5)
    return rec


def samples(rec: Recorder, phase: str) -> dict[int, MemorySample]:
    return {
        e.step: e
        for e in rec.got
        if isinstance(e, MemorySample) and e.phase == phase and e.step is not None
    }


def test_per_step_figures_and_a_peak_reset_every_step() -> None:
    keep = cuda_bytes(16 * MiB)

    def body(step: int, bus: EventBus) -> None:
        if step % 2 == 0:
            t = cuda_bytes(48 * MiB)  # a transient only on even steps
            del t

    rec = run_steps(MemoryProfiler(), 8, body)
    got = samples(rec, "step")
    assert sorted(got) == list(range(1, 9))
    for step, ev in got.items():
        assert ev.device == f"cuda:{torch.cuda.current_device()}"
        assert ev.source == "bus"
        assert ev.allocated_mb is not None
        assert ev.reserved_mb is not None
        assert ev.peak_allocated_mb is not None
        assert ev.allocated_mb == pytest.approx(torch.cuda.memory_allocated() / MB, abs=1.0)
        assert ev.reserved_mb >= ev.allocated_mb
        assert isinstance(ev.alloc_retries, int)
        assert isinstance(ev.ooms, int)
        extra = ev.peak_allocated_mb - ev.allocated_mb
        if step % 2 == 0:
            assert extra >= 48, (step, ev)
        elif step > 1:
            assert extra < 1, (step, ev)  # the previous step's transient was reset
    assert keep.numel() == 16 * MiB


def test_per_phase_peaks() -> None:
    sizes = {"forward": 16, "backward": 48, "optimizer": 8}
    events = {"forward": ForwardEnded, "backward": BackwardEnded, "optimizer": OptimizerStepped}

    def body(step: int, bus: EventBus) -> None:
        for phase, mb in sizes.items():
            t = cuda_bytes(mb * MiB)
            del t
            bus.publish(events[phase](step=step))
            assert bus.flush(5)  # handled alone: the read is this phase's

    rec = run_steps(MemoryProfiler(), 3, body)
    step_samples = samples(rec, "step")
    for phase, mb in sizes.items():
        got = samples(rec, phase)
        assert sorted(got) == [1, 2, 3]
        for step, ev in got.items():
            base = step_samples[step].allocated_mb
            assert ev.peak_allocated_mb is not None
            assert base is not None
            assert mb <= ev.peak_allocated_mb - base < mb + 8, (phase, step, ev)
    for ev in step_samples.values():
        assert ev.peak_allocated_mb is not None
        assert ev.allocated_mb is not None
        assert ev.peak_allocated_mb - ev.allocated_mb >= 48  # the step's peak: its phases'


def test_snapshot_on_the_training_thread_never_syncs() -> None:
    rec = Recorder()
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(rec)
    prof = MemoryProfiler()
    bus.subscribe(prof)
    with bus:
        assert bus.flush(5)
        x = cuda_bytes(4 * MiB)
        snap, took = no_sync(lambda: prof.snapshot(1))
        bus.publish(StepEnded(step=1))
    assert took < 0.1
    assert snap.source == "training"
    assert snap.allocated_mb == pytest.approx(torch.cuda.memory_allocated() / MB, abs=1.0)
    assert [e.source for e in rec.got if isinstance(e, MemorySample) and e.phase == "step"] == [
        "training"
    ]
    del x


def test_a_cuda_leak_is_flagged_on_allocated_memory() -> None:
    kept: list[torch.Tensor] = []

    def leak(step: int, bus: EventBus) -> None:
        kept.append(cuda_bytes(MiB))

    rec = run_steps(MemoryProfiler(leak_window=30, leak_min_growth_mb=12, leak_warmup=3), 60, leak)
    leaks = [
        e for e in rec.got if isinstance(e, MemoryLeakSuspected) and e.metric == "allocated_mb"
    ]
    assert len(leaks) == 1
    assert leaks[0].rate_mb_per_step == pytest.approx(1.0, rel=0.1)


def test_a_steady_cuda_loop_is_not_flagged() -> None:
    def steady(step: int, bus: EventBus) -> None:
        t = cuda_bytes((1 + step % 4) * 8 * MiB)
        del t

    rec = run_steps(
        MemoryProfiler(leak_window=30, leak_min_growth_mb=12, leak_warmup=3), 80, steady
    )
    assert [e for e in rec.got if isinstance(e, MemoryLeakSuspected)] == []


def _check_snapshot_file(path: str) -> None:
    assert Path(path).is_file()
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert "segments" in snap
    actions = {e["action"] for trace in snap["device_traces"] for e in trace}
    assert "oom" in actions, sorted(actions)


def test_oom_guard_writes_a_snapshot_and_publishes_its_path(tmp_path: Path) -> None:
    rec = Recorder(events=(MemorySnapshotSaved,))
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(rec)
    prof = MemoryProfiler(record_history=True, max_entries=10_000, snapshot_dir=tmp_path)
    bus.subscribe(prof)
    with bus, pytest.raises(torch.OutOfMemoryError), prof.oom_guard():
        cuda_bytes(1 << 50)  # a petabyte: the allocator refuses at once
    saved = [e for e in rec.got if isinstance(e, MemorySnapshotSaved)]
    assert len(saved) == 1, saved  # the OOM observer and the guard do not both dump
    assert saved[0].reason == "oom"
    assert prof.snapshots == [saved[0].path]
    assert Path(saved[0].path).parent == tmp_path
    _check_snapshot_file(saved[0].path)


def test_an_oom_inside_with_bus_without_a_guard_is_dumped(tmp_path: Path) -> None:
    rec = Recorder(events=(MemorySnapshotSaved,))
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(rec)
    bus.subscribe(MemoryProfiler(record_history=True, max_entries=10_000, snapshot_dir=tmp_path))
    with pytest.raises(torch.OutOfMemoryError), bus:
        cuda_bytes(1 << 50)
    saved: list[Event] = [e for e in rec.got if isinstance(e, MemorySnapshotSaved)]
    assert len(saved) == 1
    assert isinstance(saved[0], MemorySnapshotSaved)
    _check_snapshot_file(saved[0].path)
