"""What the pieces of a CUDA scalar publish cost the calling thread (µs per call, p50 / p99).

One kernel launch, the ring write, a pinned non-blocking copy, an event record, and whole
`bus.publish` calls with a float and with a CUDA scalar, each timed per call (the device is
synchronised every 250 calls, untimed, so the launch queue never fills). On a GPU machine:

    python -m benchmarks.cuda_costs
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from eventbus import Event, EventBus
from eventbus.events import Loss

__all__ = ["run"]


class _Fast:
    """A subscriber that does nothing with its batch."""

    policy = "drop_oldest"

    async def on_events(self, batch: list[Event]) -> None:
        return None


def _per_call(fn: Callable[[], Any], calls: int = 3000) -> tuple[float, float]:
    """p50 and p99 of one call of `fn`, in µs."""
    xs = []
    for i in range(calls):
        if i % 250 == 0:
            torch.cuda.synchronize()  # benchmark only: an empty launch queue for every group
        t0 = time.perf_counter_ns()
        fn()
        xs.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    xs.sort()
    return xs[len(xs) // 2] / 1e3, xs[int(len(xs) * 0.99)] / 1e3


def run() -> dict[str, tuple[float, float]]:
    """{row: (p50 µs, p99 µs)}."""
    s = torch.tensor(0.5, device="cuda")
    a = torch.randn(16, device="cuda")
    slot = torch.empty(4096, device="cuda")[:1]
    pinned = torch.empty(1, pin_memory=True)
    ev = torch.cuda.Event()
    rows: dict[str, Callable[[], Any]] = {
        "one kernel launch (a.add_(1))": lambda: a.add_(1),
        "ring write (slot.copy_(s))": lambda: slot.copy_(s),
        "pinned non-blocking copy": lambda: pinned.copy_(s, non_blocking=True),
        "event record": ev.record,
        "s.detach()": s.detach,
    }
    out = {}
    with EventBus(drain_interval=0.005) as bus:
        bus.subscribe(_Fast())
        rows["publish(Loss(value=0.5))"] = lambda: bus.publish(Loss(step=1, value=0.5))
        rows["publish(Loss(value=cuda scalar))"] = lambda: bus.publish(Loss(step=1, value=s))
        for name, fn in rows.items():
            _per_call(fn, 500)  # warm-up
            out[name] = _per_call(fn)
            bus.flush(timeout=30)
    return out


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, (p50, p99) in run().items():
        print(f"{name:36s} p50 {p50:8.2f} µs   p99 {p99:8.2f} µs")


if __name__ == "__main__":
    main()
