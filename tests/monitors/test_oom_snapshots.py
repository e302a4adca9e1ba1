"""MemoryProfiler's OOM snapshots (eventbus.monitors._oom_snapshots), through the profiler:
without CUDA (a clear warning, the error untouched) and against a fake caching allocator
(the real one: test_memory_gpu.py)."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest
import torch

from eventbus.events import MemorySnapshotSaved, Scalars, StepEnded
from eventbus.monitors import MemoryProfiler
from tests.monitors.test_memory import FakeAllocator, FakeBus, no_cuda

# -- without CUDA ----------------------------------------------------------------------------


@no_cuda
def test_record_history_without_cuda_warns_at_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="eventbus")
    prof = MemoryProfiler(record_history=True)  # said at construction, before any step
    assert any("unavailable" in r.getMessage() for r in caplog.records)
    prof.on_start(FakeBus())
    assert prof.dump_snapshot("manual") is None


@no_cuda
def test_oom_guard_without_cuda_reraises_untouched_and_says_why(
    caplog: pytest.LogCaptureFixture, tmp_path: Any
) -> None:
    caplog.set_level(logging.WARNING, logger="eventbus")
    bus = FakeBus()
    prof = MemoryProfiler(record_history=True, snapshot_dir=tmp_path)
    prof.on_start(bus)
    caplog.clear()
    err = torch.OutOfMemoryError("CUDA out of memory (simulated)")
    with pytest.raises(torch.OutOfMemoryError) as info, prof.oom_guard():
        raise err
    assert info.value is err
    assert any("unavailable" in r.getMessage() for r in caplog.records)
    assert not any(isinstance(e, MemorySnapshotSaved) for e in bus.got)
    assert list(tmp_path.iterdir()) == []

    @prof.oom_guard()
    def step() -> None:
        raise torch.OutOfMemoryError("again")

    with pytest.raises(torch.OutOfMemoryError, match="again"):
        step()


def test_oom_guard_lets_other_errors_and_success_through(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="eventbus")
    prof = MemoryProfiler()
    with prof.oom_guard():
        pass
    with pytest.raises(ValueError, match="not memory"), prof.oom_guard():
        raise ValueError("not memory")
    assert caplog.records == []


# -- against a fake caching allocator ---------------------------------------------------------


def test_cuda_oom_is_dumped_once_and_published(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    fake = FakeAllocator(monkeypatch)
    bus = FakeBus()
    prof = MemoryProfiler(record_history=True, max_entries=123, snapshot_dir=tmp_path)
    assert fake.recording == [{"max_entries": 123, "device": 0}]  # from construction on
    prof.on_start(bus)
    with pytest.raises(torch.OutOfMemoryError, match="fake"), prof.oom_guard():
        fake.oom()  # the observer dumps at the OOM; the guard finds it already done
    saved = [e for e in bus.got if isinstance(e, MemorySnapshotSaved)]
    assert len(saved) == 1
    assert saved[0].reason == "oom"
    assert list(tmp_path.iterdir()) == [tmp_path / saved[0].path.rsplit("/", 1)[-1]]
    anyio.run(prof.on_events, [StepEnded(step=1)])  # the OOM counter is seen again: no second dump
    prof.on_close()
    assert len([e for e in bus.got if isinstance(e, MemorySnapshotSaved)]) == 1
    assert fake.recording[-1] == {"enabled": None}  # recording stopped at close
    summary = [e for e in bus.got if isinstance(e, Scalars)][-1].values
    assert summary["memory/ooms"] == 1
    assert summary["memory/snapshots_saved"] == 1


def test_cuda_oom_missed_by_observer_is_dumped_at_close(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    fake = FakeAllocator(monkeypatch)
    bus = FakeBus()
    prof = MemoryProfiler(record_history=True, snapshot_dir=tmp_path)
    prof.on_start(bus)
    fake.observers.clear()  # an older torch without the OOM observer
    with pytest.raises(torch.OutOfMemoryError):
        fake.oom()  # inside `with bus:`, no guard
    prof.on_close()
    assert [e.reason for e in bus.got if isinstance(e, MemorySnapshotSaved)] == ["oom"]
