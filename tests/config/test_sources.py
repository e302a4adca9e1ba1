"""Configuration from the environment, TOML and JSON; what it builds and subscribes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eventbus import EventBus
from eventbus.config import (
    CONFIG_ENV,
    SUBSCRIBERS_ENV,
    ConfigError,
    bus_from_config,
    load_config,
    subscribe_from_config,
    subscribers_from_config,
)
from eventbus.events import Loss, StepEnded
from eventbus.process import ProcessSubscriber
from tests.config.subs import write_module, write_toml

# -- environment variables -----------------------------------------------------------------


def test_env_json_with_options(monkeypatch: pytest.MonkeyPatch) -> None:
    entries = [
        {
            "factory": "tests.config.subs:Collector",
            "kwargs": {"tag": "a"},
            "policy": "block",
            "events": ["Loss"],
            "name": "first",
            "maxsize": 5,
        },
        {"factory": "tests.config.subs:Collector", "ranks": [1]},
    ]
    monkeypatch.setenv(SUBSCRIBERS_ENV, json.dumps(entries))
    with EventBus(drain_interval=0.002) as bus:
        subs = subscribe_from_config(bus)
        assert [s.name for s in subs] == ["first"]  # the rank-1 entry is not built on rank 0
        bus.publish(Loss(step=1, value=1.0))
        bus.publish(StepEnded(step=1))
        bus.flush(timeout=5)
        st = subs[0].stats()
    assert st is not None
    assert (st.policy, st.published) == ("block", 1)


def test_env_spec_list_and_rank_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(
        SUBSCRIBERS_ENV,
        f"jsonl:{tmp_path / 'j'}; tensorboard:{tmp_path / 'tb'} ;tests.config.subs:RankZeroOnly",
    )
    on0 = subscribers_from_config(rank=0)
    assert [type(b.subscriber).__name__ for b in on0] == [
        "JsonlWriter",
        "TensorBoardSink",
        "RankZeroOnly",
    ]
    for b in on0:
        if hasattr(b.subscriber, "on_close"):
            b.subscriber.on_close()
    on1 = subscribers_from_config(rank=1)
    assert [type(b.subscriber).__name__ for b in on1] == ["JsonlWriter"]  # TB: rank 0 only


def test_env_config_toml_and_bus_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    toml = tmp_path / "eventbus.toml"
    toml.write_text(
        "[bus]\nstop_check_every = 7\ndrain_interval = 0.003\n\n"
        '[[subscribers]]\nfactory = "tests.config.subs:Collector"\nargs = ["t"]\n'
        'events = "Loss"\n'
    )
    monkeypatch.setenv(CONFIG_ENV, str(toml))
    monkeypatch.setenv(SUBSCRIBERS_ENV, "tests.config.subs:Collector:tag=env")
    bus = bus_from_config()
    try:
        assert bus.drain_interval == 0.003
        st = bus.stats()
        assert list(st.subscribers) == ["Collector", "Collector#2"]
    finally:
        bus.close()
    assert len(load_config()) == 2  # both variables read by the plain loader too
    monkeypatch.delenv(CONFIG_ENV)
    monkeypatch.setenv(SUBSCRIBERS_ENV, str(toml))  # a .toml path in the subscribers variable
    assert [c.args for c in load_config()] == [("t",)]


def test_process_placement_from_config(tmp_path: Path) -> None:
    doc = {
        "subscribers": [
            {
                "factory": "tests.process.subs:Tally",
                "kwargs": {"path": str(tmp_path / "steps")},
                "placement": "process",
            }
        ]
    }
    built = subscribers_from_config(doc)
    sub = built[0].subscriber
    assert isinstance(sub, ProcessSubscriber)  # built in the child: nothing pickled
    bus = EventBus(drain_interval=0.002)
    h = built[0].subscribe(bus)
    with bus:
        for i in range(5):
            bus.publish(Loss(step=i, value=1.0))
    assert h.stats().delivered == 5  # type: ignore[union-attr]
    assert (tmp_path / "steps").read_text().split() == ["0", "1", "2", "3", "4"]


def test_bad_env_and_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(SUBSCRIBERS_ENV, '[{"factory": "jsonl",')
    with pytest.raises(ConfigError, match="EVENTBUS_SUBSCRIBERS: starts like JSON"):
        load_config()
    monkeypatch.setenv(SUBSCRIBERS_ENV, "divergence; nonsense")
    with pytest.raises(ConfigError, match=r"EVENTBUS_SUBSCRIBERS entry 2 \('nonsense'\)"):
        load_config()
    monkeypatch.delenv(SUBSCRIBERS_ENV)
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match=r"cannot read .*missing\.toml"):
        load_config()
    bad = tmp_path / "bad.toml"
    bad.write_text("[[subscribers]\nfactory = 1\n")
    monkeypatch.setenv(CONFIG_ENV, str(bad))
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config()
    top = tmp_path / "top.toml"
    top.write_text('[[subscriber]]\nfactory = "jsonl"\n')
    with pytest.raises(ConfigError, match=r"unknown top-level key\(s\) 'subscriber'"):
        load_config(top)
    two = tmp_path / "two.toml"
    two.write_text(
        '[[subscribers]]\nfactory = "divergence"\n\n'
        '[[subscribers]]\nfactory = "divergence"\nranks = "all"\n'
    )
    with pytest.raises(ConfigError, match=r"two.toml subscribers #2 \('divergence'\): ranks"):
        load_config(two)
    opts = tmp_path / "opts.toml"
    opts.write_text("[bus]\ndrain_intervall = 1\n")
    with pytest.raises(ConfigError, match=r"opts.toml \[bus\]: unknown option 'drain_intervall'"):
        bus_from_config(opts)


def test_nothing_configured_is_empty() -> None:
    assert load_config() == []
    with EventBus() as bus:
        assert subscribe_from_config(bus) == []


def test_bus_options_in_env_json_are_checked_and_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SUBSCRIBERS_ENV, json.dumps({"bus": {"drain_interval": 0}}))
    with pytest.raises(ConfigError, match=r"EVENTBUS_SUBSCRIBERS \[bus\]: drain_interval"):
        load_config()
    monkeypatch.setenv(SUBSCRIBERS_ENV, json.dumps({"bus": {"drain_interval": 0.007}}))
    bus = bus_from_config()
    bus.close()
    assert bus.drain_interval == 0.007  # applied (it used to be ignored silently)
    monkeypatch.setenv(SUBSCRIBERS_ENV, json.dumps({"bus": {"name": "from-env"}}))
    bus = bus_from_config(name="from-code")  # keyword options win over files
    bus.close()
    assert bus.name == "from-code"


def test_two_sources_disagreeing_on_a_bus_option(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = write_toml(tmp_path, "[bus]\ndrain_interval = 0.01\n")
    monkeypatch.setenv(SUBSCRIBERS_ENV, json.dumps({"bus": {"drain_interval": 0.05}}))
    with pytest.raises(
        ConfigError,
        match=r"EVENTBUS_SUBSCRIBERS \[bus\]: drain_interval = 0.05 "
        r"contradicts .*eventbus.toml's 0.01; set it in one place",
    ):
        bus_from_config(path)


def test_nothing_named_is_imported_before_the_whole_config_is_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guarantee 6: a bad [bus] table fails before any subscriber module runs, and a path that
    appears only as an argument value is never imported."""
    marker = tmp_path / "imported"
    name = write_module(
        tmp_path,
        monkeypatch,
        "cfg_marks",
        f"open({str(marker)!r}, 'a').write('x')\ndef make(*a, **k):\n    return a\n",
    )
    path = write_toml(
        tmp_path, f'[bus]\ndrain_interval = 0\n\n[[subscribers]]\nfactory = "{name}:make"\n'
    )
    with pytest.raises(ConfigError, match="drain_interval"):
        bus_from_config(path)
    assert not marker.exists()
    load_config(
        [
            f"tests.config.subs:Collector:{name}:make",
            {"factory": "tests.config.subs:Collector", "kwargs": {"tag": f"{name}:make"}},
        ]
    )
    assert not marker.exists()
    load_config([f"{name}:make"])  # asked for: imported
    assert marker.exists()
