"""Subscribers built from configuration, so torchrun workers get them without code changes.

One resolver serves the environment, TOML files and the CLI's `--subscribe SPEC`:

    EVENTBUS_SUBSCRIBERS="jsonl:runs/exp1; divergence:action=stop"      SPECs, ';'-separated
    EVENTBUS_SUBSCRIBERS='[{"factory": "tensorboard", "args": ["runs/tb"], "ranks": [0]}]'
    EVENTBUS_CONFIG=eventbus.toml        (EVENTBUS_SUBSCRIBERS=eventbus.toml works too)

A SPEC is `NAME[:ARG]` or `package.module:factory[:ARG]`, where ARG is one positional value
(`jsonl:runs/exp1`) or `key=value` pairs (`divergence:action=stop,patience=5`; values are
JSON when they parse as JSON, else strings). A TOML file (or JSON entry) carries options too:

    [bus]                                # EventBus keyword arguments (bus_from_config)
    stop_check_every = 10

    [[subscribers]]
    factory = "mypkg.analysis:Spectrum"  # a short name or "package.module:factory"
    args = []                            # positional arguments
    kwargs = { bins = 64 }               # keyword arguments
    placement = "process"                # built in the child: nothing is pickled
    policy = "drop_oldest"
    ranks = [0]
    events = ["Loss", "TensorStats"]     # event type names
    name = "spectrum"

Everything is checked when the configuration is loaded: a bad entry raises `ConfigError`
naming the entry and what to fix, before anything is subscribed.
"""

from __future__ import annotations

import difflib
import inspect
import json
import math
import os
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eventbus.events import Event, event_type
from eventbus.loader import SHORT_NAMES, LoadError, load_object

if TYPE_CHECKING:
    from eventbus.bus import EventBus, Subscription

__all__ = [
    "CONFIG_ENV",
    "SHORT_NAMES",
    "SUBSCRIBERS_ENV",
    "ConfigError",
    "Configured",
    "SubscriberConfig",
    "bus_from_config",
    "load_config",
    "load_object",  # re-exported (with SHORT_NAMES) until process placement imports eventbus.loader
    "parse_spec",
    "subscribe_from_config",
    "subscriber_from_spec",
    "subscribers_from_config",
]

CONFIG_ENV = "EVENTBUS_CONFIG"
SUBSCRIBERS_ENV = "EVENTBUS_SUBSCRIBERS"

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
        opts: dict[str, Any] = {k: getattr(self, k) for k in _OPTIONS if k != "events"
                                and getattr(self, k) is not None}
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
            return ProcessSubscriber(SHORT_NAMES.get(self.factory, self.factory),
                                     args=self.args, kwargs=self.kwargs,
                                     events=self.event_types())
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
    required = [p for p in params if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
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


def _entry(raw: Any, where: str) -> SubscriberConfig:
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
        factory=factory, args=tuple(args), kwargs=dict(kwargs), policy=raw.get("policy"),
        ranks=tuple(ranks) if isinstance(ranks, list | tuple) else ranks,
        placement=raw.get("placement"),
        events=tuple(events) if isinstance(events, list | tuple) else events,
        maxsize=raw.get("maxsize"), max_batch=raw.get("max_batch"), name=raw.get("name"),
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
        not isinstance(c.events, tuple) or not c.events
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


def _read_toml(path: Path, where: str) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"{where}: cannot read {str(path)!r}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: {str(path)!r} is not valid TOML: {e}") from None


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
_BUS_RULES: dict[str, _Rule] = {
    "drain_interval": _Rule("> 0 seconds (a finite number)", _seconds),
    "inbox_maxsize": _Rule("an int >= 2", _int_from(2)),
    "close_timeout": _Rule("> 0 seconds (a finite number)", _seconds),
    "handle_signals": _Rule("true or false", lambda v: type(v) is bool),
    "max_consecutive_failures": _Rule("an int >= 1 (JSON null: never disable)",
                                      lambda v: v is None or _int_from(1)(v)),
    "rank": _Rule("an int >= 0", _int_from(0)),
    "world_size": _Rule("an int >= 1", _int_from(1)),
    "name": _Rule("a non-empty string", lambda v: isinstance(v, str) and bool(v)),
    "stop_check_every": _Rule("an int >= 1", _int_from(1)),
}


def _bus_keywords() -> list[str]:
    """Every keyword `EventBus` takes (its signature, so a new option is known at once)."""
    from eventbus.bus import EventBus

    params = inspect.signature(EventBus).parameters.values()
    return sorted({p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
                  | set(_BUS_RULES))


def _bus_options(raw: Any, where: str) -> dict[str, Any]:
    """A `[bus]` table, every option known, typed and in range (EventBus's own wording)."""
    w = f"{where} [bus]"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{w}: must be a table of EventBus options, got {raw!r}")
    known = _bus_keywords()
    for key, value in raw.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"{w}: unknown option {key!r} (EventBus does not take it); {hint}"
                f"known options: {', '.join(known)}"
            )
        rule = _BUS_RULES.get(key)
        if rule is not None and not rule.ok(value):
            raise ConfigError(f"{w}: {key} must be {rule.need}, got {value!r}")
    rank, size = raw.get("rank"), raw.get("world_size")
    if rank is not None and size is not None and rank >= size:
        raise ConfigError(f"{w}: rank {rank} must be below world_size {size}")
    return dict(raw)


_Parsed = tuple[dict[str, Any], list[SubscriberConfig]]  # ([bus] options, subscribers)


def _document(doc: Mapping[str, Any], where: str) -> _Parsed:
    unknown = sorted(set(doc) - {"subscribers", "bus"})
    if unknown:
        raise ConfigError(
            f"{where}: unknown top-level key(s) {', '.join(map(repr, unknown))}; "
            "use [[subscribers]] entries and an optional [bus] table"
        )
    bus = _bus_options(doc.get("bus", {}), where)
    subs = doc.get("subscribers", [])
    if not isinstance(subs, list):
        raise ConfigError(f"{where}: 'subscribers' must be an array of tables ([[subscribers]])")
    return bus, [_entry(raw, f"{where} subscribers #{i}") for i, raw in enumerate(subs, 1)]


def _toml(path: Path, where: str) -> _Parsed:
    return _document(_read_toml(path, where), where)


def _from_text(text: str, where: str) -> _Parsed:
    """An environment variable's value: a TOML path, JSON, or ';'-separated SPECs."""
    s = text.strip()
    if not s:
        return {}, []
    if s.endswith(".toml") or (os.sep in s and Path(s).is_file() and "\n" not in s):
        return _toml(Path(s), f"{where} ({s})")
    if s[0] in "[{":
        try:
            data = json.loads(s)
        except ValueError as e:
            raise ConfigError(f"{where}: starts like JSON but does not parse: {e}") from None
        if isinstance(data, Mapping):
            return _document(data, where)
        return {}, [_entry(raw, f"{where} entry {i}") for i, raw in enumerate(data, 1)]
    specs = [p for p in s.replace("\n", ";").split(";") if p.strip()]
    return {}, [parse_spec(p, where=f"{where} entry {i} ({p.strip()!r})")
                for i, p in enumerate(specs, 1)]


def _merged(*parts: tuple[str, _Parsed]) -> _Parsed:
    """Several sources' options and subscribers; an option two sources set differently is
    an error (which one wins would be a guess)."""
    bus: dict[str, Any] = {}
    seen: dict[str, str] = {}
    subs: list[SubscriberConfig] = []
    for where, (opts, configs) in parts:
        for k, v in opts.items():
            if k in bus and bus[k] != v:
                raise ConfigError(f"{where} [bus]: {k} = {v!r} contradicts {seen[k]}'s "
                                  f"{bus[k]!r}; set it in one place")
            bus[k], seen[k] = v, where
        subs += configs
    return bus, subs


def _environment(config: Path | None = None) -> list[tuple[str, _Parsed]]:
    """`config` or else `EVENTBUS_CONFIG` (a TOML path), then `EVENTBUS_SUBSCRIBERS`."""
    out = []
    if config is not None:
        out.append((str(config), _toml(config, str(config))))
    elif path := os.environ.get(CONFIG_ENV, "").strip():
        out.append((CONFIG_ENV, _toml(Path(path), f"{CONFIG_ENV} ({path})")))
    out.append((SUBSCRIBERS_ENV, _from_text(os.environ.get(SUBSCRIBERS_ENV, ""), SUBSCRIBERS_ENV)))
    return out


Source = str | os.PathLike[str] | Mapping[str, Any] | Sequence[Any] | None


def load_config(source: Source = None) -> list[SubscriberConfig]:
    """Parse and check a configuration (its `[bus]` table too); nothing is built yet.

    `source`: None (the environment: `EVENTBUS_CONFIG`, then `EVENTBUS_SUBSCRIBERS`), a TOML
    path, a string as the environment variable takes it, a parsed document (dict with
    `subscribers`), or a list of SPEC strings / entry dicts.
    """
    if source is None:
        return _merged(*_environment())[1]
    if isinstance(source, os.PathLike):
        return _toml(Path(source), str(source))[1]
    if isinstance(source, str):
        return _from_text(source, "subscriber config")[1]
    if isinstance(source, Mapping):
        return _document(source, "subscriber config")[1]
    return [_entry(raw, f"subscriber config entry {i}") for i, raw in enumerate(source, 1)]


def _build(configs: list[SubscriberConfig], rank: int | None) -> list[Configured]:
    built = []
    for c in configs:
        ranks = c.effective_ranks()
        if rank is not None and ranks is not None and rank not in ranks:
            continue  # not built at all here: a TensorBoard writer on rank 1 makes no files
        built.append(Configured(c.build(), c.subscribe_options(), c))
    return built


def subscribers_from_config(source: Source = None, *, rank: int | None = None) -> list[Configured]:
    """Build the configured subscribers (for `rank`: entries for other ranks are skipped)."""
    return _build(load_config(source), rank)


def subscriber_from_spec(spec: str) -> Any:
    """The subscriber one SPEC builds (the CLI's `--subscribe SPEC`)."""
    return parse_spec(spec).build()


def subscribe_from_config(bus: EventBus, source: Source = None) -> list[Subscription]:
    """Build and subscribe what the configuration (default: the environment) names."""
    return [b.subscribe(bus) for b in subscribers_from_config(source, rank=bus.rank)]


def bus_from_config(source: str | os.PathLike[str] | None = None, **options: Any) -> EventBus:
    """An `EventBus` with the `[bus]` options of a TOML file (default: `EVENTBUS_CONFIG`) and of
    `EVENTBUS_SUBSCRIBERS`, `options` on top, and both sources' subscribers subscribed."""
    from eventbus.bus import EventBus

    parts = _environment(config=None if source is None else Path(source))
    bus_opts, configs = _merged(*parts)
    try:
        bus = EventBus(**{**bus_opts, **options})
    except (TypeError, ValueError) as e:  # an option _BUS_RULES does not cover, or a keyword
        named = [w for w, (opts, _) in parts if opts] + ["keywords"] * bool(options)
        raise ConfigError(f"bus options from {' and '.join(named)}: {e}") from None
    for b in _build(configs, bus.rank):
        b.subscribe(bus)
    return bus
