"""The smallest useful instrumented loop: JSONL log, divergence stop, progress, zero syncs.

.venv/bin/python examples/custom_loop.py [--quick] [--out runs/custom]
"""

from __future__ import annotations

import argparse

import torch

from eventbus import EventBus
from eventbus.events import Loss, RunEnded, RunStarted
from eventbus.monitors import DivergenceDetector
from eventbus.sinks import ConsoleProgress, JsonlWriter


def main(argv: list[str] | None = None) -> None:
    args = argparse.ArgumentParser(description=__doc__)
    args.add_argument("--quick", action="store_true", help="a few dozen steps")
    args.add_argument("--out", default="runs/custom", help="directory for events.jsonl")
    opts = args.parse_args(argv)
    steps = 40 if opts.quick else 500

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randn(4096, 16)
    y = torch.sin(x[:, :4]).sum(dim=1, keepdim=True)

    bus = EventBus()
    bus.subscribe(JsonlWriter(opts.out, overwrite=True))  # lossless: every line on disk
    bus.subscribe(DivergenceDetector(action="stop"))  # NaN at once, a blow-up in ~3 steps
    bus.subscribe(ConsoleProgress(total=steps))  # step, loss, steps/s, ETA
    with bus:
        bus.publish(RunStarted(config={"lr": 3e-3, "steps": steps}, total_steps=steps))
        for step in range(1, steps + 1):
            with bus.step(step, samples=64):  # StepStarted / StepEnded(duration)
                idx = torch.randint(0, len(x), (64,))
                loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                with bus.phase("optimizer") as ph:  # OptimizerStepped(lr, grad_norm)
                    ph.set(
                        grad_norm=torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0),
                        lr=opt.param_groups[0]["lr"],
                    )
                    opt.step()
                bus.publish(Loss(step=step, value=loss))  # a tensor: no .item(), no sync
            if bus.should_stop:  # the detector asked us to stop
                break
        bus.publish(RunEnded(step=step, status="stopped" if bus.should_stop else "completed"))
    print(f"wrote {opts.out}/events.jsonl; try: eventbus summary {opts.out}/events.jsonl")


if __name__ == "__main__":
    main()
