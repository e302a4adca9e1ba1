"""JSON lines: events to flat JSON objects and back, every value as it was.

orjson writes NaN and +/-Inf as `null`, which would make a diverged step look like a missing
value. We write them as the strings "NaN", "Infinity" and "-Infinity" (protobuf's JSON
spelling). So that the string "NaN" stays a string, a string that reads as one of those tags,
or that starts with U+0000, gets a U+0000 prefix ("\\u0000NaN"), and a dict key that is not a
string (int, float, bool, None) is written as U+0000 plus its JSON text ("\\u00001"): `1` and
`"1"` stay apart. Fields declared `str` are written and read as they are. Lines without these
marks (nearly all) skip that work: encoding checks its output for them, decoding its input.

Encoding works from per-class generated functions (orjson on a dict is ~5x faster than on a
slotted dataclass); decoding checks each field against its annotation with per-class checks,
so a wrong type raises `EventDecodeError` naming the field.
"""

from __future__ import annotations

import datetime
import math
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import orjson

from eventbus.events import Event, UnknownEvent, event_fields, event_type

__all__ = [
    "MAX_DEPTH",
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
MAX_DEPTH = 100
"""Containers nested deeper than this in a field (or cyclic) are refused with a clear error."""

_ESC = "\x00"
_TAGS: dict[str, float] = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_PLAIN = (str, int, bool, type(None))
_INT_MIN, _INT_END = -(1 << 63), 1 << 64  # what orjson can write
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


def _marked(line: bytes | str) -> bool:
    """Whether a line may hold a non-finite tag or an escape; if not, no value needs fixing.

    Tags hold "N" or "I" and escapes a backslash; one-byte searches (memchr) cost ~10 ns each.
    """
    if type(line) is not bytes:
        return "N" in line or "I" in line or "\\" in line if isinstance(line, str) else _marked(
            bytes(line))
    return 78 in line or 73 in line or 92 in line  # b"N", b"I", b"\\"


# -- encoding ----------------------------------------------------------------------------


def _tag(v: float) -> float | str:
    if v - v == 0.0:
        return v
    return "NaN" if math.isnan(v) else "Infinity" if v > 0 else "-Infinity"


class _Exact(Exception):
    """Raised by `_fast` for a value only the exact path writes right (a string to escape)."""


def _fast(v: Any) -> Any:
    """Tag non-finite floats on the common path; raises `_Exact` for a string to escape."""
    t = type(v)
    if t is float:
        return _tag(v)
    if t is str:
        if v in _TAGS or v[:1] == _ESC:
            raise _Exact
        return v
    if t is dict:
        # Finite floats and ints inline: metric dicts are the common container.
        return {
            k: x if (type(x) is float and x - x == 0.0) or type(x) is int or x is None
            else _fast(x)
            for k, x in v.items()
        }
    if t is list or t is tuple:
        return [_fast(x) for x in v]
    if hasattr(v, "tolist") and hasattr(v, "device"):
        # A CPU tensor (non-scalar fields are delivered as CPU tensors); never called on the
        # training thread, so never a device sync there.
        return _fast(v.tolist())
    return v  # bool, None, anything else: orjson decides, and on an error `_exact` does it


def _exact(v: Any, depth: int = 0) -> Any:  # noqa: PLR0911 - one return per kind
    """A JSON-ready copy of `v` that decodes back to `v`; raises naming what cannot."""
    t = type(v)
    if t is str:
        return _ESC + v if v in _TAGS or v[:1] == _ESC else v
    if t is float:
        return _tag(v)
    if t is int:
        if not _INT_MIN <= v < _INT_END:
            raise ValueError(f"the integer {v:.3g} is beyond 64 bits; publish it as a float "
                             "or a str")
        return v
    if v is None or t is bool:
        return v
    if depth >= MAX_DEPTH:
        raise ValueError(f"containers nested deeper than {MAX_DEPTH} levels (or a cycle); "
                         "publish a flatter value")
    if isinstance(v, Mapping):
        return {_key(k): _exact(x, depth + 1) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_exact(x, depth + 1) for x in v]
    if isinstance(v, str):  # a str subclass (StrEnum)
        return _exact(str.__str__(v))
    if isinstance(v, bool | int | float):  # IntEnum, numpy.float64
        return _exact(bool(v) if isinstance(v, bool) else (int(v) if isinstance(v, int)
                                                          else float(v)))
    if isinstance(v, set | frozenset):
        raise TypeError("a set has no JSON form; publish a sorted list")
    if isinstance(v, bytes | bytearray | memoryview):
        raise TypeError("bytes have no JSON form; publish a str (bytes.decode()) or numbers")
    if isinstance(v, datetime.date | datetime.time | datetime.timedelta):
        raise TypeError(f"a {t.__name__} would come back as a str; publish a str "
                        "(.isoformat()) or a number (.timestamp() / .total_seconds())")
    if hasattr(v, "tolist"):  # tensors, numpy arrays and numpy scalars
        return _exact(_tolist(v), depth + 1)
    return v  # dataclasses, enums, uuids: orjson writes them, or raises naming the type


def _tolist(v: Any) -> Any:
    """A tensor or array as nested lists: sparse made dense, quantized dequantized first."""
    if getattr(v, "is_quantized", False):
        v = v.dequantize()
    layout = getattr(v, "layout", None)
    if layout is not None and str(layout) != "torch.strided":
        v = v.to_dense()  # sparse COO / CSR...: on the writer's thread, never the training one
    return v.tolist()


def _key(k: Any) -> str:
    t = type(k)
    if t is str:
        ks: str = k
        return _ESC + ks if ks[:1] == _ESC else ks
    if t is bool or k is None:
        return _ESC + ("null" if k is None else "true" if k else "false")
    if isinstance(k, int) and not isinstance(k, bool):
        return _ESC + str(int(k))
    if isinstance(k, float) and math.isfinite(k):
        return _ESC + repr(float(k))
    if isinstance(k, str):
        return _key(str(str.__str__(k)))
    raise TypeError(f"the dict key {k!r:.40} ({t.__name__}) has no JSON form; use str or int "
                    "keys")


# -- per-class codecs ----------------------------------------------------------------------

# What a field's annotation allows, for the decoding checks (and raw writing of str fields).
_STR, _INT, _NUM, _BOOL, _DICT, _TUPLE, _LIST, _ANY, _STAMP, _COUNT = (
    "str", "int", "num", "bool", "dict", "tuple", "list", "any", "stamp", "count")
_WANT = {_STR: "a string", _INT: "an integer", _NUM: "a number", _BOOL: "a boolean",
         _DICT: "an object", _TUPLE: "a list", _LIST: "a list", _STAMP: "an integer",
         _COUNT: "a non-negative integer"}  # (negative counts are the log reader's check)
_STAMPS = {"step": _STAMP, "ts": _STAMP, "seq": _COUNT, "rank": _COUNT}


def _kind(hint: Any) -> str:  # noqa: PLR0911 - one return per kind
    """The kind of value an annotation allows (`_ANY` where it cannot tell)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = {_kind(a) for a in typing.get_args(hint) if a is not type(None)}
        if kinds <= {_INT, _NUM}:
            return _NUM if _NUM in kinds else _INT
        return kinds.pop() if len(kinds) == 1 else _ANY
    origin = typing.get_origin(hint) or hint
    if origin is str:
        return _STR
    if origin is bool:
        return _BOOL
    if origin is int:
        return _INT
    if origin is float:
        return _NUM
    if origin is tuple:
        return _TUPLE
    if origin is Mapping or (isinstance(origin, type) and issubclass(origin, dict)):
        return _DICT
    if origin is Sequence or (isinstance(origin, type) and issubclass(origin, list)):
        return _LIST
    return _ANY


def _hints(cls: type[Event]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # a user type with unresolvable annotations: check the stamps only
        return typing.get_type_hints(Event)


class _Invalid(ValueError):
    """A field value of the wrong kind (decode); `EventDecodeError` adds type and field."""


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _checker(  # noqa: PLR0911 - one return per kind
    kind: str, marked: bool, optional: bool = True
) -> tuple[frozenset[type], Callable[[Any], Any]]:
    """(types accepted as they are, the check of any other value) for one kind of field.

    null passes everywhere (a field left at None is written as null); it is named in the
    message where the annotation allows it.
    """
    none: type = type(None)
    want = f"{_WANT.get(kind)} or null" if optional else _WANT.get(kind)

    def bad(v: Any) -> Any:
        raise _Invalid(f"must be {want}, got {_show(v)}")

    def number(v: Any) -> Any:
        return _TAGS[v] if type(v) is str and v in _TAGS else bad(v)

    def container(want_type: type, convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def check(v: Any) -> Any:
            return convert(_restore(v) if marked else v) if type(v) is want_type else bad(v)
        return check

    if kind in (_STAMP, _COUNT):
        return frozenset((int, none)), bad
    if kind == _STR:  # a number here is a user's slip, not a broken line: kept
        return frozenset((str, int, float, bool, none)), bad
    if kind == _BOOL:
        return frozenset((bool, none)), bad
    if kind in (_INT, _NUM):  # an int field filled from a float tensor holds a float
        return frozenset((int, float, none)), number
    if kind == _DICT:
        return frozenset((none,)), container(dict, lambda v: v)
    if kind == _TUPLE:
        return frozenset((none,)), container(list, tuple)
    if kind == _LIST:
        return frozenset((none,)), container(list, lambda v: v)
    if marked:
        return frozenset((int, float, bool, none)), _restore
    return frozenset((int, float, bool, none, str, dict, list)), lambda v: v


class _ClassCodec:
    """Per-class encoding and decoding built once: `to_dict` is a generated function (as
    dataclasses generates `__init__`); `checks` are the decoding checks of each field."""

    __slots__ = ("checks", "cls", "kinds", "names", "to_dict", "type_name")

    def __init__(self, cls: type[Event]) -> None:
        self.cls = cls
        self.type_name = cls.__name__
        self.names = tuple(f.name for f in event_fields(cls))
        hints = _hints(cls)
        self.kinds = {n: _STAMPS.get(n) or _kind(hints.get(n, Any)) for n in self.names}
        optional = {n: type(None) in typing.get_args(hints.get(n)) for n in self.names}
        self.checks = {
            marked: {n: _checker(k, marked, optional[n]) for n, k in self.kinds.items()}
            for marked in (False, True)
        }
        # (dict, whether a value took the slow path): then `encode` checks for escapes
        self.to_dict: Callable[[Event], tuple[dict[str, Any], bool]] = self._compile(hints)

    def _compile(self, hints: dict[str, Any]) -> Callable[[Event], tuple[dict[str, Any], bool]]:
        lines, items = ["    slow = False"], [f'"type": {self.type_name!r}']
        for i, name in enumerate(self.names):
            items.append(f'"{name}": v{i}')
            lines.append(f"    v{i} = ev.{name}")
            kind = self.kinds[name]
            if kind == _STR or hints.get(name) in (int, bool):
                continue  # written as is (orjson checks the type)
            if name in _STAMPS:  # ints; a float or numpy step is made an int
                lines.append(f"    if not (v{i} is None or type(v{i}) is int): v{i} = _stamp(v{i})")
                continue
            # Finite floats, ints and None pass; NaN/Inf (x - x is NaN), strings, containers,
            # tensors and anything else go through _fast, and make `encode` check for escapes.
            lines.append(
                f"    if not (v{i} is None or (type(v{i}) is float and v{i} - v{i} == 0.0)"
                f" or type(v{i}) is int):\n        v{i} = _fast(v{i})\n        slow = True"
            )
        src = "def to_dict(ev):\n" + "\n".join(lines) + (
            "\n    return {" + ", ".join(items) + "}, slow\n"
        )
        scope: dict[str, Any] = {"_fast": _fast, "_stamp": _stamp}
        exec(compile(src, f"<eventbus.codec {self.type_name}>", "exec"), scope)
        return typing.cast(Callable[[Event], tuple[dict[str, Any], bool]], scope["to_dict"])

    def exact(self, ev: Event) -> dict[str, Any]:
        """The exact dict (escapes, checked keys); `EventEncodeError` names a bad field."""
        out: dict[str, Any] = {"type": self.type_name}
        for name in self.names:
            v = getattr(ev, name)
            kind = self.kinds[name]
            out[name] = v if kind == _STR and type(v) is str else _field(ev, name, v, kind)
        return out


_CODECS: dict[type[Event], _ClassCodec] = {}


def _codec(cls: type[Event]) -> _ClassCodec:
    c = _CODECS.get(cls)
    if c is None:
        c = _CODECS[cls] = _ClassCodec(cls)
    return c


def _field(ev: Event, name: str, v: Any, kind: str = _ANY) -> Any:
    """One field made exact; any error becomes an `EventEncodeError` naming type and field."""
    try:
        return _stamp(v) if kind in (_STAMP, _COUNT) and v is not None else _exact(v)
    except Exception as e:  # RecursionError, a tolist() that raises, anything: name it
        raise _encode_error(ev, name, v, e) from e


def _encode_error(ev: Event, name: str, v: Any, e: BaseException) -> EventEncodeError:
    tname = _type_name(ev)
    return EventEncodeError(
        f"cannot serialise {tname}.{name}, a {type(v).__name__} ({_reason(e)}); use "
        "numbers, strings, lists, dicts with str or int keys, or tensors in event fields",
        tname, name)


def _type_name(ev: Event) -> str:
    return ev.type_name if isinstance(ev, UnknownEvent) else type(ev).__name__


def _stamp(v: Any) -> int:
    """A step (or other stamp) as an int: numpy and integral floats converted, else refused."""
    if type(v) is int:
        return v
    x = v.item() if hasattr(v, "item") and not isinstance(v, int | float) else v
    if isinstance(x, int) and not isinstance(x, bool):
        return int(x)
    if isinstance(x, float) and x.is_integer():
        return int(x)
    raise TypeError(f"expected an integer, got {v!r:.40}")


def _reason(e: BaseException) -> str:
    if isinstance(e, RecursionError):
        return f"nested too deeply or cyclic; keep containers under {MAX_DEPTH} levels"
    return f"{type(e).__name__}: {e}" if not isinstance(e, TypeError | ValueError) else str(e)


def to_dict(ev: Event) -> dict[str, Any]:
    """The flat JSON-ready dict of an event (`type` first), exactly as `encode` writes it."""
    if type(ev) is UnknownEvent:
        d: dict[str, Any] = {"type": ev.type_name}
        for name, kind in _STAMPS.items():
            d[name] = _field(ev, name, getattr(ev, name), kind)
        for k, v in ev.data.items():
            d[k] = _field(ev, k, v)
        return d
    return _codec(type(ev)).exact(ev)


def encode(ev: Event) -> bytes:
    """One JSON line (with trailing newline) for `ev`; `EventEncodeError` names a bad field.

    Any failure (a set, a cycle, a tensor whose `tolist()` raises...) is an `EventEncodeError`.
    """
    c = _CODECS.get(type(ev))
    if c is not None or type(ev) is not UnknownEvent:
        try:
            d, slow = (c or _codec(type(ev))).to_dict(ev)
            out = orjson.dumps(d, option=_OPTS)
        except Exception:  # _Exact, or an error the exact path below names
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


def _restore(v: Any) -> Any:
    """Undo tags and escapes in a decoded value (only called on marked lines)."""
    t = type(v)
    if t is str:
        if v in _TAGS:
            return _TAGS[v]
        return v[1:] if v[:1] == _ESC else v
    if t is dict:
        return {_unkey(k): _restore(x) for k, x in v.items()}
    if t is list:
        return [_restore(x) for x in v]
    return v


def _unkey(k: str) -> Any:
    if k[:1] != _ESC:
        return k
    s = k[1:]
    if s[:1] == _ESC:
        return s
    if s in ("null", "true", "false"):
        return None if s == "null" else s == "true"
    try:
        return int(s) if s.lstrip("-").isdigit() else float(s)
    except ValueError:
        raise _Invalid(f"has the escaped key {k!r:.40}, which is not a number, bool or null"
                       ) from None


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
    marked = _marked(line)
    cls = event_type(name)
    if cls is None or cls is UnknownEvent:
        return _unknown(name, d, marked)
    checks = _codec(cls).checks[marked]
    kwargs: dict[str, Any] = {}
    k = ""
    try:
        for k, v in d.items():
            check = checks.get(k)
            if check is not None:
                kwargs[k] = v if type(v) in check[0] else check[1](v)
    except (_Invalid, RecursionError) as e:
        raise EventDecodeError(f"{name}.{k} {_why(e)}") from None
    try:
        return cls(**kwargs)
    except TypeError:  # a required field missing (a log from another version)
        return _unknown(name, d, marked)


def _why(e: BaseException) -> str:
    return "is nested too deeply" if isinstance(e, RecursionError) else str(e)


_STAMP_CHECKS = {n: _checker(kind, False) for n, kind in _STAMPS.items()}


def _unknown(name: str, d: dict[str, Any], marked: bool) -> UnknownEvent:
    base: dict[str, Any] = {}
    k = ""
    try:
        for k, check in _STAMP_CHECKS.items():
            v = d.pop(k, None)
            base[k] = v if type(v) in check[0] else check[1](v)
        k = ""
        data = {x: _restore(v) for x, v in d.items()} if marked else d
    except (_Invalid, RecursionError) as e:
        raise EventDecodeError(f"{name}.{k or 'data'} {_why(e)}") from None
    return UnknownEvent(type_name=name, data=data, **base)


def iter_lines(lines: Iterable[bytes]) -> Iterator[Event]:
    """Decode lines, skipping blank lines and headers (a torn last line raises)."""
    for line in lines:
        if line.strip():
            ev = decode(line)
            if ev is not None:
                yield ev
