"""What PrometheusExporter costs, by subscribers on the bus and local ranks on the node.

Each rank is a child process running a ~1.2 ms torch step that publishes StepEnded, Loss and
OptimizerStepped (MemorySample every 10th step) to a bus with S no-op subscribers, with or
without an exporter. This process plays Prometheus: it scrapes every rank's `/metrics` every
`--interval` seconds over HTTP. Per variant: the training thread's step p50/p99, the bus
thread's CPU per step, the CPU of the process's other threads (the scrapes' HTTP threads)
per second and per scrape, and scrape latency, size and series.

    .venv/bin/python -m benchmarks.prometheus_cost [--quick] [--seconds 6] [--interval 0.25]
        [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks._util import machine, summarize

__all__ = ["run"]

ROOT = Path(__file__).resolve().parent.parent


class _NoOp:
    """A subscriber that takes every event and does nothing (a stand-in for a light sink)."""

    policy = "drop_oldest"

    async def on_events(self, batch: list[Any]) -> None:
        return None


def _child(port: int, subs: int, exporter: bool, seconds: float) -> None:
    """One rank: the loop, then one JSON line of what it measured."""
    import torch

    from eventbus import EventBus
    from eventbus.events import Loss, MemorySample, OptimizerStepped
    from eventbus.sinks import PrometheusExporter

    torch.set_num_threads(1)
    bus = EventBus()
    for i in range(subs):
        bus.subscribe(_NoOp(), name=f"sink{i}")
    exp = PrometheusExporter(port, run="bench") if exporter else None
    if exp is not None:
        bus.subscribe(exp)
    a, b = torch.randn(192, 192), torch.randn(192, 192)
    steps: list[float] = []
    with bus:
        url = exp.wait_listening(30) if exp is not None else "-"
        print(f"ready {url}", flush=True)
        thread = bus.thread
        assert thread is not None and thread.ident is not None
        bus_clock = time.pthread_getcpuclockid(thread.ident)
        cpu0, bus0, main0 = time.process_time(), time.clock_gettime(bus_clock), time.thread_time()
        end = time.perf_counter() + seconds
        step = 0
        while time.perf_counter() < end:
            step += 1
            t0 = time.perf_counter()
            with bus.step(step, samples=32, tokens=32 * 128):
                for _ in range(8):
                    c = a @ b  # the step's work (torch releases the GIL here)
                bus.publish(Loss(step=step, value=float(c[0, 0])))
                bus.publish(OptimizerStepped(step=step, lr=1e-3, grad_norm=1.0))
                if step % 10 == 0:
                    bus.publish(MemorySample(step=step, rss_mb=100.0))
            steps.append((time.perf_counter() - t0) * 1e3)
        cpu, bus_cpu = time.process_time() - cpu0, time.clock_gettime(bus_clock) - bus0
        main = time.thread_time() - main0
    s = summarize(steps)
    print(
        json.dumps(
            {
                "steps": step,
                "step_p50_ms": s["p50"],
                "step_p99_ms": s["p99"],
                "bus_cpu_us_per_step": bus_cpu / step * 1e6,
                "other_cpu_ms_per_s": (cpu - bus_cpu - main) / seconds * 1e3,
            }
        ),
        flush=True,
    )


def _free_base(n: int) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = int(s.getsockname()[1])
    return base if base + n < 65536 else _free_base(n)


def _variant(
    ranks: int, subs: int, exporter: bool, seconds: float, interval: float
) -> dict[str, Any]:
    """Run `ranks` children at once; scrape each every `interval` s while they run."""
    base = _free_base(ranks)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = []
    for r in range(ranks):
        cmd = [sys.executable, "-m", "benchmarks.prometheus_cost", "--child", str(base)]
        cmd += ["--subs", str(subs), "--seconds", str(seconds)] + (
            ["--exporter"] if exporter else []
        )
        procs.append(
            subprocess.Popen(
                cmd,
                env={**env, "LOCAL_RANK": str(r), "RANK": str(r)},
                stdout=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
        )
    urls = []
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline().split()
        if not line or line[0] != "ready":
            raise RuntimeError(f"a rank did not start: {line!r}")
        urls.append(line[1])
    latencies: list[float] = []
    sizes: list[int] = []
    series = 0
    while exporter and all(p.poll() is None for p in procs):
        for url in urls:
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    body = resp.read()
            except OSError:  # the rank ended between our check and the scrape
                continue
            latencies.append((time.perf_counter() - t0) * 1e3)
            sizes.append(len(body))
            series = sum(1 for ln in body.decode().splitlines() if ln and ln[0] != "#")
        time.sleep(interval)  # Prometheus's scrape interval
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=seconds + 60)
        lines = out.strip().splitlines()
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"a rank failed (exit {p.returncode}): {out[-500:]!r}")
        results.append(json.loads(lines[-1]))
    row: dict[str, Any] = {
        k: sum(r[k] for r in results) / len(results)
        for k in ("step_p50_ms", "step_p99_ms", "bus_cpu_us_per_step", "other_cpu_ms_per_s")
    }
    if latencies:
        lat = summarize(latencies)
        row |= {
            "scrape_p50_ms": lat["p50"],
            "scrape_p99_ms": lat["p99"],
            "scrapes": len(latencies),
            "scrape_bytes": max(sizes),
            "series_per_rank": series,
            # the exporter's HTTP thread (its idle polls included) per scrape of this rank
            "scrape_cpu_ms": row["other_cpu_ms_per_s"] * seconds / (len(latencies) / ranks),
        }
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def run(
    quick: bool = False, seconds: float = 6.0, interval: float = 0.25, repeat: int = 1
) -> dict[str, Any]:
    """Flat results: `prometheus_cost.r{ranks}_s{subs}_{none|exporter}.{figure}`, each the
    median over `repeat` rounds (each round runs every variant once, in alternating order)."""
    if quick:
        seconds, repeat = 1.5, 1
    variants = [
        (ranks, subs, exporter)
        for ranks in (1, 2)
        for subs in ((1, 2, 4) if not quick else (1, 4))
        for exporter in (False, True)
    ]
    rounds: dict[str, list[Any]] = {}
    for i in range(repeat):
        for ranks, subs, exporter in variants if i % 2 == 0 else variants[::-1]:
            row = _variant(ranks, subs, exporter, seconds, interval)
            name = f"r{ranks}_s{subs}_{'exporter' if exporter else 'none'}"
            for k, v in row.items():
                rounds.setdefault(f"prometheus_cost.{name}.{k}", []).append(v)
    return {k: statistics.median(v) for k, v in rounds.items()}


def _table(res: dict[str, Any]) -> str:
    rows = sorted({k.split(".")[1] for k in res})
    cols = (
        "step_p50_ms",
        "step_p99_ms",
        "bus_cpu_us_per_step",
        "other_cpu_ms_per_s",
        "scrape_p50_ms",
        "scrape_p99_ms",
        "scrape_cpu_ms",
        "scrape_bytes",
        "series_per_rank",
    )
    lines = ["| variant | " + " | ".join(cols) + " |", "|---" + "|---:" * len(cols) + "|"]
    for r in rows:
        vals = [str(res.get(f"prometheus_cost.{r}.{c}", "")) for c in cols]
        lines.append(f"| {r} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seconds", type=float, default=6.0, help="per variant and rank")
    ap.add_argument("--interval", type=float, default=0.25, help="scrape interval, seconds")
    ap.add_argument("--repeat", type=int, default=1, help="rounds; each figure's median")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--child", type=int, metavar="BASE_PORT", help=argparse.SUPPRESS)
    ap.add_argument("--subs", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--exporter", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        _child(args.child, args.subs, args.exporter, args.seconds)
        return
    res = run(args.quick, args.seconds, args.interval, args.repeat)
    print(_table(res))
    print(json.dumps(machine()))
    if args.json:
        args.json.write_text(json.dumps(res | {"machine": machine()}, indent=1))


if __name__ == "__main__":
    main()
