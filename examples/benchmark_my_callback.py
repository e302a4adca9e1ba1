"""Measure what your own subscriber costs your training loop (and what it would cost inline).

Replace `MySubscriber` and `train_step` with yours, then run:

    python examples/benchmark_my_callback.py            # ~1 minute
    python examples/benchmark_my_callback.py --quick    # a few seconds

It times every step in blocks that alternate between
  (a) no instrumentation,
  (b) your subscriber on the bus (what eventbus costs the loop: publishing + the GIL the
      bus side takes), and
  (c) your subscriber's work called inline on the training thread, as a callback would be,
and prints p50/p99 step time, the slowdown of (b) and (c) against (a), and the bus's view of
your subscriber: delivered, dropped, and how late it ran (latency). If (b) is slower than
you like and your subscriber is CPU-heavy Python, try `placement="process"`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from eventbus import Event, EventBus
from eventbus.events import Loss, StepEnded


class MySubscriber:
    """Your subscriber. This one keeps an exponential moving average of the loss and does
    ~0.2 ms of Python work per event: replace it with your own."""

    events = (Loss, StepEnded)
    policy = "drop_oldest"  # analysis may drop under pressure; use "block" for a sink

    def __init__(self) -> None:
        self.ema: float | None = None

    def handle(self, ev: Event) -> None:
        """The per-event work, shared by the bus path and the inline path."""
        if isinstance(ev, Loss):
            v = float(ev.value)  # on the bus: already a float; inline: a tensor -> .item()
            self.ema = v if self.ema is None else 0.98 * self.ema + 0.02 * v
            sum(i * i for i in range(2000))  # stand-in for real analysis work

    def on_events(self, batch: list[Event]) -> None:
        for ev in batch:
            self.handle(ev)


def make_train_step() -> Any:
    """Your training step. This one: a small MLP on CPU, a few ms per step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def train_step() -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        return loss.detach()

    return train_step


def run_block(
    mode: str, steps: int, train_step: Any, sub: MySubscriber, bus: EventBus | None
) -> list[float]:
    """Per-step wall times (s) of one block in `mode`: "none", "bus" or "inline"."""
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        loss = train_step()
        events = (Loss(step=step, value=loss), StepEnded(step=step, samples=64))
        if mode == "bus" and bus is not None:
            for ev in events:
                bus.publish(ev)  # a tensor value is captured, never .item() here
        elif mode == "inline":
            for ev in events:
                sub.handle(ev)  # float(tensor) here is the .item() a callback pays
        times.append(time.perf_counter() - t0)
    return times[3:]  # the first steps of a block warm caches up


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few seconds instead of ~a minute")
    p.add_argument("--blocks", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="steps per block")
    a = p.parse_args()
    blocks = a.blocks or (3 if a.quick else 12)
    steps = a.steps or (40 if a.quick else 300)
    torch.set_num_threads(1)  # leave a core to the bus, as a GPU job leaves the host cores

    train_step = make_train_step()
    run_block("none", 20, train_step, MySubscriber(), None)  # warm up
    times: dict[str, list[float]] = {"none": [], "bus": [], "inline": []}
    bus_sub = MySubscriber()
    bus = EventBus()
    handle = bus.subscribe(bus_sub, name="mine")
    modes = list(times)
    with bus:
        for b in range(blocks):
            k = b % len(modes)
            for mode in modes[k:] + modes[:k]:  # rotate the order: drift hits all alike
                times[mode] += run_block(mode, steps, train_step, MySubscriber(), bus)
                if mode == "bus":  # untimed: let the subscriber finish before the next block
                    bus.flush(timeout=60)
    st = handle.stats()

    base = statistics.median(times["none"])
    print(f"{'variant':8s} {'p50 ms':>8s} {'p99 ms':>8s} {'p50 slowdown':>13s}")
    for mode, values in times.items():
        p50 = statistics.median(values)
        print(
            f"{mode:8s} {p50 * 1e3:8.3f} {pct(values, 99) * 1e3:8.3f} "
            f"{(p50 / base - 1) * 100:+12.1f}%"
        )
    if st is not None:
        lat = (
            "n/a"
            if st.latency_p50_ms is None
            else (f"{st.latency_p50_ms:.2f} ms / p99 {st.latency_p99_ms or 0:.2f} ms")
        )
        print(
            f"\nyour subscriber on the bus: delivered {st.delivered}, dropped {st.dropped}, "
            f"failed {st.failed}, queue high-water {st.queue_high_water}, "
            f"latency (publish to handled) p50 {lat}"
        )
    print(
        "(the bus stays up through all blocks, flushed after each of its own: an idle bus\n"
        " thread wakes every few ms, which is part of what (b) is measured against)"
    )


if __name__ == "__main__":
    main()
