"""Shared fixtures: a started bus that is always closed, and a recording subscriber."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import structlog

from eventbus import Event, EventBus


@pytest.fixture(autouse=True)
def _structlog_unconfigured() -> Iterator[None]:
    """Each test starts with structlog unconfigured (capture_logs leaves it "configured"),
    so eventbus logs through stdlib logging, where caplog sees them."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


class Recorder:
    """A lossless async subscriber that keeps every event it receives."""

    policy = "block"

    def __init__(self, events: Any = None) -> None:
        self.got: list[Event] = []
        if events is not None:
            self.events = events

    async def on_events(self, batch: list[Event]) -> None:
        self.got.extend(batch)


@pytest.fixture
def bus() -> Iterator[EventBus]:
    b = EventBus(drain_interval=0.002, close_timeout=10)
    try:
        yield b
    finally:
        b.close(timeout=5)


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@dataclass(slots=True, kw_only=True)
class Ratio(Event):
    """A user event with a field its `__post_init__` computes (`init=False`): rebuilt from its
    fields (the wire, a log, a compiled publish), `__init__` refuses a value for that one."""

    num: Any = 0.0
    den: float = 1.0
    ratio: Any = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.ratio = self.num / self.den
