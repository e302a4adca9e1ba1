"""Wake-ups: does a running bus slow a ~2 ms training step through its thread's wake-ups?

A small MLP steps every ~2 ms on one CPU thread (micro-batches accumulated per step, their
number calibrated at start to reach ~2 ms) and publishes one small event per step.
Blocks rotate between no bus at all, a running bus with 4 no-op subscribers, and the same
with `drain_interval=0.005` (an old default: 10x more timer wakes); per-step wall time is
compared (pooled p50/p99, and the median over adjacent block pairs). The bus thread drains
on a timer (`drain_interval`, 50 ms by default) instead of being woken per event; the
`forced_wakeups` key counts the cross-thread wakes publish did make (0 expected).

    python -m benchmarks.wakeups [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import time
from typing import Any

from benchmarks._util import blockwise_inflation, flatten, inflation, interleave_blocks, summarize

__all__ = ["run"]

WARMUP_STEPS = 20


class _Noop:
    """A subscriber that does nothing with its batch (on the bus loop)."""

    async def on_events(self, batch: list[Any]) -> None:
        return None


def _other_threads_cpu_s() -> float:
    """CPU seconds used by every thread but this one (here: the bus thread)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime - time.thread_time()


def _model(width: int, batch: int) -> tuple[Any, Any, Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, width), torch.nn.ReLU(), torch.nn.Linear(width, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, 128)
    y = torch.randint(0, 10, (batch,))
    return model, opt, x, y


def run(
    quick: bool = False,
    *,
    blocks: int | None = None,
    steps: int | None = None,
    threads: int = 1,
    target_step_s: float = 0.002,
) -> dict[str, Any]:
    """Flat `wakeups.*` keys: step times with and without a running bus, and the inflation."""
    import torch

    from eventbus import EventBus
    from eventbus.events import StepEnded

    blocks = blocks if blocks is not None else (6 if quick else 16)
    steps = steps if steps is not None else (300 if quick else 500)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    model, opt, x, y = _model(width=512, batch=64)
    loss_fn = torch.nn.functional.cross_entropy
    forced = [0]
    cpu = {"bus": 0.0, "bus_drain5": 0.0}
    interval = EventBus().drain_interval
    micro = [1]

    def train(n: int, bus: Any) -> list[float]:
        pc = time.perf_counter
        out = []
        k = micro[0]
        for i in range(n):
            t0 = pc()
            opt.zero_grad(set_to_none=True)
            for _ in range(k):  # gradient accumulation over k micro-batches
                loss = loss_fn(model(x), y)
                loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            if bus is not None:
                bus.publish(StepEnded(step=i, samples=64 * k))
            out.append(pc() - t0)
        return out[WARMUP_STEPS:]

    def no_bus(b: int) -> list[float]:
        return train(steps, None)

    def with_bus(b: int, drain_interval: float = interval, key: str = "bus") -> list[float]:
        bus = EventBus(drain_interval=drain_interval)
        for _ in range(4):
            bus.subscribe(_Noop())
        with bus:
            c0 = _other_threads_cpu_s()
            out = train(steps, bus)
            cpu[key] += _other_threads_cpu_s() - c0
            forced[0] += bus.stats().wakeups  # before close(), which wakes the thread itself
        return out

    def with_bus_drain5(b: int) -> list[float]:
        return with_bus(b, 0.005, "bus_drain5")

    try:
        train(WARMUP_STEPS + 100, None)  # warm-up
        for _ in range(4):  # calibrate: micro-batches per step for a ~2 ms step (p50)
            p50 = sorted(train(WARMUP_STEPS + 100, None))[50]
            if p50 >= 0.9 * target_step_s:
                break
            micro[0] = max(micro[0] + 1, math.ceil(micro[0] * target_step_s / p50))
        per_block = interleave_blocks(
            {"none": no_bus, "bus": with_bus, "bus_drain5": with_bus_drain5}, blocks=blocks
        )
    finally:
        torch.set_num_threads(prev_threads)
    none, bus = summarize(flatten(per_block["none"])), summarize(flatten(per_block["bus"]))
    d5 = summarize(flatten(per_block["bus_drain5"]))
    n_steps = blocks * steps
    return {
        "wakeups.none_p50_ms": round(none["p50"] * 1e3, 4),
        "wakeups.none_p99_ms": round(none["p99"] * 1e3, 4),
        "wakeups.bus_p50_ms": round(bus["p50"] * 1e3, 4),
        "wakeups.bus_p99_ms": round(bus["p99"] * 1e3, 4),
        "wakeups.p50_inflation": round(inflation(bus["p50"], none["p50"]), 4),
        "wakeups.p99_inflation": round(inflation(bus["p99"], none["p99"]), 4),
        "wakeups.p50_inflation_blockwise": round(
            blockwise_inflation(per_block["bus"], per_block["none"]), 4
        ),
        "wakeups.forced_wakeups": forced[0],
        "wakeups.drain_interval_ms": interval * 1e3,
        "wakeups.steps_per_variant": int(none["n"]),
        "wakeups.micro_batches_per_step": micro[0],
        # What the bus thread itself ran per step (CPU, on the other core, GIL included).
        "wakeups.bus_side_cpu_us_per_step": round(cpu["bus"] / n_steps * 1e6, 1),
        # The same with drain_interval=0.005 instead of the default: 4x more timer wakes.
        "wakeups.bus_drain5_p50_ms": round(d5["p50"] * 1e3, 4),
        "wakeups.bus_drain5_p50_inflation": round(inflation(d5["p50"], none["p50"]), 4),
        "wakeups.bus_drain5_p50_inflation_blockwise": round(
            blockwise_inflation(per_block["bus_drain5"], per_block["none"]), 4
        ),
        "wakeups.bus_drain5_bus_side_cpu_us_per_step": round(cpu["bus_drain5"] / n_steps * 1e6, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    print(json.dumps(run(a.quick), indent=1))


if __name__ == "__main__":
    main()
