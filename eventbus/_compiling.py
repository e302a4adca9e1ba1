"""`compiling()`: False when code runs, True while torch.compile traces it.

`EventBus.publish` asks it first. Run eagerly it costs one call (~25 ns); `eventbus._torch_ops`
tells dynamo to read it as True, so a traced publish takes the graph-safe path instead.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["TRACED", "compiling", "teach_torch", "traced_publish"]

TRACED: list[Callable[[Any, Any], None]] = []
"""The traced publish, put here by `eventbus._torch_ops` (which needs torch) when imported."""


def compiling() -> bool:
    """False; inside a torch.compile trace, True (once `eventbus._torch_ops` is imported)."""
    return False


def traced_publish(bus: Any, ev: Any) -> None:
    """What a traced `bus.publish(ev)` becomes: one ordered op (`eventbus._torch_ops`)."""
    TRACED[0](bus, ev)


def teach_torch() -> None:
    """Register the traced publish with torch.compile if torch is imported (bus init, start)."""
    if not TRACED and "torch" in sys.modules:
        importlib.import_module("eventbus._torch_ops")
