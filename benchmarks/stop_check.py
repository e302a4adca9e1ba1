"""The cost of an agreed `bus.should_stop` check: one all_reduce(MAX) of 4 ints per check.

Run under torchrun (gloo on CPU):

    python -m torch.distributed.run --nproc_per_node=2 -m benchmarks.stop_check [--quick]

Rank 0 prints one JSON object: per-call cost of `should_stop` for a blocking check at every
call with nothing between calls (the collective's own latency), then with a 1 ms step
between calls: blocking, overlapped (the default: started at one check, read at the next),
every 10th call (blocking and overlapped), and a single-process bus (no agreement). The
"step" sleeps rather than spins: on a 2-core machine two spinning ranks plus their bus
threads would measure the scheduler.
`run(quick)` launches torchrun itself and returns the flat `stop_check.*` keys.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

__all__ = ["run"]


def _step(seconds: float) -> None:
    """Stand-in for a training step: sleeps, so two ranks on a 2-core box don't fight."""
    if seconds > 0:
        time.sleep(seconds)


def _measure(bus: Any, n: int, work_s: float) -> dict[str, float]:
    import torch.distributed as dist

    from benchmarks._util import summarize

    dist.barrier()
    samples = []
    for _ in range(n):
        _step(work_s)
        t0 = time.perf_counter_ns()
        stop = bus.should_stop
        samples.append((time.perf_counter_ns() - t0) / 1e3)
        if stop:
            break
    s = summarize(samples)
    return {"p50_us": s["p50"], "p99_us": s["p99"], "mean_us": s["mean"]}


def _worker(quick: bool) -> None:
    import torch
    import torch.distributed as dist

    from eventbus import EventBus
    from eventbus.agreement import StopAgreement

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n = 300 if quick else 3000
    work_s = 0.001
    out: dict[str, float] = {}
    cases: list[tuple[str, float, dict[str, Any]]] = [
        ("back_to_back", 0.0, {"every": 1, "overlap": False}),
        ("every_call", work_s, {"every": 1, "overlap": False}),
        ("overlap", work_s, {"every": 1, "overlap": True}),
        ("every_10", work_s, {"every": 10, "overlap": False}),
        ("every_10_overlap", work_s, {"every": 10, "overlap": True}),
    ]
    for label, step_s, options in cases:
        bus = EventBus(close_timeout=5)
        bus.control.agree = StopAgreement(bus.control, **options)
        with bus:
            for k, v in _measure(bus, n, step_s).items():
                out[f"stop_check.{label}_{k}"] = round(v, 2)
    single = EventBus(world_size=1, close_timeout=5)
    with single:
        for k, v in _measure(single, n, work_s).items():
            out[f"stop_check.single_process_{k}"] = round(v, 3)
    out["stop_check.load_average_1m"] = os.getloadavg()[0]
    dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(out), flush=True)


def run(quick: bool = False) -> dict[str, Any]:
    """Launch the measurement under torchrun (2 ranks, gloo, CPU); the flat result keys."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_port=0",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=127.0.0.1:0",
        "-m",
        "benchmarks.stop_check",
        "--worker",
    ]
    if quick:
        cmd.append("--quick")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            return dict(json.loads(line))
    raise RuntimeError(f"no result line from the workers:\n{proc.stdout[-2000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--worker", action="store_true", help="(internal) run as a torchrun worker")
    args = p.parse_args()
    if args.worker or "LOCAL_RANK" in os.environ:
        _worker(args.quick)
    else:
        print(json.dumps(run(args.quick), indent=2))


if __name__ == "__main__":
    main()
