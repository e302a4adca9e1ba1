"""After `os.fork` (a DataLoader worker), each bus in the child is made inert at once."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable

__all__ = ["call_after_fork"]

_CALLBACKS: list[weakref.WeakMethod[Callable[[], None]]] = []


def call_after_fork(method: Callable[[], None]) -> None:
    """Call this bound method in a forked child (held weakly: a collected bus is skipped)."""
    _CALLBACKS[:] = [ref for ref in _CALLBACKS if ref() is not None]
    _CALLBACKS.append(weakref.WeakMethod(method))


def _in_child() -> None:
    for ref in list(_CALLBACKS):
        fn = ref()
        if fn is not None:
            fn()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)
