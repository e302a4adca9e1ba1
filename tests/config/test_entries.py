"""One subscriber entry: SPECs and tables, built or refused with a clear error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from eventbus.config import (
    SUBSCRIBERS_ENV,
    ConfigError,
    load_config,
    parse_spec,
    subscriber_from_spec,
    subscribers_from_config,
)
from eventbus.monitors import DivergenceDetector
from eventbus.sinks import JsonlWriter
from tests.config.subs import READY, Collector, on_loss, write_module

# -- SPECs (shared with the CLI's --subscribe) ---------------------------------------------


def test_spec_forms() -> None:
    c = parse_spec("jsonl:runs/x")
    assert (c.factory, c.args, c.kwargs) == ("jsonl", ("runs/x",), {})
    c = parse_spec("divergence")
    assert (c.factory, c.args, c.kwargs) == ("divergence", (), {})
    c = parse_spec("divergence:action=stop,metric=grad_norm")
    assert c.kwargs == {"action": "stop", "metric": "grad_norm"}
    c = parse_spec("tests.config.subs:Collector:tag=a,n=3")
    assert (c.factory, c.kwargs) == ("tests.config.subs:Collector", {"tag": "a", "n": 3})
    c = parse_spec("tests.config.subs:Collector:hello")
    assert c.args == ("hello",)


def test_spec_builds_builtins_and_paths(tmp_path: Path) -> None:
    w = subscriber_from_spec(f"jsonl:{tmp_path}")
    assert isinstance(w, JsonlWriter)
    d = subscriber_from_spec("divergence:action=stop")
    assert isinstance(d, DivergenceDetector)
    assert d.action == "stop"
    c = subscriber_from_spec("tests.config.subs:make_collector:tag=x")
    assert isinstance(c, Collector)
    assert c.tag == "x"
    assert subscriber_from_spec("tests.config.subs:on_loss") is on_loss  # a function of one event
    assert subscriber_from_spec("tests.config.subs:READY") is READY  # an object: used as is
    assert [b.subscriber for b in subscribers_from_config(["tests.config.subs:READY"], rank=0)] == [
        READY
    ]
    assert isinstance(subscriber_from_spec("tb:" + str(tmp_path / "tb")).ranks, tuple)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nonsense", "unknown subscriber 'nonsense'.*jsonl.*package.module:factory"),
        ("no_such_module_xyz:thing", "cannot import 'no_such_module_xyz'"),
        ("tests.config.subs:Missing", "has no attribute 'Missing'"),
        ("tests.config.subs:Collector:colour=red", "arguments do not fit.*colour"),
        ("divergence:action=explode", "building DivergenceDetector.*action must be one of"),
        ("", "empty"),
    ],
)
def test_bad_specs_say_what_to_fix(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        subscriber_from_spec(spec)


# -- bad configuration: a clear error naming the entry, raised at load time ------------------


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (
            [{"factory": "jsonl", "polcy": "block"}],
            r"entry 1.*unknown key\(s\) 'polcy'; allowed: factory",
        ),
        ([{"args": ["x"]}], "entry 1: 'factory' is required"),
        (
            ["divergence", {"factory": "divergence", "policy": "sometimes"}],
            "entry 2 .*policy 'sometimes' is not one of block",
        ),
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


def test_relative_import_path_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SUBSCRIBERS_ENV, ".relative:x")
    with pytest.raises(
        ConfigError,
        match=r"EVENTBUS_SUBSCRIBERS entry 1 \('\.relative:x'\): "
        r".*not an absolute module name \(relative imports",
    ):
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
    name = write_module(tmp_path, monkeypatch, f"cfg_bad_{abs(hash(body))}", body)
    monkeypatch.setenv(SUBSCRIBERS_ENV, f"divergence; {name}:make")
    with pytest.raises(
        ConfigError,
        match=rf"EVENTBUS_SUBSCRIBERS entry 2 \('{name}:make'\): "
        rf".*{name}.*{message}",
    ):
        load_config()


def test_keyboard_interrupt_at_import_is_not_swallowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = write_module(tmp_path, monkeypatch, "cfg_ctrl_c", "raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        load_config([f"{name}:make"])


def test_factory_raising_system_exit_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = write_module(
        tmp_path, monkeypatch, "cfg_exits", "import sys\ndef make():\n    sys.exit('no')\n"
    )
    with pytest.raises(
        ConfigError, match=r"entry 1 \('cfg_exits:make'\): building make\(\) failed: SystemExit"
    ):
        subscribers_from_config([f"{name}:make"])
