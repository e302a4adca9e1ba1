"""A bus factory for process-placement tests: every bus made is closed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from eventbus import EventBus


@pytest.fixture
def new_bus() -> Iterator[Callable[..., EventBus]]:
    made: list[EventBus] = []

    def make(**kw: Any) -> EventBus:
        b = EventBus(drain_interval=0.002, close_timeout=20, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close(timeout=5)
