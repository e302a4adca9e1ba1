"""How many bytes an event holds, estimated cheaply, for the inbox's and queues' byte bounds.

Only values that can be big are measured: strings, bytes, tensors and containers (walked up
to a budget, then extrapolated). Reading a tensor's size is host metadata: no device sync.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

from eventbus.capture import capturable_fields
from eventbus.events import Event

__all__ = [
    "NUMBERS",
    "QUICK",
    "checked_fields",
    "not_an_event",
    "published_twice",
    "quick_check",
    "sizeof_event",
    "sizeof_value",
]

NUMBERS: frozenset[type] = frozenset((int, float, bool, type(None)))
_BASE = 64  # an event object's own bytes, roughly
_WALK = 256  # items of a container measured before extrapolating
_DEPTH = 16
_CONTAINERS = frozenset((dict, list, tuple, set, frozenset))
_STR = frozenset((str,))

_CHECKED: dict[type, tuple[str, ...]] = {}


def checked_fields(cls: type[Event]) -> tuple[str, ...]:
    """The fields `publish` looks at: those that may hold tensors, containers or text."""
    names = _CHECKED.get(cls)
    if names is None:
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # an annotation that does not resolve: look at every field
            hints = {}
        text = tuple(
            n
            for n, h in hints.items()
            if h in (str, bytes, str | None) and n not in ("step", "ts", "seq", "rank")
        )
        names = _CHECKED[cls] = tuple(dict.fromkeys(capturable_fields(cls) + text))
    return names


def sizeof_event(ev: Event, names: tuple[str, ...]) -> int:
    """The estimated bytes of `ev`: its object plus what its fields `names` hold."""
    total = _BASE
    for n in names:  # a plain loop: this runs at publish, for every tensor-valued event
        v = getattr(ev, n)
        t = type(v)
        if t in NUMBERS:
            total += 8
        elif t is str:
            total += 49 + len(v)
        elif t in _CONTAINERS:
            total += _sizeof(v, 0)
        else:  # a tensor or an array (inline: the common case of a slow publish)
            try:
                nb = getattr(v, "nbytes", None)  # host metadata: no device sync
            except Exception:  # a sparse or exotic tensor without a plain size
                nb = None
            total += nb if type(nb) is int else 64
    return total


def sizeof_value(v: Any) -> int:
    """The estimated bytes of one field's value (as `sizeof_event` counts it)."""
    return _sizeof(v, 0)


def _sizeof(v: Any, depth: int) -> int:  # noqa: PLR0911 - one return per kind of value
    t = type(v)
    if t in NUMBERS:
        return 8
    if t is str or t is bytes or t is bytearray:
        return 49 + len(v)
    if depth >= _DEPTH:
        return 64
    if t not in _CONTAINERS:
        try:
            nbytes = getattr(v, "nbytes", None)  # tensors, arrays: host metadata, no sync
        except Exception:  # a sparse or exotic tensor without a plain size
            return 64
        return nbytes if type(nbytes) is int else 64
    if t is dict:
        n = len(v)
        if (
            n <= _WALK
            and _STR.issuperset(map(type, v))
            and NUMBERS.issuperset(map(type, v.values()))
        ):
            # A Scalars' values, in C loops: what the walk below counts, 49 + len(key) for
            # each key and 8 for each number.
            return 64 + (49 + 8) * n + sum(map(len, v))
        walked = 0
        total = 0
        for k, x in v.items():
            total += _sizeof(k, depth + 1) + _sizeof(x, depth + 1)
            walked += 1
            if walked >= _WALK:
                break
        return 64 + (total * n // walked if walked else 0)
    n = len(v)  # list, tuple, set or frozenset
    items = list(v)[:_WALK] if t in (set, frozenset) else v[:_WALK]
    total = sum(_sizeof(x, depth + 1) for x in items)
    return 56 + (total * n // len(items) if items else 0)


QUICK: dict[type, Callable[[Event], int]] = {}  # quick_check's, by class (the hot path reads it)


def quick_check(cls: type[Event]) -> Callable[[Event], int]:
    """A function generated for `cls` (as the codec does: direct attribute reads, no loop):
    -1 if an event holds a tensor or a container (the slow path), else its text length."""
    fn = QUICK.get(cls)
    if fn is None:
        names = checked_fields(cls)
        lines = ["def check(ev):", "    n = 0"]
        for i, name in enumerate(names):
            lines += [
                f"    v{i} = ev.{name}",
                f"    t{i} = type(v{i})",
                f"    if t{i} is str:",
                f"        n += len(v{i})",
                f"    elif t{i} not in NUMBERS:",
                "        return -1",
            ]
        lines.append("    return n")
        scope: dict[str, Any] = {"NUMBERS": NUMBERS}
        exec(compile("\n".join(lines), f"<eventbus.sizing {cls.__qualname__}>", "exec"), scope)
        fn = QUICK[cls] = scope["check"]
    return fn


def not_an_event(ev: object) -> TypeError:
    """What `publish` raises for something that is not an event."""
    return TypeError(
        f"publish() takes an eventbus Event (a dataclass subclassing eventbus.Event), "
        f"got {type(ev).__module__}.{type(ev).__qualname__}: {ev!r:.80}"
    )


def published_twice(ev: Event) -> ValueError:
    """What `publish` raises for an event object published before."""
    return ValueError(
        f"this {type(ev).__name__} object was already published (seq={ev.seq}); the bus "
        "holds it until subscribers have it, so publish a new event object each time "
        "(dataclasses.replace(ev) makes a copy)"
    )
