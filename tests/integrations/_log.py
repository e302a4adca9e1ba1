"""The event log the bridge tests read: JSONL through `JsonlWriter` once it exists."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from eventbus import Event, EventBus
from eventbus.codec import decode


class Recorder:
    """A lossless subscriber keeping every event (the fallback before JsonlWriter landed)."""

    policy = "block"

    def __init__(self) -> None:
        self.got: list[Event] = []

    async def on_events(self, batch: list[Event]) -> None:
        self.got.extend(batch)


def attach_log(bus: EventBus, directory: Path) -> Callable[[], list[Event]]:
    """Subscribe the run log; the returned function reads it back (after `bus.close()`)."""
    try:
        from eventbus.sinks import JsonlWriter  # type: ignore[attr-defined]
    except ImportError:
        rec = Recorder()
        bus.subscribe(rec)
        return lambda: list(rec.got)
    bus.subscribe(JsonlWriter(directory))

    def read() -> list[Event]:
        out: list[Any] = []
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
