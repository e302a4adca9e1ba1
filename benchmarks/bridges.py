"""What a bridge adds to each training step: its hooks called as the trainer calls them.

    .venv/bin/python -m benchmarks.bridges [--steps 20000]

Calls the HF bridge's per-step hooks (step begin, pre/post optimizer step, step end, log)
and the Lightning bridge's (batch start, before optimizer step, batch end) directly, with the
objects the trainers pass, on a running bus with one lossless subscriber. The trainers' own
dispatch (HF ~7.6 us, Lightning ~25 us per hook with 4 callbacks: docs/performance.md) is
not included.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace
from typing import Any

import torch

from eventbus import Event, EventBus


class _Count:
    policy = "block"

    def __init__(self) -> None:
        self.n = 0

    async def on_events(self, batch: list[Event]) -> None:
        self.n += len(batch)


def _hf(bus: EventBus, steps: int) -> float:
    from eventbus.integrations.transformers import EventBusCallback

    cb = EventBusCallback(bus)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    args: Any = SimpleNamespace(per_device_train_batch_size=8, gradient_accumulation_steps=1)
    state: Any = SimpleNamespace(global_step=0, num_input_tokens_seen=0)
    control: Any = SimpleNamespace(
        should_training_stop=False, should_save=False, should_evaluate=False
    )
    t0 = time.perf_counter_ns()
    for k in range(steps):
        cb.on_step_begin(args, state, control)
        cb.on_pre_optimizer_step(args, state, control)
        cb.on_optimizer_step(args, state, control, optimizer=opt)
        state.global_step = k + 1
        cb.on_step_end(args, state, control)
        cb.on_log(
            args,
            state,
            control,
            logs={"loss": 1.0, "grad_norm": 0.5, "learning_rate": 0.1, "epoch": 0.1},
        )
    return (time.perf_counter_ns() - t0) / steps / 1000


def _lightning(bus: EventBus, steps: int) -> float:
    from eventbus.integrations.lightning import EventBusCallback

    cb = EventBusCallback(bus)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    trainer: Any = SimpleNamespace(global_step=0, should_stop=False)
    batch = (torch.zeros(8, 4), torch.zeros(8, 1))
    out = {"loss": torch.tensor(1.0)}
    t0 = time.perf_counter_ns()
    for k in range(steps):
        cb.on_train_batch_start(trainer, None, batch, k)
        cb.on_before_optimizer_step(trainer, None, opt)
        trainer.global_step = k + 1
        cb.on_train_batch_end(trainer, None, out, batch, k)
    return (time.perf_counter_ns() - t0) / steps / 1000


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--repeats", type=int, default=5)
    opts = p.parse_args(argv)
    results: dict[str, list[float]] = {"transformers": [], "lightning": []}
    for _ in range(opts.repeats):
        for name, fn in (("transformers", _hf), ("lightning", _lightning)):
            bus = EventBus()
            sub = _Count()
            bus.subscribe(sub)
            with bus:
                results[name].append(fn(bus, opts.steps))
    for name, us in results.items():
        print(
            f"{name:13s} bridge hooks per step: median {statistics.median(us):6.1f} us "
            f"(min {min(us):.1f}, max {max(us):.1f}; {opts.steps} steps x {opts.repeats})"
        )


if __name__ == "__main__":
    main()
