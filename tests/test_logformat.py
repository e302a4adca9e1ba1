"""The log format: records written and checked, files found, read in order, bad lines named."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import orjson
import pytest

from eventbus.codec import encode
from eventbus.events import Loss, RunEnded
from eventbus.logformat import (
    FORMAT_VERSION,
    HEADER_TYPE,
    STATS_TYPE,
    LogLine,
    LogReadError,
    check_record,
    header,
    log_files,
    log_ranks,
    looks_torn,
    read_log,
    record,
    write_events,
)


def test_header_and_records_are_written_with_non_finite_floats_kept() -> None:
    h = orjson.loads(header(rank=2, world_size=4))
    assert h == {
        "type": HEADER_TYPE,
        "format": "eventbus.jsonl",
        "version": FORMAT_VERSION,
        "rank": 2,
        "world_size": 4,
    }
    r = orjson.loads(record(STATS_TYPE, bus={"blocked_s": math.inf}, writer={"x": math.nan}))
    assert r["bus"] == {"blocked_s": "Infinity"}
    assert r["writer"] == {"x": "NaN"}
    with pytest.raises(ValueError, match=r"record types start with 'eventbus\.'"):
        record("stats")


def test_written_events_read_back_located_by_file_and_line(tmp_path: Path) -> None:
    path = write_events(tmp_path, [Loss(step=1, value=1.0), RunEnded()], replayed_from=["x"])
    assert path == tmp_path / "replay.jsonl"
    with open(path, "ab") as f:
        f.write(b"\n   \n" + encode(Loss(step=2, value=math.nan)))
    got = list(read_log(tmp_path, records=True, located=True))
    assert all(isinstance(x, LogLine) for x in got)
    assert [(x.lineno, type(x.item).__name__) for x in got] == [
        (1, "dict"),
        (2, "Loss"),
        (3, "RunEnded"),
        (6, "Loss"),
    ]
    assert got[-1].where == f"{path}:6"
    assert [type(e).__name__ for e in read_log(path)] == ["Loss", "RunEnded", "Loss"]


def test_log_files_and_ranks(tmp_path: Path) -> None:
    for r in (1, 0):
        (tmp_path / f"events.rank{r}.jsonl").write_bytes(header(rank=r, world_size=2))
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "sub.jsonl").mkdir()  # a directory named like a log is not one
    assert [p.name for p in log_files(tmp_path)] == ["events.rank0.jsonl", "events.rank1.jsonl"]
    assert log_ranks(tmp_path) == [0, 1]
    with pytest.raises(LogReadError, match="no log files given"):
        log_files([])
    with pytest.raises(LogReadError, match=r"no \*\.jsonl files in this directory"):
        log_files(tmp_path / "sub.jsonl")


@pytest.mark.parametrize(
    ("line", "words"),
    [
        (b'{"type":"Loss","step":"abc","value":1.0}', "Loss.step must be an integer or null"),
        (b'{"type":"Loss","step":1,"ts":"yesterday","value":1.0}', "Loss.ts must be an integer"),
        (b'{"type":"Loss","step":1,"rank":[1],"value":1.0}', "Loss.rank must be a non-negative"),
        (b'{"type":"Mine","step":1,"seq":-1}', "Mine.seq must be a non-negative integer"),
        (b'{"type":"eventbus.stats","bus":[1]}', "stats record: bus must be an object"),
        (
            b'{"type":"eventbus.stats","bus":{"subscribers":{"w":{"failed":1.5}}}}',
            "stats record: bus.subscribers.w: failed must be an integer",
        ),
        (b'{"type":"eventbus.stats","writer":{"lines_lost":[1]}}', "writer.lines_lost must be"),
        (b'{"type":"eventbus.skipped","reason":1,"event_type":"Loss"}', "reason must be a string"),
        (b'{"type":"eventbus.header","format":"other","version":1}', "format 'other' is not"),
        (
            b'{"type":"eventbus.header","format":"eventbus.jsonl","version":99}',
            "format version 99 is newer than this eventbus reads (1); upgrade eventbus",
        ),
        (b"\x00\x01\x02\n", "not an eventbus log: binary data"),
        (b"[1, 2]\n", "not an event record"),
    ],
)
def test_a_bad_line_is_named_by_file_and_line(tmp_path: Path, line: bytes, words: str) -> None:
    log = tmp_path / "bad.jsonl"
    log.write_bytes(
        encode(Loss(step=1, value=1.0))
        + line.rstrip(b"\n")
        + b"\n"
        + encode(Loss(step=2, value=1.0))
    )
    with pytest.raises(LogReadError) as e:
        list(read_log(log))  # records are checked even when not asked for
    assert str(e.value).startswith(f"{log}:2: ")
    assert words in str(e.value)


def test_a_record_from_a_newer_writer_is_ignored() -> None:
    check_record({"type": "eventbus.something_new", "anything": [1, {"x": None}]})
    with pytest.raises(ValueError, match="not a record"):
        check_record([1])


def test_a_torn_last_line_is_skipped_but_binary_garbage_is_refused(tmp_path: Path) -> None:
    good = encode(Loss(step=1, value=1.0))
    snowman = encode(RunEnded(reason="\u2603"))
    log = tmp_path / "events.jsonl"
    log.write_bytes(good + snowman[: snowman.index(b"\xe2") + 1])  # cut inside a character
    assert [e.step for e in read_log(log)] == [1]
    log.write_bytes(good + b"\xff\xfe garbage")
    with pytest.raises(LogReadError, match=r"events\.jsonl:2: not an eventbus log"):
        list(read_log(log))
    log.write_bytes(b"\x00\x01binary, no newline at all")
    with pytest.raises(LogReadError, match=r"events\.jsonl:1: not an eventbus log"):
        list(read_log(log))
    assert looks_torn(b'{"type":"Lo')
    assert not looks_torn(b"garbage")
    assert not looks_torn(b'{"a":"\x00')


def test_a_gzip_file_is_refused_with_what_to_do(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl.gz"
    log.write_bytes(gzip.compress(encode(Loss(step=1, value=1.0))))
    with pytest.raises(LogReadError, match=r"a gzip file, not a JSONL log; decompress it first"):
        list(read_log(log))


def test_empty_and_header_only_files_hold_no_events(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_bytes(b"")
    (tmp_path / "b.jsonl").write_bytes(header(rank=0))
    assert list(read_log(tmp_path)) == []
    assert [d["type"] for d in read_log(tmp_path, records=True)] == [HEADER_TYPE]
