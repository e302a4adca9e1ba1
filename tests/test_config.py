"""Subscribers built from configuration: SPECs, environment variables, TOML; bad entries."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from eventbus import Event, EventBus
from eventbus.config import (
    CONFIG_ENV,
    SUBSCRIBERS_ENV,
    ConfigError,
    bus_from_config,
    load_config,
    parse_spec,
    subscribe_from_config,
    subscriber_from_spec,
    subscribers_from_config,
)
from eventbus.events import Loss, StepEnded
from eventbus.monitors import DivergenceDetector
from eventbus.process import ProcessSubscriber
from eventbus.sinks import JsonlWriter


class Collector:
    """A configurable test subscriber (module level: importable by path)."""

    policy = "drop_newest"

    def __init__(self, tag: str = "", n: int = 0) -> None:
        self.tag, self.n = tag, n
        self.got: list[Event] = []

    async def on_events(self, batch: list[Event]) -> None:
        self.got.extend(batch)


class RankZeroOnly(Collector):
    ranks = (0,)


def make_collector(**kw: Any) -> Collector:
    return Collector(**kw)


def on_loss(ev: Event) -> None:
    """A plain function subscriber, named by path."""


READY = Collector(tag="ready")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.delenv(SUBSCRIBERS_ENV, raising=False)


# -- SPECs (shared with the CLI's --subscribe) ---------------------------------------------


def test_spec_forms() -> None:
    c = parse_spec("jsonl:runs/x")
    assert (c.factory, c.args, c.kwargs) == ("jsonl", ("runs/x",), {})
    c = parse_spec("divergence")
    assert (c.factory, c.args, c.kwargs) == ("divergence", (), {})
    c = parse_spec("divergence:action=stop,metric=grad_norm")
    assert c.kwargs == {"action": "stop", "metric": "grad_norm"}
    c = parse_spec("tests.test_config:Collector:tag=a,n=3")
    assert (c.factory, c.kwargs) == ("tests.test_config:Collector", {"tag": "a", "n": 3})
    c = parse_spec("tests.test_config:Collector:hello")
    assert c.args == ("hello",)


def test_spec_builds_builtins_and_paths(tmp_path: Path) -> None:
    w = subscriber_from_spec(f"jsonl:{tmp_path}")
    assert isinstance(w, JsonlWriter)
    d = subscriber_from_spec("divergence:action=stop")
    assert isinstance(d, DivergenceDetector)
    assert d.action == "stop"
    c = subscriber_from_spec("tests.test_config:make_collector:tag=x")
    assert isinstance(c, Collector)
    assert c.tag == "x"
    assert subscriber_from_spec("tests.test_config:on_loss") is on_loss  # a function of one event
    assert subscriber_from_spec("tests.test_config:READY") is READY  # an object: used as is
    assert [b.subscriber for b in subscribers_from_config(["tests.test_config:READY"], rank=0)] \
        == [READY]
    assert isinstance(subscriber_from_spec("tb:" + str(tmp_path / "tb")).ranks, tuple)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nonsense", "unknown subscriber 'nonsense'.*jsonl.*package.module:factory"),
        ("no_such_module_xyz:thing", "cannot import 'no_such_module_xyz'"),
        ("tests.test_config:Missing", "has no attribute 'Missing'"),
        ("tests.test_config:Collector:colour=red", "arguments do not fit.*colour"),
        ("divergence:action=explode", "building DivergenceDetector.*action must be one of"),
        ("", "empty"),
    ],
)
def test_bad_specs_say_what_to_fix(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        subscriber_from_spec(spec)


# -- environment variables -----------------------------------------------------------------


def test_env_json_with_options(monkeypatch: pytest.MonkeyPatch) -> None:
    entries = [
        {"factory": "tests.test_config:Collector", "kwargs": {"tag": "a"}, "policy": "block",
         "events": ["Loss"], "name": "first", "maxsize": 5},
        {"factory": "tests.test_config:Collector", "ranks": [1]},
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
        f"jsonl:{tmp_path / 'j'}; tensorboard:{tmp_path / 'tb'} ;tests.test_config:RankZeroOnly",
    )
    on0 = subscribers_from_config(rank=0)
    assert [type(b.subscriber).__name__ for b in on0] == [
        "JsonlWriter", "TensorBoardSink", "RankZeroOnly"]
    for b in on0:
        if hasattr(b.subscriber, "on_close"):
            b.subscriber.on_close()
    on1 = subscribers_from_config(rank=1)
    assert [type(b.subscriber).__name__ for b in on1] == ["JsonlWriter"]  # TB: rank 0 only


def test_env_config_toml_and_bus_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    toml = tmp_path / "eventbus.toml"
    toml.write_text(
        '[bus]\nstop_check_every = 7\ndrain_interval = 0.003\n\n'
        '[[subscribers]]\nfactory = "tests.test_config:Collector"\nargs = ["t"]\n'
        'events = "Loss"\n'
    )
    monkeypatch.setenv(CONFIG_ENV, str(toml))
    monkeypatch.setenv(SUBSCRIBERS_ENV, "tests.test_config:Collector:tag=env")
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
    doc = {"subscribers": [{"factory": "tests.process.subs:Tally",
                            "kwargs": {"path": str(tmp_path / "steps")},
                            "placement": "process"}]}
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


# -- bad configuration: a clear error naming the entry, raised at load time ------------------


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([{"factory": "jsonl", "polcy": "block"}],
         r"entry 1.*unknown key\(s\) 'polcy'; allowed: factory"),
        ([{"args": ["x"]}], "entry 1: 'factory' is required"),
        (["divergence", {"factory": "divergence", "policy": "sometimes"}],
         "entry 2 .*policy 'sometimes' is not one of block"),
        ([{"factory": "divergence", "ranks": ["0"]}], "ranks must be a list of ranks"),
        ([{"factory": "divergence", "placement": "gpu"}], "placement 'gpu'"),
        ([{"factory": "divergence", "events": ["Loss", "Losss"]}], "unknown event type 'Losss'"),
        ([{"factory": "divergence", "kwargs": ["a"]}], "'kwargs' must be a table"),
        ([{"factory": "divergence", "maxsize": 0}], "maxsize must be a positive int"),
        ([42], "entry 1: expected a SPEC string or a table"),
    ],
)
def test_bad_entries(entries: list[Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(entries)


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
    two.write_text('[[subscribers]]\nfactory = "divergence"\n\n'
                   '[[subscribers]]\nfactory = "divergence"\nranks = "all"\n')
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


# -- issue 14 item 10: every bad entry is a ConfigError naming its source and entry ----------


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, body: str) -> str:
    """A module `name` on sys.path whose import runs `body`."""
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_relative_import_path_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SUBSCRIBERS_ENV, ".relative:x")
    with pytest.raises(ConfigError, match=r"EVENTBUS_SUBSCRIBERS entry 1 \('\.relative:x'\): "
                       r".*not an absolute module name \(relative imports"):
        load_config()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("def broken(:\n", "SyntaxError"),
        ("raise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here"),
        ("import sys\nsys.exit(2)\n", "SystemExit: 2.*__main__"),  # a script without a guard
        ("from no_such_dependency_xyz import thing\n", "No module named 'no_such_dependency_xyz'"),
    ],
    ids=["syntax", "raises", "sys.exit", "missing-dependency"],
)
def test_module_failing_at_import_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, message: str
) -> None:
    name = _module(tmp_path, monkeypatch, f"cfg_bad_{abs(hash(body))}", body)
    monkeypatch.setenv(SUBSCRIBERS_ENV, f"divergence; {name}:make")
    with pytest.raises(ConfigError, match=rf"EVENTBUS_SUBSCRIBERS entry 2 \('{name}:make'\): "
                       rf".*{name}.*{message}"):
        load_config()


def test_keyboard_interrupt_at_import_is_not_swallowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = _module(tmp_path, monkeypatch, "cfg_ctrl_c", "raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        load_config([f"{name}:make"])


def test_factory_raising_system_exit_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = _module(tmp_path, monkeypatch, "cfg_exits",
                   "import sys\ndef make():\n    sys.exit('no')\n")
    with pytest.raises(ConfigError,
                       match=r"entry 1 \('cfg_exits:make'\): building make\(\) failed: SystemExit"):
        subscribers_from_config([f"{name}:make"])


def _toml_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "eventbus.toml"
    path.write_text(text)
    return path


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
        ("drain_intervall = 1", "unknown option 'drain_intervall'.*did you mean 'drain_interval'"
                                ".*known options: close_timeout, drain_interval, handle_signals"),
        ("bus = 1", "unknown option 'bus'"),
    ],
)
def test_bad_bus_option(tmp_path: Path, line: str, message: str) -> None:
    path = _toml_file(tmp_path, f"[bus]\n{line}\n")
    where = rf"{path} \[bus\]: "
    with pytest.raises(ConfigError, match=where + message):
        load_config(path)  # checked at load time: nothing is built
    with pytest.raises(ConfigError, match=where + message):
        bus_from_config(path)


def test_bus_table_must_be_a_table(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[bus\]: must be a table of EventBus options"):
        load_config(_toml_file(tmp_path, 'bus = "fast"\n'))


def test_bus_options_cover_every_eventbus_keyword() -> None:
    """Each keyword EventBus takes has a typed, range-checked rule in config."""
    import inspect

    from eventbus import config

    params = inspect.signature(EventBus).parameters
    assert set(config._BUS_RULES) == set(params)


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
    path = _toml_file(tmp_path, "[bus]\ndrain_interval = 0.01\n")
    monkeypatch.setenv(SUBSCRIBERS_ENV, json.dumps({"bus": {"drain_interval": 0.05}}))
    with pytest.raises(ConfigError, match=r"EVENTBUS_SUBSCRIBERS \[bus\]: drain_interval = 0.05 "
                       r"contradicts .*eventbus.toml's 0.01; set it in one place"):
        bus_from_config(path)


def test_nothing_named_is_imported_before_the_whole_config_is_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guarantee 6: a bad [bus] table fails before any subscriber module runs, and a path that
    appears only as an argument value is never imported."""
    marker = tmp_path / "imported"
    name = _module(tmp_path, monkeypatch, "cfg_marks",
                   f"open({str(marker)!r}, 'a').write('x')\ndef make(*a, **k):\n    return a\n")
    path = _toml_file(tmp_path, f'[bus]\ndrain_interval = 0\n\n[[subscribers]]\n'
                                f'factory = "{name}:make"\n')
    with pytest.raises(ConfigError, match="drain_interval"):
        bus_from_config(path)
    assert not marker.exists()
    load_config([f"tests.test_config:Collector:{name}:make",
                 {"factory": "tests.test_config:Collector", "kwargs": {"tag": f"{name}:make"}}])
    assert not marker.exists()
    load_config([f"{name}:make"])  # asked for: imported
    assert marker.exists()
