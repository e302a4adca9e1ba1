"""A CUDA training step for `eventbus bench`: an MLP whose loss and grad norm are published as
device tensors (no `.item()`), so the bench's sync pass shows what each variant syncs.

    eventbus bench benchmarks/cuda_step.py:step -s jsonl:/tmp/run divergence memory

`STEP_DEVICE=cpu` runs it on the CPU (for a check without a GPU).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from eventbus.events import Loss, OptimizerStepped

__all__ = ["step"]

torch.manual_seed(0)
_DEV = torch.device(os.environ.get("STEP_DEVICE", "cuda"))
_MODEL = torch.nn.Sequential(
    torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
).to(_DEV)
_OPT = torch.optim.AdamW(_MODEL.parameters(), lr=1e-3, fused=_DEV.type == "cuda")
_X = torch.randn(256, 1024, device=_DEV)


def step(n: int, bus: Any) -> None:
    """One training step; publishes `Loss` and `OptimizerStepped` with tensor values."""
    loss = _MODEL(_X).pow(2).mean()
    loss.backward()  # type: ignore[no-untyped-call]
    norm = torch.nn.utils.clip_grad_norm_(_MODEL.parameters(), 1.0)
    _OPT.step()
    _OPT.zero_grad(set_to_none=True)
    bus.publish(Loss(step=n, value=loss))
    bus.publish(OptimizerStepped(step=n, lr=1e-3, grad_norm=norm))
