"""Sustained throughput: events/s from `publish` to JSON lines on disk, lossless.

A publisher builds and publishes small `Loss` events flat out into a bus with one
`JsonlWriter` (policy `block`: backpressure, never a drop). The clock runs from the first
publish until `close()` returned, so every line is on disk; then the lines are counted. It
runs in a child process so that `rss_peak_mb` is this benchmark's own peak, not that of
whatever ran before it in the parent.

    python -m benchmarks.throughput [--events N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["measure", "run"]


def _count_lines(path: Path, type_name: str) -> int:
    """Event lines of `type_name` in the file (the header and stats records are not)."""
    needle = f'"type":"{type_name}"'.encode()
    n = 0
    with path.open("rb") as f:
        for line in f:
            if needle in line:
                n += 1
    return n


def measure(events: int) -> dict[str, Any]:
    """Publish `events` events into a JSONL writer in this process; flat `throughput.*` keys."""
    from benchmarks._util import peak_rss_mb
    from eventbus import EventBus
    from eventbus.events import Loss
    from eventbus.sinks import JsonlWriter

    with tempfile.TemporaryDirectory(prefix="eventbus-bench-tp-") as d:
        writer = JsonlWriter(d)
        bus = EventBus()
        bus.subscribe(writer)
        rss0 = peak_rss_mb()
        publish = bus.publish
        bus.start()
        bus.flush(timeout=120)  # the sidecar is up: a run overlaps its start with set-up
        side0 = _sidecar_cpu_s(bus)
        cpu0 = _thread_cpu_s()  # start-up (imports, the sidecar's launch) is not per event
        t0 = time.perf_counter()
        for i in range(events):
            publish(Loss(step=i, value=i * 0.001))
        t_published = time.perf_counter()
        bus.flush(timeout=600)
        cpu = _thread_cpu_s(since=cpu0)  # before close: the bus thread and workers still live
        side = _sidecar_cpu_s(bus) - side0  # the sidecar process (the writer runs there)
        st = bus.close(timeout=600)
        t1 = time.perf_counter()
        lines = _count_lines(writer.path, "Loss")
        size_mb = writer.path.stat().st_size / 2**20
    elapsed = t1 - t0
    sub = st.subscribers["jsonl"]
    return {
        "throughput.events": events,
        "throughput.events_per_s": round(events / elapsed),
        "throughput.publish_events_per_s": round(events / (t_published - t0)),
        "throughput.lost": events - lines,
        "throughput.lines_on_disk": lines,
        "throughput.dropped": sub.dropped,
        "throughput.failed": sub.failed,
        "throughput.seconds": round(elapsed, 3),
        "throughput.publisher_blocked_s": round(st.blocked_s, 3),
        "throughput.file_mb": round(size_mb, 1),
        "throughput.rss_before_mb": round(rss0, 1),
        "throughput.rss_peak_mb": round(peak_rss_mb(), 1),
        # CPU per event of each thread (all share one GIL, so they add up).
        "throughput.cpu_us_per_event.publisher": round(cpu.get("MainThread", 0) / events * 1e6, 2),
        "throughput.cpu_us_per_event.bus_thread": round(cpu.get("eventbus", 0) / events * 1e6, 2),
        "throughput.cpu_us_per_event.jsonl_worker": round(
            cpu.get("eventbus-jsonl", 0) / events * 1e6, 2
        ),  # 0 when the writer runs in the sidecar (the default): see .sidecar
        "throughput.cpu_us_per_event.sidecar_senders": round(
            sum(v for k, v in cpu.items() if k.startswith("eventbus-sidecar")) / events * 1e6, 2
        ),
        "throughput.cpu_us_per_event.sidecar": round(side / events * 1e6, 2),
    }


def _sidecar_cpu_s(bus: Any) -> float:
    """CPU seconds the bus's sidecar process used so far (0 without one)."""
    import psutil

    side = bus.stats().sidecar
    if side is None or side.pid is None:
        return 0.0
    try:
        t = psutil.Process(side.pid).cpu_times()
    except psutil.Error:
        return 0.0
    return float(t.user + t.system)


def _thread_cpu_s(since: dict[str, float] | None = None) -> dict[str, float]:
    """CPU seconds used by each live thread of this process, by thread name: so far, or
    since the readings `since`."""
    import threading

    import psutil

    names = {t.native_id: t.name for t in threading.enumerate()}
    now = {
        names.get(t.id, str(t.id)): t.user_time + t.system_time for t in psutil.Process().threads()
    }
    return {k: v - (since or {}).get(k, 0.0) for k, v in now.items()}


def run(quick: bool = False, events: int | None = None) -> dict[str, Any]:
    """Measure in a fresh child process (its own peak RSS); 1M events, 200k when quick."""
    n = events if events is not None else (200_000 if quick else 1_000_000)
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.throughput", "--events", str(n), "--in-process"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"throughput child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument(
        "--in-process",
        action="store_true",
        help="measure here (default: in a child process, for a clean peak RSS)",
    )
    a = p.parse_args()
    result = measure(a.events) if a.in_process else run(events=a.events)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
