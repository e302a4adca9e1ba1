"""JsonlWriter: round trip, resume, disk full, size cap, flushing, per-rank files (the file
itself: test_jsonl_file.py)."""

from __future__ import annotations

import errno
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from eventbus import Event, EventBus
from eventbus.codec import decode, encode
from eventbus.events import (
    CheckpointLoaded,
    EvalEnded,
    Loss,
    OptimizerStepped,
    RunEnded,
    RunStarted,
    Scalars,
    StepEnded,
    TensorStats,
)
from eventbus.logformat import FORMAT_VERSION, HEADER_TYPE
from eventbus.sinks import JsonlWriteError, JsonlWriter
from tests.conftest import Recorder


@dataclass(slots=True, kw_only=True)
class JsonlUserEvent(Event):
    """A user-defined type: registered by name, rebuilt on read."""

    label: str = ""
    score: float = 0.0


@dataclass(slots=True, kw_only=True)
class Opaque(Event):
    """A field JSON cannot hold."""

    thing: Any = None


def _bus(**kw: Any) -> EventBus:
    return EventBus(drain_interval=0.002, close_timeout=20, **kw)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def _events(path: Path) -> list[Event]:
    return [ev for line in path.read_bytes().splitlines() if (ev := decode(line)) is not None]


def _loss_steps(path: Path) -> list[int]:
    return [d["step"] for d in _lines(path) if d["type"] == "Loss"]


def _write_run(directory: Path, steps: range, **kw: Any) -> JsonlWriter:
    w = JsonlWriter(directory, **kw)
    bus = _bus()
    bus.subscribe(w, placement="thread")
    with bus:
        for s in steps:
            bus.publish(Loss(step=s, value=float(s)))
            bus.publish(StepEnded(step=s, duration_s=0.01))
    return w


def _mixed(i: int) -> Event:  # noqa: PLR0911 - one per kind of event
    k = i % 7
    special = (math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-300, 3.5)[i % 7]
    if k == 0:
        return Loss(step=i, value=special)
    if k == 1:
        return Scalars(step=i, values={"acc": special, "n": i, "nested": [special, 1.0]})
    if k == 2:
        return OptimizerStepped(step=i, lr=1e-3, grad_norm=special)
    if k == 3:
        return StepEnded(step=i, duration_s=0.002, samples=32, tokens=None)
    if k == 4:
        return EvalEnded(step=i, metrics={"loss": special, "acc": 0.5})
    if k == 5:
        return JsonlUserEvent(step=i, label=f"u{i}", score=special)
    return TensorStats(step=i, name="fc.weight", shape=(3, 4), norm=special, nan_count=0)


def test_100k_mixed_events_read_back_equal_with_non_finite(tmp_path: Path) -> None:
    sent = [_mixed(i) for i in range(100_000)]
    w = JsonlWriter(tmp_path)
    bus = _bus(cost_every=None)  # exactly these events
    bus.subscribe(w)  # in the sidecar, as by default
    with bus:
        for ev in sent:
            bus.publish(ev)
    st = bus.stats()["jsonl"]
    assert (st.delivered, st.failed, st.dropped) == (100_000, 0, 0)
    back = _events(w.path)
    assert len(back) == len(sent)
    for a, b in zip(sent, back, strict=True):
        assert type(a) is type(b)
        assert encode(a) == encode(b)  # equal field by field, NaN and -0.0 included
    assert math.isnan(back[0].value)  # type: ignore[attr-defined]
    assert back[1].values["acc"] == math.inf  # type: ignore[attr-defined]
    assert back[2].grad_norm == -math.inf  # type: ignore[attr-defined]
    assert [e.seq for e in back] == list(range(100_000))  # nothing lost, in order
    assert w.stats().lines_written == 100_000


def test_header_first_with_format_version_and_stats_record_last(tmp_path: Path) -> None:
    w = _write_run(tmp_path, range(1, 4))
    lines = _lines(w.path)
    assert lines[0]["type"] == HEADER_TYPE
    assert lines[0]["version"] == FORMAT_VERSION
    assert lines[0]["rank"] == 0
    assert lines[0]["world_size"] == 1
    last = lines[-1]
    assert last["type"] == "eventbus.stats"
    assert last["bus"]["subscribers"]["jsonl"]["delivered"] == 6
    assert last["writer"]["lines_written"] == 6
    assert w.path == tmp_path / "events.jsonl"


def test_one_file_per_rank_when_world_size_above_one(tmp_path: Path) -> None:
    for rank in (0, 1):
        w = JsonlWriter(tmp_path)
        bus = EventBus(rank=rank, world_size=2, drain_interval=0.002)
        bus.subscribe(w, placement="thread")
        with bus:
            bus.publish(Loss(step=1, value=float(rank)))
        assert w.path == tmp_path / f"events.rank{rank}.jsonl"
    for rank in (0, 1):
        lines = _lines(tmp_path / f"events.rank{rank}.jsonl")
        assert lines[0]["rank"] == rank
        assert lines[0]["world_size"] == 2
        assert [d["value"] for d in lines if d["type"] == "Loss"] == [float(rank)]


def test_explicit_file_path(tmp_path: Path) -> None:
    w = _write_run(tmp_path / "sub" / "mine.jsonl", range(1, 3))
    assert w.path == tmp_path / "sub" / "mine.jsonl"
    assert _loss_steps(w.path) == [1, 2]


def test_resume_through_load_state_dict_from_a_checkpoint(tmp_path: Path) -> None:
    first = _write_run(tmp_path, range(1, 9))
    state = first.state_dict()
    assert state["step"] == 8
    w = JsonlWriter(tmp_path)
    bus = _bus()
    bus.subscribe(w, placement="thread")
    bus.load_state_dict({"jsonl": {"step": 4}})  # as a checkpoint at step 4 would restore
    with bus:
        for s in range(5, 7):
            bus.publish(Loss(step=s, value=float(s)))
    assert _loss_steps(w.path) == [1, 2, 3, 4, 5, 6]


def test_checkpoint_loaded_mid_run_rolls_the_log_back(tmp_path: Path) -> None:
    w = JsonlWriter(tmp_path)
    bus = _bus()
    bus.subscribe(w, placement="thread")
    with bus:
        for s in range(1, 9):
            bus.publish(Loss(step=s, value=1.0))
        bus.publish(CheckpointLoaded(step=5, path="ckpt-5.pt"))
        for s in range(6, 8):
            bus.publish(Loss(step=s, value=2.0))
    assert _loss_steps(w.path) == [1, 2, 3, 4, 5, 6, 7]
    assert [d["value"] for d in _lines(w.path) if d["type"] == "Loss"][-2:] == [2.0, 2.0]


def test_dev_full_marks_the_sink_failed_and_the_rest_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    w = JsonlWriter("/dev/full")
    rec = Recorder()
    bus = EventBus(drain_interval=0.002, max_consecutive_failures=5)
    bus.subscribe(w, placement="thread")
    bus.subscribe(rec)
    with caplog.at_level(logging.WARNING, logger="eventbus"), bus:
        for s in range(500):
            bus.publish(Loss(step=s, value=1.0))
            if s % 50 == 0:
                time.sleep(0.005)  # several batches
    st = bus.stats()
    js = st["jsonl"]
    assert js.failed > 0
    assert js.failed + js.dropped == 500
    assert js.delivered == 0
    assert "subscriber disabled" in caplog.text  # the bus gave up after 5 failures in a row
    assert "No space left" in (js.error or "")
    assert len(rec.got) == 500  # the other subscriber got everything
    assert w.stats().failed is not None
    assert "JSONL writer failed" in caplog.text


def test_disk_full_mid_run_keeps_what_was_written_and_counts_the_rest(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = JsonlWriter(tmp_path)
    real_write = os.write
    full = {"on": False}

    def write(fd: int, data: Any) -> int:
        if full["on"] and os.path.realpath(f"/proc/self/fd/{fd}") == str(w.path.resolve()):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    rec = Recorder()
    bus = _bus()
    bus.subscribe(w, placement="thread")
    bus.subscribe(rec)
    with bus:
        for s in range(100):
            bus.publish(Loss(step=s, value=1.0))
        assert bus.flush(10)
        full["on"] = True
        for s in range(100, 200):
            bus.publish(Loss(step=s, value=1.0))
    js = bus.stats()["jsonl"]
    assert js.delivered == 100
    assert js.failed + js.dropped == 100
    assert _loss_steps(w.path) == list(range(100))  # intact up to the failure
    assert w.stats().lines_written == 100
    assert w.stats().lines_lost == 100
    assert len(rec.got) == 200


def test_unwritable_directory_is_an_error_at_construction(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(OSError, match=r"JsonlWriter cannot write under .*a-file"):
        JsonlWriter(blocker / "run")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_directory_is_an_error_at_construction(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match="JsonlWriter cannot write"):
            JsonlWriter(ro)
    finally:
        ro.chmod(0o755)


def test_bad_arguments_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="flush_interval"):
        JsonlWriter(tmp_path, flush_interval=-1)
    with pytest.raises(ValueError, match="max_line_bytes"):
        JsonlWriter(tmp_path, max_line_bytes=10)
    with pytest.raises(TypeError, match="resume_from_step"):
        JsonlWriter(tmp_path, resume_from_step="5")  # type: ignore[arg-type]


def test_oversize_line_becomes_a_counted_marker(tmp_path: Path) -> None:
    w = JsonlWriter(tmp_path, max_line_bytes=1024)
    bus = _bus()
    bus.subscribe(w, placement="thread")
    with bus:
        bus.publish(Loss(step=1, value=1.0))
        bus.publish(Scalars(step=2, values={f"k{i}": float(i) for i in range(200)}))
        bus.publish(Loss(step=3, value=3.0))
    lines = _lines(w.path)
    marker = next(d for d in lines if d["type"] == "eventbus.skipped")
    assert marker["reason"] == "oversize"
    assert marker["event_type"] == "Scalars"
    assert marker["step"] == 2
    assert marker["size"] > 1024
    assert marker["limit"] == 1024
    assert w.stats().skipped_oversize == 1
    assert _loss_steps(w.path) == [1, 3]
    assert [type(e).__name__ for e in _events(w.path)] == ["Loss", "Loss"]  # marker skipped


def test_unserialisable_field_is_counted_logged_and_the_batch_goes_on(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    w = JsonlWriter(tmp_path)
    bus = _bus()
    bus.subscribe(w, placement="thread")
    with caplog.at_level(logging.WARNING, logger="eventbus"), bus:
        bus.publish(Loss(step=1, value=1.0))
        bus.publish(Opaque(step=2, thing=object()))
        bus.publish(Opaque(step=3, thing=object()))
        bus.publish(Loss(step=4, value=4.0))
    assert _loss_steps(w.path) == [1, 4]
    markers = [d for d in _lines(w.path) if d["type"] == "eventbus.skipped"]
    assert [m["step"] for m in markers] == [2, 3]
    assert "Opaque.thing" in markers[0]["error"]
    assert w.stats().skipped_unserialisable == 2
    assert caplog.text.count("a field cannot be serialised") == 1  # rate-limited
    assert "Opaque" in caplog.text


def test_flush_interval_holds_lines_then_writes_them(tmp_path: Path) -> None:
    w = JsonlWriter(tmp_path, flush_interval=0.2)
    bus = _bus()
    bus.subscribe(w, placement="thread")
    with bus:
        bus.publish(Loss(step=1, value=1.0))
        assert bus.flush(5)
        deadline = time.monotonic() + 5
        while not (w.path.exists() and _loss_steps(w.path)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _loss_steps(w.path) == [1]  # written by the interval timer while running


def test_long_flush_interval_holds_lines_until_flush_or_close(tmp_path: Path) -> None:
    w = JsonlWriter(tmp_path, flush_interval=3600)
    bus = _bus()
    bus.subscribe(w, placement="thread")
    with bus:
        for s in range(1, 4):
            bus.publish(Loss(step=s, value=1.0))
        assert bus.flush(5)  # reaches the writer's on_flush: the lines are on disk now
        assert _loss_steps(w.path) == [1, 2, 3]
        bus.publish(Loss(step=4, value=1.0))
    assert _loss_steps(w.path) == [1, 2, 3, 4]


def test_without_interval_each_batch_is_on_disk_before_close(tmp_path: Path) -> None:
    w = JsonlWriter(tmp_path)
    bus = _bus()
    bus.subscribe(w, placement="thread")
    with bus:
        bus.publish(Loss(step=1, value=1.0))
        assert bus.flush(5)
        assert _loss_steps(w.path) == [1]


@pytest.mark.parametrize("fsync", [True, False])
def test_optional_fsync_at_close(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fsync: bool,
) -> None:
    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    w = _write_run(tmp_path, range(1, 3), fsync=fsync)
    assert (str(w.path.resolve()) in synced) is fsync


def test_state_dict_reports_last_step(tmp_path: Path) -> None:
    w = _write_run(tmp_path, range(1, 6))
    assert w.state_dict()["step"] == 5
    with pytest.raises(TypeError, match="int"):
        w.load_state_dict({"step": "x"})


def test_write_error_type_is_an_oserror() -> None:
    assert issubclass(JsonlWriteError, OSError)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_writes_the_parents_held_lines(tmp_path: Path) -> None:
    w = JsonlWriter(tmp_path, flush_interval=3600)  # lines held in memory when we fork
    bus = _bus()
    bus.subscribe(w, placement="thread")
    with bus:
        for s in range(1, 4):
            bus.publish(Loss(step=s, value=1.0))
        assert bus.flush(5)
        pid = os.fork()
        if pid == 0:  # the child (a DataLoader worker): touching the writer writes nothing
            try:
                w.on_flush()
                bus.publish(Loss(step=99, value=1.0))
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
    assert _loss_steps(w.path) == [1, 2, 3]


def test_overwrite_starts_the_file_afresh(tmp_path: Path) -> None:
    _write_run(tmp_path, range(1, 4))
    w = _write_run(tmp_path, range(1, 3), overwrite=True)
    assert _loss_steps(w.path) == [1, 2]
    w = _write_run(tmp_path, range(3, 4))  # the default: a run of its own, beside
    assert _loss_steps(w.path) == [3]
    assert w.path == tmp_path / "run-2" / "events.jsonl"
    assert _loss_steps(tmp_path / "events.jsonl") == [1, 2]


# -- one bad payload skips only itself (issue 14, item 5) ------------------------------------


def _deep(n: int) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for _ in range(n):
        d = {"a": d}
    return d


def _cyclic() -> dict[str, Any]:
    d: dict[str, Any] = {}
    d["self"] = d
    return d


class _ToListRaises:
    device = "cpu"

    def tolist(self) -> list[Any]:
        raise RuntimeError("cannot convert")


@pytest.mark.parametrize(
    "bad",
    [
        lambda: _deep(600),
        lambda: _deep(5000),
        _cyclic,
        _ToListRaises,
        lambda: {1, 2},
        lambda: 2**70,
        lambda: {(1, 2): 1.0},
    ],
    ids=["deep600", "deep5000", "cyclic", "tolist-raises", "set", "bigint", "tuple-key"],
)
def test_one_bad_payload_skips_exactly_itself_and_the_batch_goes_on(
    tmp_path: Path,
    bad: Any,
) -> None:
    w = JsonlWriter(tmp_path)
    bus = _bus()
    bus.subscribe(w, placement="thread")
    with bus:  # one batch: nothing is written until the bus drains after close
        bus.publish(Loss(step=0, value=0.0))
        bus.publish(Opaque(step=1, thing=bad()))
        for s in range(2, 502):
            bus.publish(Loss(step=s, value=float(s)))
    assert _loss_steps(w.path) == [0, *range(2, 502)]
    markers = [d for d in _lines(w.path) if d["type"] == "eventbus.skipped"]
    assert len(markers) == 1
    assert (markers[0]["event_type"], markers[0]["field"], markers[0]["step"]) == (
        "Opaque",
        "thing",
        1,
    )
    assert "Opaque.thing" in markers[0]["error"]
    st = w.stats()
    assert (st.skipped_unserialisable, st.lines_lost, st.lines_written) == (1, 0, 502)
    js = bus.stats()["jsonl"]
    assert (js.delivered, js.failed, js.dropped) == (502, 0, 0)


def test_string_tags_and_int_keys_survive_the_writer(tmp_path: Path) -> None:
    w = JsonlWriter(tmp_path)
    bus = _bus()
    bus.subscribe(w, placement="thread")
    with bus:
        bus.publish(RunStarted(config={1: "a", "1": "b", "act": "NaN"}))
        bus.publish(JsonlUserEvent(step=1, label="Infinity", score=math.inf))
    first, second, ended = _events(w.path)  # close() ended the run
    assert isinstance(ended, RunEnded) and ended.status == "completed"
    assert isinstance(first, RunStarted) and first.config == {1: "a", "1": "b", "act": "NaN"}
    assert isinstance(second, JsonlUserEvent)
    assert (second.label, second.score) == ("Infinity", math.inf)
