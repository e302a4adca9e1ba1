"""A second run never merges into the first: each gets a place of its own; a resume continues
the newest (issue 15 item 3)."""

from __future__ import annotations

from pathlib import Path

import pytest

from eventbus import EventBus
from eventbus.events import CheckpointLoaded, Loss, RunStarted
from eventbus.logformat import read_log
from eventbus.sinks import JsonlWriter, TensorBoardSink
from eventbus.sinks._runs import is_resume, run_place


def _run(path: Path, steps: range, *, placement: str = "thread", **kw: object) -> JsonlWriter:
    w = JsonlWriter(path, **kw)  # type: ignore[arg-type]
    bus = EventBus(drain_interval=0.005, cost_every=None)
    bus.subscribe(w, placement=placement)
    with bus:
        bus.publish(RunStarted(config={"first": steps.start}))
        for s in steps:
            bus.publish(Loss(step=s, value=float(s)))
    return w


def _steps(path: Path) -> list[int]:
    return [e.step for e in read_log(path) if isinstance(e, Loss) and e.step is not None]


@pytest.mark.parametrize("placement", ["thread", "process"])
def test_each_run_into_one_directory_gets_its_own(tmp_path: Path, placement: str) -> None:
    a = _run(tmp_path, range(1, 4), placement=placement)
    b = _run(tmp_path, range(1, 3), placement=placement)
    c = _run(tmp_path, range(1, 2), placement=placement)
    assert a.path == tmp_path / "events.jsonl"
    assert b.path == tmp_path / "run-2" / "events.jsonl"
    assert c.path == tmp_path / "run-3" / "events.jsonl"
    assert [_steps(w.path) for w in (a, b, c)] == [[1, 2, 3], [1, 2], [1]]


def test_a_named_file_gets_numbered_siblings(tmp_path: Path) -> None:
    a = _run(tmp_path / "log.jsonl", range(1, 3))
    b = _run(tmp_path / "log.jsonl", range(1, 2))
    assert b.path == tmp_path / "log.run-2.jsonl"
    assert (_steps(a.path), _steps(b.path)) == ([1, 2], [1])


def test_a_resume_continues_the_newest_run(tmp_path: Path) -> None:
    _run(tmp_path, range(1, 4))
    _run(tmp_path, range(1, 6))  # run-2, steps 1..5
    w = JsonlWriter(tmp_path)
    bus = EventBus(drain_interval=0.005, cost_every=None)
    bus.subscribe(w, placement="thread")
    with bus:
        bus.publish(RunStarted(resumed_from_step=3))  # the loop says so, first thing
        bus.publish(Loss(step=4, value=40.0))
    assert w.path == tmp_path / "run-2" / "events.jsonl"
    assert _steps(w.path) == [1, 2, 3, 4]  # what came after step 3 was dropped
    assert _steps(tmp_path / "events.jsonl") == [1, 2, 3]  # the first run untouched
    r = _run(tmp_path, range(4, 5), resume_from_step=3)  # said to the writer
    assert r.path == w.path


def test_overwrite_replaces_the_first_and_leaves_the_others(tmp_path: Path) -> None:
    _run(tmp_path, range(1, 4))
    _run(tmp_path, range(1, 3))
    w = _run(tmp_path, range(7, 8), overwrite=True)
    assert w.path == tmp_path / "events.jsonl"
    assert _steps(w.path) == [7]
    assert _steps(tmp_path / "run-2" / "events.jsonl") == [1, 2]


def test_a_run_with_no_events_still_has_its_own_file(tmp_path: Path) -> None:
    _run(tmp_path, range(1, 3))
    w = JsonlWriter(tmp_path)
    bus = EventBus(cost_every=None)
    bus.subscribe(w, placement="thread")
    with bus:
        pass
    assert w.path == tmp_path / "run-2" / "events.jsonl"
    assert w.path.stat().st_size > 0  # its header and stats record
    assert _steps(tmp_path / "events.jsonl") == [1, 2]


def test_the_rules() -> None:
    used = {Path("a"), Path("a/run-2")}
    place = {1: Path("a"), 2: Path("a/run-2"), 3: Path("a/run-3")}.__getitem__
    assert run_place(place, used.__contains__, resume=False) == Path("a/run-3")
    assert run_place(place, used.__contains__, resume=True) == Path("a/run-2")
    assert run_place(place, set().__contains__, resume=True) == Path("a")
    assert is_resume([Loss(step=1, value=0.0), RunStarted(resumed_from_step=0)])
    assert is_resume([CheckpointLoaded(step=3)])
    assert not is_resume([RunStarted(), CheckpointLoaded(step=3)])
    assert not is_resume([Loss(step=1, value=0.0)])


def _tb(log_dir: Path, steps: range, *, resumed_from: int | None = None) -> TensorBoardSink:
    sink = TensorBoardSink(log_dir)
    bus = EventBus(drain_interval=0.005, cost_every=None)
    bus.subscribe(sink, placement="thread")
    with bus:
        bus.publish(RunStarted(resumed_from_step=resumed_from))
        for s in steps:
            bus.publish(Loss(step=s, value=float(s)))
    return sink


def _tb_steps(d: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(d), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("train/loss")]


def test_tensorboard_runs_never_double_a_curve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twice into one log_dir: TensorBoard shows two runs, not one with every point twice;
    a resume continues the newest, purging what came after its step."""
    from tensorboard.summary.writer import event_file_writer

    # The resumed run's new file must sort after the old one; within one second the names
    # end in a process-wide counter (a resumed process starts at a later second anyway).
    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(0))
    a = _tb(tmp_path, range(1, 4))
    b = _tb(tmp_path, range(1, 3))
    assert (a.run_dir, b.run_dir) == (tmp_path, tmp_path / "run-2")
    assert _tb_steps(tmp_path) == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert _tb_steps(tmp_path / "run-2") == [(1, 1.0), (2, 2.0)]
    c = _tb(tmp_path, range(2, 4), resumed_from=1)
    assert c.run_dir == tmp_path / "run-2"
    assert _tb_steps(tmp_path / "run-2") == [(1, 1.0), (2, 2.0), (3, 3.0)]
