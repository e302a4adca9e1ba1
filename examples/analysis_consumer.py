"""A user-written async analysis consumer with its own event type.

It watches the gradient-noise ratio (the variance of the loss over a window relative to its
mean) on the bus thread and publishes its own `LossNoise` events, which land in the JSONL log
like any built-in event and are rebuilt by `eventbus replay` through the type registry.

    .venv/bin/python examples/analysis_consumer.py [--quick] [--out runs/analysis]
"""

from __future__ import annotations

import argparse
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from eventbus import Event, EventBus, Subscriber
from eventbus.events import Loss, RunStarted
from eventbus.sinks import JsonlWriter


@dataclass(slots=True, kw_only=True)
class LossNoise(Event):
    """Relative spread of the training loss over the last `window` steps."""

    window: int
    mean: float
    cv: float  # coefficient of variation: stdev / mean


class LossNoiseMonitor(Subscriber):
    """Publishes `LossNoise` every `every` steps; runs on the bus thread, never the loop's."""

    events = (Loss,)
    policy = "drop_oldest"  # analysis may skip an event under load; training never waits

    def __init__(self, window: int = 50, every: int = 25) -> None:
        self.values: deque[float] = deque(maxlen=window)
        self.every = every
        self.bus: Any = None

    def on_start(self, bus: Any) -> None:
        self.bus = bus

    async def on_events(self, batch: list[Event]) -> None:
        for ev in batch:
            assert isinstance(ev, Loss)
            self.values.append(ev.value)  # a float: the bus resolved the tensor
            if ev.step is not None and ev.step % self.every == 0 and len(self.values) > 2:
                mean = statistics.fmean(self.values)
                cv = statistics.stdev(self.values) / mean if mean else float("nan")
                self.bus.publish(LossNoise(step=ev.step, window=len(self.values), mean=mean, cv=cv))


def main(argv: list[str] | None = None) -> None:
    args = argparse.ArgumentParser(description=__doc__)
    args.add_argument("--quick", action="store_true")
    args.add_argument("--out", default="runs/analysis")
    opts = args.parse_args(argv)
    steps = 60 if opts.quick else 400

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(1024, 8)
    y = x @ torch.arange(1.0, 9.0).unsqueeze(1)

    bus = EventBus()
    bus.subscribe(JsonlWriter(opts.out, overwrite=True))
    monitor = LossNoiseMonitor()
    bus.subscribe(monitor)
    noise: list[LossNoise] = []
    bus.subscribe(noise.append, events=[LossNoise], policy="block")  # a plain function
    with bus:  # a run: RunStarted here, RunEnded (completed, or why not) when it closes
        bus.publish(RunStarted(config={"lr": 0.05, "batch": 32}, total_steps=steps))
        for step in range(1, steps + 1):
            idx = torch.randint(0, len(x), (32,))
            loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            bus.publish(Loss(step=step, value=loss))
    for ev in noise:
        print(f"step {ev.step:4d}  mean loss {ev.mean:9.4f}  cv {ev.cv:.3f}")
    print(f"wrote {opts.out}/events.jsonl ({len(noise)} LossNoise events among them)")


if __name__ == "__main__":
    main()
