"""Subscribers' state for checkpoints: each one's `state_dict()`, by its unique name."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from eventbus.core.delivery import Delivery

__all__ = ["load_states", "states"]


def states(deliveries: Iterable[Delivery]) -> dict[str, Any]:
    """Every subscriber's `state_dict()` that has one, by name."""
    return {
        d.name: d.sub.state_dict()
        for d in deliveries
        if callable(getattr(d.sub, "state_dict", None))
    }


def load_states(deliveries: Iterable[Delivery], state: dict[str, Any]) -> None:
    """Hand each subscriber its part; a name this bus does not have is a clear KeyError."""
    known = {d.name: d for d in deliveries if d.sub is not None}  # removed ones: no state
    for name, part in state.items():
        d = known.get(name)
        if d is None:
            raise KeyError(f"no subscriber named {name!r} on this bus; have {sorted(known)}")
        d.sub.load_state_dict(part)
