"""replay(): rebuild recorded events, feed them through subscribers, collect what they publish."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

import eventbus
from eventbus import Event, EventBus
from eventbus.codec import encode
from eventbus.events import (
    DivergenceDetected,
    Loss,
    RunEnded,
    RunStarted,
    Scalars,
    StepEnded,
    StopRequested,
    UnknownEvent,
)
from eventbus.logformat import LogReadError, read_log
from eventbus.replay import replay
from eventbus.sinks import JsonlWriter
from tests.conftest import Recorder
from tests.demo_run import record_demo_run


@dataclass(slots=True, kw_only=True)
class ReplayUserEvent(Event):
    """A user type: replay finds it through the registry."""

    note: str = ""
    x: float = 0.0


class NanWatcher:
    """Publishes a DivergenceDetected and asks to stop on a non-finite loss (once)."""

    events = (Loss,)

    def __init__(self) -> None:
        self.bus: Any = None
        self.closed = False

    def on_start(self, bus: Any) -> None:
        self.bus = bus

    async def on_events(self, batch: list[Event]) -> None:
        for ev in batch:
            if isinstance(ev, Loss) and not math.isfinite(ev.value) and not self.bus.should_stop:
                self.bus.publish(
                    DivergenceDetected(
                        step=ev.step,
                        metric="loss",
                        value=ev.value,
                        baseline=0.0,
                        reason="non-finite",
                    )
                )
                self.bus.control.request_stop("non-finite loss", source="NanWatcher")

    def on_close(self) -> None:
        self.closed = True


def _log(path: Path, events: list[Event]) -> Path:
    path.write_bytes(b"".join(encode(e) for e in events))
    return path


def test_replay_is_re_exported() -> None:
    assert eventbus.replay is replay


def test_recorded_events_come_back_in_order_with_their_stamps(tmp_path: Path) -> None:
    log = record_demo_run(tmp_path, steps=20, blow_up_at=None)
    rec = Recorder()
    assert replay(log, [rec]) == []
    originals = list(read_log(log))
    assert len(rec.got) == len(originals) == 1 + 20 * 4 + 1
    assert [encode(a) for a in rec.got] == [encode(b) for b in originals]
    assert [e.seq for e in rec.got] == list(range(len(rec.got)))  # original seq kept
    assert isinstance(rec.got[0], RunStarted)
    assert isinstance(rec.got[-1], RunEnded)


def test_published_events_are_returned_delivered_and_written(tmp_path: Path) -> None:
    log = record_demo_run(tmp_path / "run", steps=50, blow_up_at=30)
    watcher, rec = NanWatcher(), Recorder(events=(DivergenceDetected, StopRequested))
    out = tmp_path / "out.jsonl"
    published = replay(log, [watcher, rec], out=out)
    assert [type(e) for e in published] == [DivergenceDetected, StopRequested]
    div = published[0]
    assert div.step is not None
    assert div.step > 30
    assert div.ts is not None  # stamped with the replay clock: the recorded time of its batch
    recorded_ts = [e.ts for e in read_log(log) if e.ts is not None]
    assert min(recorded_ts) <= div.ts <= max(recorded_ts)
    assert rec.got == published  # the others saw them, as on a live bus
    assert watcher.closed
    back = list(read_log(out))
    assert [encode(e) for e in back] == [encode(e) for e in published]


def test_several_rank_files_interleave_by_step_then_ts(tmp_path: Path) -> None:
    def ev(step: int | None, ts: int, rank: int, seq: int) -> Loss | RunStarted:
        if step is None:
            return RunStarted(ts=ts, rank=rank, seq=seq)
        return Loss(step=step, value=float(rank), ts=ts, rank=rank, seq=seq)

    a = _log(
        tmp_path / "events.rank0.jsonl",
        [ev(None, 10, 0, 0), ev(1, 100, 0, 1), ev(2, 300, 0, 2), ev(3, 500, 0, 3)],
    )
    b = _log(
        tmp_path / "events.rank1.jsonl",
        [ev(None, 5, 1, 0), ev(1, 150, 1, 1), ev(2, 250, 1, 2), ev(3, 450, 1, 3)],
    )
    rec = Recorder()
    replay([a, b], rec)
    order = [(e.step, e.rank) for e in rec.got]
    assert order == [(None, 1), (None, 0), (1, 0), (1, 1), (2, 1), (2, 0), (3, 1), (3, 0)]
    rec2 = Recorder()
    replay(tmp_path, rec2)  # a directory: its *.jsonl files
    assert [(e.step, e.rank) for e in rec2.got] == order


def test_user_types_rebuilt_and_unknown_types_never_imported(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    _log(log, [ReplayUserEvent(step=1, note="hi", x=math.inf, seq=0)])
    with open(log, "ab") as f:
        f.write(
            orjson.dumps({"type": "os.system", "step": 2, "module": "evil_mod_xyz", "value": "NaN"})
            + b"\n"
        )
    rec = Recorder()
    replay(log, rec)
    user, unknown = rec.got
    assert isinstance(user, ReplayUserEvent)
    assert user.x == math.inf
    assert isinstance(unknown, UnknownEvent)
    assert unknown.type_name == "os.system"
    assert math.isnan(unknown.data["value"])
    assert "evil_mod_xyz" not in sys.modules


def test_subscriber_protocol_functions_sync_and_async(tmp_path: Path) -> None:
    log = _log(
        tmp_path / "l.jsonl", [Loss(step=s, value=1.0) for s in range(5)] + [StepEnded(step=4)]
    )
    seen: list[str] = []

    def fn(ev: Event) -> None:
        seen.append(f"fn{ev.step}")

    async def afn(ev: Event) -> None:
        seen.append(f"afn{ev.step}")

    class SyncSub:
        events = (StepEnded,)

        def on_start(self) -> None:  # the no-argument form works too
            seen.append("start")

        def on_events(self, batch: list[Event]) -> None:
            seen.extend(f"sync{e.step}" for e in batch)

        def on_close(self) -> None:
            seen.append("close")

    replay(log, [fn, afn, SyncSub()])
    assert seen.count("start") == 1
    assert seen[-1] == "close"
    assert [s for s in seen if s.startswith("fn")] == [f"fn{i}" for i in range(5)] + ["fn4"]
    assert [s for s in seen if s.startswith("sync")] == ["sync4"]


def test_a_failing_subscriber_is_isolated(tmp_path: Path) -> None:
    log = _log(tmp_path / "l.jsonl", [Loss(step=s, value=1.0) for s in range(10)])

    def bad(ev: Event) -> None:
        raise RuntimeError("boom")

    rec = Recorder()
    replay(log, [bad, rec], batch_size=3)
    assert len(rec.got) == 10


def test_events_published_in_on_close_reach_subscribers_not_yet_closed(tmp_path: Path) -> None:
    log = _log(tmp_path / "l.jsonl", [Loss(step=1, value=1.0)])

    class Closer:
        def on_start(self, bus: Any) -> None:
            self.bus = bus

        def on_events(self, batch: list[Event]) -> None:
            pass

        def on_close(self) -> None:
            self.bus.publish(RunEnded(status="completed"))

    rec = Recorder()
    published = replay(log, [rec, Closer()])  # Closer closes first (newest first)
    assert [type(e) for e in published] == [RunEnded]
    assert isinstance(rec.got[-1], RunEnded)


def test_replay_through_a_writer_keeps_the_original_stamps(tmp_path: Path) -> None:
    log = record_demo_run(tmp_path / "run", steps=5, blow_up_at=None, rank=3, world_size=4)
    w = JsonlWriter(tmp_path / "copy")
    replay(log, w)
    assert w.path == tmp_path / "copy" / "events.jsonl"
    assert [encode(e) for e in read_log(w.path)] == [encode(e) for e in read_log(log)]
    assert {e.rank for e in read_log(w.path)} == {3}


def test_torn_last_line_is_skipped_and_a_corrupt_line_names_its_place(tmp_path: Path) -> None:
    log = _log(tmp_path / "l.jsonl", [Loss(step=1, value=1.0), Loss(step=2, value=2.0)])
    with open(log, "ab") as f:
        f.write(b'{"type":"Loss","st')
    rec = Recorder()
    replay(log, rec)
    assert [e.step for e in rec.got] == [1, 2]

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(
        encode(Loss(step=1, value=1.0)) + b"not json\n" + encode(Loss(step=3, value=1.0))
    )
    with pytest.raises(LogReadError, match=r"bad\.jsonl:2"):
        replay(bad, Recorder())


def test_missing_inputs_and_bad_subscribers_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(LogReadError, match="no such file"):
        replay(tmp_path / "nope.jsonl", Recorder())
    with pytest.raises(LogReadError, match=r"no \*\.jsonl"):
        replay(tmp_path, Recorder())
    log = _log(tmp_path / "l.jsonl", [Loss(step=1, value=1.0)])
    with pytest.raises(TypeError, match="replay\\(\\) takes subscribers"):
        replay(log, [42])
    with pytest.raises(TypeError, match="an instance"):  # every event would fail on these
        replay(log, Recorder)
    with pytest.raises(TypeError, match="one event"):
        replay(log, [lambda: None])


@pytest.mark.asyncio
async def test_replay_works_from_async_code(tmp_path: Path) -> None:
    log = _log(tmp_path / "l.jsonl", [Loss(step=s, value=1.0) for s in range(3)])
    rec = Recorder()
    replay(log, rec)
    assert len(rec.got) == 3


def test_live_bus_and_replay_agree_on_what_a_monitor_publishes(tmp_path: Path) -> None:
    watcher = NanWatcher()
    w = JsonlWriter(tmp_path / "live")
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(w)
    bus.subscribe(watcher)
    with bus:
        for s, v in enumerate([1.0, 0.5, math.nan, 0.2]):
            bus.publish(Loss(step=s, value=v))
    live = [
        type(e).__name__
        for e in read_log(w.path)
        if isinstance(e, DivergenceDetected | StopRequested)
    ]
    losses = tmp_path / "losses.jsonl"
    _log(losses, [e for e in read_log(w.path) if isinstance(e, Loss)])
    replayed = [type(e).__name__ for e in replay(losses, NanWatcher())]
    assert live == replayed == ["DivergenceDetected", "StopRequested"]


def test_a_subscriber_feeding_on_its_own_output_is_bounded_in_replay(tmp_path: Path) -> None:
    from eventbus.replay import FEEDBACK_LIMIT, Replayer

    class Echo:
        def on_start(self, bus: Any) -> None:
            self.bus = bus

        def on_events(self, batch: list[Event]) -> None:
            for ev in batch:
                self.bus.publish(Scalars(step=ev.step, values={"echo": 1.0}))

    r = Replayer(Echo())
    published = r.run([Loss(step=1, value=1.0, seq=0, ts=1)])
    assert len(published) == FEEDBACK_LIMIT  # then dropped and counted, not an endless loop
    assert r.stats().feedback_dropped == 1
