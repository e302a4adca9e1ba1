"""`LogRelay`: the sidecar's `eventbus` log records, held for the parent to log as its own."""

from __future__ import annotations

import contextlib
import logging
import threading

from eventbus.log import LOGGER_NAME

__all__ = ["LogRelay"]


class LogRelay(logging.Handler):
    """The sidecar's `eventbus` log records, held for the parent, which logs them as its own
    (its handlers, levels and structlog configuration decide what a person sees)."""

    def __init__(self, wake: threading.Event) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[int, str]] = []
        self._wake = wake

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.records.append((record.levelno, record.getMessage()))
            self._wake.set()

    def take(self) -> list[tuple[int, str]]:
        out, self.records = self.records, []
        return out

    def install(self) -> None:
        log = logging.getLogger(LOGGER_NAME)
        log.addHandler(self)
        log.setLevel(logging.INFO)
        log.propagate = False  # the parent shows them: nothing printed here
