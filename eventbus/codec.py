"""JSON lines: events to flat JSON objects and back, with non-finite floats kept apart.

orjson writes NaN and +/-Inf as `null`, which would make a diverged step look like a missing
value. We write them as the strings "NaN", "Infinity" and "-Infinity" (the spelling of
protobuf's JSON mapping) and turn them back into floats when reading fields that hold
numbers. Encoding works from per-class field tuples: orjson on a dict is ~5x faster than on
a slotted dataclass.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import orjson

from eventbus.events import Event, UnknownEvent, event_type

__all__ = [
    "RECORD_PREFIX",
    "EventDecodeError",
    "EventEncodeError",
    "decode",
    "encode",
    "iter_lines",
    "to_dict",
]

RECORD_PREFIX = "eventbus."
"""Types starting with this are records about a log (header, stats, markers), not events."""

_NONFINITE_OUT = {math.inf: "Infinity", -math.inf: "-Infinity"}
_NONFINITE_IN: dict[str, float] = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_PLAIN = (str, int, bool, type(None))


class EventEncodeError(TypeError):
    """An event field cannot be written as JSON; names the event type and the field."""


class EventDecodeError(ValueError):
    """A line is not a valid event record."""


def _finite_or_tag(v: float) -> float | str:
    if math.isnan(v):
        return "NaN"
    return _NONFINITE_OUT.get(v, v)


def _sanitize(v: Any) -> Any:  # noqa: PLR0911 - one return per kind of value
    """Tag non-finite floats inside containers; convert tuples and tensors (rare path)."""
    t = type(v)
    if t is float:
        return _finite_or_tag(v)
    if t in _PLAIN:
        return v
    if t is dict or isinstance(v, dict):
        # Finite floats and plain values inline: metric dicts are the common container.
        return {
            k if type(k) is str else str(k):
            x if (type(x) is float and x - x == 0.0) or type(x) in _PLAIN else _sanitize(x)
            for k, x in v.items()
        }
    if t is list or t is tuple or isinstance(v, list | tuple):
        return [_sanitize(x) for x in v]
    if hasattr(v, "tolist") and hasattr(v, "device"):
        # A CPU tensor that reached a writer (non-scalar fields are delivered as CPU
        # tensors). Never called on the training thread, so never a device sync there.
        return _sanitize(v.tolist())
    if isinstance(v, float):
        return _finite_or_tag(float(v))
    return v


class _ClassCodec:
    """Per-class encoding built once: `to_dict` is a generated function (as dataclasses
    generates `__init__`): one dict display, a finiteness test only where a float can be."""

    __slots__ = ("cls", "names", "numeric", "to_dict", "type_name")

    def __init__(self, cls: type[Event]) -> None:
        self.cls = cls
        self.type_name = cls.__name__
        self.names = tuple(f.name for f in dataclasses.fields(cls))
        self.numeric = frozenset(_numeric_fields(cls))
        self.to_dict: Callable[[Event], dict[str, Any]] = self._compile()

    def _compile(self) -> Callable[[Event], dict[str, Any]]:
        lines, items = [], [f'"type": {self.type_name!r}']
        for i, name in enumerate(self.names):
            if name not in self.numeric:  # declared str / int / bool: written as is
                items.append(f'"{name}": ev.{name}')
                continue
            lines.append(f"    v{i} = ev.{name}")
            # Finite floats and None pass; NaN/Inf (x - x is NaN), containers, tensors and
            # anything else go through _sanitize.
            items.append(
                f'"{name}": v{i} if v{i} is None or (type(v{i}) is float and v{i} - v{i} == 0.0)'
                f" or type(v{i}) is int else _sanitize(v{i})"
            )
        src = "def to_dict(ev):\n" + "\n".join(lines) + (
            "\n    return {" + ", ".join(items) + "}\n"
        )
        scope: dict[str, Any] = {"_sanitize": _sanitize}
        exec(compile(src, f"<eventbus.codec {self.type_name}>", "exec"), scope)
        return typing.cast(Callable[[Event], dict[str, Any]], scope["to_dict"])


def _numeric_fields(cls: type[Event]) -> Iterator[str]:
    """Fields whose declared type can hold a float (where "NaN" strings become floats)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # a user type with unresolvable annotations: treat all as numeric
        hints = {}
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name, Any)
        if hint is str or hint is int or hint is bool:
            continue
        yield f.name


_CODECS: dict[type[Event], _ClassCodec] = {}


def _codec(cls: type[Event]) -> _ClassCodec:
    c = _CODECS.get(cls)
    if c is None:
        c = _CODECS[cls] = _ClassCodec(cls)
    return c


def to_dict(ev: Event) -> dict[str, Any]:
    """The flat JSON-ready dict of an event: `type` first, then its fields."""
    if type(ev) is UnknownEvent:
        d: dict[str, Any] = {"type": ev.type_name, "step": ev.step, "ts": ev.ts,
                             "seq": ev.seq, "rank": ev.rank}
        d.update({k: _sanitize(v) for k, v in ev.data.items()})
        return d
    return _codec(type(ev)).to_dict(ev)


def encode(ev: Event) -> bytes:
    """One JSON line (with trailing newline) for `ev`; `EventEncodeError` names a bad field."""
    d = to_dict(ev)
    try:
        return orjson.dumps(d, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        raise _explain(ev, d) from None


def _explain(ev: Event, d: dict[str, Any]) -> EventEncodeError:
    for name, v in d.items():
        try:
            orjson.dumps(v)
        except TypeError as e:
            return EventEncodeError(
                f"cannot serialise {type(ev).__name__}.{name}: a {type(v).__name__} value "
                f"({e}); use numbers, strings, lists, dicts or tensors in event fields"
            )
    return EventEncodeError(f"cannot serialise {type(ev).__name__}")


def _restore(v: Any) -> Any:
    t = type(v)
    if t is str:
        return _NONFINITE_IN.get(v, v)
    if t is dict:
        return {k: _restore(x) for k, x in v.items()}
    if t is list:
        return [_restore(x) for x in v]
    return v


def decode(line: bytes | str) -> Event | None:
    """Rebuild the event of one JSON line; None for a header or another "eventbus." record.

    Types are looked up in the registry (user classes register on definition); a type not
    registered becomes `UnknownEvent`, which encodes back to the same line.
    """
    try:
        d = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise EventDecodeError(f"not a JSON line: {e}") from None
    if type(d) is not dict or type(d.get("type")) is not str:
        raise EventDecodeError("not an event record: a JSON object with a string 'type' expected")
    name: str = d.pop("type")
    if name.startswith(RECORD_PREFIX):
        return None
    cls = event_type(name)
    if cls is None or cls is UnknownEvent:
        return _unknown(name, d)
    c = _codec(cls)
    kwargs = {k: (_restore(v) if k in c.numeric else v) for k, v in d.items() if k in c.names}
    if "shape" in kwargs and type(kwargs["shape"]) is list:
        kwargs["shape"] = tuple(kwargs["shape"])
    try:
        return cls(**kwargs)
    except TypeError:  # a required field missing (a log from another version)
        return _unknown(name, d)


def _unknown(name: str, d: dict[str, Any]) -> UnknownEvent:
    base = {k: d.pop(k, None) for k in ("step", "ts", "seq", "rank")}
    return UnknownEvent(type_name=name, data={k: _restore(v) for k, v in d.items()}, **base)


def iter_lines(lines: Iterable[bytes]) -> Iterator[Event]:
    """Decode lines, skipping blank lines and headers (a torn last line raises)."""
    for line in lines:
        if line.strip():
            ev = decode(line)
            if ev is not None:
                yield ev
