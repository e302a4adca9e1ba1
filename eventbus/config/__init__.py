"""Subscribers built from configuration, so torchrun workers get them without code changes.

One resolver serves the environment, TOML files and the CLI's `--subscribe SPEC`:

    EVENTBUS_SUBSCRIBERS="jsonl:runs/exp1; divergence:action=stop"      SPECs, ';'-separated
    EVENTBUS_SUBSCRIBERS='[{"factory": "tensorboard", "args": ["runs/tb"], "ranks": [0]}]'
    EVENTBUS_CONFIG=eventbus.toml        (EVENTBUS_SUBSCRIBERS=eventbus.toml works too)

A SPEC is `NAME[:ARG]` or `package.module:factory[:ARG]`, where ARG is one positional value
(`jsonl:runs/exp1`) or `key=value` pairs (`divergence:action=stop,patience=5`; values are
JSON when they parse as JSON, else strings). A TOML file (or JSON entry) carries options too:

    [bus]                                # EventBus keyword arguments (bus_from_config),
    stop_check_every = 10                # typed and range-checked at load time

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
naming the source, the entry and what to fix, before anything is subscribed. A module is
imported only when an entry names it as its factory.

Modules: `_entries` (one subscriber entry: SPEC or table), `_bus` (the `[bus]` options),
`_sources` (environment, TOML and JSON documents; building and subscribing).
"""

from eventbus.config._entries import ConfigError, Configured, SubscriberConfig, parse_spec
from eventbus.config._sources import (
    CONFIG_ENV,
    SUBSCRIBERS_ENV,
    bus_from_config,
    load_config,
    subscribe_from_config,
    subscriber_from_spec,
    subscribers_from_config,
)

__all__ = [
    "CONFIG_ENV",
    "SUBSCRIBERS_ENV",
    "ConfigError",
    "Configured",
    "SubscriberConfig",
    "bus_from_config",
    "load_config",
    "parse_spec",
    "subscribe_from_config",
    "subscriber_from_spec",
    "subscribers_from_config",
]
