"""The GIL: a CPU-heavy Python subscriber in the bus thread against the same in a child process.

A real small model trains on CPU (one torch thread, a step of about 2 ms) and publishes a
`Loss` per step. A subscriber does about 5 ms of pure-Python work per event. Step time p50,
three ways: (a) no subscriber, (b) the subscriber in the bus thread (its `async on_events` on
the bus loop), (c) the same subscriber with `placement="process"`.

    python -m benchmarks.gil [--quick]

Keys: `gil.none_p50_ms`, `gil.in_thread_p50_ms`, `gil.process_p50_ms` (+ p90 and mean, the
work per event actually measured, and the load average: on a shared 2-core machine, (c)
competes with whatever else runs for the second core). In the bus thread the slowdown is
bimodal (a step waits for the GIL or it does not), so the mean, which sets the run's wall
time, shows it more than the p50.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from eventbus import EventBus
from eventbus.events import Event, Loss

__all__ = ["BusyAnalysis", "run"]

WORK_MS = 5.0


def _spin(n: int) -> int:
    """Pure-Python work that holds the GIL throughout."""
    acc = 0
    for i in range(n):
        acc = (acc + i * i) % 1_000_003
    return acc


def calibrate(target_ms: float = WORK_MS) -> int:
    """Loop count whose `_spin` costs about `target_ms` of this thread's CPU time.

    CPU time, not wall time: on a loaded machine a preempted run would look slower.
    """
    for _ in range(20):  # let the interpreter specialise `_spin` first (3.11 quickening)
        _spin(1000)
    n = 20_000
    while True:
        cost = min(_cpu(n) for _ in range(5))  # the least disturbed of five
        if cost > 0.02:
            return max(1, int(n * target_ms / 1000 / cost))
        n *= 2


def _cpu(n: int) -> float:
    t0 = time.thread_time()
    _spin(n)
    return time.thread_time() - t0


class BusyAnalysis:
    """About 5 ms of Python per `Loss`: stands in for a CPU-heavy analysis consumer."""

    events = (Loss,)
    policy = "drop_oldest"
    maxsize = 64

    def __init__(self, loops: int) -> None:
        self.loops = loops
        self.handled = 0

    async def on_events(self, batch: list[Event]) -> None:
        for _ in batch:
            _spin(self.loops)
            self.handled += 1


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 1),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4096, 128)
    y = x[:, :1].clone()
    return model, opt, x, y


class _Trainer:
    """One model trained across all configurations, a block of steps at a time."""

    def __init__(self) -> None:
        self.model, self.opt, self.x, self.y = _model()
        self.step = 0

    def block(self, bus: EventBus, steps: int) -> list[float]:
        model, opt, x, y = self.model, self.opt, self.x, self.y
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            idx = torch.randint(0, len(x), (64,))
            loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            bus.publish(Loss(step=self.step, value=loss.detach()))  # captured, no .item()
            times.append((time.perf_counter() - t0) * 1000)
            self.step += 1
        return times


def serialisation() -> dict[str, float]:
    """Per-event cost of what crosses the pipe (`process.pack` / `unpack`) against JSON lines
    (`codec.encode` / `decode`), best of 20 over 1,536 mixed events."""
    from eventbus import codec
    from eventbus.events import Scalars, StepEnded
    from eventbus.process.wire import pack, unpack

    evs: list[Event] = []
    for i in range(512):
        evs += [
            Loss(step=i, value=1.0 / (i + 1), ts=time.time_ns(), seq=3 * i, rank=0),
            StepEnded(step=i, duration_s=0.002, samples=32, ts=1, seq=3 * i + 1, rank=0),
            Scalars(step=i, values={"a": 1.0, "b": 2.0}, ts=1, seq=3 * i + 2, rank=0),
        ]

    def best_us(fn: Any) -> float:
        best = min(_wall(fn) for _ in range(20))
        return round(best / len(evs) * 1e6, 2)

    blob = pack(evs)
    lines = b"".join(codec.encode(e) for e in evs)
    return {
        "gil.pack_us_per_event": best_us(lambda: pack(evs)),
        "gil.unpack_us_per_event": best_us(lambda: unpack(blob)),
        "gil.codec_encode_us_per_event": best_us(lambda: b"".join(codec.encode(e) for e in evs)),
        "gil.codec_decode_us_per_event": best_us(
            lambda: [codec.decode(x) for x in lines.splitlines()]
        ),
    }


def _wall(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _p(values: list[float], q: float) -> float:
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q / 100 * len(s)))], 3)


def run(quick: bool = False) -> dict[str, Any]:
    """Step p50 / p90 (ms) with no subscriber, in the bus thread, and in a child process.

    The three run in alternating blocks of steps (order rotated each round, every bus
    flushed between blocks, untimed), so drifting machine load hits them alike.
    """
    from eventbus.process import ProcessSubscriber

    torch.set_num_threads(1)
    rounds, block = (6, 25) if quick else (12, 50)
    loops = calibrate()
    labels = ("none", "in_thread", "process")
    buses = {label: EventBus(close_timeout=30) for label in labels}
    buses["in_thread"].subscribe(BusyAnalysis(loops))
    proxy = ProcessSubscriber(BusyAnalysis(loops))
    buses["process"].subscribe(proxy)
    times: dict[str, list[float]] = {label: [] for label in labels}
    trainer = _Trainer()
    for b in buses.values():
        b.start()
    try:
        t0 = time.perf_counter()
        if not buses["process"].flush(timeout=120):  # the sidecar built it and started it
            raise RuntimeError("the sidecar did not start within 120 s")
        start_s = time.perf_counter() - t0
        trainer.block(buses["none"], 30)  # warm-up, untimed
        for r in range(rounds):
            for label in labels[r % 3 :] + labels[: r % 3]:
                times[label] += trainer.block(buses[label], block)
                buses[label].flush(timeout=60)  # the subscriber idle again before the next
    finally:
        stats = {label: b.close() for label, b in buses.items()}
    out: dict[str, Any] = {
        "gil.work_per_event_ms": round(min(_cpu(loops) for _ in range(5)) * 1000, 2)
    }
    for label in labels:
        out[f"gil.{label}_p50_ms"] = _p(times[label], 50)
        out[f"gil.{label}_p90_ms"] = _p(times[label], 90)
        out[f"gil.{label}_mean_ms"] = round(sum(times[label]) / len(times[label]), 3)
        for s in stats[label].subscribers.values():
            out[f"gil.{label}_handled"] = s.delivered
            out[f"gil.{label}_dropped"] = s.dropped
    out["gil.process_start_s"] = round(start_s, 2)  # after bus.start(): what was left to wait
    side = stats["process"].sidecar
    out["gil.sidecar_spawn_s"] = None if side is None else round(side.spawn_s or 0.0, 2)
    out.update(serialisation())
    out["gil.steps_each"] = rounds * block
    out["gil.load_average_1m"] = round(os.getloadavg()[0], 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    print(json.dumps(run(args.quick), indent=2))


if __name__ == "__main__":
    main()
