"""Diagnostics through structlog under the `eventbus` logger name, printing nothing unasked.

If the application configured structlog, its configuration is used. Otherwise we wrap the
standard library's `logging.getLogger("eventbus")`, so nothing is installed, levels and
handlers are the application's, and `logging`'s own rules decide what a person sees.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import structlog

__all__ = ["RateLimiter", "get_logger"]

LOGGER_NAME = "eventbus"


def get_logger() -> Any:
    """The `eventbus` structlog logger (looked up per call: configuration may change)."""
    if structlog.is_configured():
        return structlog.get_logger(LOGGER_NAME)
    return structlog.wrap_logger(
        logging.getLogger(LOGGER_NAME),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.format_exc_info,
            structlog.processors.KeyValueRenderer(key_order=["event"], sort_keys=False),
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
    )


class RateLimiter:
    """At most one message per key every `interval` seconds; counts what it held back."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._last: dict[Any, float] = {}
        self._held: dict[Any, int] = {}
        self._lock = threading.RLock()  # reentrant: a warning from a signal handler's publish

    def allow(self, key: Any) -> tuple[bool, int]:
        """(whether to log now, how many were suppressed since the last one)."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval:
                self._held[key] = self._held.get(key, 0) + 1
                return False, 0
            self._last[key] = now
            return True, self._held.pop(key, 0)
