"""What the bench runs: the user's step and the subscribers, resolved and checked up front.

A step is a callable `step(step: int, bus)`, or the text `module:function` /
`path/to/file.py:function` naming one. A subscriber is a SPEC (`eventbus.config.parse_spec`:
`jsonl:DIR`, `divergence`, `pkg.mod:factory[:ARG]`), a `SubscriberConfig`, a class or other
factory taking no arguments (built afresh for every variant), or a ready subscriber (an object
with `on_events`, or a function of one event: the same object in every variant).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eventbus.config import ConfigError, SubscriberConfig, parse_spec
from eventbus.core.subscriber import describe, unique_name
from eventbus.loader import LoadError, load_object

__all__ = ["BenchError", "Source", "StepFn", "check_step", "load_step", "sources"]

StepFn = Callable[[int, Any], object]
"""The user's step: called with the step number and the bus to publish on."""


class BenchError(ValueError):
    """Bad input to the bench (a step or subscriber that cannot be used, a count that is not
    positive), or a step that raised: the message names it, and the step number."""


def load_step(target: str) -> StepFn:
    """The step `module:function` or `path/to/file.py:function` names (imported now).

    A file's directory goes first on `sys.path` (as `python path/to/file.py` does), so its
    module imports by name here and in the sidecar process.
    """
    where, sep, attr = target.rpartition(":")
    if not sep or not where or not attr:
        raise BenchError(f"step {target!r}: write 'module:function' or 'path/to/file.py:function'")
    if where.endswith(".py") or "/" in where:
        path = Path(where).resolve()
        if not path.is_file():
            raise BenchError(f"step {target!r}: no such file {where}")
        if not path.stem.isidentifier():
            raise BenchError(f"step {target!r}: name the file as a module ({path.stem!r} is not)")
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        where = path.stem
        found = sys.modules.get(where)
        if found is not None and Path(getattr(found, "__file__", "") or "").resolve() != path:
            raise BenchError(
                f"step {target!r}: a module named {where!r} is already imported from "
                f"{getattr(found, '__file__', None)}; rename {path.name}"
            )
    try:
        fn = load_object(f"{where}:{attr}", where=f"step {target!r}")
    except LoadError as e:
        raise BenchError(str(e)) from None
    return check_step(fn, target)


def check_step(fn: Any, name: str | None = None) -> StepFn:
    """`fn` if it can be called as `fn(step, bus)`; else a `BenchError` saying why."""
    shown = name or describe(fn)
    if not callable(fn):
        raise BenchError(f"step {shown!r} is not callable: {type(fn).__name__}")
    try:
        inspect.signature(fn).bind(0, None)
    except ValueError:  # a builtin without a signature: let the call decide
        pass
    except TypeError:
        raise BenchError(
            f"step {shown!r} must take (step, bus): the step number and the bus to publish on"
        ) from None
    step: StepFn = fn
    return step


@dataclass(frozen=True)
class Source:
    """One subscriber to bench: a name, how to get one for a variant, how to subscribe it."""

    name: str
    make: Callable[[], Any]
    options: Mapping[str, Any]  # keyword arguments for bus.subscribe (policy, events, ...)
    fresh: bool  # built anew for every variant (False: the caller's own object, reused)


def sources(subscribers: Iterable[Any] | str) -> list[Source]:
    """Each subscriber resolved, built once now (a bad one fails before anything runs), named."""
    items = [subscribers] if isinstance(subscribers, str) else list(subscribers)
    if not items:
        raise BenchError("name at least one subscriber to bench (a SPEC such as 'jsonl:DIR')")
    taken: set[str] = {"all"}  # `bus:all` is the variant with every subscriber
    return [_source(item, taken) for item in items]


def _source(item: Any, taken: set[str]) -> Source:
    options: dict[str, Any] = {}
    if isinstance(item, str | SubscriberConfig):
        try:
            c = parse_spec(item) if isinstance(item, str) else item
            options = c.subscribe_options()
        except ConfigError as e:
            raise BenchError(str(e)) from None
        made = dataclasses.replace(c, placement=None)  # built here; the variant places it
        make: Callable[[], Any] = lambda: _built(made)  # noqa: E731
        fresh = True
    elif _is_factory(item):
        make, fresh = lambda: _made(item), True
    elif hasattr(item, "on_events") or callable(item):
        make, fresh = lambda: item, False
    else:
        raise BenchError(
            "a subscriber is a SPEC string, a class or factory, an object with "
            f"on_events(batch) or a function of one event; got {type(item).__name__}: {item!r:.80}"
        )
    first = make()
    name = unique_name(options.get("name") or describe(first), taken)
    return Source(name, make, options, fresh)


def _is_factory(item: Any) -> bool:
    """A class, or a callable without `on_events` that takes no argument."""
    if isinstance(item, type):
        return True
    if hasattr(item, "on_events") or not callable(item):
        return False
    try:
        inspect.signature(item).bind()
    except (TypeError, ValueError):
        return False
    return True


def _built(c: SubscriberConfig) -> Any:
    try:
        return c.build()
    except ConfigError as e:
        raise BenchError(str(e)) from None


def _made(factory: Callable[[], Any]) -> Any:
    try:
        return factory()
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # user code: a factory may raise anything
        raise BenchError(
            f"building subscriber {describe(factory)!r} failed: {type(e).__name__}: {e}"
        ) from e
