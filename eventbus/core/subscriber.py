"""What makes something a subscriber: its name, the events it asks for, its hooks' shape.

One rule for each, shared by the bus, `replay` and a process-placed subscriber's child.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

from eventbus.core.queue import POLICIES
from eventbus.events import Event

__all__ = [
    "State",
    "SubscribeOptions",
    "SubscriberGone",
    "describe",
    "event_types",
    "failed_part",
    "is_async",
    "positive",
    "subscribe_options",
    "takes_argument",
    "unique_name",
]


class SubscriberGone(Exception):
    """Raised by a subscriber that can never work again (its process died): disable it now."""


class State(enum.StrEnum):
    """Where a subscriber is in its life; shown as a string in `bus.stats()`."""

    PENDING = "pending"  # subscribed, the loop has not attached it yet
    RUNNING = "running"
    DISABLED = "disabled"  # failed too often (or on_start raised): events counted, not handed
    REMOVED = "removed"  # `Subscription.remove()`: delivering what was queued, then closed
    CLOSED = "closed"
    HUNG = "hung"  # still inside its code at the close deadline: abandoned


def describe(sub: Any) -> str:
    """A readable default name: the object's `name`, its class, or the function's name."""
    name = getattr(sub, "name", None)
    if isinstance(name, str) and name:
        return name
    if inspect.isroutine(sub):  # functions, methods, builtins such as `list.append`
        return str(getattr(sub, "__qualname__", None) or getattr(sub, "__name__", "function"))
    return type(sub).__name__


def event_types(spec: Any) -> tuple[type[Event], ...]:
    """`events=` (one class, several, or None for all) as a tuple of Event subclasses."""
    if spec is None:
        return (Event,)
    items = (spec,) if isinstance(spec, type) else tuple(spec)
    if not items:
        raise ValueError("events= is empty: name at least one Event subclass, or leave it out")
    for t in items:
        if not (isinstance(t, type) and issubclass(t, Event)):
            raise TypeError(f"events= takes Event subclasses (e.g. events=[Loss]); got {t!r}")
    return items


def failed_part(exc: BaseException, n: int) -> int:
    """How many of a batch of `n` events a failure lost: its `events_failed` (an int from 1 to
    `n`: a batch whose events run side by side, `CheckpointJobs`' jobs, may fail in part), else
    all `n`. Read from anything a subscriber raised, so it never raises itself."""
    try:
        k = getattr(exc, "events_failed", None)
    except BaseException:  # a user's exception with a __getattr__ of its own
        return n
    return k if type(k) is int and 0 < k <= n else n


def unique_name(base: str, taken: set[str]) -> str:
    """`base`, or `base#2`, `base#3`, ...: the first not in `taken` (which it joins)."""
    name, i = base, 2
    while name in taken:
        name, i = f"{base}#{i}", i + 1
    taken.add(name)
    return name


def is_async(fn: Any) -> bool:
    """Whether calling `fn` gives a coroutine (an `async def`, or an object with one as
    `__call__`)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
    )


def takes_argument(fn: Callable[..., Any]) -> bool:
    """Whether a hook accepts a positional argument (`on_start(self, bus)` vs `on_start(self)`)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params
    )


class SubscribeOptions(NamedTuple):
    """`subscribe()`'s options once checked, with the subscriber's class defaults applied."""

    events: tuple[type[Event], ...]
    policy: str
    maxsize: int
    max_batch: int
    placement: str
    ranks: frozenset[int] | None


def subscribe_options(
    sub: Any,
    *,
    events: Any,
    policy: str | None,
    maxsize: int | None,
    max_batch: int | None,
    placement: str | None,
    ranks: Any,
) -> SubscribeOptions:
    """Check what `subscribe()` was given; defaults come from the subscriber's attributes
    (`events`, `policy`, `maxsize`, `max_batch`, `placement`, `ranks`)."""
    if not (hasattr(sub, "on_events") or callable(sub)):
        raise TypeError(
            "subscribe() takes an object with an on_events(batch) method or a function "
            f"called with one event; got {type(sub).__qualname__}: {sub!r:.80}"
        )
    if hasattr(sub, "on_events") and not callable(sub.on_events):
        raise TypeError(f"{type(sub).__qualname__}.on_events is not callable")
    types = event_types(events if events is not None else getattr(sub, "events", None))
    policy = policy or getattr(sub, "policy", None) or "drop_oldest"
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    maxsize = maxsize if maxsize is not None else getattr(sub, "maxsize", None) or 10_000
    if not isinstance(maxsize, int) or maxsize < 1:
        raise ValueError(f"maxsize must be a positive int, got {maxsize!r}")
    max_batch = max_batch if max_batch is not None else getattr(sub, "max_batch", None) or 512
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be a positive int, got {max_batch!r}")
    placement = placement or getattr(sub, "placement", None) or "thread"
    if placement not in ("thread", "process"):
        raise ValueError(f"placement must be 'thread' or 'process', got {placement!r}")
    ranks = ranks if ranks is not None else getattr(sub, "ranks", None)
    return SubscribeOptions(
        types,
        policy,
        maxsize,
        max_batch,
        placement,
        frozenset(ranks) if ranks is not None else None,
    )


def positive(name: str, value: Any, kind: type, *, least: int | None = None) -> None:
    """Raise a clear ValueError unless `value` is a positive `kind` (int, or any number),
    or, with `least`, one at least that big."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (value <= 0 if least is None else value < least)
        or (kind is int and not isinstance(value, int))
    ):
        what = "a positive" if least is None else f"{'an' if kind is int else 'a'}"
        bound = "" if least is None else f" >= {least}"
        raise ValueError(f"{name} must be {what} {kind.__name__}{bound}, got {value!r}")


# EventBus's numeric arguments: (kind, least; None: positive), and which may be None.
_BUS_ARGS: dict[str, tuple[type, int | None]] = {
    "drain_interval": (float, None),
    "close_timeout": (float, None),
    "hang_timeout": (float, None),
    "inbox_max_bytes": (int, None),
    "queue_max_bytes": (int, None),
    "inbox_maxsize": (int, 2),
    "stop_check_every": (int, 1),
    "cost_every": (int, 1),
}
_MAY_BE_NONE = ("hang_timeout", "cost_every")


def check_bus_args(args: dict[str, Any]) -> None:
    """Refuse a bad numeric `EventBus(...)` argument with a ValueError that names it."""
    for name, (kind, least) in _BUS_ARGS.items():
        if not (args[name] is None and name in _MAY_BE_NONE):
            positive(name, args[name], kind, least=least)
