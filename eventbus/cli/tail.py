"""`eventbus tail`: one line per step of a (live) log, following it as it grows; a log to follow
that does not exist yet (a run about to start) is waited for."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eventbus.cli._checks import check_event
from eventbus.cli._errors import UsageError
from eventbus.events import (
    CheckpointLoaded,
    CheckpointSaved,
    DivergenceDetected,
    Event,
    MemoryLeakSuspected,
    RunEnded,
    RunStarted,
    StopRequested,
)
from eventbus.logformat import LogReadError, log_files, looks_torn, parse_line
from eventbus.sinks._text import describe, fields

__all__ = ["StepLines", "add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Register `eventbus tail LOG [-n N] [--no-follow] [--timeout S] [--max-lines N]`."""
    t = sub.add_parser("tail", help="follow a live log, one line per step")
    t.add_argument("log", metavar="LOG")
    t.add_argument(
        "-n",
        "--lines",
        type=int,
        default=10,
        metavar="N",
        help="show the last N lines of what is already there (default 10)",
    )
    t.add_argument("--no-follow", action="store_true", help="print what is there and exit")
    t.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop after this many seconds without new lines (or waiting for LOG to appear)",
    )
    t.add_argument(
        "--max-lines", type=int, default=None, metavar="N", help="stop after printing N lines"
    )
    t.add_argument(
        "--interval",
        type=float,
        default=0.25,
        metavar="SECONDS",
        help="how often to look for new lines (default 0.25)",
    )
    t.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:  # noqa: PLR0911 - one per stop reason
    """Print one line per step of a (live) log, then follow it."""
    if args.lines < 0 or (args.max_lines is not None and args.max_lines < 1):
        raise UsageError("-n and --max-lines must be positive")
    if args.interval <= 0 or (args.timeout is not None and args.timeout < 0):
        raise UsageError("--interval must be positive and --timeout not negative")
    log = Path(args.log)
    files = log_files([log]) if args.no_follow else _wait_for(log, args.timeout, args.interval)
    if len(files) != 1:
        raise UsageError(
            f"tail follows one file; {args.log} holds {len(files)}: "
            + ", ".join(p.name for p in files)
        )
    path = files[0]
    steps = StepLines(path)
    printed = 0

    def emit(lines: list[str]) -> bool:
        nonlocal printed
        for line in lines:
            print(line, flush=True)
            printed += 1
            if args.max_lines is not None and printed >= args.max_lines:
                return True
        return False

    follower = _Follower(path)
    backlog: deque[str] = deque(maxlen=args.lines or None)
    for line in follower.read_lines():
        backlog.extend(steps.feed(line))
    backlog.extend(steps.feed_partial(follower.partial, final=args.no_follow))
    if args.no_follow:
        backlog.extend(steps.flush())
    if args.lines and emit(list(backlog)):
        return 0
    if args.no_follow or steps.ended:
        return 0
    idle_since = time.monotonic()
    while True:
        got = False
        for line in follower.read_lines():
            got = True
            if emit(steps.feed(line)):
                return 0
        steps.feed_partial(follower.partial, final=False)
        if follower.truncated:
            follower.truncated = False
            steps.lineno = 0
            if emit(["-- the log was truncated (a resume); reading it again from the start"]):
                return 0
        now = time.monotonic()
        if got:
            idle_since = now
        elif steps.pending and now - idle_since >= 2 * args.interval and emit(steps.flush()):
            return 0
        if steps.ended:
            emit(steps.flush())
            return 0
        if args.timeout is not None and now - idle_since >= args.timeout:
            emit(steps.flush())
            return 0
        time.sleep(args.interval)


def _wait_for(log: Path, timeout: float | None, interval: float) -> list[Path]:
    """The files of `log` once it exists (a directory: once it holds a `*.jsonl` file), saying
    on stderr that it waits; a `UsageError` if `timeout` seconds pass first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    waiting = False
    while not (log.exists() and (not log.is_dir() or any(log.glob("*.jsonl")))):
        if not waiting:
            bound = "Ctrl-C to stop" if timeout is None else f"up to {timeout:g} s"
            print(f"eventbus: waiting for {log} to appear ({bound})", file=sys.stderr, flush=True)
            waiting = True
        if deadline is not None and time.monotonic() >= deadline:
            raise UsageError(f"{log}: no such file or directory after waiting {timeout:g} s")
        time.sleep(interval)
    return log_files([log])


class _Follower:
    """Reads complete lines appended to a file; notices truncation (a resume)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.truncated = False

    def read_lines(self) -> Iterator[bytes]:
        """The complete lines appended since the last call (blank ones included)."""
        try:
            size = os.stat(self.path).st_size
        except OSError as e:
            raise LogReadError(f"{self.path}: cannot read: {e.strerror or e}") from None
        if size < self.offset:
            self.offset, self.partial, self.truncated = 0, b"", True
        if size == self.offset:
            return
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(size - self.offset)
        except OSError as e:
            raise LogReadError(f"{self.path}: cannot read: {e.strerror or e}") from None
        if self.offset == 0 and data[:2] == b"\x1f\x8b":
            raise LogReadError(
                f"{self.path}: a gzip file, not a JSONL log; decompress it "
                f"first (gunzip -k {self.path})"
            )
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        yield from lines


class StepLines:
    """Folds a step's events into one line, printed when the next step begins."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.step: int | None = None
        self.fields: dict[str, str] = {}
        self.ended = False
        self.lineno = 0

    @property
    def pending(self) -> bool:
        """Whether a step's line is being gathered."""
        return bool(self.fields)

    def feed(self, line: bytes) -> list[str]:
        """The lines to print after one more log line; `LogReadError` names a bad one."""
        self.lineno += 1
        if not line.strip():
            return []
        try:
            item = parse_line(line)
            if item is None or isinstance(item, dict):
                return []
            check_event(item)
            return self._event(item)
        except (LogReadError, ValueError) as e:
            raise LogReadError(f"{self.path}:{self.lineno}: {e}") from None
        except Exception as e:  # a value no check foresaw: still name the line
            raise LogReadError(
                f"{self.path}:{self.lineno}: cannot show this line: {type(e).__name__}: {e}"
            ) from None

    def feed_partial(self, partial: bytes, *, final: bool) -> list[str]:
        """An unterminated last line: refused at once if it can never become a log line; when
        `final` (no more to come), shown if complete, else skipped as a torn line."""
        if not partial.strip():
            return []
        if not looks_torn(partial):
            lineno = self.lineno
            try:
                return self.feed(partial)
            finally:
                self.lineno = lineno
        if final:
            try:
                return self.feed(partial)
            except LogReadError:
                return []  # cut short by a crash or a writer mid-write
        return []

    def _event(self, ev: Event) -> list[str]:
        out: list[str] = []
        if ev.step is not None and self.step is not None and ev.step != self.step:
            out.extend(self.flush())
        if ev.step is not None:
            self.step = ev.step
        note = _notable(ev)
        if note is not None:
            out.append(note)
            if isinstance(ev, RunEnded):
                out[-1:-1] = self.flush()
                self.ended = True
            return out
        self.fields.update(fields(ev))
        return out

    def flush(self) -> list[str]:
        """The pending step's line, if any."""
        if not self.fields:
            return []
        step = "-" if self.step is None else self.step
        line = f"step {step:>6}  " + "  ".join(f"{k} {v}" for k, v in self.fields.items())
        self.fields = {}
        return [line]


def _notable(ev: Event) -> str | None:
    if isinstance(
        ev,
        RunStarted
        | RunEnded
        | DivergenceDetected
        | MemoryLeakSuspected
        | StopRequested
        | CheckpointSaved
        | CheckpointLoaded,
    ):
        return "-- " + describe(ev)
    return None
