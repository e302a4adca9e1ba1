"""`eventbus.bench.variants`: which variants run, and where each puts its subscribers."""

from __future__ import annotations

from pathlib import Path

import pytest

from eventbus.bench.inline import InlineBus, NullBus
from eventbus.bench.sources import BenchError, sources
from eventbus.bench.variants import plan
from eventbus.bus import EventBus
from eventbus.events import Loss
from tests.bench import subs


def test_every_variant_in_the_table_order() -> None:
    names = [v.name for v in plan(sources([subs.Sleeper, subs.Spinner]))]
    assert names == [
        "bare",
        "inline:Sleeper",
        "inline:Spinner",
        "bus:Sleeper",
        "bus:Spinner",
        "bus:all",
        "process:Sleeper",
        "process:Spinner",
    ]


def test_bus_all_only_with_two_subscribers_or_more() -> None:
    names = [v.name for v in plan(sources([subs.Sleeper]))]
    assert names == ["bare", "inline:Sleeper", "bus:Sleeper", "process:Sleeper"]


def test_only_keeps_kinds_and_names_and_always_bare() -> None:
    srcs = sources([subs.Sleeper, subs.Spinner])
    assert [v.name for v in plan(srcs, ["inline", "bus:Spinner", "bus:all"])] == [
        "bare",
        "inline:Sleeper",
        "inline:Spinner",
        "bus:Spinner",
        "bus:all",
    ]
    with pytest.raises(BenchError, match=r"unknown variant\(s\) 'buss'.*inline"):
        plan(srcs, ["buss"])


def test_a_subscriber_the_sidecar_cannot_take_is_skipped_with_the_reason() -> None:
    (bare, process) = plan(sources([subs.Locked]), ["process"])
    assert process.name == "process:Locked"
    assert process.skipped is not None
    assert "picklable" in process.skipped
    assert bare.skipped is None


def test_each_variant_gives_the_step_its_own_bus_with_fresh_subscribers() -> None:
    bare, inline, bus, process = plan(sources(["tests.bench.subs:Locked"]), None)
    assert process.skipped is not None  # Locked holds a lock
    s = bare.open()
    assert type(s.bus) is NullBus
    assert s.close().delivered == 0

    a, b = inline.open(), inline.open()
    assert isinstance(a.bus, InlineBus)
    assert a.bus.sub is not b.bus.sub
    a.bus.publish(Loss(step=1, value=1.0))
    assert a.close().delivered == 1
    b.close()

    s = bus.open()
    assert isinstance(s.bus, EventBus)
    s.bus.publish(Loss(step=1, value=1.0))
    assert s.settle()
    assert s.sidecar_pid() is None  # placement="thread"
    counts = s.close()
    assert (counts.delivered, counts.dropped, counts.failed) == (1, 0, 0)


def test_process_places_it_in_the_sidecar_and_bus_all_keeps_default_placements(
    tmp_path: Path,
) -> None:
    variants = {
        v.name: v
        for v in plan(sources(["tests.bench.subs:Spinner:ms=0.1", "jsonl:" + str(tmp_path)]))
    }
    s = variants["process:Spinner"].open()
    s.bus.publish(Loss(step=1, value=1.0))
    assert s.settle()
    assert s.sidecar_pid() is not None
    assert s.close().delivered == 1

    s = variants["bus:jsonl"].open()  # placement="thread": no sidecar
    assert s.settle()
    assert s.sidecar_pid() is None
    s.close()

    s = variants["bus:all"].open()  # the JSONL writer where it runs by default: the sidecar
    assert s.settle()
    assert s.sidecar_pid() is not None
    s.close()


def test_failures_and_errors_are_counted() -> None:
    (_, inline, bus, _) = plan(sources([subs.Failing]))
    for v in (inline, bus):
        s = v.open()
        s.bus.publish(Loss(step=1, value=1.0))
        s.settle()
        counts = s.close()
        assert counts.failed == 1, v.name
        assert any("planted failure" in e for e in counts.errors), counts.errors
