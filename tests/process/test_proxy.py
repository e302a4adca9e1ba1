"""The parent's side: a process-placed subscriber is counted like any other subscriber."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from eventbus import Event, EventBus
from eventbus.core.subscriber import SubscriberGone
from eventbus.events import Loss, Scalars, StopRequested
from eventbus.process import ChildProcessDied, ChildProcessHung, ProcessSubscriber
from tests.conftest import Recorder
from tests.process.subs import Tally, gone, on_one, steps_in

NewBus = Callable[..., EventBus]


def test_receives_everything_publishes_back_and_is_reaped(new_bus: NewBus, tmp_path: Path) -> None:
    bus = new_bus()
    seen = Recorder(events=[Scalars, StopRequested])
    bus.subscribe(seen)
    proxy = ProcessSubscriber(Tally(str(tmp_path / "steps")))
    handle = bus.subscribe(proxy)
    n = 3000
    with bus:
        assert proxy.wait_ready(30)
        pid = proxy.pid
        assert pid is not None
        assert pid != os.getpid()
        assert proxy.alive
        assert psutil.Process(pid).nice() == min(19, os.nice(0) + 10)  # yields CPU to training
        for i in range(n):
            bus.publish(Loss(step=i, value=float(i)))
            bus.publish(Scalars(step=i, values={"x": 1.0}))  # not routed to the child
    st = bus.stats()[handle.name]  # type: ignore[index]
    assert steps_in(tmp_path / "steps") == list(range(n))  # lossless, in order
    assert (st.published, st.delivered, st.failed, st.dropped) == (n, n, 0, 0)
    assert st.latency_p50_ms is not None
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    summary = [e for e in seen.got if isinstance(e, Scalars) and "received" in e.values]
    assert [e.values["received"] for e in summary] == [n]  # published by the child in on_close
    assert summary[0].values["pid"] == pid
    assert bus.control.stop_requested
    assert bus.control.reason == "saw step 50"
    stops = [e for e in seen.got if isinstance(e, StopRequested)]
    assert [(e.source, e.step, e.abort) for e in stops] == [("tally", 50, False)]


def test_exception_is_counted_like_in_thread(
    new_bus: NewBus, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    results = {}
    for placement in ("thread", "process"):
        bus = new_bus()
        other = Recorder(events=[Loss])
        bus.subscribe(other)
        h = bus.subscribe(
            Tally(str(tmp_path / placement), fail_on=10), placement=placement, max_batch=1
        )
        with caplog.at_level(logging.WARNING, logger="eventbus"), bus:
            for i in range(40):
                bus.publish(Loss(step=i, value=1.0))
        results[placement] = h.stats()
        assert len(other.got) == 40  # the others go on
        assert steps_in(tmp_path / placement) == list(range(40))  # and so does it, after failing
    t, p = results["thread"], results["process"]
    assert t is not None
    assert p is not None
    assert (p.failed, p.delivered, p.state) == (t.failed, t.delivered, t.state) == (1, 39, "closed")
    assert p.error is not None
    assert p.error.startswith("RemoteError: ValueError: bad step 10")
    assert "event type Loss" in p.error
    assert "child traceback" in p.error
    assert any(
        "subscriber failed" in r.getMessage() and "Loss" in r.getMessage() for r in caplog.records
    )


def test_import_path_is_built_in_the_child(new_bus: NewBus, tmp_path: Path) -> None:
    bus = new_bus()
    sub = ProcessSubscriber("tests.process.subs:Tally", kwargs={"path": str(tmp_path / "s")})
    assert sub.policy == "block"  # type: ignore[attr-defined]
    assert sub.events == (Loss,)
    h = bus.subscribe(sub)
    with bus:
        for i in range(10):
            bus.publish(Loss(step=i, value=1.0))
    assert h.stats().delivered == 10  # type: ignore[union-attr]
    assert steps_in(tmp_path / "s") == list(range(10))


def test_state_dict_round_trips_through_the_child(new_bus: NewBus, tmp_path: Path) -> None:
    bus = new_bus()
    sub = ProcessSubscriber(Tally(str(tmp_path / "s")))
    with pytest.raises(RuntimeError, match="not running: the bus has not started it"):
        sub.state_dict()
    bus.subscribe(sub)
    with bus:
        assert sub.wait_ready(30)
        assert sub.state_dict() is None  # Tally has no state_dict
        sub.load_state_dict({"n": 1})  # nor load_state_dict: accepted, ignored


def test_dead_or_hung_child_raises_subscriber_gone() -> None:
    assert issubclass(ChildProcessDied, SubscriberGone)
    assert issubclass(ChildProcessHung, SubscriberGone)
    assert issubclass(ChildProcessDied, RuntimeError)  # as before the split


def test_child_death_is_counted_logged_and_disables(
    new_bus: NewBus, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bus = new_bus()
    other = Recorder(events=[Loss])
    bus.subscribe(other)
    sub = ProcessSubscriber(Tally(str(tmp_path / "s"), die_on=5))
    h = bus.subscribe(sub, max_batch=1)
    with caplog.at_level(logging.ERROR, logger="eventbus"), bus:
        bus.publish(Loss(step=0, value=1.0))
        assert sub.wait_ready(30)
        for i in range(1, 30):
            bus.publish(Loss(step=i, value=1.0))
        assert bus.flush(timeout=30)
        st = h.stats()
    assert st is not None
    assert st.state == "disabled"
    assert (st.delivered, st.failed, st.dropped) == (5, 1, 24)  # disabled at once: no retries
    assert "exit code 7" in (st.error or "")
    assert len(other.got) == 30
    assert any("child is gone" in r.getMessage() for r in caplog.records)


def test_failed_start_in_child_disables_like_on_start(new_bus: NewBus, tmp_path: Path) -> None:
    bus = new_bus()
    sub = ProcessSubscriber("tests.process.subs:broken_factory", args=[str(tmp_path)])
    h = bus.subscribe(sub, events=[Loss])
    with bus:
        bus.publish(Loss(step=1, value=1.0))
        assert bus.flush(timeout=30)
    st = h.stats()
    assert st is not None
    assert st.state in ("disabled", "closed")
    assert st.delivered == 0
    assert "cannot build: no GPU here" in (st.error or "")
    assert sub.pid is not None
    assert gone(sub.pid, 5)


def test_hung_child_is_killed_at_batch_timeout(new_bus: NewBus, tmp_path: Path) -> None:
    bus = new_bus()
    sub = ProcessSubscriber(Tally(str(tmp_path / "s"), hang_on=2), batch_timeout=1.0)
    h = bus.subscribe(sub, max_batch=1)
    with bus:
        for i in range(5):
            bus.publish(Loss(step=i, value=1.0))
        assert sub.wait_ready(30)
        pid = sub.pid
        assert bus.flush(timeout=15)
    st = h.stats()
    assert st is not None
    assert (st.delivered, st.failed, st.dropped) == (2, 1, 2)  # disabled at once: no retries
    assert "no answer to a batch within 1.0 s" in (st.error or "")
    assert pid is not None
    assert gone(pid, 5)


def test_child_abandoned_at_close_deadline_is_killed(new_bus: NewBus, tmp_path: Path) -> None:
    bus = new_bus()
    tally = tmp_path / "s"
    sub = ProcessSubscriber(Tally(str(tally), hang_on=0))
    bus.subscribe(sub)
    bus.start()
    bus.publish(Loss(step=0, value=1.0))
    assert sub.wait_ready(30)
    assert _wait_for(lambda: tally.read_text() == "0\n", 30)  # the child is inside its hang
    pid = sub.pid
    stats = bus.close(timeout=1.0)
    assert stats.hung == ("Tally",)
    assert pid is not None
    assert gone(pid, 5)


def test_unpicklable_subscriber_fails_at_subscribe(new_bus: NewBus) -> None:
    lock = threading.Lock()

    class Local:
        def __init__(self) -> None:
            self.lock = lock

        async def on_events(self, batch: list[Event]) -> None:
            return None

    with pytest.raises(TypeError, match=r"needs a picklable subscriber.*import path"):
        new_bus().subscribe(Local(), placement="process")
    with pytest.raises(TypeError, match="args/kwargs are for an import path"):
        ProcessSubscriber(on_one, kwargs={"x": 1})


def _wait_for(cond: Callable[[], bool], within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False
