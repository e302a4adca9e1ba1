"""What both trainer bridges share: the missing-framework error, config cleaning, stop checks."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from eventbus.bus import EventBus

__all__ = ["is_number", "jsonable", "missing_framework", "stop_state"]

_SCALARS = (str, int, float, bool, type(None))


def missing_framework(bridge: str, package: str, extra: str, err: ImportError) -> ImportError:
    """The one-line error raised when a bridge's framework cannot be imported."""
    return ImportError(
        f"eventbus.integrations.{bridge} needs {package} ({err}); "
        f"install it with: pip install 'eventbus[{extra}]'"
    )


def jsonable(v: Any, *, _depth: int = 0) -> Any:
    """`v` made of JSON types only (for `RunStarted.config`): unknown objects become strings."""
    if isinstance(v, enum.Enum):
        v = v.value
    if isinstance(v, _SCALARS):
        return v
    if _depth > 8:
        return repr(v)
    if isinstance(v, Mapping):
        return {str(k): jsonable(x, _depth=_depth + 1) for k, x in v.items()}
    if isinstance(v, list | tuple | set | frozenset):
        return [jsonable(x, _depth=_depth + 1) for x in v]
    if hasattr(v, "device") and hasattr(v, "numel"):
        return repr(v)  # a tensor in a config: its repr, never a device read
    return str(v)


def is_number(v: Any) -> bool:
    """True for ints, floats and tensors (values a metric event may carry); False for bools."""
    if isinstance(v, bool):
        return False
    if isinstance(v, int | float):
        return True
    return hasattr(v, "device") and hasattr(v, "numel")


def stop_state(bus: EventBus) -> tuple[bool, bool]:
    """(should stop, should abort), read once each; cheap outside distributed runs."""
    stop = bus.should_stop
    return stop, (stop and bus.should_abort)
