"""The run log the bridge tests read back: JSONL written by `JsonlWriter`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from eventbus import Event, EventBus
from eventbus.logformat import read_log
from eventbus.sinks import JsonlWriter


def attach_log(bus: EventBus, directory: Path) -> Callable[[], list[Event]]:
    """Subscribe a `JsonlWriter`; the returned function reads its file (after close)."""
    bus.subscribe(JsonlWriter(directory))

    def read() -> list[Event]:
        out = list(read_log(sorted(directory.glob("*.jsonl"))))
        assert out, f"no events in {directory}"
        return out

    return read


def of(events: list[Event], cls: type[Event]) -> list[Any]:
    """The events of exactly type `cls`, in log order."""
    return [e for e in events if type(e) is cls]


def run_example(name: str, out: Path) -> list[Event]:
    """Run `examples/<name>` in quick mode in this process; the events it logged."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "examples" / name
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--quick", "--out", str(out)])
    return list(read_log(out / "events.jsonl"))
