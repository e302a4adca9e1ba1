"""The JSONL log format: its records (header, stats, skipped markers), and finding, reading and
writing log files. Shared by JsonlWriter, replay, the report and the `eventbus` command.

A log is one JSON object per line. Events are encoded by `eventbus.codec`; lines whose type
starts with "eventbus." are records about the log: a header at each open (format name and
version, rank, world size), a stats record at close, and a skipped marker in place of an event
that could not be written. Reading checks what it orders and counts by (step, ts, seq, rank)
and the records' shape, and names `file:line` for every line it cannot use.
"""

from __future__ import annotations

import codecs
import heapq
import itertools
import os
import typing
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from eventbus.codec import RECORD_PREFIX, EventDecodeError, decode, encode, tag
from eventbus.events import Event
from eventbus.log import get_logger

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HEADER_TYPE",
    "SKIPPED_TYPE",
    "STATS_TYPE",
    "LogLine",
    "LogReadError",
    "PathLike",
    "check_record",
    "header",
    "iter_file",
    "log_files",
    "log_ranks",
    "looks_torn",
    "parse_line",
    "read_log",
    "record",
    "write_events",
]

PathLike = str | os.PathLike[str]

FORMAT_NAME = "eventbus.jsonl"
FORMAT_VERSION = 1
HEADER_TYPE = "eventbus.header"
"""The first line of each writer session: format name and version, rank, world size, pid..."""
STATS_TYPE = "eventbus.stats"
"""The record appended at close: the bus's counters and the writer's own."""
SKIPPED_TYPE = "eventbus.skipped"
"""The marker written instead of an event that is too large or cannot be serialised."""

_RECORD_MARK = b'"type":"' + RECORD_PREFIX.encode()
_GZIP_MAGIC = b"\x1f\x8b"
_STAMPS = ("step", "ts", "seq", "rank")


class LogReadError(EventDecodeError):
    """A log file is missing, unreadable, or holds a line that is not a valid record."""


class LogLine(NamedTuple):
    """One item read from a log, with where it came from."""

    path: Path
    lineno: int
    item: Event | dict[str, Any]

    @property
    def where(self) -> str:
        """`file:line`, the prefix of every message about this line."""
        return f"{self.path}:{self.lineno}"


# -- writing ----------------------------------------------------------------------------------


def header(**info: Any) -> bytes:
    """The first line of a log: format name and version plus `info` (rank, world size...)."""
    return record(HEADER_TYPE, format=FORMAT_NAME, version=FORMAT_VERSION, **info)


def record(type_name: str, **info: Any) -> bytes:
    """A non-event line (its type starts with "eventbus."): `codec.decode` returns None for it."""
    if not type_name.startswith(RECORD_PREFIX):
        raise ValueError(f"record types start with {RECORD_PREFIX!r}; got {type_name!r}")
    return orjson.dumps(
        {"type": type_name, **{k: _plain(v) for k, v in info.items()}},
        option=orjson.OPT_APPEND_NEWLINE,
    )


def _plain(v: Any) -> Any:
    """Non-finite floats spelled as the codec spells them (orjson would write null)."""
    if isinstance(v, float):
        return tag(v)
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    return v


def write_events(path: PathLike, events: Iterable[Event], **info: Any) -> Path:
    """Write events as a JSONL log (header first); a directory gets `replay.jsonl` inside."""
    p = Path(path)
    if p.is_dir():
        p = p / "replay.jsonl"
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "wb") as f:
        f.write(header(**info))
        for ev in events:
            f.write(encode(ev))
    return p


# -- finding ----------------------------------------------------------------------------------


def log_files(paths: PathLike | Iterable[PathLike]) -> list[Path]:
    """The files to read: each path as given, a directory as its `*.jsonl` files (sorted)."""
    items = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    if not items:
        raise LogReadError("no log files given")
    out: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = [f for f in sorted(p.glob("*.jsonl")) if f.is_file()]
            if not found:
                raise LogReadError(
                    f"{p}: no *.jsonl files in this directory; give the "
                    "directory a JsonlWriter wrote to, or the files themselves"
                )
            out.extend(found)
        elif p.exists():
            out.append(p)
        else:
            raise LogReadError(f"{p}: no such file or directory")
    return out


def log_ranks(paths: PathLike | Iterable[PathLike]) -> list[int]:
    """The ranks the files of these logs were written by (sorted; 0 if none is named)."""
    ranks = {_file_rank(p) for p in log_files(paths)}
    return sorted(r for r in ranks if r is not None) or [0]


def _file_rank(path: Path) -> int | None:
    """The rank named by a file's header or first event (a cheap peek)."""
    try:
        with open(path, "rb") as f:
            for line in itertools.islice(f, 16):
                try:
                    d = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                r = d.get("rank") if type(d) is dict else None
                if type(r) is int and r >= 0:
                    return r
    except OSError:
        return None
    return None


# -- reading ----------------------------------------------------------------------------------


def read_log(
    paths: PathLike | Iterable[PathLike], *, records: bool = False, located: bool = False
) -> Iterator[Any]:
    """Events of one or more logs in replay order: by step, then ts, each file's order kept.

    A step-less event (RunStarted, RunEnded) sorts with the last step its own file showed.
    `records=True` adds the "eventbus.*" records as dicts; `located=True` yields `LogLine`s.
    """
    files = log_files(paths)
    streams = [_keyed(iter_file(p, records=records), i) for i, p in enumerate(files)]
    merged = streams[0] if len(streams) == 1 else heapq.merge(*streams, key=lambda kv: kv[0])
    for _, line in merged:
        yield line if located else line.item


def _keyed(lines: Iterator[LogLine], index: int) -> Iterator[tuple[tuple[int, int, int], LogLine]]:
    last = -1
    for line in lines:
        item = line.item
        step, ts = (
            (item.get("step"), item.get("ts")) if isinstance(item, dict) else (item.step, item.ts)
        )
        if type(step) is int:
            last = step
        yield (last, ts if type(ts) is int else 0, index), line


def iter_file(path: Path, *, records: bool = False) -> Iterator[LogLine]:
    """One file's events in order (and its "eventbus.*" records as dicts if `records`).

    A partial last line (a crash or a writer mid-write) is skipped with a warning; any other
    line that is not a valid event or record raises `LogReadError` naming `file:line`.
    """
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed in the finally below (a generator)
    except OSError as e:
        raise LogReadError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        if f.read(2) == _GZIP_MAGIC:
            raise LogReadError(
                f"{path}: a gzip file, not a JSONL log; decompress it first (gunzip -k {path})"
            )
        f.seek(0)
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = parse_line(line)
            except LogReadError as e:
                if not line.endswith(b"\n") and looks_torn(line):
                    get_logger().warning(
                        "skipped a partial last line (a crash or a writer mid-write)",
                        path=str(path),
                        line=lineno,
                    )
                    return
                raise LogReadError(f"{path}:{lineno}: {e}") from None
            if item is not None and (records or not isinstance(item, dict)):
                yield LogLine(path, lineno, item)
    except OSError as e:
        raise LogReadError(f"{path}: cannot read: {e.strerror or e}") from None
    finally:
        f.close()


def parse_line(line: bytes) -> Event | dict[str, Any] | None:
    """The event or record of one line; `LogReadError` (without the place) says what is wrong."""
    if b"\x00" in line or not _utf8(line):
        raise LogReadError(
            "not an eventbus log: binary data, not JSON text; give a *.jsonl "
            "file written by JsonlWriter"
        )
    try:
        ev = decode(line)
    except EventDecodeError as e:
        raise LogReadError(str(e)) from None
    except Exception as e:  # a user type's __post_init__ can raise anything
        raise LogReadError(f"cannot rebuild this event: {type(e).__name__}: {e}") from None
    if ev is None:  # a record
        d = orjson.loads(line)
        try:
            check_record(d)
        except (TypeError, ValueError) as e:
            raise LogReadError(str(e)) from None
        return typing.cast(dict[str, Any], d)
    for name in _STAMPS:
        v = getattr(ev, name)
        if v is not None and (type(v) is not int or (v < 0 and name in ("seq", "rank"))):
            what = "a non-negative integer" if name in ("seq", "rank") else "an integer"
            raise LogReadError(f"{_type_name(ev)}.{name} must be {what} or null, got {_show(v)}")
    return ev


def _utf8(line: bytes) -> bool:
    try:
        line.decode()
    except UnicodeDecodeError:
        return False
    return True


def looks_torn(line: bytes) -> bool:
    """Whether an unterminated last line is the start of a record cut short (a crash or a
    writer mid-write), rather than something that is not a log line at all."""
    if b"\x00" in line or not line.lstrip().startswith(b"{"):
        return False
    try:  # a cut can split a multi-byte character: only what comes before it must be valid
        codecs.getincrementaldecoder("utf-8")().decode(line, final=False)
    except UnicodeDecodeError:
        return False
    return True


def _type_name(ev: Event) -> str:
    return str(getattr(ev, "type_name", None) or type(ev).__name__)


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


# -- records ----------------------------------------------------------------------------------


def check_record(d: Any) -> None:
    """Raise `ValueError` naming the field if an "eventbus.*" record has the wrong shape."""
    if not isinstance(d, dict) or not isinstance(d.get("type"), str):
        raise ValueError("not a record: a JSON object with a string 'type' expected")
    kind = d["type"]
    if kind == HEADER_TYPE:
        _check_header(d)
    elif kind == STATS_TYPE:
        _ints(d, "stats record", "rank", "step", "ts")
        bus, writer = d.get("bus"), d.get("writer")
        if bus is not None:
            _check_bus(_mapping(bus, "stats record: bus"))
        if writer is not None:
            for k, v in _mapping(writer, "stats record: writer").items():
                if isinstance(v, dict | list):
                    raise ValueError(
                        f"stats record: writer.{k} must be a number, a string "
                        f"or null, got {_show(v)}"
                    )
    elif kind == SKIPPED_TYPE:
        _ints(d, "skipped marker", "step", "ts", "seq", "rank")
        for k in ("reason", "event_type"):
            if not isinstance(d.get(k), str):
                raise ValueError(f"skipped marker: {k} must be a string, got {_show(d.get(k))}")
    # Other "eventbus.*" records are from a newer writer: readers ignore what they don't know.


def _check_header(d: dict[str, Any]) -> None:
    if d.get("format", FORMAT_NAME) != FORMAT_NAME:
        raise ValueError(f"header: format {_show(d.get('format'))} is not {FORMAT_NAME!r}")
    v = d.get("version")
    if type(v) is not int or v < 1:
        raise ValueError(f"header: version must be a positive integer, got {_show(v)}")
    if v > FORMAT_VERSION:
        raise ValueError(
            f"header: format version {v} is newer than this eventbus reads "
            f"({FORMAT_VERSION}); upgrade eventbus to read this log"
        )
    _ints(d, "header", "rank", "world_size", "ts", "pid", "resumed_from_step")


def _check_bus(bus: dict[str, Any]) -> None:
    _ints(bus, "stats record: bus", "published", "rejected")
    hung = bus.get("hung")
    if hung is not None and not (isinstance(hung, list) and all(isinstance(h, str) for h in hung)):
        raise ValueError(f"stats record: bus.hung must be a list of names, got {_show(hung)}")
    subs = bus.get("subscribers")
    if subs is None:
        return
    for name, s in _mapping(subs, "stats record: bus.subscribers").items():
        _ints(
            _mapping(s, f"stats record: bus.subscribers.{name}"),
            f"stats record: bus.subscribers.{name}",
            "dropped",
            "failed",
        )


def _mapping(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ValueError(f"{where} must be an object, got {_show(v)}")
    return v


def _ints(d: dict[str, Any], where: str, *names: str) -> None:
    for name in names:
        v = d.get(name)
        if v is not None and type(v) is not int:
            raise ValueError(f"{where}: {name} must be an integer or null, got {_show(v)}")
