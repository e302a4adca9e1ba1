"""Where configuration comes from (environment, TOML, JSON, lists) and what it builds."""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eventbus.config._bus import check_bus_options
from eventbus.config._entries import (
    ConfigError,
    Configured,
    SubscriberConfig,
    parse_entry,
    parse_spec,
)

if TYPE_CHECKING:
    from eventbus.bus import EventBus, Subscription

__all__ = [
    "CONFIG_ENV",
    "SUBSCRIBERS_ENV",
    "Source",
    "bus_from_config",
    "load_config",
    "subscribe_from_config",
    "subscriber_from_spec",
    "subscribers_from_config",
]

CONFIG_ENV = "EVENTBUS_CONFIG"
SUBSCRIBERS_ENV = "EVENTBUS_SUBSCRIBERS"


def _read_toml(path: Path, where: str) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"{where}: cannot read {str(path)!r}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: {str(path)!r} is not valid TOML: {e}") from None


_Parsed = tuple[dict[str, Any], list[SubscriberConfig]]  # ([bus] options, subscribers)


def _document(doc: Mapping[str, Any], where: str) -> _Parsed:
    unknown = sorted(set(doc) - {"subscribers", "bus"})
    if unknown:
        raise ConfigError(
            f"{where}: unknown top-level key(s) {', '.join(map(repr, unknown))}; "
            "use [[subscribers]] entries and an optional [bus] table"
        )
    bus = check_bus_options(doc.get("bus", {}), where)
    subs = doc.get("subscribers", [])
    if not isinstance(subs, list):
        raise ConfigError(f"{where}: 'subscribers' must be an array of tables ([[subscribers]])")
    return bus, [parse_entry(raw, f"{where} subscribers #{i}") for i, raw in enumerate(subs, 1)]


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
        return {}, [parse_entry(raw, f"{where} entry {i}") for i, raw in enumerate(data, 1)]
    specs = [p for p in s.replace("\n", ";").split(";") if p.strip()]
    return {}, [
        parse_spec(p, where=f"{where} entry {i} ({p.strip()!r})") for i, p in enumerate(specs, 1)
    ]


def _merged(*parts: tuple[str, _Parsed]) -> _Parsed:
    """Several sources' options and subscribers; an option two sources set differently is
    an error (which one wins would be a guess)."""
    bus: dict[str, Any] = {}
    seen: dict[str, str] = {}
    subs: list[SubscriberConfig] = []
    for where, (opts, configs) in parts:
        for k, v in opts.items():
            if k in bus and bus[k] != v:
                raise ConfigError(
                    f"{where} [bus]: {k} = {v!r} contradicts {seen[k]}'s "
                    f"{bus[k]!r}; set it in one place"
                )
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
    return [parse_entry(raw, f"subscriber config entry {i}") for i, raw in enumerate(source, 1)]


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
    except (TypeError, ValueError) as e:  # an option RULES does not cover, or a keyword
        named = [w for w, (opts, _) in parts if opts] + ["keywords"] * bool(options)
        raise ConfigError(f"bus options from {' and '.join(named)}: {e}") from None
    for b in _build(configs, bus.rank):
        b.subscribe(bus)
    return bus
