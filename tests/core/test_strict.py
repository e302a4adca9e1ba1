"""`EventBus(strict=True)` raises the first subscriber failure on the training thread, and every
`RunEnded` says what was lost or failed (issue 23, "errors that surface")."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from eventbus import Event, EventBus, SubscriberFailed
from eventbus.core.handle import BusHandle
from eventbus.events import Loss, RunEnded, RunStarted, Scalars
from tests.core.helpers import identity, until


class Recorder:
    def __init__(self) -> None:
        self.got: list[Event] = []

    def on_events(self, batch: list[Event]) -> None:
        self.got.extend(batch)


class FailsAt:
    """Raises on the event of step `bad`."""

    events = (Loss,)

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def on_events(self, batch: list[Event]) -> None:
        if any(ev.step == self.bad for ev in batch):
            raise ValueError(f"cannot take step {self.bad}")


def test_the_next_publish_raises_the_first_failure_after_queueing_its_event() -> None:
    rec = Recorder()
    bus = EventBus(strict=True)
    bus.subscribe(FailsAt(3), name="picky")
    bus.subscribe(rec, events=[Loss])
    with bus:
        for step in range(5):
            bus.publish(Loss(step=step, value=1.0))
        assert bus.flush()
        with pytest.raises(SubscriberFailed) as caught:
            bus.publish(Loss(step=5, value=1.0))
        bus.publish(Loss(step=6, value=1.0))  # raised once: the run may go on
    e = caught.value
    assert (e.subscriber, e.event_type) == ("picky", "Loss")
    assert e.step is not None and e.step <= 3 < e.step + e.events  # the batch holding step 3
    assert isinstance(e.__cause__, ValueError)
    assert "cannot take step 3" in str(e)
    assert [ev.step for ev in rec.got] == list(range(7))  # step 5 was queued, then raised
    identity(bus.stats())


def test_close_raises_it_when_no_publish_came_after_and_drains_first(tmp_path: Path) -> None:
    rec = Recorder()
    bus = EventBus(strict=True)
    bus.subscribe(FailsAt(9), name="picky")
    bus.subscribe(rec, events=[Loss])
    bus.start()
    for step in range(10):
        bus.publish(Loss(step=step, value=1.0))
    with pytest.raises(SubscriberFailed, match="picky"):
        bus.close()
    assert len(rec.got) == 10
    assert not bus.running
    assert bus.close().failed >= 1  # closed: later calls return the stats (a batch failed)


def test_a_lax_bus_never_raises_and_says_so_in_run_ended() -> None:
    rec = Recorder()
    bus = EventBus()
    bus.subscribe(FailsAt(2), name="picky")
    bus.subscribe(rec, events=[RunEnded])
    with bus:
        bus.publish(RunStarted(step=0))
        for step in range(4):
            bus.publish(Loss(step=step, value=1.0))
        bus.flush()
        bus.publish(RunEnded(step=4))
    (ended,) = rec.got
    assert isinstance(ended, RunEnded) and ended.losses is not None
    failed = bus.stats().subscribers["picky"].failed  # the batch holding step 2
    assert failed >= 1
    assert ended.losses["failed"] == ended.losses["subscribers"]["picky"]["failed"] == failed
    assert "cannot take step 2" in ended.losses["subscribers"]["picky"]["error"]


def test_a_clean_run_ends_with_no_losses_and_the_close_made_run_ended_has_them_too() -> None:
    rec = Recorder()
    with EventBus() as bus:
        bus.subscribe(rec, events=[RunEnded])
        bus.publish(RunStarted(step=0))
        bus.publish(Loss(step=0, value=1.0))
    (ended,) = rec.got
    assert isinstance(ended, RunEnded) and ended.losses is None and ended.cost is not None

    rec2 = Recorder()
    with EventBus() as bus:
        bus.subscribe(FailsAt(0), name="picky")
        bus.subscribe(rec2, events=[RunEnded])
        bus.publish(RunStarted(step=0))
        bus.publish(Loss(step=0, value=1.0))
        bus.flush()
    (ended,) = rec2.got  # published by close(), after the failure
    assert isinstance(ended, RunEnded) and ended.losses is not None
    assert ended.losses["failed"] == 1  # the one event of its batch


def test_the_loops_own_exception_is_never_masked() -> None:
    bus = EventBus(strict=True)
    bus.subscribe(FailsAt(0), name="picky")

    def loop() -> None:
        with bus:
            bus.publish(Loss(step=0, value=1.0))
            bus.flush()
            raise KeyError("the loop's own")

    with pytest.raises(KeyError, match="the loop's own"):
        loop()
    assert bus.stats().failed == 1


class FailsInStart:
    def on_start(self, bus: BusHandle) -> None:
        raise OSError("cannot open the file")

    def on_events(self, batch: list[Event]) -> None:
        pass


def test_a_failed_hook_counts() -> None:
    bus = EventBus(strict=True)
    bus.subscribe(FailsInStart(), name="opener")
    bus.start()
    assert bus.flush()
    with pytest.raises(SubscriberFailed, match="in on_start: OSError: cannot open"):
        bus.publish(Loss(step=0, value=1.0))
    bus.close()


class Echo:
    """Publishes a Scalars back for each Loss: its publish is on the bus side."""

    events = (Loss,)

    def on_start(self, bus: BusHandle) -> None:
        self.bus = bus

    def on_events(self, batch: list[Event]) -> None:
        for ev in batch:
            self.bus.publish(Scalars(step=ev.step, values={"echo": 1.0}))


def test_only_the_users_threads_get_it() -> None:
    """A subscriber publishing (bus side) and a thread of eventbus's own never take the
    failure: it would be caught there and never reach the training thread."""
    rec = Recorder()
    bus = EventBus(strict=True)
    bus.subscribe(FailsAt(0), name="picky")
    bus.subscribe(Echo())
    bus.subscribe(rec, events=[Scalars])
    errors: list[BaseException] = []

    def ours() -> None:
        try:
            bus.publish(Scalars(step=1, values={"x": 1.0}))
        except BaseException as e:
            errors.append(e)

    with bus:
        bus.publish(Loss(step=0, value=1.0))
        assert bus.flush()
        assert bus.flush()  # the echo of step 0 was published after the failure, bus side
        t = threading.Thread(target=ours, name="eventbus-test-helper")
        t.start()
        t.join()
        assert not errors
        with pytest.raises(SubscriberFailed):
            bus.publish(Loss(step=1, value=1.0))
    assert {ev.step for ev in rec.got} >= {0, 1}


def test_sidecar_subscribers_failures_count(tmp_path: Path) -> None:
    from tests.process.subs import Tally

    bus = EventBus(strict=True, drain_interval=0.002, close_timeout=20)
    bus.subscribe(Tally(str(tmp_path / "t.txt"), fail_on=2), placement="process", name="tally")
    bus.start()
    for step in range(4):
        bus.publish(Loss(step=step, value=1.0))
    assert until(lambda: bus.stats().subscribers["tally"].failed > 0)  # the sidecar reported
    with pytest.raises(SubscriberFailed, match="tally") as caught:
        bus.publish(Loss(step=4, value=1.0))
    assert "bad step 2" in str(caught.value)
    bus.close()  # raised once already


def test_a_sidecar_failure_only_its_last_report_shows_is_raised_at_close(
    tmp_path: Path,
) -> None:
    from tests.process.subs import Tally

    bus = EventBus(strict=True, drain_interval=0.002, close_timeout=20)
    bus.subscribe(Tally(str(tmp_path / "t.txt"), fail_on=2), placement="process", name="tally")
    bus.start()
    for step in range(4):
        bus.publish(Loss(step=step, value=1.0))
    with pytest.raises(SubscriberFailed, match="tally"):
        bus.close()


def test_a_bad_strict_is_a_plain_flag() -> None:
    bus: Any = EventBus(strict=False)
    assert "strict_publish" not in repr(bus.publish)  # a lax bus keeps its plain method
    bus.close()


# -- where it must not be raised (an adversarial review's findings) ---------------------------


def _pending(bus: EventBus) -> None:
    """Make a failure pending on `bus` (strict) without raising it: via the unwrapped publish."""
    bus.subscribe(FailsAt(0), name="picky")
    bus.start()
    EventBus.publish(bus, Loss(step=0, value=1.0))
    assert bus.flush()


def test_a_compiled_function_publishing_gets_it_at_run_time_not_a_tracing_error() -> None:
    import torch

    bus = EventBus(strict=True)
    _pending(bus)

    @torch.compile(fullgraph=True, backend="eager")
    def step(x: torch.Tensor, i: int) -> torch.Tensor:
        y = x * 2
        bus.publish(Loss(step=i, value=y.sum()))
        return y

    with pytest.raises(SubscriberFailed, match="picky"):
        step(torch.ones(3), 1)
    step(torch.ones(3), 2)  # raised once; the compiled function still works
    rec = Recorder()
    bus.subscribe(rec, events=[Loss])
    step(torch.ones(3), 3)
    bus.close()
    assert [e.step for e in rec.got] == [3]


def test_a_forked_child_never_raises_the_parents_failure() -> None:
    import os

    bus = EventBus(strict=True)
    _pending(bus)
    pid = os.fork()
    if pid == 0:  # the child: every bus call returns at once
        code = 0
        try:
            bus.publish(Loss(step=1, value=1.0))
            bus.close()
        except BaseException:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with pytest.raises(SubscriberFailed):  # the parent still has it
        bus.publish(Loss(step=1, value=1.0))
    bus.close()


def test_a_drain_on_a_signal_or_at_exit_does_not_raise_it() -> None:
    """SIGTERM drains on a thread of eventbus's own and the process then ends; atexit has
    nobody to raise to. The close warning says it; nothing is printed as an uncaught error."""
    for end in ("signalled", "at_exit"):
        bus = EventBus(strict=True)
        _pending(bus)
        if end == "signalled":
            bus._ending.signalled("SIGTERM")
        else:
            bus._ending.at_exit()
        assert bus.close().failed >= 1  # no raise


def test_a_subscriber_of_another_bus_publishing_here_does_not_take_it() -> None:
    """The other bus's loop thread carries the user's name, not "eventbus": it is still a bus
    side, and the failure waits for this bus's own user."""
    strict = EventBus(strict=True)
    _pending(strict)
    errors: list[BaseException] = []

    async def forward(ev: Event) -> None:
        try:
            strict.publish(Scalars(step=ev.step, values={"x": 1.0}))
        except BaseException as e:
            errors.append(e)

    other = EventBus(name="metrics")
    other.subscribe(forward, events=[Loss])
    with other:
        other.publish(Loss(step=5, value=1.0))
    assert not errors
    with pytest.raises(SubscriberFailed):
        strict.close()


def test_a_step_that_raised_it_at_its_start_is_not_left_open() -> None:
    from eventbus.steps import current_step

    bus = EventBus(strict=True)
    _pending(bus)
    with pytest.raises(SubscriberFailed), bus.step(7):
        pass  # never runs: the StepStarted's publish raised
    assert current_step(bus) is None
    with bus.step(8):
        assert current_step(bus) == 8
    assert current_step(bus) is None
    bus.close()
