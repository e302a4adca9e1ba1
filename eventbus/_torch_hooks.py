"""What `watch()` and `instrument()` share: running code after backward, finding output tensors.

Both hook a model from the training thread; nothing here reads a device value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["leaves", "queue_after_backward", "resolve_bus"]


def queue_after_backward(fn: Callable[[], None]) -> None:
    """Run `fn` when the running backward pass ends (as DDP does); at once if none runs."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(fn)
    except RuntimeError:  # not inside a backward pass (a hook called by hand)
        fn()


def leaves(out: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors in a module output with names: `prefix` for the first, suffixed for the rest."""
    found = 0

    def walk(v: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal found
        if isinstance(v, torch.Tensor):
            found += 1
            yield (prefix if found == 1 else path), v
        elif isinstance(v, dict):
            for k, x in v.items():
                yield from walk(x, f"{path}.{k}")
        elif isinstance(v, list | tuple):
            for i, x in enumerate(v):
                yield from walk(x, f"{path}[{i}]")

    yield from walk(out, prefix)


def resolve_bus(bus: Any) -> Any:
    """`bus`, checked; the default bus (`eventbus.get_bus()`) for None."""
    if bus is None:
        from eventbus._globals import get_bus

        return get_bus()
    if not callable(getattr(bus, "publish", None)):
        raise TypeError(f"bus must be an EventBus; got {type(bus).__qualname__}")
    return bus
