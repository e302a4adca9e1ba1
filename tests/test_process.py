"""placement="process": a subscriber in a spawned child, counted like any other subscriber."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from eventbus import Event, EventBus
from eventbus.events import Loss, Scalars, StopRequested
from eventbus.process import ProcessSubscriber, pack, unpack
from tests.conftest import Recorder

# -- subscribers that run in the child (module level: picklable by reference) --------------


class Tally:
    """Writes every step it receives to a file, one per line; publishes a summary at close."""

    policy = "block"
    events = (Loss,)

    def __init__(self, path: str, fail_on: int | None = None, die_on: int | None = None,
                 hang_on: int | None = None) -> None:
        self.path = path
        self.fail_on, self.die_on, self.hang_on = fail_on, die_on, hang_on
        self.bus: Any = None
        self.n = 0

    def on_start(self, bus: Any) -> None:
        self.bus = bus
        Path(self.path).write_text("")

    async def on_events(self, batch: list[Event]) -> None:
        with open(self.path, "a") as f:
            f.writelines(f"{ev.step}\n" for ev in batch)
        self.n += len(batch)
        steps = {ev.step for ev in batch}
        if self.die_on in steps:
            os._exit(7)
        if self.hang_on in steps:
            time.sleep(3600)
        if self.fail_on in steps:
            raise ValueError(f"bad step {self.fail_on}")
        if 50 in steps:
            self.bus.control.request_stop("saw step 50", source="tally")

    def on_close(self) -> None:
        self.bus.publish(Scalars(values={"received": self.n, "pid": os.getpid()}))


def broken_factory(path: str) -> Tally:
    raise RuntimeError("cannot build: no GPU here")


def on_one(ev: Event) -> None:
    """A plain function subscriber (one event per call)."""
    if ev.step == 3:
        raise KeyError("three")


def _steps(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()]


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def new_bus() -> Any:
    made: list[EventBus] = []

    def make(**kw: Any) -> EventBus:
        b = EventBus(drain_interval=0.002, close_timeout=20, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close(timeout=5)


# -- tests ------------------------------------------------------------------------------------


def test_pack_round_trip_keeps_types_and_unknowns() -> None:
    evs: list[Event] = [Loss(step=1, value=float("nan"), ts=5, seq=1, rank=0),
                        Scalars(step=2, values={"a": 1.0})]
    out = unpack(pack(evs))
    assert [type(e) for e in out] == [Loss, Scalars]
    assert out[1].values == {"a": 1.0}  # type: ignore[attr-defined]
    assert out[0].ts == 5
    assert out[0].value != out[0].value


def test_receives_everything_publishes_back_and_is_reaped(new_bus: Any, tmp_path: Path) -> None:
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
    assert _steps(tmp_path / "steps") == list(range(n))  # lossless, in order
    assert (st.published, st.delivered, st.failed, st.dropped) == (n, n, 0, 0)
    assert st.latency_p50_ms is not None
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    summary = [e for e in seen.got if isinstance(e, Scalars) and "received" in e.values]
    assert [e.values["received"] for e in summary] == [n]  # published by the child in on_close
    assert summary[0].values["pid"] == pid
    assert bus.control.stop_requested
    assert bus.control.reason == "saw step 50"
    assert any(isinstance(e, StopRequested) and e.source == "tally" for e in seen.got)


def test_exception_is_counted_like_in_thread(
    new_bus: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    results = {}
    for placement in ("thread", "process"):
        bus = new_bus()
        other = Recorder(events=[Loss])
        bus.subscribe(other)
        h = bus.subscribe(Tally(str(tmp_path / placement), fail_on=10), placement=placement,
                          max_batch=1)
        with caplog.at_level(logging.WARNING, logger="eventbus"), bus:
            for i in range(40):
                bus.publish(Loss(step=i, value=1.0))
        results[placement] = h.stats()
        assert len(other.got) == 40  # the others go on
        assert _steps(tmp_path / placement) == list(range(40))  # and so does it, after failing
    t, p = results["thread"], results["process"]
    assert (p.failed, p.delivered, p.state) == (t.failed, t.delivered, t.state) == (1, 39, "closed")
    assert p.error is not None
    assert p.error.startswith("RemoteError: ValueError: bad step 10")
    assert "event type Loss" in p.error
    assert "child traceback" in p.error
    assert any("subscriber failed" in r.getMessage() and "Loss" in r.getMessage()
               for r in caplog.records)


def test_import_path_is_built_in_the_child(new_bus: Any, tmp_path: Path) -> None:
    bus = new_bus()
    sub = ProcessSubscriber("tests.test_process:Tally", kwargs={"path": str(tmp_path / "s")})
    assert sub.policy == "block"
    assert sub.events == (Loss,)
    h = bus.subscribe(sub)
    with bus:
        for i in range(10):
            bus.publish(Loss(step=i, value=1.0))
    assert h.stats().delivered == 10  # type: ignore[union-attr]
    assert _steps(tmp_path / "s") == list(range(10))


def test_function_subscriber_in_child(new_bus: Any) -> None:
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


def test_child_death_is_counted_logged_and_disables(
    new_bus: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bus = new_bus()
    other = Recorder(events=[Loss])
    bus.subscribe(other)
    h = bus.subscribe(Tally(str(tmp_path / "s"), die_on=5), placement="process", max_batch=1)
    with caplog.at_level(logging.ERROR, logger="eventbus"), bus:
        for i in range(30):
            bus.publish(Loss(step=i, value=1.0))
            time.sleep(0.002)
        bus.flush(timeout=10)
        st = h.stats()
    assert st is not None
    assert st.state in ("disabled", "closed")
    assert st.failed == 1
    assert st.delivered == 5
    assert st.delivered + st.failed + st.dropped == 30
    assert "exit code 7" in (st.error or "")
    assert len(other.got) == 30
    assert any("child is gone" in r.getMessage() for r in caplog.records)


def test_failed_start_in_child_disables_like_on_start(new_bus: Any, tmp_path: Path) -> None:
    bus = new_bus()
    sub = ProcessSubscriber("tests.test_process:broken_factory", args=[str(tmp_path)])
    h = bus.subscribe(sub, events=[Loss])
    with bus:
        bus.publish(Loss(step=1, value=1.0))
        bus.flush(timeout=10)
    st = h.stats()
    assert st is not None
    assert st.state in ("disabled", "closed")
    assert st.delivered == 0
    assert "cannot build: no GPU here" in (st.error or "")
    assert sub.pid is not None
    assert _gone(sub.pid, 5)


def test_hung_child_is_killed_at_batch_timeout(new_bus: Any, tmp_path: Path) -> None:
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
    assert st.failed == 1
    assert "no answer" in (st.error or "")
    assert pid is not None
    assert _gone(pid, 5)


def test_child_abandoned_at_close_deadline_is_killed(new_bus: Any, tmp_path: Path) -> None:
    bus = new_bus()
    sub = ProcessSubscriber(Tally(str(tmp_path / "s"), hang_on=0))
    bus.subscribe(sub)
    bus.start()
    bus.publish(Loss(step=0, value=1.0))
    assert sub.wait_ready(30)
    time.sleep(0.5)
    pid = sub.pid
    stats = bus.close(timeout=1.0)
    assert stats.hung == ("Tally",)
    assert pid is not None
    assert _gone(pid, 5)


def test_unpicklable_subscriber_fails_at_subscribe(new_bus: Any) -> None:
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


SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from eventbus import Event, EventBus
from eventbus.events import Loss, Scalars

class InScript:
    policy = "block"
    def __init__(self):
        self.bus = None
    def on_start(self, bus):
        self.bus = bus
    async def on_events(self, batch):
        for ev in batch:
            self.bus.publish(Scalars(step=ev.step, values={{"echo": 1.0}}))

def main():
    bus = EventBus()
    seen = []
    bus.subscribe(lambda ev: seen.append(ev.step), events=[Scalars], policy="block")
    h = bus.subscribe(InScript(), events=[Loss], placement="process")
    with bus:
        for i in range(5):
            bus.publish(Loss(step=i, value=1.0))
        bus.flush(30)
    st = h.stats()
    print("delivered", st.delivered, "echoed", len(seen), st.state)
    print("error", st.error)

{call}
"""


@pytest.mark.parametrize("guarded", [True, False])
def test_subscriber_defined_in_the_script(tmp_path: Path, guarded: bool) -> None:
    call = 'if __name__ == "__main__":\n    main()' if guarded else "main()"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(root=str(Path(__file__).parents[1]), call=call))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=90, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if guarded:  # imported as __mp_main__ in the child: its class unpickles, main() does not run
        assert "delivered 5 echoed 5 closed" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    else:  # the child would run the training again: it refuses, and says what to do
        assert "delivered 0" in proc.stdout, proc.stdout + proc.stderr[-2000:]
        assert 'guard the script\'s training code with `if __name__ == "__main__":`' \
            in proc.stdout


def test_child_dies_when_parent_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parents[1])!r})
        from eventbus import EventBus
        from eventbus.process import ProcessSubscriber
        from tests.test_process import Tally
        if __name__ == "__main__":
            bus = EventBus()
            sub = ProcessSubscriber(Tally({str(tmp_path / "s")!r}))
            bus.subscribe(sub)
            bus.start()
            sub.wait_ready(60)
            print(sub.pid, flush=True)
            time.sleep(120)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        child = int(line)
        assert psutil.pid_exists(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        assert _gone(child, 5), "the child outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(5)
