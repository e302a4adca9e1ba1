"""The sidecar's side: user code that raises anything, returns coroutines, and its `bus`."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from eventbus import EventBus
from eventbus.events import CheckpointSaved, Loss, SaveRequested, Scalars, StopRequested
from eventbus.process import ProcessSubscriber
from eventbus.process.errors import RemoteError
from tests.conftest import Recorder
from tests.process.subs import (
    Handle,
    Raiser,
    ReturnsCoroutine,
    SaveAsker,
    exit_on_even,
    on_one,
    steps_in,
)

NewBus = Callable[..., EventBus]
BASE_EXCEPTIONS = ["SystemExit", "KeyboardInterrupt", "GeneratorExit"]


def test_function_subscriber_in_child(new_bus: NewBus) -> None:
    bus = new_bus()
    h = bus.subscribe(on_one, events=[Loss], placement="process", policy="block", max_batch=1)
    with bus:
        for i in range(6):
            bus.publish(Loss(step=i, value=1.0))
    st = h.stats()
    assert st is not None
    assert (st.delivered, st.failed) == (5, 1)
    assert st.error is not None
    assert "KeyError" in st.error


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize("what", BASE_EXCEPTIONS)
def test_base_exception_in_on_events_fails_that_batch_and_the_child_goes_on(
    new_bus: NewBus, tmp_path: Path, what: str, sync: bool
) -> None:
    bus = new_bus()
    sub = ProcessSubscriber(Raiser(str(tmp_path / "s"), what, on=(3, 5), sync=sync))
    h = bus.subscribe(sub, max_batch=1)
    with bus:
        for i in range(10):
            bus.publish(Loss(step=i, value=1.0))
        assert bus.flush(timeout=30)
        side = bus.stats().sidecar
        assert side is not None
        assert side.alive  # still answering: a failure, not the end of the sidecar
    st = h.stats()
    assert st is not None
    assert (st.delivered, st.failed, st.dropped) == (8, 2, 0)
    assert st.error is not None
    assert f"{what}: {what} at step 5" in st.error
    assert steps_in(tmp_path / "s") == list(range(10))  # the same sidecar saw every batch
    assert bus.stats().sidecar.restarts == 0  # type: ignore[union-attr]


def test_repeated_system_exit_from_a_function_is_counted_per_batch(new_bus: NewBus) -> None:
    bus = new_bus()
    h = bus.subscribe(exit_on_even, events=[Loss], placement="process", policy="block", max_batch=1)
    with bus:
        for i in range(20):
            bus.publish(Loss(step=i, value=1.0))
    st = h.stats()
    assert st is not None
    assert (st.delivered, st.failed, st.state) == (10, 10, "closed")
    assert "SystemExit: step 18" in (st.error or "")


@pytest.mark.parametrize("what", BASE_EXCEPTIONS)
def test_base_exception_in_on_close_is_reported_not_a_death(
    new_bus: NewBus, tmp_path: Path, what: str
) -> None:
    bus = new_bus()
    sub = ProcessSubscriber(Raiser(str(tmp_path / "s"), what, where="on_close"))
    h = bus.subscribe(sub)
    with bus:
        bus.publish(Loss(step=1, value=1.0))
    st = h.stats()
    assert st is not None
    assert st.delivered == 1
    assert f"{what}: {what} in on_close" in (st.error or "")


def test_base_exception_in_state_dict_is_a_remote_error(new_bus: NewBus, tmp_path: Path) -> None:
    bus = new_bus()
    sub = ProcessSubscriber(Raiser(str(tmp_path / "s"), "SystemExit", where="state_dict"))
    bus.subscribe(sub)
    with bus:
        with pytest.raises(RemoteError, match="SystemExit: SystemExit in state_dict"):
            bus.state_dict()
        assert bus.stats().sidecar.alive  # type: ignore[union-attr]


def test_base_exception_in_on_start_disables_like_a_failed_start(
    new_bus: NewBus, tmp_path: Path
) -> None:
    bus = new_bus()
    sub = ProcessSubscriber(Raiser(str(tmp_path / "s"), "KeyboardInterrupt", where="on_start"))
    h = bus.subscribe(sub)
    with bus:
        bus.publish(Loss(step=1, value=1.0))
        assert bus.flush(timeout=30)
    st = h.stats()
    assert st is not None
    assert (st.delivered, st.state) == (0, "closed")
    assert "KeyboardInterrupt in on_start" in (st.error or "")


def test_a_function_returning_a_coroutine_has_it_awaited_in_the_child(
    new_bus: NewBus, tmp_path: Path
) -> None:
    bus = new_bus()
    h = bus.subscribe(
        ReturnsCoroutine(str(tmp_path / "s")), events=[Loss], placement="process", policy="block"
    )
    with bus:
        for i in range(5):
            bus.publish(Loss(step=i, value=1.0))
    assert h.stats().delivered == 5  # type: ignore[union-attr]
    assert steps_in(tmp_path / "s") == list(range(5))  # the coroutines ran, in order


def test_child_bus_is_a_bus_handle_with_the_one_control(new_bus: NewBus) -> None:
    bus = new_bus()
    seen = Recorder(events=[Scalars, StopRequested])
    bus.subscribe(seen)
    bus.subscribe(Handle(), events=[Loss], placement="process", max_batch=1)
    with bus:
        bus.publish(Loss(step=3, value=1.0))
        assert bus.flush(timeout=30)
    (report,) = [e for e in seen.got if isinstance(e, Scalars)]
    assert report.values == {
        "is_handle": 1.0,
        "real_control": 1.0,
        "should_stop": 1.0,
        "rank": 0.0,
        "world_size": 1.0,
        "local_rank": 0.0,
    }
    assert bus.control.should_abort  # the child's request reached the parent's control
    assert bus.control.reason == "enough"
    (stop,) = [e for e in seen.got if isinstance(e, StopRequested)]  # published once, here
    assert (stop.abort, stop.step, stop.source) == (True, 3, "Handle")


def _until(what: str, cond: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


@pytest.mark.parametrize("placement", ["thread", "process"])
def test_a_subscriber_can_ask_for_a_save_again_once_the_loop_saved(
    new_bus: NewBus, tmp_path: Path, placement: str
) -> None:
    bus = new_bus()
    seen = Recorder(events=[SaveRequested, CheckpointSaved, Scalars])
    bus.subscribe(seen)
    bus.subscribe(SaveAsker(at=(2, 5, 6)), placement=placement, max_batch=1)
    saved = []
    with bus:
        for step in range(1, 9):
            bus.publish(Loss(step=step, value=1.0))
            if step in (2, 5):  # asked on this step: the loop sees it within a few drains
                _until(f"the save asked at step {step}", lambda: bus.control.save_requested)
            if bus.control.save_requested:
                bus.publish(CheckpointSaved(step=step, path=str(tmp_path / f"{step}.pt")))
                bus.control.save_done()
                assert not bus.control.save_requested  # the request cleared at once
                saved.append(step)
            if step == 6:  # asked again while nothing was pending: seen too
                _until("the save asked at step 6", lambda: bus.control.save_requested)
                bus.control.save_done()
                saved.append(step)
        assert bus.flush(timeout=30)
    assert saved == [2, 5, 6]
    asks = [e for e in seen.got if isinstance(e, SaveRequested)]
    assert [e.step for e in asks] == [2, 5, 6]  # every request reached the parent's bus
    if placement == "process":  # the sidecar names the subscriber that asked
        assert {e.source for e in asks} == {"SaveAsker"}
    answers = [e.values["asked"] for e in seen.got if isinstance(e, Scalars)]
    assert answers == [1.0, 1.0, 1.0]  # and each one said it asked
