"""One configured subscriber: a SPEC string or a table, checked and built."""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from eventbus.events import Event, event_type
from eventbus.loader import SHORT_NAMES, LoadError, load_object

if TYPE_CHECKING:
    from eventbus.bus import EventBus, Subscription

__all__ = ["ConfigError", "Configured", "SubscriberConfig", "parse_entry", "parse_spec"]

_OPTIONS = ("policy", "ranks", "placement", "events", "maxsize", "max_batch", "name")
_ENTRY_KEYS = ("factory", "args", "kwargs", *_OPTIONS)
_PLACEMENTS = ("thread", "process")
_POLICIES = ("block", "drop_oldest", "drop_newest", "latest")


class ConfigError(ValueError):
    """A subscriber configuration that cannot be used; says which entry and what to fix."""


def _load(path: str, where: str) -> Any:
    """`load_object`, its `LoadError` as a `ConfigError` naming the source and entry."""
    try:
        return load_object(path)
    except LoadError as e:
        raise ConfigError(f"{where}: {e}") from e


@dataclass
class SubscriberConfig:
    """One configured subscriber: how to build it and how to subscribe it (all checked)."""

    factory: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    policy: str | None = None
    ranks: tuple[int, ...] | None = None
    placement: str | None = None
    events: tuple[str, ...] | None = None
    maxsize: int | None = None
    max_batch: int | None = None
    name: str | None = None
    where: str = ""  # "EVENTBUS_SUBSCRIBERS entry 2 ('jsonl')": prefixes every error

    def factory_object(self) -> Any:
        """The callable the factory path names (imported now)."""
        obj = _load(self.factory, self.where)
        if not callable(obj):
            raise ConfigError(f"{self.where}: {self.factory!r} is not callable")
        return obj

    def event_types(self) -> tuple[type[Event], ...] | None:
        """`events` as classes (after importing the factory, which may define them)."""
        if self.events is None:
            return None
        out = []
        for n in self.events:
            cls = event_type(n)
            if cls is None:
                raise ConfigError(
                    f"{self.where}: unknown event type {n!r} in events=; use a class name "
                    "such as 'Loss' or 'StepEnded' (user events must be defined in a module "
                    "the factory imports)"
                )
            out.append(cls)
        return tuple(out)

    def effective_ranks(self) -> tuple[int, ...] | None:
        """`ranks` from the entry, else a `ranks` keyword argument, else the factory's class
        attribute (`TensorBoardSink.ranks == (0,)`); None means every rank."""
        if self.ranks is not None:
            return self.ranks
        if "ranks" in self.kwargs:
            r = self.kwargs["ranks"]
            return None if r is None else tuple(r)
        cls_ranks = getattr(_load(self.factory, self.where), "ranks", None)
        return tuple(cls_ranks) if isinstance(cls_ranks, (tuple, list)) else None

    def ready_made(self) -> Any:
        """The named object itself when it already is a subscriber (an object with
        `on_events`, or a function of one event) and no arguments were given; else None."""
        if self.args or self.kwargs:
            return None
        obj = _load(self.factory, self.where)
        if isinstance(obj, type):
            return None
        if hasattr(obj, "on_events"):
            return obj
        return obj if _one_required_argument(obj) else None

    def check(self) -> None:
        """Import the factory, resolve event names, bind the arguments: raise what is wrong."""
        made = self.ready_made()
        self.event_types()
        if made is not None:
            return
        fn = self.factory_object()
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin without a signature: let the call decide
            return
        try:
            sig.bind(*self.args, **self.kwargs)
        except TypeError as e:
            raise ConfigError(
                f"{self.where}: arguments do not fit {_qualname(fn)}{sig}: {e}; fix args/kwargs "
                "(in a SPEC: name:ARG or name:key=value,...)"
            ) from None

    def subscribe_options(self) -> dict[str, Any]:
        """Keyword arguments for `bus.subscribe` (only those given)."""
        opts: dict[str, Any] = {
            k: getattr(self, k) for k in _OPTIONS if k != "events" and getattr(self, k) is not None
        }
        types = self.event_types()
        if types is not None:
            opts["events"] = types
        return opts

    def build(self) -> Any:
        """The subscriber object; with `placement="process"` a `ProcessSubscriber` whose
        child builds it from the import path (so nothing needs to be picklable)."""
        made = self.ready_made()
        if self.placement == "process":
            from eventbus.process import ProcessSubscriber

            if made is not None:  # module-level: pickled by reference
                return ProcessSubscriber(made, events=self.event_types())
            return ProcessSubscriber(
                SHORT_NAMES.get(self.factory, self.factory),
                args=self.args,
                kwargs=self.kwargs,
                events=self.event_types(),
            )
        if made is not None:
            return made
        fn = self.factory_object()
        try:
            return fn(*self.args, **self.kwargs)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # user code: a factory may raise anything, SystemExit too
            raise ConfigError(
                f"{self.where}: building {_qualname(fn)}({_show_args(self)}) failed: "
                f"{type(e).__name__}: {e}"
            ) from e


@dataclass(frozen=True)
class Configured:
    """A built subscriber and the options to subscribe it with."""

    subscriber: Any
    options: dict[str, Any]
    config: SubscriberConfig

    def subscribe(self, bus: EventBus) -> Subscription:
        """`bus.subscribe(subscriber, **options)`."""
        return bus.subscribe(self.subscriber, **self.options)


def _one_required_argument(fn: Any) -> bool:
    """A plain function of one event (`def on_loss(ev)`), not a factory."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    required = [
        p
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return len(required) == 1


def _qualname(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", None) or type(fn).__qualname__)


def _show_args(c: SubscriberConfig) -> str:
    parts = [repr(a) for a in c.args] + [f"{k}={v!r}" for k, v in c.kwargs.items()]
    return ", ".join(parts)


# -- parsing ------------------------------------------------------------------------------


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _is_ident(s: str) -> bool:
    return s.isidentifier()


def parse_spec(spec: str, *, where: str = "") -> SubscriberConfig:
    """A SPEC (`jsonl:DIR`, `divergence`, `divergence:action=stop`, `pkg.mod:factory[:ARG]`)."""
    text = spec.strip()
    where = where or f"subscriber spec {spec!r}"
    if not text:
        raise ConfigError(f"{where}: empty; use e.g. 'jsonl:runs/exp1' or 'pkg.mod:factory'")
    head, sep, rest = text.partition(":")
    if head in SHORT_NAMES:
        factory, arg = head, rest if sep else None
    elif not sep:
        raise ConfigError(
            f"{where}: unknown subscriber {head!r}; use a built-in ({', '.join(SHORT_NAMES)}) "
            "or an import path 'package.module:factory'"
        )
    else:
        attr, sep2, arg_text = rest.partition(":")
        if not attr:
            raise ConfigError(f"{where}: the import path needs a factory after ':'")
        factory, arg = f"{head}:{attr}", arg_text if sep2 else None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}
    if arg:
        pairs = [p.partition("=") for p in arg.split(",")]
        if all(eq and _is_ident(k.strip()) for k, eq, _ in pairs):
            kwargs = {k.strip(): _value(v.strip()) for k, _, v in pairs}
        else:
            args = (arg,)
    return _checked(SubscriberConfig(factory=factory, args=args, kwargs=kwargs, where=where))


def parse_entry(raw: Any, where: str) -> SubscriberConfig:
    """One entry of a list or document: a SPEC string or a table of `factory` and options."""
    if isinstance(raw, str):
        return parse_spec(raw, where=f"{where} ({raw.strip()!r})")
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a SPEC string or a table, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_ENTRY_KEYS))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; allowed: "
            f"{', '.join(_ENTRY_KEYS)}"
        )
    factory = raw.get("factory")
    if not isinstance(factory, str) or not factory:
        raise ConfigError(
            f"{where}: 'factory' is required: a built-in ({', '.join(SHORT_NAMES)}) or "
            "'package.module:factory'"
        )
    where = f"{where} ({factory!r})"
    args = raw.get("args", [])
    if isinstance(args, str) or not isinstance(args, Sequence):
        raise ConfigError(f"{where}: 'args' must be a list, got {args!r}")
    kwargs = raw.get("kwargs", {})
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ConfigError(f"{where}: 'kwargs' must be a table of name = value, got {kwargs!r}")
    ranks: Any = raw.get("ranks")
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        ranks = [ranks]
    events: Any = raw.get("events")
    if isinstance(events, str):
        events = [events]
    c = SubscriberConfig(
        factory=factory,
        args=tuple(args),
        kwargs=dict(kwargs),
        policy=raw.get("policy"),
        ranks=tuple(ranks) if isinstance(ranks, list | tuple) else ranks,
        placement=raw.get("placement"),
        events=tuple(events) if isinstance(events, list | tuple) else events,
        maxsize=raw.get("maxsize"),
        max_batch=raw.get("max_batch"),
        name=raw.get("name"),
        where=where,
    )
    return _checked(c)


def _checked(c: SubscriberConfig) -> SubscriberConfig:
    w = c.where
    if c.policy is not None and c.policy not in _POLICIES:
        raise ConfigError(f"{w}: policy {c.policy!r} is not one of {', '.join(_POLICIES)}")
    if c.placement is not None and c.placement not in _PLACEMENTS:
        raise ConfigError(f"{w}: placement {c.placement!r} is not 'thread' or 'process'")
    if c.ranks is not None and (
        not isinstance(c.ranks, tuple)
        or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in c.ranks)
    ):
        raise ConfigError(f"{w}: ranks must be a list of ranks (ints >= 0), got {c.ranks!r}")
    if c.events is not None and (
        not isinstance(c.events, tuple)
        or not c.events
        or not all(isinstance(n, str) for n in c.events)
    ):
        raise ConfigError(f"{w}: events must be a non-empty list of type names, got {c.events!r}")
    for key in ("maxsize", "max_batch"):
        v = getattr(c, key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigError(f"{w}: {key} must be a positive int, got {v!r}")
    if c.name is not None and (not isinstance(c.name, str) or not c.name):
        raise ConfigError(f"{w}: name must be a non-empty string, got {c.name!r}")
    c.check()
    return c
