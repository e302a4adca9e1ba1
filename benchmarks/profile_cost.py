"""What a profile window's export costs the training thread, by where it runs (issue 18).

One window of a small MLP (many small ops) is recorded with `torch.profiler`, then a loop of
~4 ms CPU steps runs while the window is handled in one of three ways:

  (a) trace      `export_chrome_trace` on a thread (Kineto's C++ writer);
  (b) table      `key_averages().table()` on a thread (the parse is pure Python);
  (c) child      the table built from the trace in a child process, as
                 `eventbus.torch.profile` does (`python -m eventbus._torch_profile_table`).

For each it reports how long the work took and the training steps run meanwhile: count,
p50, max and throughput against the loop alone. Also the training thread's own cost when a
window ends (`prof.step()` stopping Kineto).

    python -m benchmarks.profile_cost [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["run"]


def run(quick: bool = False) -> dict[str, Any]:
    """Measure (a), (b), (c) and the window's end; the figures as a dict."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    small = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    big = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(20)])
    reps = 5 if quick else 60

    def step() -> None:
        for _ in range(20):
            small(torch.randn(16, 64)).sum().backward()

    windows: list[Any] = []
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(2):  # one window for the thread's table, one for the trace and child
            prof = torch.profiler.profile(
                schedule=torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1),
                on_trace_ready=lambda p: windows.append(p.profiler),
            )
            prof.start()
            for i in range(3):
                for _ in range(reps):
                    big(torch.randn(16, 64)).sum().backward()
                t0 = time.perf_counter()
                prof.step()
                if i == 2:
                    out["window_end_ms"] = (time.perf_counter() - t0) * 1e3
            prof.stop()
        base = [_timed(step) for _ in range(30)]
        out["step_ms_alone_p50"] = statistics.median(base) * 1e3
        trace = Path(tmp) / "w.json"
        cmd = [sys.executable, "-m", "eventbus._torch_profile_table", str(trace), str(trace) + ".t"]
        out["ops"] = 0
        for name, work in (
            ("trace", lambda: windows[1].export_chrome_trace(str(trace))),
            ("table", lambda: windows[0].key_averages().table(row_limit=30)),
            ("child", lambda: subprocess.run(cmd, check=True)),
        ):
            out[name] = _during(work, step)
            if name == "trace":
                events = json.loads(trace.read_text())["traceEvents"]
                out["ops"] = sum(1 for e in events if e.get("cat") == "cpu_op")
    alone = 1e3 / out["step_ms_alone_p50"]
    for name in ("trace", "table", "child"):
        d = out[name]
        d["steps_per_s_vs_alone"] = d["steps_per_s"] / alone if d["steps_per_s"] else 0.0
    return out


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _during(work: Callable[[], Any], step: Callable[[], None]) -> dict[str, Any]:
    """Run `work` on a thread; training steps meanwhile, and how long `work` took."""
    took: list[float] = []
    th = threading.Thread(target=lambda: took.append(_timed(work)))
    steps: list[float] = []
    t0 = time.perf_counter()
    th.start()
    while th.is_alive():
        steps.append(_timed(step))
    wall = time.perf_counter() - t0
    return {
        "work_s": took[0] if took else None,
        "steps": len(steps),
        "step_ms_p50": statistics.median(steps) * 1e3 if steps else None,
        "step_ms_max": max(steps) * 1e3 if steps else None,
        "steps_per_s": len(steps) / wall if wall > 0 else 0.0,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="a small window (for tests)")
    print(json.dumps(run(p.parse_args(argv).quick), indent=2))


if __name__ == "__main__":
    main()
