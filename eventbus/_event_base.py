"""The `Event` base and the name registry: what every event class is built on.

Part of `eventbus.events` (which re-exports it); imports nothing of ours. Split from it so that
the catalogue and the machinery each stay readable.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from dataclasses import dataclass
from typing import Any

__all__ = ["Event", "Number", "event_fields", "event_type", "rebuild", "registered_types"]

# Type name -> class. Filled by `Event.__init_subclass__`, so user subclasses register
# themselves on definition; `replay` rebuilds them by name and never imports anything.
_REGISTRY: dict[str, type[Event]] = {}

Number = Any
"""A float, an int, or a tensor (captured at publish; subscribers see a float)."""


@dataclass(slots=True, kw_only=True)
class Event:
    """Base of every event. `ts` (ns, wall clock), `seq` and `rank` are stamped at publish."""

    step: int | None = None
    ts: int | None = None
    seq: int | None = None
    rank: int | None = None

    def __init_subclass__(cls) -> None:
        # No zero-argument super() here: `slots=True` re-creates the class, which breaks it.
        _register(cls)


def _register(cls: type[Event]) -> None:
    name = cls.__name__
    old = _REGISTRY.get(name)
    # `@dataclass(slots=True)` re-creates the class (with a provisional qualname), and
    # notebooks re-run cells: a class from the same module replaces the old one silently.
    if old is not None and old.__module__ != cls.__module__:
        warnings.warn(
            f"event type name {name!r} is defined by both {old.__module__}.{old.__qualname__} "
            f"and {cls.__module__}.{cls.__qualname__}; JSONL logs and replay will use the "
            "latter. Rename one of them.",
            RuntimeWarning,
            stacklevel=3,
        )
    _REGISTRY[name] = cls


def event_type(name: str) -> type[Event] | None:
    """The registered event class called `name`, or None."""
    return _REGISTRY.get(name)


def registered_types() -> dict[str, type[Event]]:
    """A copy of the registry: type name -> event class."""
    return dict(_REGISTRY)


def event_fields(cls: type) -> tuple[dataclasses.Field[Any], ...]:
    """The dataclass fields of an event class; `TypeError` if a subclass was not decorated.

    `__init_subclass__` runs before `@dataclass` can, so this check runs where a class is first
    published or encoded (the per-class caches call it once per class).
    """
    fields = dataclasses.fields(cls)
    known = {f.name for f in fields}
    if "type" in known:  # a log line's "type" is the class name: the field would replace it
        raise TypeError(
            f"{cls.__qualname__} has a field named 'type', which would overwrite the event "
            "type in its JSONL line (replayed as another class, or unknown): rename it "
            "(e.g. kind)"
        )
    for klass in cls.__mro__:
        if klass is Event or klass is object:
            break
        own = inspect.get_annotations(klass)
        lost = [n for n, a in own.items() if n not in known and "ClassVar" not in str(a)]
        if lost:
            raise TypeError(
                f"{klass.__qualname__} subclasses eventbus.Event but is not a dataclass, so its "
                f"fields {', '.join(lost)} would be lost: decorate it with "
                "@dataclass(slots=True, kw_only=True)"
            )
    return fields


_LATER: dict[type, frozenset[str]] = {}  # per class: the fields __init__ takes no value for


def rebuild(cls: type[Event], values: dict[str, Any]) -> Event:
    """`cls` from logged or sent field values, through `__init__` (its `__post_init__` runs);
    a field `__init__` takes no value for (`field(init=False)`) is set after, to its value."""
    later = _LATER.get(cls)
    if later is None:
        later = _LATER[cls] = frozenset(f.name for f in dataclasses.fields(cls) if not f.init)
    given = later.intersection(values)
    if not given:
        return cls(**values)
    ev = cls(**{k: v for k, v in values.items() if k not in given})
    for k in given:
        object.__setattr__(ev, k, values[k])
    return ev
