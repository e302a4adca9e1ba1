"""`eventbus.bench.sources`: the step and the subscribers, resolved and checked before a run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from eventbus.bench.sources import BenchError, load_step, sources
from eventbus.config import parse_spec
from eventbus.events import Event
from tests.bench import subs


def test_a_module_path_names_the_step() -> None:
    assert load_step("tests.bench.subs:cpu_step") is subs.cpu_step


def test_a_file_path_names_the_step_and_its_module_imports_by_name(tmp_path: Path) -> None:
    f = tmp_path / "bench_step_file_mod.py"
    f.write_text("def step(step, bus):\n    return step * 2\n", encoding="utf-8")
    try:
        fn = load_step(f"{f}:step")
        assert fn(3, None) == 6
        assert str(tmp_path) in sys.path  # so the sidecar finds it too
        assert sys.modules["bench_step_file_mod"].step is fn
    finally:
        sys.modules.pop("bench_step_file_mod", None)
        sys.path.remove(str(tmp_path))


@pytest.mark.parametrize(
    ("target", "words"),
    [
        ("no_such_module_xyz:step", ["cannot import", "no_such_module_xyz"]),
        ("tests.bench.subs:nope", ["no attribute", "nope"]),
        ("tests.bench.subs:STEP_MS", ["not callable"]),
        ("tests.bench.subs:spin_cpu", ["must take (step, bus)"]),
        ("just_a_name", ["module:function"]),
        ("missing/dir/step.py:step", ["no such file"]),
    ],
)
def test_a_step_that_cannot_be_used_is_a_bench_error(target: str, words: list[str]) -> None:
    with pytest.raises(BenchError) as e:
        load_step(target)
    for w in words:
        assert w in str(e.value)


def test_a_spec_resolves_as_configuration_does_and_builds_fresh_each_time() -> None:
    (src,) = sources(["tests.bench.subs:Sleeper:ms=1.5"])
    a, b = src.make(), src.make()
    assert isinstance(a, subs.Sleeper)
    assert a.ms == 1.5
    assert a is not b
    assert src.name == "Sleeper"
    assert src.fresh


def test_a_config_keeps_its_subscribe_options() -> None:
    c = parse_spec("tests.bench.subs:Sleeper")
    c.policy, c.maxsize, c.name = "drop_newest", 7, "slow"
    (src,) = sources([c])
    assert src.name == "slow"
    assert src.options == {"policy": "drop_newest", "maxsize": 7, "name": "slow"}


def test_classes_are_built_per_variant_and_objects_are_reused() -> None:
    seen: list[Event] = []

    def on_event(ev: Event) -> None:
        seen.append(ev)

    spinner = subs.Spinner(1.0)
    by_class, by_object, by_function = sources([subs.Locked, spinner, on_event])
    assert by_class.fresh and by_class.make() is not by_class.make()
    assert not by_object.fresh and by_object.make() is spinner
    assert by_function.make() is on_event
    assert (by_class.name, by_object.name, by_function.name) == (
        "Locked",
        "Spinner",
        "test_classes_are_built_per_variant_and_objects_are_reused.<locals>.on_event",
    )


def test_the_same_subscriber_twice_gets_two_names() -> None:
    names = [s.name for s in sources(["tests.bench.subs:Sleeper", "tests.bench.subs:Sleeper"])]
    assert names == ["Sleeper", "Sleeper#2"]


@pytest.mark.parametrize(
    ("item", "words"),
    [
        ("no_such_builtin", ["unknown subscriber", "no_such_builtin"]),
        ("tests.bench.subs:Nope", ["no attribute", "Nope"]),
        ("tests.bench.subs:Sleeper:bogus=1", ["arguments do not fit"]),
        (42, ["a subscriber is a SPEC string", "int"]),
    ],
)
def test_a_subscriber_that_cannot_be_used_is_a_bench_error(item: Any, words: list[str]) -> None:
    with pytest.raises(BenchError) as e:
        sources([item])
    for w in words:
        assert w in str(e.value)


def test_a_factory_that_raises_is_a_bench_error_naming_it() -> None:
    def broken() -> Any:
        raise OSError("disk full")

    with pytest.raises(BenchError, match=r"building subscriber .*broken.* OSError: disk full"):
        sources([broken])


def test_no_subscriber_is_a_bench_error() -> None:
    with pytest.raises(BenchError, match="at least one subscriber"):
        sources([])
