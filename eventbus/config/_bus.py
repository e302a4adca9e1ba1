"""The `[bus]` table: EventBus keyword arguments, typed and range-checked before any build."""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from eventbus.config._entries import ConfigError

__all__ = ["RULES", "bus_keywords", "check_bus_options"]


@dataclass(frozen=True)
class _Rule:
    """What one `[bus]` option takes, in words (`need`) and as a test (`ok`)."""

    need: str
    ok: Callable[[Any], bool]


def _int_from(lo: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and v >= lo  # `type is`: True is not an int here


def _seconds(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and v > 0


# The EventBus keywords a [bus] table may set, checked before anything is built. A keyword
# EventBus takes that is missing here is passed through for EventBus to check (a test pins
# that this table covers them all).
RULES: dict[str, _Rule] = {
    "drain_interval": _Rule("> 0 seconds (a finite number)", _seconds),
    "inbox_maxsize": _Rule("an int >= 2", _int_from(2)),
    "inbox_max_bytes": _Rule("a positive int (bytes)", _int_from(1)),
    "queue_max_bytes": _Rule("a positive int (bytes)", _int_from(1)),
    "close_timeout": _Rule("> 0 seconds (a finite number)", _seconds),
    "hang_timeout": _Rule(
        "> 0 seconds (JSON null: wait forever)", lambda v: v is None or _seconds(v)
    ),
    "handle_signals": _Rule("true or false", lambda v: type(v) is bool),
    "max_consecutive_failures": _Rule(
        "an int >= 1 (JSON null: never disable)", lambda v: v is None or _int_from(1)(v)
    ),
    "rank": _Rule("an int >= 0", _int_from(0)),
    "world_size": _Rule("an int >= 1", _int_from(1)),
    "name": _Rule("a non-empty string", lambda v: isinstance(v, str) and bool(v)),
    "stop_check_every": _Rule("an int >= 1", _int_from(1)),
    "cost_every": _Rule(
        "an int >= 1 (JSON null: no cost report)", lambda v: v is None or _int_from(1)(v)
    ),
    "strict": _Rule("true or false", lambda v: type(v) is bool),
}


def bus_keywords() -> list[str]:
    """Every keyword `EventBus` takes (its signature, so a new option is known at once)."""
    from eventbus.bus import EventBus

    params = inspect.signature(EventBus).parameters.values()
    return sorted(
        {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)} | set(RULES)
    )


def check_bus_options(raw: Any, where: str) -> dict[str, Any]:
    """A `[bus]` table, every option known, typed and in range (EventBus's own wording)."""
    w = f"{where} [bus]"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{w}: must be a table of EventBus options, got {raw!r}")
    known = bus_keywords()
    for key, value in raw.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"{w}: unknown option {key!r} (EventBus does not take it); {hint}"
                f"known options: {', '.join(known)}"
            )
        rule = RULES.get(key)
        if rule is not None and not rule.ok(value):
            raise ConfigError(f"{w}: {key} must be {rule.need}, got {value!r}")
    rank, size = raw.get("rank"), raw.get("world_size")
    if rank is not None and size is not None and rank >= size:
        raise ConfigError(f"{w}: rank {rank} must be below world_size {size}")
    return dict(raw)
