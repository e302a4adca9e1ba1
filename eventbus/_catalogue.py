"""Renders the event catalogue (docs/events.md) from the classes themselves.

    python -m eventbus._catalogue > docs/events.md

A test compares the committed file with this rendering, so the docs cannot drift.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any

from eventbus import events

_BASE = ("step", "ts", "seq", "rank")


def _type_name(hint: Any) -> str:
    text = str(hint) if not isinstance(hint, type) else hint.__name__
    return text.replace("typing.", "").replace("eventbus.events.", "").replace("NoneType", "None")


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return repr(f.default_factory())
    return "required"


_ORDER = (
    "RunStarted",
    "RunEnded",
    "EpochStarted",
    "EpochEnded",
    "StepStarted",
    "StepEnded",
    "ForwardEnded",
    "BackwardEnded",
    "OptimizerStepped",
    "Loss",
    "Scalars",
    "EvalEnded",
    "CheckpointSaved",
    "CheckpointLoaded",
    "MemorySample",
    "MemoryLeakSuspected",
    "MemorySnapshotSaved",
    "TimeEstimate",
    "StallDetected",
    "StallEnded",
    "ProfileSaved",
    "TensorStats",
    "TensorLayout",
    "DivergenceDetected",
    "StopRequested",
    "SaveRequested",
    "BusCost",
)


def catalogue() -> list[type[events.Event]]:
    """The built-in event classes: lifecycle order first, then any others by name."""
    found = {
        name: obj
        for name in events.__all__
        if isinstance(obj := getattr(events, name), type)
        and issubclass(obj, events.Event)
        and obj is not events.Event
        and getattr(obj, "catalogue", True)
    }
    ordered = [found.pop(n) for n in _ORDER if n in found]
    return ordered + [found[n] for n in sorted(found)]


def render_markdown() -> str:
    """The whole of docs/events.md."""
    lines = [
        "# Event catalogue",
        "",
        "Generated from `eventbus/events.py` by `python -m eventbus._catalogue`; a test keeps",
        "this file and the code in step. Every event also has the base fields of `Event`:",
        "`step` (int or None), `ts` (wall clock, ns, stamped at publish if unset), `seq` (the",
        "bus's counter, stamped at publish: gaps prove loss) and `rank` (stamped). Fields typed",
        "`Number` accept a float, an int or a tensor: tensors are captured without a device",
        "sync and reach subscribers as plain numbers (CPU tensors if not scalar).",
        "",
        "Subscribe to a base class to receive its subclasses: `events=[Event]` gets everything.",
        "User events subclass `Event` (`@dataclass(slots=True, kw_only=True)`) and register",
        "by class name, so JSONL logs and `replay` rebuild them.",
        "",
    ]
    for cls in catalogue():
        hints = typing.get_type_hints(cls)
        doc = inspect.cleandoc(cls.__doc__ or "").replace("\n", " ")
        lines += [f"## `{cls.__name__}`", "", doc, ""]
        own = [f for f in dataclasses.fields(cls) if f.name not in _BASE]
        if own:
            lines += ["| field | type | default |", "|---|---|---|"]
            for f in own:
                t = (
                    "Number"
                    if hints.get(f.name) is Any and f.name != "histogram"
                    else _type_name(hints.get(f.name, Any))
                )
                cells = (f.name, t, _default(f))
                lines.append("| " + " | ".join(f"`{c}`".replace("|", "\\|") for c in cells) + " |")
            lines.append("")
        else:
            lines += ["Only the base fields.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_markdown(), end="")
