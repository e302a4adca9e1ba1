"""What the in-process monitors cost per step, on the thread that pays it.

Bus side (the bus thread, sharing the GIL with training): one RSS read (psutil,
/proc/self/statm), the kernel's RSS high-water mark, MemoryProfiler's whole `on_events` for
one StepEnded (RSS, CUDA counters when present, leak rule, sample built and published),
SpeedMonitor.update, and DivergenceDetector's `on_events` for one Loss (its rule on a noisy
falling loss). Training side: `MemoryProfiler.snapshot(step)`. With CUDA also the
allocator read and peak reset alone.

    python -m benchmarks.monitor_cost [--n 2000]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any

import torch

from benchmarks._util import machine, summarize
from eventbus.events import Event, Loss, StepEnded
from eventbus.monitors import DivergenceDetector, MemoryProfiler, SpeedMonitor
from eventbus.monitors._memory_read import (
    CudaReader,
    rss_bytes,
    rss_bytes_procfs,
    rss_peak_bytes,
    rss_procfs_available,
)

__all__ = ["run"]


class _Sink:
    rank = 0
    local_rank = 0

    def publish(self, ev: Event) -> None:
        return None


def _ran(coro: Coroutine[Any, Any, None]) -> None:
    """Run an async `on_events` that does not wait (as these do, but for rare dumps)."""
    try:
        coro.send(None)
    except StopIteration:
        return
    coro.close()
    raise RuntimeError("on_events waited: it cannot be timed this way")


def _us(fn: Callable[[int], Any], n: int) -> dict[str, float]:
    out = []
    for i in range(1, n + 1):
        t0 = time.perf_counter_ns()
        fn(i)
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return {k: round(v, 2) for k, v in summarize(out).items()}


def run(n: int = 2000) -> dict[str, Any]:
    """Per-call microseconds (p50/p90/p99/mean) of each piece."""
    prof = MemoryProfiler(leak_window=100)
    prof.on_start(_Sink())
    speed = SpeedMonitor(every=10)
    speed.on_start(_Sink())
    div = DivergenceDetector(action="warn")
    div.on_start(_Sink())
    rng = random.Random(0)
    losses = [2.0 * math.exp(-i / (4 * n)) + rng.gauss(0, 0.02) for i in range(n + 1)]
    now = time.time_ns()
    res: dict[str, Any] = {
        "rss_psutil_us": _us(lambda i: rss_bytes(), n),
        "rss_peak_us": _us(lambda i: rss_peak_bytes(), n),
        "profiler_step_us": _us(lambda i: _ran(prof.on_events([StepEnded(step=i, ts=now)])), n),
        "profiler_snapshot_us": _us(lambda i: prof.snapshot(n + i), n),
        "speed_update_us": _us(
            lambda i: speed.update(StepEnded(step=i, ts=now + i * 10**6, samples=32)), n
        ),
        "divergence_step_us": _us(
            lambda i: _ran(div.on_events([Loss(step=i, ts=now, value=losses[i])])), n
        ),
    }
    if rss_procfs_available():
        res["rss_procfs_us"] = _us(lambda i: rss_bytes_procfs(), n)
    if torch.cuda.is_available():
        torch.ones(1, device="cuda")
        reader = CudaReader(torch.cuda.current_device())
        res["cuda_read_reset_us"] = _us(lambda i: reader.read(reset_peak=True), n)
        res["cuda_memory_stats_flat_us"] = _us(lambda i: torch.cuda.memory_stats(), n)
    return {"machine": machine(), "n": n, "results": res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    print(json.dumps(run(ap.parse_args().n), indent=2))


if __name__ == "__main__":
    main()
