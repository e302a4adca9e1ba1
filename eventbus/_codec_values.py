"""The codec's value rules: one value to JSON and back, exactly as it was.

orjson writes NaN and +/-Inf as `null`; we write the strings "NaN", "Infinity" and "-Infinity"
(protobuf's JSON spelling). So that the string "NaN" stays a string, a string that reads as one
of those tags, or that starts with U+0000, gets a U+0000 prefix ("\\u0000NaN"), and a dict key
that is not a string (int, float, bool, None) is written as U+0000 plus its JSON text
("\\u00001"): `1` and `"1"` stay apart. `fast` is the common path, `exact` the one that escapes
and refuses what has no exact JSON form; `restore` undoes tags and escapes when decoding.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "MAX_DEPTH",
    "TAGS",
    "Escape",
    "InvalidValue",
    "exact",
    "fast",
    "marked",
    "restore",
    "stamp",
]

MAX_DEPTH = 100
"""Containers nested deeper than this in a field (or cyclic) are refused with a clear error."""

_ESC = "\x00"
TAGS: dict[str, float] = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_INT_MIN, _INT_END = -(1 << 63), 1 << 64  # what orjson can write


class Escape(Exception):
    """Raised by `fast` for a value only the exact path writes right (a string to escape)."""


class InvalidValue(ValueError):
    """A field value of the wrong kind (decode); `EventDecodeError` adds type and field."""


def marked(line: bytes | str) -> bool:
    """Whether a line may hold a non-finite tag or an escape; if not, no value needs fixing.

    Tags hold "N" or "I" and escapes a backslash; one-byte searches (memchr) cost ~10 ns each.
    """
    if type(line) is not bytes:
        return (
            "N" in line or "I" in line or "\\" in line
            if isinstance(line, str)
            else marked(bytes(line))
        )
    return 78 in line or 73 in line or 92 in line  # b"N", b"I", b"\\"


# -- encoding ----------------------------------------------------------------------------


def tag(v: float) -> float | str:
    """A float as the log spells it: itself if finite, else "NaN", "Infinity", "-Infinity"."""
    if v - v == 0.0:
        return v
    return "NaN" if math.isnan(v) else "Infinity" if v > 0 else "-Infinity"


def fast(v: Any) -> Any:
    """Tag non-finite floats on the common path; raises `Escape` for a string to escape."""
    t = type(v)
    if t is float:
        return tag(v)
    if t is str:
        if v in TAGS or v[:1] == _ESC:
            raise Escape
        return v
    if t is dict:
        # Finite floats and ints inline: metric dicts are the common container.
        return {
            k: x if (type(x) is float and x - x == 0.0) or type(x) is int or x is None else fast(x)
            for k, x in v.items()
        }
    if t is list or t is tuple:
        return [fast(x) for x in v]
    if hasattr(v, "tolist") and hasattr(v, "device"):
        # A CPU tensor (non-scalar fields are delivered as CPU tensors); never called on the
        # training thread, so never a device sync there.
        return fast(v.tolist())
    return v  # bool, None, anything else: orjson decides, and on an error `exact` does it


def exact(v: Any, depth: int = 0) -> Any:  # noqa: PLR0911 - one return per kind
    """A JSON-ready copy of `v` that decodes back to `v`; raises naming what cannot."""
    t = type(v)
    if t is str:
        return _ESC + v if v in TAGS or v[:1] == _ESC else v
    if t is float:
        return tag(v)
    if t is int:
        if not _INT_MIN <= v < _INT_END:
            raise ValueError(
                f"the integer {v:.3g} is beyond 64 bits; publish it as a float or a str"
            )
        return v
    if v is None or t is bool:
        return v
    if depth >= MAX_DEPTH:
        raise ValueError(
            f"containers nested deeper than {MAX_DEPTH} levels (or a cycle); "
            "publish a flatter value"
        )
    if isinstance(v, Mapping):
        return {_key(k): exact(x, depth + 1) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [exact(x, depth + 1) for x in v]
    if isinstance(v, str):  # a str subclass (StrEnum)
        return exact(str.__str__(v))
    if isinstance(v, bool | int | float):  # IntEnum, numpy.float64
        return exact(
            bool(v) if isinstance(v, bool) else (int(v) if isinstance(v, int) else float(v))
        )
    if isinstance(v, set | frozenset):
        raise TypeError("a set has no JSON form; publish a sorted list")
    if isinstance(v, bytes | bytearray | memoryview):
        raise TypeError("bytes have no JSON form; publish a str (bytes.decode()) or numbers")
    if isinstance(v, datetime.date | datetime.time | datetime.timedelta):
        raise TypeError(
            f"a {t.__name__} would come back as a str; publish a str "
            "(.isoformat()) or a number (.timestamp() / .total_seconds())"
        )
    if hasattr(v, "tolist"):  # tensors, numpy arrays and numpy scalars
        return exact(_tolist(v), depth + 1)
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
    raise TypeError(f"the dict key {k!r:.40} ({t.__name__}) has no JSON form; use str or int keys")


def stamp(v: Any) -> int:
    """A step (or other stamp) as an int: numpy and integral floats converted, else refused."""
    if type(v) is int:
        return v
    x = v.item() if hasattr(v, "item") and not isinstance(v, int | float) else v
    if isinstance(x, int) and not isinstance(x, bool):
        return int(x)
    if isinstance(x, float) and x.is_integer():
        return int(x)
    raise TypeError(f"expected an integer, got {v!r:.40}")


# -- decoding -----------------------------------------------------------------------------


def restore(v: Any) -> Any:
    """Undo tags and escapes in a decoded value (only called on marked lines)."""
    t = type(v)
    if t is str:
        if v in TAGS:
            return TAGS[v]
        return v[1:] if v[:1] == _ESC else v
    if t is dict:
        return {_unkey(k): restore(x) for k, x in v.items()}
    if t is list:
        return [restore(x) for x in v]
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
        raise InvalidValue(
            f"has the escaped key {k!r:.40}, which is not a number, bool or null"
        ) from None
