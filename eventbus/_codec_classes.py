"""The codec's per-class parts, built once per event class: encoder and decoding checks.

Encoding works from a generated `to_dict` per class (orjson on a dict is ~5x faster than on a
slotted dataclass); decoding checks each field against its annotation, so a wrong type is
reported naming the field. Fields declared `str` are written and read as they are.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from eventbus._codec_values import TAGS, InvalidValue, fast, restore, stamp
from eventbus.events import Event, event_fields

__all__ = [
    "CODECS",
    "STAMPS",
    "STAMP_CHECKS",
    "STAMP_KINDS",
    "STR",
    "Check",
    "ClassCodec",
    "codec_of",
]

# What a field's annotation allows, for the decoding checks (and raw writing of str fields).
STR, _INT, _NUM, _BOOL, _DICT, _TUPLE, _LIST, _ANY, _STAMP, _COUNT = (
    "str",
    "int",
    "num",
    "bool",
    "dict",
    "tuple",
    "list",
    "any",
    "stamp",
    "count",
)
_WANT = {
    STR: "a string",
    _INT: "an integer",
    _NUM: "a number",
    _BOOL: "a boolean",
    _DICT: "an object",
    _TUPLE: "a list",
    _LIST: "a list",
    _STAMP: "an integer",
    _COUNT: "a non-negative integer",
}  # (negative counts are the log reader's check)
STAMPS = {"step": _STAMP, "ts": _STAMP, "seq": _COUNT, "rank": _COUNT}
"""The stamp fields every event has, and their kinds."""
STAMP_KINDS = frozenset((_STAMP, _COUNT))

Check = tuple[frozenset[type], Callable[[Any], Any]]
"""(types accepted as they are, the check of any other value) for one field."""


def _kind(hint: Any) -> str:  # noqa: PLR0911 - one return per kind
    """The kind of value an annotation allows (`_ANY` where it cannot tell)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = {_kind(a) for a in typing.get_args(hint) if a is not type(None)}
        if kinds <= {_INT, _NUM}:
            return _NUM if _NUM in kinds else _INT
        return kinds.pop() if len(kinds) == 1 else _ANY
    origin = typing.get_origin(hint) or hint
    if origin is str:
        return STR
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


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _checker(  # noqa: PLR0911 - one return per kind
    kind: str, marked: bool, optional: bool = True
) -> Check:
    """(types accepted as they are, the check of any other value) for one kind of field.

    null passes everywhere (a field left at None is written as null); it is named in the
    message where the annotation allows it.
    """
    none: type = type(None)
    want = f"{_WANT.get(kind)} or null" if optional else _WANT.get(kind)

    def bad(v: Any) -> Any:
        raise InvalidValue(f"must be {want}, got {_show(v)}")

    def number(v: Any) -> Any:
        return TAGS[v] if type(v) is str and v in TAGS else bad(v)

    def container(want_type: type, convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def check(v: Any) -> Any:
            return convert(restore(v) if marked else v) if type(v) is want_type else bad(v)

        return check

    if kind in (_STAMP, _COUNT):
        return frozenset((int, none)), bad
    if kind == STR:  # a number here is a user's slip, not a broken line: kept
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
        return frozenset((int, float, bool, none)), restore
    return frozenset((int, float, bool, none, str, dict, list)), lambda v: v


STAMP_CHECKS = {n: _checker(kind, False) for n, kind in STAMPS.items()}
"""The checks of the stamp fields, for a type not registered (`UnknownEvent`)."""


class ClassCodec:
    """Per-class encoding and decoding built once: `to_dict` is a generated function (as
    dataclasses generates `__init__`); `checks` are the decoding checks of each field."""

    __slots__ = ("checks", "cls", "kinds", "names", "to_dict", "type_name")

    def __init__(self, cls: type[Event]) -> None:
        self.cls = cls
        self.type_name = cls.__name__
        self.names = tuple(f.name for f in event_fields(cls))
        hints = _hints(cls)
        self.kinds = {n: STAMPS.get(n) or _kind(hints.get(n, Any)) for n in self.names}
        optional = {n: type(None) in typing.get_args(hints.get(n)) for n in self.names}
        self.checks: dict[bool, dict[str, Check]] = {
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
            if kind == STR or hints.get(name) in (int, bool):
                continue  # written as is (orjson checks the type)
            if name in STAMPS:  # ints; a float or numpy step is made an int
                lines.append(f"    if not (v{i} is None or type(v{i}) is int): v{i} = _stamp(v{i})")
                continue
            # Finite floats, ints and None pass; NaN/Inf (x - x is NaN), strings, containers,
            # tensors and anything else go through _fast, and make `encode` check for escapes.
            lines.append(
                f"    if not (v{i} is None or (type(v{i}) is float and v{i} - v{i} == 0.0)"
                f" or type(v{i}) is int):\n        v{i} = _fast(v{i})\n        slow = True"
            )
        src = (
            "def to_dict(ev):\n"
            + "\n".join(lines)
            + ("\n    return {" + ", ".join(items) + "}, slow\n")
        )
        scope: dict[str, Any] = {"_fast": fast, "_stamp": stamp}
        exec(compile(src, f"<eventbus.codec {self.type_name}>", "exec"), scope)
        return typing.cast(Callable[[Event], tuple[dict[str, Any], bool]], scope["to_dict"])


CODECS: dict[type[Event], ClassCodec] = {}
"""Each event class's codec, built on first use."""


def codec_of(cls: type[Event]) -> ClassCodec:
    c = CODECS.get(cls)
    if c is None:
        c = CODECS[cls] = ClassCodec(cls)
    return c
