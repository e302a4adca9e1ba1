"""The process's default bus, behind `get_bus()`, `set_bus()` and `register_global()`.

Cerebras-style registration: code that cannot pass a bus around attaches subscribers to the
process's default bus, which starts on first use and drains at interpreter exit. This is the
only global a user sees; other process-wide state (the event-type registry, capture's pooled
CUDA events, the live buses that fork and exit hooks reach) stays with the module that owns it.
"""

from __future__ import annotations

import threading
from typing import Any

from eventbus.bus import EventBus, Subscription

__all__ = ["get_bus", "register_global", "set_bus"]

_lock = threading.Lock()
_default: EventBus | None = None


def get_bus() -> EventBus:
    """The process's default bus, created and started on first use."""
    global _default
    with _lock:
        if _default is None or not (_default.running or _default._state == "new"):
            _default = EventBus(name="eventbus-default")
        bus = _default
    if not bus.running:
        bus.start()
    return bus


def set_bus(bus: EventBus | None) -> EventBus | None:
    """Make `bus` the default (None: a fresh one on next use); returns the previous one."""
    global _default
    with _lock:
        old, _default = _default, bus
    return old


def register_global(sub: Any, **options: Any) -> Subscription:
    """Subscribe `sub` to the default bus; the handle's `.remove()` detaches it."""
    return get_bus().subscribe(sub, **options)
