"""What both trainer bridges share: the missing-framework error, config cleaning, stop checks."""

from __future__ import annotations

import enum
import numbers
from collections.abc import Mapping
from typing import Any

from eventbus.bus import EventBus

__all__ = ["jsonable", "metric", "missing_framework", "numeric_items", "stop_state"]

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


def metric(v: Any) -> Any:
    """`v` as a metric event carries it, or None when it is not a number (bools are not).

    Tensors and Python numbers pass unchanged (a tensor is captured at publish, never read
    here); NumPy scalars become Python numbers (host memory: no device involved).
    """
    if isinstance(v, bool):
        return None
    if type(v) is int or type(v) is float or (hasattr(v, "device") and hasattr(v, "numel")):
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)
    return None


def numeric_items(values: Mapping[Any, Any], skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The numeric entries of `values` (see `metric`), keys as strings, `skip` left out."""
    out = {}
    for k, v in values.items():
        if k not in skip and (m := metric(v)) is not None:
            out[str(k)] = m
    return out


def stop_state(bus: EventBus) -> tuple[bool, bool]:
    """(should stop, should abort), read once each; cheap outside distributed runs."""
    stop = bus.should_stop
    return stop, (stop and bus.should_abort)
