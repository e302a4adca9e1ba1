"""JsonlWriter's file (eventbus.sinks._jsonl_file), through the writer: torn lines repaired,
resumes that keep each step once, and write failures whose losses are counted exactly."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from eventbus import Event
from eventbus.events import EvalEnded, Loss, RunStarted
from eventbus.logformat import HEADER_TYPE
from eventbus.sinks import JsonlWriteError, JsonlWriter
from tests.sinks.test_jsonl import _bus, _lines, _loss_steps, _write_run

# -- torn lines and resumes ------------------------------------------------------------------


def test_resume_with_torn_last_line_each_step_once(tmp_path: Path) -> None:
    first = _write_run(tmp_path, range(1, 11))
    with open(first.path, "ab") as f:  # a crash mid-write: half a line, no newline
        f.write(b'{"type":"Loss","step":11,"ts":1,"seq":99,"ra')
    w = _write_run(tmp_path, range(7, 13), resume_from_step=6)
    assert _loss_steps(w.path) == list(range(1, 13))  # each step exactly once
    assert all(line.endswith(b"}") for line in w.path.read_bytes().splitlines())
    st = w.stats()
    assert st.torn_lines_repaired == 1
    assert st.lines_truncated > 0
    headers = [d for d in _lines(w.path) if d["type"] == HEADER_TYPE]
    assert headers[-1]["resumed_from_step"] == 6


def test_resume_keeps_late_lines_of_earlier_steps(tmp_path: Path) -> None:
    w = JsonlWriter(tmp_path)
    bus = _bus()
    bus.subscribe(w, placement="thread")
    with bus:
        bus.publish(RunStarted(config={}))
        for s in range(1, 6):
            bus.publish(Loss(step=s, value=1.0))
        bus.publish(EvalEnded(step=3, metrics={"loss": 0.5}))  # a late eval of step 3
    w2 = _write_run(tmp_path, range(5, 6), resume_from_step=4)
    kinds = [
        (d["type"], d.get("step")) for d in _lines(w2.path) if not d["type"].startswith("eventbus.")
    ]
    assert kinds == [
        ("RunStarted", None),
        ("Loss", 1),
        ("Loss", 2),
        ("Loss", 3),
        ("Loss", 4),
        ("EvalEnded", 3),
        ("Loss", 5),
        ("StepEnded", 5),
    ]


def test_torn_last_line_repaired_when_appending(tmp_path: Path) -> None:
    """A run resumed after a crash mid-write continues the file, the torn line cut off."""
    first = _write_run(tmp_path, range(1, 3))
    with open(first.path, "ab") as f:
        f.write(b'{"type":"Lo')
    w = JsonlWriter(tmp_path)
    bus = _bus()
    bus.subscribe(w, placement="thread")
    with bus:
        bus.publish(RunStarted(resumed_from_step=2))
        for s in (3, 4):
            bus.publish(Loss(step=s, value=float(s)))
    assert w.path == first.path
    assert _loss_steps(w.path) == [1, 2, 3, 4]
    assert w.stats().torn_lines_repaired == 1


# -- held lines lost at a later failed write are counted exactly (item 13) -------------------


class _Disk:
    """Makes `os.write` on one file fail with ENOSPC, after writing `room` more bytes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
        self.path = path
        self.room: int | None = None  # None: writes succeed
        self.real = os.write
        monkeypatch.setattr(os, "write", self.write)

    def write(self, fd: int, data: Any) -> int:
        if self.room is None or os.path.realpath(f"/proc/self/fd/{fd}") != str(self.path.resolve()):
            return self.real(fd, data)
        if self.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = self.real(fd, bytes(data[: self.room]))
        self.room -= n
        return n


def _losses(start: int, n: int) -> list[Event]:
    return [Loss(step=s, value=float(s), seq=s) for s in range(start, start + n)]


def test_held_lines_lost_at_a_later_write_are_counted_and_raised(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    w = JsonlWriter(tmp_path, flush_interval=3600)
    disk = _Disk(monkeypatch, w.path)
    w.on_start()
    w.on_events(_losses(0, 100))  # held: the interval is not due
    w.on_events(_losses(100, 50))
    assert not w.path.exists() or w.path.read_bytes() == b""
    disk.room = 0
    with pytest.raises(JsonlWriteError):
        w.on_flush()  # the held 150 are lost: delivered to the writer, never written
    st = w.stats()
    assert (st.lines_written, st.lines_lost, st.lines_lost_held) == (0, 150, 150)
    with pytest.raises(JsonlWriteError) as info:
        w.on_events(_losses(150, 10))  # the next batch carries the earlier loss to the bus
    assert info.value.earlier_lost == 150
    assert w.stats().lines_lost == 160
    with caplog.at_level(logging.ERROR, logger="eventbus"):
        w.on_close()
    assert "closed after a write failure" in caplog.text
    assert "lines_lost=160" in caplog.text


def test_a_partial_write_leaves_whole_lines_and_exact_counts(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = JsonlWriter(tmp_path, flush_interval=3600)
    disk = _Disk(monkeypatch, w.path)
    w.on_start()
    w.on_events(_losses(0, 1000))
    disk.room = 20_000  # the disk fills up in the middle of a line
    with pytest.raises(JsonlWriteError):
        w.on_flush()
    with pytest.raises(JsonlWriteError):
        w.on_events(_losses(1000, 1))  # refused: counted lost too
    disk.room = None  # room again: the stats record at close gets written
    w.on_close()
    assert w.path.read_bytes().endswith(b"\n")
    steps = _loss_steps(w.path)  # every line parses: the torn line was cut off
    st = w.stats()
    assert 0 < st.lines_written < 1000
    assert steps == list(range(st.lines_written))
    assert (st.lines_lost, st.lines_lost_held) == (1001 - st.lines_written, 1000 - st.lines_written)
    stats = _lines(w.path)[-1]
    assert stats["type"] == "eventbus.stats"
    assert stats["writer"]["lines_lost"] == st.lines_lost


def test_bus_stats_say_what_reached_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 13: with flush_interval > 0 on a full disk, delivered means written."""
    w = JsonlWriter(tmp_path, flush_interval=3600)
    disk = _Disk(monkeypatch, w.path)
    bus = _bus(cost_every=None)
    sub = bus.subscribe(w, placement="thread")
    with bus:
        for s in range(5000):
            bus.publish(Loss(step=s, value=float(s)))
        assert bus.flush(10)  # held lines written: the disk has room
        disk.room = 0  # full from here on
        for s in range(5000, 10_000):
            bus.publish(Loss(step=s, value=float(s)))
        bus.flush(10)  # the held lines are lost here; counted when the writer says so
        bus.publish(Loss(step=10_000, value=1.0))  # the writer reports the earlier loss
    st = sub.stats()
    assert st is not None
    on_disk = len(_loss_steps(w.path))
    assert on_disk == 5000
    assert st.delivered == on_disk  # not 10,001
    assert st.delivered + st.failed + st.dropped == 10_001
