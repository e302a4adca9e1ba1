"""The run log the bridge tests read back: JSONL written by `JsonlWriter`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from eventbus import Event, EventBus
from eventbus.codec import decode
from eventbus.sinks import JsonlWriter


def attach_log(bus: EventBus, directory: Path) -> Callable[[], list[Event]]:
    """Subscribe a `JsonlWriter`; the returned function reads its file (after close)."""
    bus.subscribe(JsonlWriter(directory))

    def read() -> list[Event]:
        out: list[Event] = []
        for path in sorted(directory.glob("*.jsonl")):
            for line in path.read_bytes().splitlines():
                ev = decode(line)
                if ev is not None:
                    out.append(ev)
        assert out, f"no events in {directory}"
        return out

    return read


def of(events: list[Event], cls: type[Event]) -> list[Any]:
    """The events of exactly type `cls`, in log order."""
    return [e for e in events if type(e) is cls]
