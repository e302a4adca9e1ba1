"""JSON lines: events to flat JSON objects and back, every value as it was.

orjson writes NaN and +/-Inf as `null`, which would make a diverged step look like a missing
value. We write them as the strings "NaN", "Infinity" and "-Infinity", escape strings and
non-str dict keys that would read back as something else, and write fields declared `str` as
they are (the rules: `eventbus._codec_values`). Lines without these marks (nearly all) skip
that work: encoding checks its output for them, decoding its input.

Encoding works from per-class generated functions (orjson on a dict is ~5x faster than on a
slotted dataclass); decoding checks each field against its annotation with per-class checks
(`eventbus._codec_classes`), so a wrong type raises `EventDecodeError` naming the field.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import orjson

from eventbus._codec_classes import CODECS, STAMP_CHECKS, STAMP_KINDS, STAMPS, STR, codec_of
from eventbus._codec_values import MAX_DEPTH, InvalidValue, exact, marked, restore, stamp, tag
from eventbus._event_base import rebuild
from eventbus.events import Event, UnknownEvent, event_type

__all__ = [
    "MAX_DEPTH",
    "RECORD_PREFIX",
    "EventDecodeError",
    "EventEncodeError",
    "decode",
    "encode",
    "iter_lines",
    "tag",
    "to_dict",
]

RECORD_PREFIX = "eventbus."
"""Types starting with this are records about a log (header, stats, markers), not events."""

_OPTS = orjson.OPT_APPEND_NEWLINE | orjson.OPT_PASSTHROUGH_DATETIME
_NO_FIELD = "-"


class EventEncodeError(TypeError):
    """An event field cannot be written as JSON; names the event type and the field."""

    def __init__(self, message: str, event_type: str = "", field: str = _NO_FIELD) -> None:
        super().__init__(message)
        self.event_type = event_type
        self.field = field


class EventDecodeError(ValueError):
    """A line is not a valid event record; the message names the field that is wrong."""


# -- encoding ----------------------------------------------------------------------------


def _field(ev: Event, name: str, v: Any, stamped: bool = False) -> Any:
    """One field made exact; any error becomes an `EventEncodeError` naming type and field."""
    try:
        return stamp(v) if stamped and v is not None else exact(v)
    except Exception as e:  # RecursionError, a tolist() that raises, anything: name it
        raise _encode_error(ev, name, v, e) from e


def _encode_error(ev: Event, name: str, v: Any, e: BaseException) -> EventEncodeError:
    tname = _type_name(ev)
    return EventEncodeError(
        f"cannot serialise {tname}.{name}, a {type(v).__name__} ({_reason(e)}); use "
        "numbers, strings, lists, dicts with str or int keys, or tensors in event fields",
        tname,
        name,
    )


def _type_name(ev: Event) -> str:
    return ev.type_name if isinstance(ev, UnknownEvent) else type(ev).__name__


def _reason(e: BaseException) -> str:
    if isinstance(e, RecursionError):
        return f"nested too deeply or cyclic; keep containers under {MAX_DEPTH} levels"
    return f"{type(e).__name__}: {e}" if not isinstance(e, TypeError | ValueError) else str(e)


def to_dict(ev: Event) -> dict[str, Any]:
    """The flat JSON-ready dict of an event (`type` first), exactly as `encode` writes it."""
    if type(ev) is UnknownEvent:
        d: dict[str, Any] = {"type": ev.type_name}
        for name in STAMPS:
            d[name] = _field(ev, name, getattr(ev, name), True)
        for k, v in ev.data.items():
            d[k] = _field(ev, k, v)
        return d
    c = codec_of(type(ev))
    out: dict[str, Any] = {"type": c.type_name}  # escapes, checked keys; errors name the field
    for name in c.names:
        v = getattr(ev, name)
        kind = c.kinds[name]
        out[name] = (
            v if kind == STR and type(v) is str else _field(ev, name, v, kind in STAMP_KINDS)
        )
    return out


def encode(ev: Event) -> bytes:
    """One JSON line (with trailing newline) for `ev`; `EventEncodeError` names a bad field.

    Any failure (a set, a cycle, a tensor whose `tolist()` raises...) is an `EventEncodeError`.
    """
    c = CODECS.get(type(ev))
    if c is not None or type(ev) is not UnknownEvent:
        try:
            d, slow = (c or codec_of(type(ev))).to_dict(ev)
            out = orjson.dumps(d, option=_OPTS)
        except Exception:  # Escape, or an error the exact path below names
            pass
        else:  # a dict key starting with U+0000 needs escaping: only the exact path does it
            if not slow or 92 not in out or b"\\u0000" not in out:  # 92: a backslash
                return out
    d = to_dict(ev)
    try:
        return orjson.dumps(d, option=_OPTS)
    except Exception as e:  # each value made exact; find the one orjson still refuses
        for name, v in d.items():
            try:
                orjson.dumps(v, option=_OPTS)
            except Exception as ef:
                raise _encode_error(ev, name, getattr(ev, name, v), ef) from e
        raise _encode_error(ev, _NO_FIELD, None, e) from e


# -- decoding -----------------------------------------------------------------------------


def decode(line: bytes | str) -> Event | None:
    """Rebuild the event of one JSON line; None for a header or another "eventbus." record.

    Types are looked up in the registry (user classes register on definition); a type not
    registered becomes `UnknownEvent`, which encodes back to the same line. A field of the
    wrong type raises `EventDecodeError` naming it.
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
    is_marked = marked(line)
    cls = event_type(name)
    if cls is None or cls is UnknownEvent:
        return _unknown(name, d, is_marked)
    checks = codec_of(cls).checks[is_marked]
    kwargs: dict[str, Any] = {}
    k = ""
    try:
        for k, v in d.items():
            check = checks.get(k)
            if check is not None:
                kwargs[k] = v if type(v) in check[0] else check[1](v)
    except (InvalidValue, RecursionError) as e:
        raise EventDecodeError(f"{name}.{k} {_why(e)}") from None
    try:
        return rebuild(cls, kwargs)  # `init=False` fields too, as logged
    except TypeError:  # a required field missing (a log from another version)
        return _unknown(name, d, is_marked)


def _why(e: BaseException) -> str:
    return "is nested too deeply" if isinstance(e, RecursionError) else str(e)


def _unknown(name: str, d: dict[str, Any], is_marked: bool) -> UnknownEvent:
    base: dict[str, Any] = {}
    k = ""
    try:
        for k, check in STAMP_CHECKS.items():
            v = d.pop(k, None)
            base[k] = v if type(v) in check[0] else check[1](v)
        k = ""
        data = {x: restore(v) for x, v in d.items()} if is_marked else d
    except (InvalidValue, RecursionError) as e:
        raise EventDecodeError(f"{name}.{k or 'data'} {_why(e)}") from None
    return UnknownEvent(type_name=name, data=data, **base)


def iter_lines(lines: Iterable[bytes]) -> Iterator[Event]:
    """Decode lines, skipping blank lines and headers (a torn last line raises)."""
    for line in lines:
        if line.strip():
            ev = decode(line)
            if ev is not None:
                yield ev
