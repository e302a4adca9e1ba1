"""The sidecar's log relay: its records are held for the parent, taken once, and wake it."""

from __future__ import annotations

import logging
import threading

from eventbus.process.logrelay import LogRelay


def test_records_are_held_taken_once_and_wake_the_reporter() -> None:
    wake = threading.Event()
    relay = LogRelay(wake)
    log = logging.getLogger("eventbus.test-relay")
    log.addHandler(relay)
    try:
        log.error("lost %d events", 3)
        log.debug("below the relay's level")
    finally:
        log.removeHandler(relay)
    assert wake.is_set()
    assert relay.take() == [(logging.ERROR, "lost 3 events")]
    assert relay.take() == []
