"""The sidecar: one child process per bus hosting every process-placed subscriber, counted,
flushed, closed and checkpointed like any other, surviving its own death."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from eventbus import EventBus
from eventbus.events import Loss, SaveRequested, Scalars, StopRequested
from eventbus.process import ProcessSubscriber, RemoteTimeout
from eventbus.sinks import JsonlWriter, TensorBoardSink
from eventbus.stats import losses
from tests.conftest import Recorder
from tests.core.helpers import until
from tests.process.subs import (
    BigBlob,
    Burner,
    DieOnce,
    Echo,
    Gate,
    SlowStart,
    SlowStartNoFlush,
    SlowState,
    Storm,
    Summary,
    Tally,
    WhereAmI,
    gone,
    steps_in,
)

NewBus = Callable[..., EventBus]


def test_one_sidecar_hosts_every_process_subscriber(new_bus: NewBus, tmp_path: Path) -> None:
    bus = new_bus(cost_every=None)  # exact counts: no BusCost among them
    seen = Recorder(events=[StopRequested, SaveRequested])
    bus.subscribe(seen)
    bus.subscribe(WhereAmI(str(tmp_path / "pid1")), placement="process")
    bus.subscribe(WhereAmI(str(tmp_path / "pid2")), placement="process")
    a = bus.subscribe(Tally(str(tmp_path / "a")), placement="process")
    b = bus.subscribe(ProcessSubscriber(Tally(str(tmp_path / "b"))), name="second")
    writer = JsonlWriter(tmp_path / "log")  # in the sidecar by default
    bus.subscribe(writer)
    n = 3000
    with bus:
        for i in range(n):
            bus.publish(Loss(step=i, value=float(i)))
            bus.publish(Scalars(step=i, values={"x": 1.0}))  # only the writer wants these
        assert bus.flush(timeout=30)
        assert bus.flush(timeout=30)  # and the stop the sidecar published back meanwhile
        side = bus.stats().sidecar
        assert side is not None
        assert side.alive
        assert side.pid != os.getpid()
        assert psutil.Process(side.pid).ppid() == os.getpid()
        assert psutil.Process(side.pid).nice() == min(19, os.nice(0) + 10)  # yields the CPU
        assert side.spawn_s is not None
        assert 0 < side.spawn_s < 60
        assert side.sent_events == 2 * n + 2  # each sent once, whoever wants it; stop, save
    st = bus.stats()
    for h in (a, b):
        s = st[h.name]  # type: ignore[index]
        assert (s.published, s.delivered, s.failed, s.dropped, s.queued) == (n, n, 0, 0, 0)
        assert s.state == "closed"
    assert steps_in(tmp_path / "a") == steps_in(tmp_path / "b") == list(range(n))
    pids = {int((tmp_path / f"pid{k}").read_text()) for k in (1, 2)}
    assert pids == {side.pid}  # all in the one sidecar
    assert bus.control.reason == "saw step 50"  # a stop requested there reaches us
    stops = [e for e in seen.got if isinstance(e, StopRequested)]
    assert [(e.source, e.step) for e in stops] == [("tally", 50)]  # its one control
    assert bus.control.save_requested  # and a save asked there too
    saves = [e for e in seen.got if isinstance(e, SaveRequested)]
    assert [(e.source, e.step) for e in saves] == [("tally", 50)]
    lines = [json.loads(x) for x in writer.path.read_text().splitlines()]
    assert sum(1 for x in lines if x["type"] == "Loss") == n
    assert writer.stats().lines_written >= 2 * n + len(stops)  # its copy's own report
    assert lines[-1]["bus"]["subscribers"]["second"]["delivered"] == n  # final counters
    assert gone(side.pid, 10)  # it exits once closed


def test_builtin_sinks_run_in_the_sidecar_unless_told_thread(
    new_bus: NewBus, tmp_path: Path
) -> None:
    bus = new_bus()
    bus.subscribe(JsonlWriter(tmp_path / "side"))
    bus.subscribe(TensorBoardSink(tmp_path / "tb"))
    bus.subscribe(JsonlWriter(tmp_path / "here"), placement="thread", name="here")
    with bus:
        bus.publish(Loss(step=1, value=2.0))
    st = bus.stats()
    assert st.sidecar is not None
    assert st["jsonl"].delivered == st["tensorboard"].delivered == st["here"].delivered == 1
    assert st.sidecar.sent_events == 1
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_a_failure_there_is_counted_and_logged_here(
    new_bus: NewBus, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    results = {}
    for placement in ("thread", "process"):
        bus = new_bus()
        h = bus.subscribe(
            Tally(str(tmp_path / placement), fail_on=10), placement=placement, max_batch=1
        )
        with caplog.at_level(logging.WARNING, logger="eventbus"), bus:
            for i in range(40):
                bus.publish(Loss(step=i, value=1.0))
        results[placement] = h.stats()
        assert steps_in(tmp_path / placement) == list(range(40))  # it goes on after failing
    t, p = results["thread"], results["process"]
    assert t is not None
    assert p is not None
    assert (p.failed, p.delivered, p.state) == (t.failed, t.delivered, t.state) == (1, 39, "closed")
    assert p.error == t.error == "ValueError: bad step 10"
    failed = [r.getMessage() for r in caplog.records if "subscriber failed" in r.getMessage()]
    assert any("sidecar" in m and "Loss" in m for m in failed)  # the sidecar's log, shown here


def test_import_path_and_state_dict_through_the_bus(new_bus: NewBus, tmp_path: Path) -> None:
    bus = new_bus()
    gate = tmp_path / "open"
    gate.write_text("")
    h = bus.subscribe(ProcessSubscriber("tests.process.subs:Gate", args=[str(gate)]), name="g")
    with bus:
        for i in range(7):
            bus.publish(Loss(step=i, value=1.0))
        assert bus.state_dict() == {"g": {"n": 7}}  # flushed first, then asked there
        bus.load_state_dict({"g": {"n": 100}})
        bus.publish(Loss(step=8, value=1.0))
        assert bus.state_dict()["g"] == {"n": 101}
        with pytest.raises(KeyError, match=r"no subscriber named 'nope'.*'g'"):
            bus.load_state_dict({"nope": {}})
    assert h.stats().delivered == 8  # type: ignore[union-attr]


def test_a_subscriber_that_cannot_be_built_there_is_disabled(
    new_bus: NewBus, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bus = new_bus()
    bad = bus.subscribe(ProcessSubscriber("tests.process.subs:broken_factory", args=["x"]))
    good = bus.subscribe(Tally(str(tmp_path / "s")), placement="process")
    with caplog.at_level(logging.ERROR, logger="eventbus"), bus:
        for i in range(5):
            bus.publish(Loss(step=i, value=1.0))
    b, g = bad.stats(), good.stats()
    assert b is not None
    assert g is not None
    assert b.state == "disabled"
    assert "cannot build: no GPU here" in (b.error or "")
    assert b.delivered == 0
    assert (g.delivered, g.state) == (5, "closed")
    assert any("building a sidecar subscriber failed" in r.getMessage() for r in caplog.records)


def test_sidecar_death_is_counted_logged_and_it_restarts_appending(
    new_bus: NewBus, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bus = new_bus()
    marker = tmp_path / "died"
    bus.subscribe(DieOnce(str(marker), at=300), placement="process", max_batch=1)
    writer = JsonlWriter(tmp_path / "log")
    w = bus.subscribe(writer)
    n = 1000
    with caplog.at_level(logging.ERROR, logger="eventbus"), bus:
        for i in range(n):  # the training thread never waits for the sidecar's death
            bus.publish(Loss(step=i, value=1.0))
        bus.flush(timeout=30)  # False if the sidecar died while flushing: not flushed
        assert bus.flush(timeout=30)  # the new sidecar has everything sent since
        side = bus.stats().sidecar
    assert side is not None
    assert side.restarts == 1
    assert int(marker.read_text()) != side.pid  # a new sidecar took over
    steps = [
        json.loads(x)["step"]
        for x in writer.path.read_text().splitlines()
        if json.loads(x)["type"] == "Loss"
    ]
    assert steps == sorted(steps)  # appended, in order, never rewritten
    assert steps[-1] == n - 1  # writing went on after the restart
    st = bus.stats()[w.name]  # type: ignore[index]
    missing = n - len(set(steps))
    assert st.dropped >= missing  # every event it never wrote is counted
    assert st.published == n
    assert st.delivered + st.dropped + st.failed == n
    assert bus.stats().sidecar.lost >= missing  # type: ignore[union-attr]
    assert any("sidecar process died" in r.getMessage() for r in caplog.records)


def test_large_events_are_bounded_in_bytes_before_backpressure(
    new_bus: NewBus, tmp_path: Path
) -> None:
    mib = 1 << 20
    bus = new_bus(inbox_max_bytes=8 * mib, queue_max_bytes=8 * mib)
    gate = tmp_path / "open"
    h = bus.subscribe(Gate(str(gate)), placement="process")
    big = "x" * mib
    done = threading.Event()

    def train() -> None:
        for i in range(200):  # 200 MiB: far more than the bounds hold (5 x 8 MiB)
            bus.publish(BigBlob(step=i, data=big))
        done.set()

    with bus:
        t = threading.Thread(target=train)
        t.start()
        assert not done.wait(3.0)  # backpressure: the publisher waits on the lossless Gate
        side = bus.stats().sidecar
        assert side is not None
        assert side.in_flight_bytes <= 8 * mib + 2 * mib  # the window, and one batch
        assert psutil.Process(side.pid).memory_info().rss < 200 * mib  # its bounded share
        gate.write_text("")
        t.join(120)
        assert done.is_set()
    assert h.stats().delivered == 200  # type: ignore[union-attr]


@pytest.mark.parametrize("drain", [0.002, 0.05])
def test_what_sidecar_subscribers_publish_reaches_every_sink_before_close(
    tmp_path: Path, drain: float
) -> None:
    """An answer published in the sidecar crosses to the parent, which routes it back to the
    sidecar's writer: a close right after the last publish must wait for that round trip
    (it lost every answer of a short run, counted, until close settled the sidecar)."""
    bus = EventBus(drain_interval=drain, close_timeout=20)
    bus.subscribe(JsonlWriter(tmp_path))
    bus.subscribe(Echo(), placement="process")
    seen = Recorder(events=(Scalars,))
    bus.subscribe(seen)
    with bus:
        for i in range(300):
            bus.publish(Loss(step=i, value=1.0))
    st = bus.stats()
    lines = [json.loads(x) for x in next(tmp_path.glob("*.jsonl")).read_text().splitlines()]
    echoed = sorted(x["step"] for x in lines if x.get("type") == "Scalars")
    assert echoed == list(range(300))  # every answer written, in the sidecar
    assert sorted(ev.step for ev in seen.got) == list(range(300))  # and in-process
    assert st.sidecar is not None and st.sidecar.lost == 0
    assert all(s.dropped == 0 and s.failed == 0 for s in st.subscribers.values())


def test_what_a_sidecar_subscriber_publishes_at_close_reaches_the_older_ones(
    tmp_path: Path,
) -> None:
    """As in the bus: subscribers close newest first, and what one publishes from `on_close`
    reaches those still open (the sidecar ends its subscribers one by one, each answer routed
    back to it), stamped in sequence by the training process."""
    bus = EventBus(drain_interval=0.002, close_timeout=20)
    bus.subscribe(JsonlWriter(tmp_path))  # the oldest: in the sidecar, closed last
    bus.subscribe(Summary(), placement="process")
    with bus:
        for i in range(50):
            bus.publish(Loss(step=i, value=1.0))
    st = bus.stats()
    lines = [json.loads(x) for x in next(tmp_path.glob("*.jsonl")).read_text().splitlines()]
    summary = [x for x in lines if x.get("type") == "Scalars"]
    assert [x["values"] for x in summary] == [{"summary_count": 50.0}]
    seqs = [x["seq"] for x in lines if "seq" in x]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)  # the parent stamped it
    assert st.sidecar is not None and st.sidecar.lost == 0
    assert {n: (s.state, s.dropped, s.failed) for n, s in st.subscribers.items()} == {
        "jsonl": ("closed", 0, 0),
        "Summary": ("closed", 0, 0),
    }


def test_a_hung_sidecar_subscriber_never_holds_training_or_its_neighbours(
    new_bus: NewBus, tmp_path: Path
) -> None:
    bus = new_bus(hang_timeout=1.0)
    never = tmp_path / "never"  # Gate waits for this file in its worker thread: a hang
    hung = bus.subscribe(
        Gate(str(never)), events=[Loss], placement="process", maxsize=5, max_batch=1
    )
    other = bus.subscribe(Tally(str(tmp_path / "other")), placement="process")
    bus.start()
    for i in range(100):  # the hung one's queue fills: the sidecar disables it, never waits
        bus.publish(Loss(step=i, value=1.0))
    t0 = time.monotonic()
    st = bus.close(timeout=4.0)
    assert time.monotonic() - t0 < 8  # its close deadline holds, with a hung subscriber
    h = st[hung.name]  # type: ignore[index]
    assert h.state == "hung"  # still inside its call at the deadline: named, abandoned
    assert (h.published, h.delivered) == (100, 0)
    assert h.delivered + h.failed + h.dropped + h.queued == h.published
    assert h.dropped >= 90  # what reached it once disabled, and what it held: counted
    assert steps_in(tmp_path / "other") == list(range(100))  # its neighbour had everything
    assert st[other.name].state == "closed"  # type: ignore[index]
    assert st.sidecar is not None
    assert gone(st.sidecar.pid, 10)  # the sidecar exits, leaving the hung thread behind


def test_remove_keeps_what_was_published_before_and_nothing_after(
    new_bus: NewBus, tmp_path: Path
) -> None:
    bus = new_bus()
    h = bus.subscribe(Tally(str(tmp_path / "s")), placement="process")
    with bus:
        for i in range(10):
            bus.publish(Loss(step=i, value=1.0))
        h.remove()  # as in the bus: the events before it are still its own
        assert not h.active
        for i in range(10, 20):
            bus.publish(Loss(step=i, value=1.0))
    assert steps_in(tmp_path / "s") == list(range(10))
    s = bus.stats()[h.name]  # type: ignore[index]
    assert (s.published, s.delivered, s.dropped, s.queued) == (10, 10, 0, 0)


def test_after_a_restart_only_the_rebuilt_subscribers_append(
    new_bus: NewBus, tmp_path: Path
) -> None:
    late = tmp_path / "late"
    late.mkdir()
    (late / "events.jsonl").write_text('{"type":"FromAnEarlierRun"}\n')
    bus = new_bus()
    bus.subscribe(DieOnce(str(tmp_path / "died"), at=3), placement="process", max_batch=1)
    with bus:
        for i in range(10):
            bus.publish(Loss(step=i, value=1.0))
        bus.flush(timeout=30)  # False: the sidecar died while flushing
        assert bus.flush(timeout=30)
        assert bus.stats().sidecar.restarts == 1  # type: ignore[union-attr]
        bus.subscribe(JsonlWriter(late, overwrite=True))  # new: overwrite, as asked
        bus.publish(Loss(step=10, value=1.0))
    text = (late / "events.jsonl").read_text()
    assert "FromAnEarlierRun" not in text
    assert '"step":10' in text


@pytest.mark.parametrize("sink", ["jsonl", "tensorboard"])
def test_a_sink_whose_sidecar_died_before_it_wrote_never_appends_to_an_earlier_run(
    new_bus: NewBus, tmp_path: Path, sink: str
) -> None:
    def make() -> Any:
        return JsonlWriter(tmp_path) if sink == "jsonl" else TensorBoardSink(tmp_path)

    def files() -> dict[str, int]:
        return {str(p.relative_to(tmp_path)): p.stat().st_size for p in tmp_path.rglob("*.*")}

    earlier = new_bus()
    earlier.subscribe(make(), placement="thread")
    with earlier:
        earlier.publish(Loss(step=1, value=1.0))
    before = files()
    bus = new_bus()
    bus.subscribe(make())  # in the sidecar, whose death comes before its first events
    assert until(lambda: bus.stats().sidecar.spawn_s is not None, 30)  # type: ignore[union-attr]
    os.kill(bus.stats().sidecar.pid, 9)  # type: ignore[union-attr]
    assert until(lambda: bus.stats().sidecar.restarts == 1, 30)  # type: ignore[union-attr]
    with bus:
        bus.publish(Loss(step=100, value=2.0))
    after = files()
    assert {k: after[k] for k in before} == before  # the earlier run's files: untouched
    assert any(k.startswith("run-2") for k in after)  # this run's: a run of its own


def test_a_storm_published_in_the_sidecar_is_bounded_and_counted(
    new_bus: NewBus, tmp_path: Path
) -> None:
    bus = new_bus()
    got = Recorder(events=[Scalars])
    bus.subscribe(got, policy="block", maxsize=1_000_000)
    bus.subscribe(Storm(60_000), placement="process", max_batch=1)
    with bus:
        for i in range(4):
            bus.publish(Loss(step=i, value=1.0))
        assert bus.flush(timeout=60)  # the storm happened; what came back is in our inbox
        assert bus.flush(timeout=60)  # and delivered
    st = bus.stats()
    assert st.sidecar is not None
    # What the sidecar held for us beyond its bound was dropped there, what our inbox refused
    # from the bus side here (how much of each depends on how fast we took them): memory
    # stayed bounded on both sides, and every event is either delivered or counted.
    assert st.inbox_high_water <= 65_536
    lost_here = st.feedback_dropped
    assert len(got.got) + st.sidecar.storm_dropped + lost_here == 4 * 60_000


def test_cpu_of_a_sidecar_subscriber_is_its_own_and_not_the_bus_threads(new_bus: NewBus) -> None:
    """Issue 24: a subscriber burning 2 ms of CPU per event in the sidecar reports that CPU
    (read from the sidecar), while the training process's bus thread spent far less."""
    bus = new_bus()
    bus.subscribe(Burner(2.0), placement="process", name="burner", events=[Loss])
    with bus:
        for i in range(100):
            bus.publish(Loss(step=i, value=1.0))
    st = bus.stats()
    assert st["burner"].delivered == 100
    assert st["burner"].cpu_s >= 100 * 0.002 * 0.9
    assert st.cost is not None
    assert st.cost.bus_cpu_s < st["burner"].cpu_s / 2


@pytest.mark.parametrize("placement", ["thread", "process"])
@pytest.mark.parametrize("publish", [True, False], ids=["an event", "nothing"])
@pytest.mark.parametrize("hook", [True, False], ids=["on_flush", "no on_flush"])
def test_flush_waits_for_a_slow_on_start(
    new_bus: NewBus, tmp_path: Path, placement: str, publish: bool, hook: bool
) -> None:
    gate, log = tmp_path / "gate", tmp_path / "log"
    bus = new_bus()
    with bus:
        sub = (SlowStart if hook else SlowStartNoFlush)(str(gate), str(log))
        bus.subscribe(sub, placement=placement)
        if publish:
            bus.publish(Loss(step=1, value=1.0))
        flushed: list[bool] = []
        t = threading.Thread(target=lambda: flushed.append(bus.flush(timeout=60)))
        t.start()
        deadline = time.monotonic() + 30
        while not (log.exists() and log.read_text()):  # on_start is running, held at the gate
            assert time.monotonic() < deadline, "on_start never ran"
            time.sleep(0.005)
        done_early = not t.is_alive()  # the flush must be waiting for on_start
        gate.touch()
        t.join(60)
        assert flushed == [True]
        said = log.read_text().split("\n")[:-1]
    assert not done_early, said
    assert said == [
        "start",
        "started",
        *(["step 1"] if publish else []),
        *(["flushed"] if hook else []),
    ]


def test_what_sidecar_subscribers_publish_in_its_own_close_is_counted_late(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A hung lossless neighbour holds the sidecar's router past the close's shares, so Echo
    gets its events only in the sidecar's own close, when no subscriber can take its answers
    any more: they are counted (`late`), logged and in the close report, never silent."""
    bus = EventBus(drain_interval=0.002, close_timeout=20)
    bus.subscribe(JsonlWriter(tmp_path))
    bus.subscribe(Echo(), placement="process")
    bus.subscribe(
        Gate(str(tmp_path / "never")), events=[Loss], placement="process", maxsize=5, max_batch=1
    )
    bus.start()
    for i in range(100):
        bus.publish(Loss(step=i, value=1.0))
    with caplog.at_level(logging.WARNING, logger="eventbus"):
        st = bus.close(timeout=1.0)
    lines = [json.loads(x) for x in next(tmp_path.glob("*.jsonl")).read_text().splitlines()]
    written = sum(1 for x in lines if x.get("type") == "Scalars")
    assert st.sidecar is not None
    echo = st["Echo"]  # type: ignore[index]
    assert echo.delivered + echo.dropped + echo.failed == 100  # what it never got: counted
    assert written + st.sidecar.late == echo.delivered  # each answer written, or counted late
    lost = losses(st)
    assert lost is not None and lost["sidecar_late"] == st.sidecar.late
    if st.sidecar.late:  # the usual case: the sidecar answered the close, late answers said
        assert any("counted, not sent" in r.getMessage() for r in caplog.records)


def test_a_flush_held_by_a_hung_sidecar_subscriber_holds_no_one_else(tmp_path: Path) -> None:
    """A flush that a hung lossy sidecar subscriber makes time out returns False; the sidecar
    goes on reading meanwhile (it stopped reading for `close_timeout`, starving its other
    subscribers, then the close, which ended with the hung one's report lost)."""
    bus = EventBus(drain_interval=0.002, close_timeout=600)
    never = tmp_path / "never"  # Gate waits for this file: a hang
    hung = bus.subscribe(Gate(str(never)), placement="process", policy="drop_oldest", events=[Loss])
    other = bus.subscribe(Tally(str(tmp_path / "other")), placement="process")
    here = Recorder(events=[Loss])
    bus.subscribe(here)
    try:
        bus.start()
        bus.publish(Loss(step=0, value=1.0))
        assert not bus.flush(timeout=0.5)  # the hung one holds it (the wait there goes on)
        for i in range(1, 10):
            bus.publish(Loss(step=i, value=1.0))
        deadline = time.monotonic() + 30
        while not (tmp_path / "other").exists() or steps_in(tmp_path / "other") != list(range(10)):
            assert time.monotonic() < deadline, "the sidecar stopped reading"
            time.sleep(0.01)
        st = bus.close(timeout=4)  # a hung one holds it to its deadline
    finally:
        bus.close(timeout=5)
    h = st[hung.name]  # type: ignore[index]
    assert h.state == "hung"
    assert (h.published, h.delivered, h.queued) == (10, 0, 0)
    assert h.delivered + h.failed + h.dropped + h.queued == h.published
    assert st[other.name].state == "closed"  # type: ignore[index]


def test_a_close_while_a_flush_waits_on_a_hung_sidecar_subscriber_reports_it_hung(
    tmp_path: Path,
) -> None:
    """The flush's wait for the sidecar ends when the close begins (it held the sidecar busy
    to the close deadline: abandoned, its subscriber's last report never came)."""
    bus = EventBus(drain_interval=0.002, close_timeout=600)
    hung = bus.subscribe(Gate(str(tmp_path / "never")), placement="process", policy="drop_oldest")
    try:
        bus.start()
        for i in range(10):
            bus.publish(Loss(step=i, value=1.0))
        assert not bus.flush(timeout=0.5)
        st = bus.close(timeout=4)  # a hung one holds it to its deadline
    finally:
        bus.close(timeout=5)
    h = st[hung.name]  # type: ignore[index]
    assert (h.state, h.published, h.dropped, h.queued) == ("hung", 10, 10, 0)
    assert st.hung == ("Gate",)


def test_a_sidecar_that_stops_answering_is_abandoned_at_close_named_and_counted(
    tmp_path: Path,
) -> None:
    """With `hang_timeout=None`, a hung lossless sidecar subscriber whose full queue holds the
    sidecar's reading (as it holds our bus) cannot answer the close: the close keeps its
    deadline, names it hung and counts what it never reported handled (its report said
    "running", events queued forever after the close, and no one hung)."""
    mib = 1 << 20
    bus = EventBus(
        drain_interval=0.002, close_timeout=600, hang_timeout=None, queue_max_bytes=4 * mib
    )
    hung = bus.subscribe(Gate(str(tmp_path / "never")), placement="process", maxsize=1)
    try:
        bus.start()
        for i in range(12):  # its queue, then the sidecar's inbox fill: the sidecar's reading waits
            bus.publish(BigBlob(step=i, data="x" * mib))
        pid = bus.stats().sidecar.pid  # type: ignore[union-attr]
        st = bus.close(timeout=3)
    finally:
        bus.close(timeout=5)
        (tmp_path / "never").write_text("")  # it goes on, drains and exits
    assert gone(pid, 30)
    h = st[hung.name]  # type: ignore[index]
    assert h.state == "hung"
    assert hung.name in st.hung
    assert h.published == 12
    assert (h.delivered, h.failed, h.queued) == (0, 0, 0)
    assert h.dropped == 12  # never handled: counted


@contextlib.contextmanager
def _reading_held(tmp_path: Path, close_timeout: float) -> Iterator[tuple[EventBus, Any]]:
    """A bus whose sidecar cannot read: a hung lossless `Gate` (no `hang_timeout`) holds it,
    and the byte window and our queue for the sidecar fill with 1 MiB events."""
    mib = 1 << 20
    bus = EventBus(
        drain_interval=0.002,
        close_timeout=close_timeout,
        hang_timeout=None,
        queue_max_bytes=4 * mib,
    )
    hung = bus.subscribe(Gate(str(tmp_path / "never")), placement="process", maxsize=1)
    side = bus._sidecar
    assert side is not None
    try:
        bus.start()
        for i in range(24):
            bus.publish(BigBlob(step=i, data="x" * mib))
        q = side.delivery
        assert until(lambda: q.queue is not None and len(q.queue) > 0)  # the window is full
        yield bus, hung
    finally:
        bus.close(timeout=5)
        (tmp_path / "never").write_text("")  # it goes on, drains and exits


def test_what_our_side_still_holds_for_a_hung_sidecar_at_close_is_its_loss(
    tmp_path: Path,
) -> None:
    """Events still queued here for the sidecar (its window full behind a hung subscriber)
    when the close gives up: they were counted for no one (12 of 24 "published"), and the
    close overran its deadline into the "bus loop is blocked" path."""
    with _reading_held(tmp_path, close_timeout=600) as (bus, hung):
        start = time.monotonic()
        st = bus.close(timeout=3)
        took = time.monotonic() - start
    h = st[hung.name]  # type: ignore[index]
    assert (h.published, h.dropped, h.delivered, h.queued) == (24, 24, 0, 0)
    assert (losses(st) or {}).get("dropped") == 24
    assert took < 3.2  # its deadline (0.25 s later the loop would be abandoned as blocked)


def test_a_checkpoint_request_a_hung_sidecar_cannot_read_fails_in_time_and_says_why(
    tmp_path: Path,
) -> None:
    """`bus.state_dict()` asked the sidecar without a deadline: with its reading held by a
    hung lossless subscriber (`hang_timeout=None`), the training thread waited for ever."""
    with _reading_held(tmp_path, close_timeout=1) as (bus, _):
        start = time.monotonic()
        with pytest.raises(RemoteTimeout, match="did not answer a checkpoint request within 2"):
            bus.state_dict()
        assert time.monotonic() - start < 10


def test_an_answer_that_comes_after_its_checkpoint_request_timed_out_is_not_kept(
    tmp_path: Path,
) -> None:
    """`RemoteTimeout` left the request's reply slot to the reader: the late answer (a whole
    state dict) was stored under a number nobody asks for again, one more per timed-out
    `bus.state_dict()`, for the life of the sidecar."""
    bus = EventBus(drain_interval=0.002, close_timeout=0.5)
    bus.subscribe(SlowState(str(tmp_path / "gate")), placement="process")
    side = bus._sidecar
    assert side is not None
    with bus:
        for _ in range(3):
            with pytest.raises(RemoteTimeout):
                bus.state_dict()
        chan = side.chan
        (tmp_path / "gate").write_text("")  # the three answers come now, late
        # every late answer came and was let go (`abandoned`: the numbers given up on)
        assert until(lambda: not chan.replies and not getattr(chan, "abandoned", [0])), list(
            chan.replies
        )
        assert len(bus.state_dict()["SlowState"]["big"]) == 1 << 20  # the next one is its own


class _Phantom:
    """Pickled by reference to a module only this process has (as a class of the user's
    script is, in `__main__`): the sidecar cannot unpickle it."""


def test_a_batch_the_sidecar_cannot_read_costs_only_that_batch(
    new_bus: NewBus,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A field holding an object of a class the sidecar cannot import killed the sidecar;
    its subscribers, closed by the dying sidecar, were then skipped for good after the
    restart: every later event lost, uncounted."""
    phantom = types.ModuleType("eventbus_phantom_module")
    _Phantom.__module__ = phantom.__name__
    phantom._Phantom = _Phantom  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, phantom.__name__, phantom)
    bus = new_bus()
    tally = bus.subscribe(Tally(str(tmp_path / "t")), placement="process", max_batch=1)
    with caplog.at_level(logging.ERROR, logger="eventbus"), bus:
        for i in range(5):
            bus.publish(Loss(step=i, value=1.0))
        assert bus.flush(timeout=30)
        bus.publish(Loss(step=5, value=_Phantom()))  # type: ignore[arg-type]
        bus.flush(timeout=30)
        for i in range(6, 10):
            bus.publish(Loss(step=i, value=1.0))
        assert bus.flush(timeout=30)
        side = bus.stats().sidecar
    assert side is not None
    assert side.restarts == 0
    assert steps_in(tmp_path / "t") == [0, 1, 2, 3, 4, 6, 7, 8, 9]
    s = bus.stats()[tally.name]  # type: ignore[index]
    assert (s.published, s.delivered, s.state) == (10, 9, "closed")
    assert any("eventbus_phantom_module" in r.getMessage() for r in caplog.records)


def test_a_latest_key_for_a_sidecar_subscriber_is_refused_where_it_is_given(
    new_bus: NewBus, tmp_path: Path
) -> None:
    """`key=` does not cross to the sidecar; it was dropped silently (every event kept)."""
    bus = new_bus()
    with pytest.raises(TypeError, match=r"key= .* does not cross to the sidecar"):
        bus.subscribe(
            Tally(str(tmp_path / "t")), placement="process", policy="latest", key=lambda e: 0
        )
    assert bus.stats().sidecar is None  # refused before any process started


def test_one_object_subscribed_twice_is_refused_across_placements(
    new_bus: NewBus, tmp_path: Path
) -> None:
    """Two copies of one writer in the sidecar (or one there, one here) would write every
    line twice into one file; refused while the first subscription is active, as in-process."""
    bus = new_bus()
    writer = JsonlWriter(tmp_path)
    first = bus.subscribe(writer)  # the sidecar, by default
    with pytest.raises(ValueError, match="already subscribed to this bus"):
        bus.subscribe(writer)
    with pytest.raises(ValueError, match="already subscribed to this bus"):
        bus.subscribe(writer, placement="thread")
    first.remove()
    bus.subscribe(writer, placement="thread")  # once removed, it may be subscribed again
    with pytest.raises(ValueError, match="already subscribed to this bus"):
        bus.subscribe(writer)


@pytest.mark.parametrize("name", [3, ""])
def test_a_bad_name_for_a_sidecar_subscriber_is_refused_before_a_process_starts(
    new_bus: NewBus, tmp_path: Path, name: object
) -> None:
    bus = new_bus()
    with pytest.raises(TypeError, match="name= must be a non-empty str"):
        bus.subscribe(Tally(str(tmp_path / "t")), placement="process", name=name)  # type: ignore[arg-type]
    assert bus.stats().sidecar is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_remove_in_a_forked_child_returns_while_the_parent_held_the_sidecars_lock(
    new_bus: NewBus, tmp_path: Path
) -> None:
    """A fork taken while a thread holds the sidecar's lock (the bus thread posting a batch,
    the reader restarting a dead sidecar) must leave the child's bus calls returning."""
    bus = new_bus()
    h = bus.subscribe(Tally(str(tmp_path / "t")), placement="process")
    bus.start()
    side = bus._sidecar
    assert side is not None
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with side._cond:
            held.set()
            release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(10)
    pid = os.fork()
    if pid == 0:  # the child (a DataLoader worker)
        try:
            h.remove()
        finally:
            os._exit(0)
    release.set()
    t.join()
    ended = until(lambda: os.waitpid(pid, os.WNOHANG)[0] == pid, 10)
    if not ended:  # the remove deadlocked on the lock the parent's thread held at the fork
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert ended
