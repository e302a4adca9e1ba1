"""bus.step() and bus.phase(): the standard events for custom loops, host timing only."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from eventbus import EventBus
from eventbus.events import (
    BackwardEnded,
    BatchLoaded,
    ForwardEnded,
    Loss,
    OptimizerStepped,
    StepEnded,
    StepStarted,
)
from eventbus.steps import current_step
from tests.conftest import Recorder


def _names(got: list[Any]) -> list[tuple[str, int | None]]:
    return [(type(e).__name__, e.step) for e in got]


def test_step_publishes_started_and_ended_with_duration_and_counts(
    bus: EventBus, recorder: Recorder
) -> None:
    bus.subscribe(recorder)
    with bus:
        for n in (1, 2):
            with bus.step(n, samples=8) as s:
                time.sleep(0.02)
                s.tokens = torch.tensor(8 * 128)  # known inside the step; a tensor is fine
    assert _names(recorder.got) == [
        ("StepStarted", 1),
        ("StepEnded", 1),
        ("StepStarted", 2),
        ("StepEnded", 2),
    ]
    ended = [e for e in recorder.got if isinstance(e, StepEnded)]
    for e in ended:
        assert e.samples == 8
        assert e.tokens == 1024
        assert type(e.tokens) is int
        assert 0.02 <= e.duration_s < 1.0
    assert s.duration_s == ended[-1].duration_s


def test_step_timing_never_synchronises_the_device(
    bus: EventBus, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_sync(*a: Any, **k: Any) -> None:
        raise AssertionError("bus.step must time with the host clock, not a device sync")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    bus.subscribe(recorder)
    with bus, bus.step(1), bus.phase("forward"):
        pass
    assert [type(e) for e in recorder.got] == [StepStarted, ForwardEnded, StepEnded]


def test_phases_take_the_step_of_the_open_scope(bus: EventBus, recorder: Recorder) -> None:
    bus.subscribe(recorder)
    norm = torch.tensor(2.5)
    with bus:
        with bus.step(7):
            with bus.phase("data"):
                pass
            with bus.phase("forward"):
                pass
            with bus.phase("backward"):
                time.sleep(0.01)
            with bus.phase("optimizer", lr=0.1) as ph:
                ph.set(grad_norm=norm)
            norm.fill_(0)  # after publish: the snapshot keeps 2.5
        with bus.phase("forward"):  # outside a step: no step number
            pass
        with bus.phase("forward", step=9):
            pass
    kinds = [type(e) for e in recorder.got]
    assert kinds == [
        StepStarted,
        BatchLoaded,
        ForwardEnded,
        BackwardEnded,
        OptimizerStepped,
        StepEnded,
        ForwardEnded,
        ForwardEnded,
    ]
    assert [e.step for e in recorder.got] == [7, 7, 7, 7, 7, 7, None, 9]
    opt = recorder.got[4]
    assert opt.lr == 0.1
    assert opt.grad_norm == 2.5
    assert opt.duration_s >= 0
    assert recorder.got[3].duration_s >= 0.01


def test_a_step_that_raises_publishes_no_end(bus: EventBus, recorder: Recorder) -> None:
    bus.subscribe(recorder)
    with bus:
        with pytest.raises(RuntimeError, match="oom"), bus.step(3), bus.phase("forward"):
            raise RuntimeError("oom")
        assert current_step(bus) is None  # the scope closed even so
        with bus.step(4):
            pass
    assert _names(recorder.got) == [("StepStarted", 3), ("StepStarted", 4), ("StepEnded", 4)]


def test_nested_steps_restore_the_outer_one(bus: EventBus) -> None:
    assert current_step(bus) is None
    with bus.step(1):
        with bus.step(2):
            assert current_step(bus) == 2
        assert current_step(bus) == 1
    assert current_step(bus) is None


def test_steps_of_two_buses_are_independent() -> None:
    a, b = EventBus(), EventBus()
    with a.step(5):
        assert current_step(a) == 5
        assert current_step(b) is None
    a.close()
    b.close()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda bus: bus.step("1"), TypeError, "step number as an int"),
        (lambda bus: bus.step(1.0), TypeError, "step number as an int"),
        (lambda bus: bus.step(1, samples=-1), TypeError, "samples must be"),
        (lambda bus: bus.step(1, tokens="many"), TypeError, "tokens must be"),
        (lambda bus: bus.phase("fwd"), ValueError, "unknown phase 'fwd'; use one of data, forward"),
        (lambda bus: bus.phase("forward", lr=1.0), TypeError, "ForwardEnded has no field"),
        (lambda bus: bus.phase("optimizer", step="x"), TypeError, "step must be an int"),
    ],
)
def test_bad_arguments_fail_where_they_are_given(
    bus: EventBus, call: Any, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        call(bus)


def test_a_bad_count_set_inside_the_step_fails_at_its_end(bus: EventBus) -> None:
    with pytest.raises(TypeError, match="samples must be"), bus.step(1) as s:
        s.samples = "eight"
    assert current_step(bus) is None


def test_set_checks_field_names(bus: EventBus) -> None:
    ph = bus.phase("optimizer")
    with pytest.raises(TypeError, match=r"OptimizerStepped has no field.*takes grad_norm, lr"):
        ph.set(gradnorm=1.0)


# -- device time (CUDA events at the ends of a phase) ------------------------------------------


class _FakeCudaEvent:
    """Stands in for torch.cuda.Event: `query()` says whether the device got there."""

    def __init__(self, done: bool, ms: float = 12.5) -> None:
        self.done, self.ms = done, ms

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: _FakeCudaEvent) -> float:
        assert self.done and end.done, "elapsed_time before both completed would wait"
        return self.ms


def test_device_time_is_read_once_the_device_got_there_never_waited_for() -> None:
    """A phase's `device_s` rides the capture path: the router polls the end event (never
    blocking) and delivers the event, in order, once it completed."""
    from eventbus._capture_pending import DeviceSpan

    rec = Recorder()
    start, end = _FakeCudaEvent(True), _FakeCudaEvent(False)
    with EventBus(drain_interval=0.002) as bus:
        bus.subscribe(rec)
        bus.publish(ForwardEnded(step=1, duration_s=0.001, device_s=DeviceSpan(start, end)))  # type: ignore[arg-type]
        bus.publish(Loss(step=1, value=2.0))
        assert not bus.flush(timeout=0.3)  # the device is not there yet: held, in order
        assert rec.got == []
        end.done = True
        assert bus.flush()
    fwd, loss = rec.got
    assert isinstance(fwd, ForwardEnded) and fwd.device_s == 0.0125 and fwd.duration_s == 0.001
    assert isinstance(loss, Loss)


def test_a_device_time_that_cannot_be_read_is_none_and_logged() -> None:
    from eventbus._capture_pending import DeviceSpan

    class Broken(_FakeCudaEvent):
        def query(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access")

    rec = Recorder()
    with EventBus(drain_interval=0.002) as bus:
        bus.subscribe(rec)
        span = DeviceSpan(_FakeCudaEvent(True), Broken(False))
        bus.publish(BackwardEnded(step=1, device_s=span))  # type: ignore[arg-type]
    (ev,) = rec.got
    assert isinstance(ev, BackwardEnded) and ev.device_s is None


def test_device_time_is_refused_where_it_cannot_be() -> None:
    bus = EventBus()
    with pytest.raises(ValueError, match="no device time"):
        bus.phase("data", device_time=True)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            bus.phase("forward", device_time=True)
    bus.close()
