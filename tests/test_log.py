"""Diagnostics: structlog under the `eventbus` name, through stdlib logging unless configured."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog

from eventbus.log import LOGGER_NAME, RateLimiter, get_logger


@pytest.fixture
def unconfigured() -> Iterator[None]:
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


def test_unconfigured_structlog_goes_to_the_eventbus_stdlib_logger(
    unconfigured: None, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    assert not structlog.is_configured()
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        get_logger().warning("subscriber failed", subscriber="x", event_type="Loss")
    rec = [r for r in caplog.records if r.name == LOGGER_NAME]
    assert rec and "subscriber failed" in rec[0].getMessage() and "Loss" in rec[0].getMessage()
    assert capsys.readouterr().out == ""  # nothing printed to stdout by the library
    assert logging.getLogger(LOGGER_NAME).handlers == []  # no handler installed


def test_configured_structlog_is_respected() -> None:
    with structlog.testing.capture_logs() as logs:
        get_logger().info("hello", k=1)
    assert logs == [{"event": "hello", "k": 1, "log_level": "info"}]


def test_rate_limiter_holds_back_and_counts() -> None:
    rl = RateLimiter(interval=60)
    assert rl.allow("k") == (True, 0)
    assert rl.allow("k") == (False, 0)
    assert rl.allow("k") == (False, 0)
    assert rl.allow("other") == (True, 0)
    rl._last["k"] -= 120  # as if a minute passed
    assert rl.allow("k") == (True, 2)


def test_the_rate_limiter_may_be_re_entered_on_the_same_thread() -> None:
    """A warning from a signal handler's publish may come while the interrupted code was
    inside `allow`: reentrant, not a deadlock."""
    import threading

    rl = RateLimiter(interval=60)
    done = threading.Event()

    def interrupted() -> None:
        with rl._lock:
            rl.allow("k")
        done.set()

    threading.Thread(target=interrupted, daemon=True).start()
    assert done.wait(10), "the rate limiter deadlocked when re-entered"
