"""A small training loop on CPU publishing onto the bus (grown by later issues)."""

from __future__ import annotations

import torch

from eventbus import Event, EventBus
from eventbus.events import Loss, RunEnded, RunStarted, StepEnded


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(512, 16)
    y = x.sum(dim=1, keepdim=True)

    def show(ev: Event) -> None:
        if isinstance(ev, Loss) and ev.step is not None and ev.step % 50 == 0:
            print(f"step {ev.step:4d}  loss {ev.value:.4f}")

    bus = EventBus()
    bus.subscribe(show, events=[Loss], policy="block")
    with bus:
        bus.publish(RunStarted(config={"lr": 0.05}, total_steps=300))
        for step in range(1, 301):
            idx = torch.randint(0, 512, (32,))
            loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            bus.publish(Loss(step=step, value=loss))  # a tensor: captured, never .item()
            bus.publish(StepEnded(step=step, samples=32))
        bus.publish(RunEnded(step=300))
    print(bus.stats().subscribers["main.<locals>.show"])


if __name__ == "__main__":
    main()
