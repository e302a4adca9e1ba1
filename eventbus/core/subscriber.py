"""What makes something a subscriber: its name, the events it asks for, its hooks' shape.

One rule for each, shared by the bus, `replay` and a process-placed subscriber's child.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from eventbus.core.queue import POLICIES
from eventbus.events import Event

__all__ = [
    "State",
    "SubscribeOptions",
    "SubscriberGone",
    "check_callable",
    "describe",
    "event_types",
    "failed_part",
    "is_async",
    "loop_cancelled",
    "name_for",
    "positive",
    "subscribe_options",
    "takes_argument",
    "timeout_of",
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


def loop_cancelled(e: BaseException) -> bool:
    """Whether a CancelledError is the loop cancelling us (close deadline), not the subscriber's."""
    if not isinstance(e, asyncio.CancelledError):
        return False
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


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


def name_for(sub: Any, name: Any, taken: set[str]) -> str:
    """The unique name of a new subscription: `name=` if given (a non-empty str), else
    `describe(sub)`; `#2`, `#3`, ... added when taken."""
    if name is not None and (not isinstance(name, str) or not name):
        raise TypeError(f"name= must be a non-empty str (stats and state_dict keys), got {name!r}")
    return unique_name(name or describe(sub), taken)


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
    check_callable(sub)
    types = event_types(events if events is not None else getattr(sub, "events", None))
    policy = _option(sub, "policy", policy, "drop_oldest")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    maxsize = _option(sub, "maxsize", maxsize, 10_000)
    if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
        raise ValueError(f"maxsize must be a positive int, got {maxsize!r}")
    max_batch = _option(sub, "max_batch", max_batch, 512)
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be a positive int, got {max_batch!r}")
    placement = _option(sub, "placement", placement, "thread")
    if placement not in ("thread", "process"):
        raise ValueError(f"placement must be 'thread' or 'process', got {placement!r}")
    return SubscribeOptions(
        types, policy, maxsize, max_batch, placement, _ranks(_option(sub, "ranks", ranks, None))
    )


def _option(sub: Any, name: str, given: Any, default: Any) -> Any:
    """`subscribe(name=)` if given, else the subscriber's attribute, else `default`; a falsy
    value given (`policy=""`, `maxsize=0`) is checked, never read as "not set"."""
    if given is not None:
        return given
    value = getattr(sub, name, None)
    return default if value is None else value


def _ranks(ranks: Any) -> frozenset[int] | None:
    """`ranks=`: an iterable of ints (a str or a lone int would never match a rank)."""
    if ranks is None:
        return None
    bad = isinstance(ranks, str | bytes) or not isinstance(ranks, Iterable)
    if not bad:
        ranks = tuple(ranks)
        bad = not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks)
    if bad:
        raise TypeError(f"ranks= takes the ranks as ints (e.g. ranks=[0]), got {ranks!r}")
    return frozenset(ranks)


_TAKES = "an object with an on_events(batch) method or a function called with one event"


def check_callable(sub: Any, where: str = "subscribe()", takes: str = _TAKES) -> None:
    """Refuse, where it is subscribed (`where`: `subscribe()`, `replay()`), what every event
    would fail on: not a subscriber at all (`takes` says what is), a class rather than an
    instance, an `on_events` that takes no batch, a function that takes no single event."""
    batched = hasattr(sub, "on_events")
    if isinstance(sub, type):
        raise TypeError(
            f"{where} got the class {sub.__qualname__}; pass an instance of it "
            f"({sub.__qualname__}(...)) or a function called with one event"
        )
    if not (batched or callable(sub)):
        raise TypeError(f"{where} takes {takes}; got {type(sub).__qualname__}: {sub!r:.80}")
    fn = sub.on_events if batched else sub
    what = f"{type(sub).__qualname__}.on_events" if batched else describe(sub)
    if not callable(fn):
        raise TypeError(f"{what} is not callable")
    try:
        inspect.signature(fn).bind(None)
    except ValueError:  # a builtin without a signature: called as it is
        pass
    except TypeError as e:
        takes = "the batch (a list of events)" if batched else "one event"
        raise TypeError(f"{what} must take {takes} as its one argument: {e}") from None


def positive(name: str, value: Any, kind: type, *, least: int | None = None) -> None:
    """Raise a clear ValueError unless `value` is a positive `kind` (int, or any number),
    or, with `least`, one at least that big."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or math.isnan(value)  # every comparison with NaN is False: it would pass the next
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
    "max_consecutive_failures": (int, 1),
    "rank": (int, 0),
    "world_size": (int, 1),
}
_MAY_BE_NONE = ("hang_timeout", "cost_every", "max_consecutive_failures", "rank", "world_size")


def check_bus_args(args: dict[str, Any]) -> None:
    """Refuse a bad `EventBus(...)` argument with a ValueError or TypeError that names it
    (read later on the bus thread, a bad one killed it there)."""
    for name, (kind, least) in _BUS_ARGS.items():
        if not (args[name] is None and name in _MAY_BE_NONE):
            positive(name, args[name], kind, least=least)
    for name in ("handle_signals", "strict"):
        if not isinstance(args[name], bool):
            raise TypeError(f"{name} must be True or False, got {args[name]!r}")
    if not isinstance(args["name"], str) or not args["name"]:
        raise TypeError(
            f"name must be a non-empty str (the bus thread's name), got {args['name']!r}"
        )


def timeout_of(call: str, timeout: Any, default: float) -> float:
    """`flush(timeout=)` / `close(timeout=)` as seconds: None gives `default`, a negative one
    0; anything else not a number (NaN included) is a ValueError, before any waiting."""
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or math.isnan(timeout):
        raise ValueError(f"{call}(timeout=) takes seconds (a number) or None, got {timeout!r}")
    return max(0.0, float(timeout))
