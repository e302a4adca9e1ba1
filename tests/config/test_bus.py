"""The [bus] table: every EventBus option typed and range-checked at load time."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from eventbus import EventBus
from eventbus.config import ConfigError, bus_from_config, load_config
from eventbus.config._bus import RULES
from tests.config.subs import write_toml


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("drain_interval = 0", "drain_interval must be > 0 seconds.*got 0$"),
        ("drain_interval = nan", "drain_interval must be > 0 seconds.*got nan"),
        ("drain_interval = inf", "drain_interval must be > 0 seconds.*got inf"),
        ('drain_interval = "fast"', "drain_interval must be > 0 seconds.*got 'fast'"),
        ('inbox_maxsize = "big"', "inbox_maxsize must be an int >= 2, got 'big'"),
        ("inbox_maxsize = 1", "inbox_maxsize must be an int >= 2, got 1"),
        ("inbox_maxsize = 1e6", "inbox_maxsize must be an int >= 2, got 1000000.0"),
        ("close_timeout = -1", "close_timeout must be > 0 seconds.*got -1"),
        ('handle_signals = "yes"', "handle_signals must be true or false, got 'yes'"),
        ("max_consecutive_failures = 0", "max_consecutive_failures must be an int >= 1"),
        ("rank = -1", "rank must be an int >= 0, got -1"),
        ("world_size = 0", "world_size must be an int >= 1, got 0"),
        ("rank = 2\nworld_size = 2", "rank 2 must be below world_size 2"),
        ('name = ""', "name must be a non-empty string"),
        ("stop_check_every = true", "stop_check_every must be an int >= 1, got True"),
        (
            "drain_intervall = 1",
            "unknown option 'drain_intervall'.*did you mean 'drain_interval'"
            ".*known options: close_timeout, cost_every, drain_interval, handle_signals",
        ),
        ("bus = 1", "unknown option 'bus'"),
    ],
)
def test_bad_bus_option(tmp_path: Path, line: str, message: str) -> None:
    path = write_toml(tmp_path, f"[bus]\n{line}\n")
    where = rf"{path} \[bus\]: "
    with pytest.raises(ConfigError, match=where + message):
        load_config(path)  # checked at load time: nothing is built
    with pytest.raises(ConfigError, match=where + message):
        bus_from_config(path)


def test_bus_table_must_be_a_table(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[bus\]: must be a table of EventBus options"):
        load_config(write_toml(tmp_path, 'bus = "fast"\n'))


def test_bus_options_cover_every_eventbus_keyword() -> None:
    """Each keyword EventBus takes has a typed, range-checked rule in config."""
    params = inspect.signature(EventBus).parameters
    assert set(RULES) == set(params)
