"""MemoryProfiler on CPU (RSS, leaks, summary) and its leak rule on synthetic series (OOM
snapshots: test_oom_snapshots.py)."""

from __future__ import annotations

import itertools
import math
import random
import time
from typing import Any

import anyio
import psutil
import pytest
import torch

from eventbus import Event, EventBus
from eventbus.events import (
    BackwardEnded,
    ForwardEnded,
    MemoryLeakSuspected,
    MemorySample,
    OptimizerStepped,
    Scalars,
    StepEnded,
)
from eventbus.monitors import MemoryProfiler
from eventbus.monitors._leak_rule import LeakRule, theil_sen_slope
from eventbus.monitors._memory_read import (
    MB,
    resolve_cuda_device,
    rss_bytes_procfs,
    rss_procfs_available,
)
from tests.conftest import Recorder

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path; see *_gpu.py")


class FakeBus:
    """Collects what a subscriber publishes when its hooks are called directly."""

    rank = 0
    local_rank = 0

    def __init__(self) -> None:
        self.got: list[Event] = []

    def publish(self, ev: Event) -> None:
        self.got.append(ev)


def first_verdict(series: list[float], **kw: Any) -> int | None:
    rule = LeakRule(**kw)
    for step, mb in enumerate(series, start=1):
        if rule.update(step, mb) is not None:
            return step
    return None


# -- the leak rule on synthetic series ------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rule_flags_a_steady_leak_under_noise_with_its_rate(seed: int) -> None:
    rng = random.Random(seed)
    rule = LeakRule(window=100, min_growth_mb=32)
    verdicts = [rule.update(s, 500 + 0.8 * s + rng.gauss(0, 3)) for s in range(1, 400)]
    fired = [v for v in verdicts if v is not None]
    assert len(fired) == 1, "fires once by default"
    assert fired[0].rate_mb_per_step == pytest.approx(0.8, rel=0.15)
    assert fired[0].step <= 115  # warm-up (10) + one window (100) + a few
    assert fired[0].window == 100


def test_rule_flags_a_staircase_leak() -> None:
    """An allocator that grows in 20 MB chunks every 20 steps is still a leak."""
    assert first_verdict([500 + (s // 20) * 20.0 for s in range(400)]) is not None


@pytest.mark.parametrize("sigma", [1.0, 5.0, 20.0])
def test_rule_ignores_noise(sigma: float) -> None:
    rng = random.Random(42)
    assert first_verdict([800 + rng.gauss(0, sigma) for _ in range(3000)]) is None


def test_rule_ignores_one_off_jumps() -> None:
    """The first optimizer step allocating its state, a later eval buffer: jumps, not leaks."""
    rng = random.Random(7)
    series = [
        500 + (300 if s > 30 else 0) + (200 if s > 250 else 0) + rng.gauss(0, 1)
        for s in range(1000)
    ]
    assert first_verdict(series) is None


@pytest.mark.parametrize("period", [7, 25, 60, 90])
def test_rule_ignores_a_caching_allocator_sawtooth(period: int) -> None:
    rng = random.Random(period)
    series = [500 + (s % period) * (80 / period) + rng.gauss(0, 0.5) for s in range(2000)]
    assert first_verdict(series) is None


def test_rule_ignores_growth_below_the_minimum() -> None:
    assert first_verdict([500 + 0.1 * s for s in range(1000)], min_growth_mb=32) is None
    assert first_verdict([500 + 0.1 * s for s in range(1000)], min_growth_mb=5) is not None


def test_rule_fires_again_only_after_its_cooldown() -> None:
    rule = LeakRule(window=20, min_growth_mb=5, warmup=0, cooldown=50)
    fired = [s for s in range(1, 200) if rule.update(s, 1.0 * s) is not None]
    assert fired[0] == 20
    assert all(b - a >= 50 for a, b in itertools.pairwise(fired))
    assert len(fired) >= 3


def test_rule_restarts_its_window_when_steps_go_back() -> None:
    rule = LeakRule(window=20, min_growth_mb=5, warmup=0)
    for s in range(1, 15):
        assert rule.update(s, 1.0 * s) is None
    for s in range(1, 15):  # a resume from step 1: the old points are not this run's
        assert rule.update(s, 1.0 * s) is None


def test_rule_skips_nan_and_keeps_state_across_a_checkpoint() -> None:
    rule = LeakRule(window=20, min_growth_mb=5, warmup=0)
    for s in range(1, 15):
        rule.update(s, math.nan if s == 3 else 1.0 * s)
    resumed = LeakRule(window=20, min_growth_mb=5, warmup=0)
    resumed.load_state_dict(rule.state_dict())
    assert [s for s in range(15, 30) if resumed.update(s, 1.0 * s)] == [21]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"window": 5}, "window"),
        ({"blocks": 2}, "blocks"),
        ({"min_growth_mb": 0}, "min_growth"),
        ({"max_drop_ratio": 1.5}, "max_drop_ratio"),
        ({"cooldown": 0}, "cooldown"),
    ],
)
def test_rule_rejects_bad_settings(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LeakRule(**kw)


def test_theil_sen_ignores_outliers() -> None:
    xs = [float(i) for i in range(30)]
    ys = [2.0 * x for x in xs]
    ys[5] = ys[17] = 1e6
    assert theil_sen_slope(xs, ys) == pytest.approx(2.0)


# -- the profiler on a live bus (CPU) -------------------------------------------------------


def run_loop(
    profiler: MemoryProfiler, steps: int, body: Any, rec: Recorder | None = None
) -> Recorder:
    """A training loop: `body(step)` then StepEnded; the bus handles each step before the next
    (flush), as it does when steps take longer than its drain interval."""
    rec = rec or Recorder()
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(rec)  # older than the profiler: closed after it, so it sees the summary
    bus.subscribe(profiler)
    with bus:
        for step in range(1, steps + 1):
            body(step)
            bus.publish(StepEnded(step=step))
            assert bus.flush(5)
    return rec


def of(rec: Recorder, cls: type[Event], **match: Any) -> list[Any]:
    return [
        e for e in rec.got if type(e) is cls and all(getattr(e, k) == v for k, v in match.items())
    ]


def test_a_loop_that_leaks_tensors_is_flagged() -> None:
    kept: list[torch.Tensor] = []

    def leak(step: int) -> None:
        kept.append(torch.ones(256 * 1024))  # 1 MiB of float32, pages touched

    rec = run_loop(MemoryProfiler(leak_window=30, leak_min_growth_mb=12, leak_warmup=3), 70, leak)
    leaks = of(rec, MemoryLeakSuspected, metric="rss_mb")
    assert len(leaks) == 1, [e for e in rec.got if type(e) is MemoryLeakSuspected]
    assert 0.7 < leaks[0].rate_mb_per_step < 1.4
    assert leaks[0].window == 30
    assert 33 <= leaks[0].step <= 45


def test_a_steady_loop_is_not_flagged() -> None:
    def steady(step: int) -> None:
        x = torch.ones(256 * 1024 * (1 + step % 4))  # 1-4 MiB allocated and freed each step
        y = x * 2
        del x, y

    rec = run_loop(
        MemoryProfiler(leak_window=30, leak_min_growth_mb=12, leak_warmup=3), 120, steady
    )
    assert of(rec, MemoryLeakSuspected) == []
    assert len(of(rec, MemorySample, phase="step")) == 120


def test_rss_agrees_with_psutil_and_procfs() -> None:
    """Each sample lies between psutil's readings just before the publish and just after the
    flush (the bus's threads may allocate in between), and agrees with /proc."""
    samples: list[tuple[int, float, float, float | None]] = []
    rec = Recorder()
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(rec)
    bus.subscribe(MemoryProfiler())
    rss = lambda: psutil.Process().memory_info().rss / MB  # noqa: E731
    with bus:
        for step in range(1, 6):
            before = rss()
            bus.publish(StepEnded(step=step))
            assert bus.flush(5)
            procfs = rss_bytes_procfs() / MB if rss_procfs_available() else None
            samples.append((step, before, rss(), procfs))
    got = {e.step: e for e in of(rec, MemorySample, phase="step")}
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step, before, after, procfs in samples:
        ev = got[step]
        assert min(before, after) - 2.0 <= ev.rss_mb <= max(before, after) + 2.0
        if procfs is not None:
            assert min(before, procfs) - 2.0 <= ev.rss_mb <= max(after, procfs) + 2.0
        assert ev.rss_peak_mb >= ev.rss_mb
        if not torch.cuda.is_available():
            assert ev.allocated_mb is None
            assert ev.reserved_mb is None
            assert ev.device == "cpu"
        assert ev.lag_s is not None
        assert 0 <= ev.lag_s < 5


def test_summary_at_close_says_peak_where_and_growth() -> None:
    kept: list[torch.Tensor] = []

    def grow_then_free(step: int) -> None:
        if step == 15:  # 2 x 40 MiB: above glibc's largest mmap threshold, so freeing them
            kept.extend(torch.ones(10 * 1024 * 1024) for _ in range(2))  # returns the pages
        elif kept:
            kept.clear()

    rec = run_loop(MemoryProfiler(every=5), 30, grow_then_free)
    summary = of(rec, MemorySample, phase="summary")
    scalars = [e for e in of(rec, Scalars) if "memory/peak_rss_mb" in e.values]
    assert len(summary) == 1
    assert len(scalars) == 1
    v = scalars[0].values
    assert v["memory/peak_rss_step"] == 15
    assert abs(v["memory/rss_growth_mb"]) < 40  # the 80 MiB were given back
    assert v["memory/peak_rss_mb"] >= summary[0].rss_mb
    assert summary[0].rss_peak_mb >= v["memory/peak_rss_mb"]
    assert v["memory/steps_read"] == 30
    assert "memory/rss_growth_mb" in v
    assert "memory/rss_hwm_mb" in v
    steps = [e.step for e in of(rec, MemorySample, phase="step")]
    assert steps == [5, 10, 15, 20, 25, 30]  # every=5: at its multiples


def test_steps_in_one_batch_are_read_once_for_the_newest() -> None:
    """Several StepEnded handled together would all read the same memory: only the newest is
    read and attributed; the peak window covers the ones coalesced into it."""
    bus = FakeBus()
    prof = MemoryProfiler()
    prof.on_start(bus)
    now = time.time_ns()
    anyio.run(prof.on_events, [StepEnded(step=s, ts=now) for s in range(1, 6)])
    steps = [e.step for e in bus.got if isinstance(e, MemorySample)]
    assert steps == [5]
    anyio.run(prof.on_events, [StepEnded(step=6, ts=now - 1_000_000_000)])
    last = bus.got[-1]
    assert isinstance(last, MemorySample)
    assert last.step == 6
    assert last.lag_s == pytest.approx(1.0, abs=0.5)  # read a second after the step ended


@no_cuda
def test_phase_events_without_cuda_publish_no_phase_samples() -> None:
    bus = FakeBus()
    prof = MemoryProfiler()
    prof.on_start(bus)
    for s in range(1, 4):
        for ev in (
            ForwardEnded(step=s),
            BackwardEnded(step=s),
            OptimizerStepped(step=s),
            StepEnded(step=s),
        ):
            anyio.run(prof.on_events, [ev])
    assert [e.phase for e in bus.got if isinstance(e, MemorySample)] == ["step"] * 3


def test_training_thread_snapshots_replace_late_reads() -> None:
    rec = Recorder()
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(rec)
    prof = MemoryProfiler()
    bus.subscribe(prof)
    with pytest.raises(RuntimeError, match="subscribe the profiler"):
        MemoryProfiler().snapshot(1)
    with bus:
        for step in range(1, 6):
            snap = prof.snapshot(step)
            assert snap.source == "training"
            assert snap.lag_s == 0.0
            assert snap.rss_mb
            bus.publish(StepEnded(step=step))
            assert bus.flush(5)
    steps = of(rec, MemorySample, phase="step")
    assert [(e.step, e.source) for e in steps] == [(s, "training") for s in range(1, 6)]


def test_bad_arguments_fail_where_made() -> None:
    with pytest.raises(ValueError, match="every"):
        MemoryProfiler(every=0)
    with pytest.raises(ValueError, match="max_entries"):
        MemoryProfiler(max_entries=0)
    with pytest.raises(ValueError, match="CUDA device"):
        resolve_cuda_device("cpu", 0)
    with pytest.raises(ValueError, match=">= 0"):
        resolve_cuda_device(-1, 0)
    assert resolve_cuda_device(3, 0) == 3


# -- CUDA logic against a fake caching allocator (the real one: test_memory_gpu.py) ---------


class FakeAllocator:
    """Stands in for torch's host-side allocator counters, so the CUDA logic runs on CPU."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.cur = self.peak = 100 * 2**20
        self.ooms = 0
        self.observers: list[Any] = []
        self.recording: list[dict[str, Any]] = []
        for name, fn in {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "device_count": lambda: 1,
            "current_device": lambda: 0,
            "memory_stats_as_nested_dict": self.stats,
            "reset_peak_memory_stats": self.reset,
        }.items():
            monkeypatch.setattr(torch.cuda, name, fn)
        monkeypatch.setattr(
            torch.cuda.memory, "_record_memory_history", lambda **kw: self.recording.append(kw)
        )
        monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", self.dump)
        monkeypatch.setattr(
            torch._C, "_cuda_attach_out_of_memory_observer", self.observers.append, raising=False
        )

    def stats(self, device: int) -> dict[str, Any]:
        return {
            "allocated_bytes": {"all": {"current": self.cur, "peak": self.peak}},
            "reserved_bytes": {"all": {"current": 2 * self.peak}},
            "num_alloc_retries": 0,
            "num_ooms": self.ooms,
        }

    def reset(self, device: int) -> None:
        self.peak = self.cur

    def alloc(self, mb: float) -> None:
        self.cur += int(mb * 2**20)
        self.peak = max(self.peak, self.cur)

    def dump(self, path: str) -> None:
        with open(path, "wb") as f:
            f.write(b"snapshot")

    def oom(self) -> None:
        """What the allocator does: count, call the observers, raise."""
        self.ooms += 1
        for obs in self.observers:
            obs(0, 1 << 50, self.cur, 0)
        raise torch.OutOfMemoryError("CUDA out of memory (fake)")


def test_cuda_phase_and_step_peaks_reset_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeAllocator(monkeypatch)
    bus = FakeBus()
    prof = MemoryProfiler(leak_window=20, leak_min_growth_mb=5, leak_warmup=0)
    prof.on_start(bus)
    for step in range(1, 26):
        for cls, mb in ((ForwardEnded, 16), (BackwardEnded, 48)):
            fake.alloc(mb)
            fake.alloc(-mb)
            anyio.run(prof.on_events, [cls(step=step)])  # handled alone: the read is this phase's
        fake.alloc(1)  # a 1 MB leak a step
        anyio.run(prof.on_events, [StepEnded(step=step)])
    by = {(e.step, e.phase): e for e in bus.got if isinstance(e, MemorySample)}
    base = by[(5, "step")].allocated_mb
    assert base is not None
    assert base == pytest.approx(105.0)
    assert by[(5, "forward")].peak_allocated_mb == pytest.approx(base - 1 + 16)
    assert by[(5, "backward")].peak_allocated_mb == pytest.approx(base - 1 + 48)
    assert by[(5, "step")].peak_allocated_mb == pytest.approx(base - 1 + 48)
    assert by[(5, "step")].device == "cuda:0"
    assert by[(5, "step")].source == "bus"
    leaks = [e for e in bus.got if isinstance(e, MemoryLeakSuspected)]
    assert [(e.metric, e.step) for e in leaks] == [("allocated_mb", 20)]
    assert leaks[0].rate_mb_per_step == pytest.approx(1.0)


def test_placing_it_in_the_sidecar_is_refused_where_it_is_asked() -> None:
    bus = EventBus()
    with pytest.raises(TypeError, match=r"reads the memory of the process it runs in"):
        bus.subscribe(MemoryProfiler(), placement="process")
    assert bus.stats().sidecar is None  # refused before any process was started
    bus.close()
