"""A small real training run recorded with JsonlWriter: the input of replay/CLI tests."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from eventbus import EventBus
from eventbus.events import (
    DivergenceDetected,
    Loss,
    MemorySample,
    OptimizerStepped,
    RunEnded,
    RunStarted,
    StepEnded,
)
from eventbus.sinks import JsonlWriter


def record_demo_run(
    directory: Path,
    *,
    steps: int = 60,
    blow_up_at: int | None = 40,
    rank: int = 0,
    world_size: int = 1,
    mark_divergence: bool = False,
) -> Path:
    """Train a tiny regression with SGD; at `blow_up_at` the lr jumps x1e4 so the loss
    diverges (inf, then NaN). Returns the JSONL file written."""
    torch.manual_seed(rank)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(256, 8)
    y = x @ torch.randn(8, 1) + 0.1 * torch.randn(256, 1)
    writer = JsonlWriter(directory)
    bus = EventBus(rank=rank, world_size=world_size, drain_interval=0.002)
    bus.subscribe(writer)
    with bus:
        bus.publish(
            RunStarted(
                config={"lr": 0.05, "model": "linear"}, total_steps=steps, world_size=world_size
            )
        )
        for step in range(1, steps + 1):
            if blow_up_at is not None and step == blow_up_at:
                for g in opt.param_groups:
                    g["lr"] = 500.0
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)
            opt.step()
            bus.publish(Loss(step=step, value=loss.detach()))
            bus.publish(OptimizerStepped(step=step, lr=opt.param_groups[0]["lr"], grad_norm=gn))
            bus.publish(StepEnded(step=step, duration_s=0.01 + 0.001 * (step % 3), samples=256))
            bus.publish(MemorySample(step=step, rss_mb=100.0 + step, phase="step"))
            if mark_divergence and blow_up_at is not None and step == blow_up_at + 1:
                bus.publish(
                    DivergenceDetected(
                        step=step, metric="loss", value=float(loss), baseline=1.0, reason="recorded"
                    )
                )
        bus.publish(RunEnded(status="completed"))
    return writer.path
