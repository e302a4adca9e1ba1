"""The `eventbus` command: replay, summary, tail and plot for recorded JSONL logs.

    eventbus replay LOG... --subscribe SPEC... [--out FILE]
    eventbus summary LOG... [--json]
    eventbus tail LOG [-n N] [--no-follow] [--timeout S] [--max-lines N]
    eventbus plot LOG... -o report.png

SPEC: `jsonl:DIR`, `tensorboard:DIR`, `divergence`, `memory`, `progress` (options as
`divergence:action=warn,window=50`), or `module:factory` (imported with importlib).
Bad arguments and unreadable or corrupt files: one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import orjson

from eventbus.codec import EventDecodeError, decode
from eventbus.config import ConfigError, parse_spec
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
from eventbus.replay import LogReadError, Replayer, log_files, log_ranks, read_log, write_events
from eventbus.sinks._text import describe
from eventbus.sinks._text import fields as _fields

__all__ = ["main"]



class UsageError(Exception):
    """A bad argument or input: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="eventbus", description="Look at recorded eventbus JSONL logs.")
    p.add_argument("-q", "--quiet", action="store_true", help="hide warnings from the library")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    r = sub.add_parser("replay", help="feed logs through subscribers; write what they publish")
    r.add_argument("logs", nargs="+", metavar="LOG", help="JSONL files or directories")
    r.add_argument("--subscribe", "-s", nargs="+", action="extend", required=True,
                   metavar="SPEC", help="jsonl:DIR, tensorboard:DIR, divergence, memory, "
                   "progress, or module:factory")
    r.add_argument("--out", "-o", metavar="FILE", help="write the published events as JSONL")
    r.set_defaults(func=cmd_replay)

    s = sub.add_parser("summary", help="steps, wall time, loss, throughput, losses, detections")
    s.add_argument("logs", nargs="+", metavar="LOG")
    s.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    s.set_defaults(func=cmd_summary)

    t = sub.add_parser("tail", help="follow a live log, one line per step")
    t.add_argument("log", metavar="LOG")
    t.add_argument("-n", "--lines", type=int, default=10, metavar="N",
                   help="show the last N lines of what is already there (default 10)")
    t.add_argument("--no-follow", action="store_true", help="print what is there and exit")
    t.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="stop after this many seconds without new lines")
    t.add_argument("--max-lines", type=int, default=None, metavar="N",
                   help="stop after printing N lines")
    t.add_argument("--interval", type=float, default=0.25, metavar="SECONDS",
                   help="how often to look for new lines (default 0.25)")
    t.set_defaults(func=cmd_tail)

    pl = sub.add_parser("plot", help="loss, grad norm, lr, memory and step time into a PNG")
    pl.add_argument("logs", nargs="+", metavar="LOG")
    pl.add_argument("-o", "--out", required=True, metavar="FILE.png")
    pl.add_argument("--title", default=None)
    pl.set_defaults(func=cmd_plot)
    return p


def main(argv: Sequence[str] | None = None) -> int:  # noqa: PLR0911 - one per outcome
    """Run the `eventbus` command; returns the exit code (2: bad arguments or input)."""
    handler = _LogHandler()
    logger = logging.getLogger("eventbus")
    logger.addHandler(handler)
    try:
        args = _parser().parse_args(argv)
        handler.setLevel(logging.ERROR if args.quiet else logging.WARNING)
        code: int = args.func(args)
        return code
    except UsageError as e:
        return _fail(str(e), 2)
    except (LogReadError, EventDecodeError) as e:
        return _fail(str(e), 2)
    except OSError as e:
        where = f" {e.filename}" if getattr(e, "filename", None) else ""
        return _fail(f"{e.strerror or e}{where}" if e.strerror else str(e), 2)
    except KeyboardInterrupt:
        return 130
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except Exception as e:
        if os.environ.get("EVENTBUS_DEBUG"):
            raise
        return _fail(f"unexpected {type(e).__name__}: {e} (EVENTBUS_DEBUG=1 shows the "
                     "traceback)", 1)
    finally:
        logger.removeHandler(handler)


def _fail(message: str, code: int) -> int:
    print(f"eventbus: error: {' '.join(message.split())}", file=sys.stderr)
    return code


class _LogHandler(logging.Handler):
    """The library's warnings as `eventbus: warning: ...` lines on stderr, for the CLI only."""

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            msg = " ".join(record.getMessage().split())
            print(f"eventbus: {record.levelname.lower()}: {msg}", file=sys.stderr)


# -- subscriber specs --------------------------------------------------------------------------


def resolve_spec(spec: str, *, ranks: Sequence[int] = (0,)) -> Any:
    """Build the subscriber a SPEC names (`eventbus.config` rules); `UsageError` when it cannot."""
    try:
        c = parse_spec(spec)
        if c.factory in ("tensorboard", "tb") and "ranks" not in c.kwargs:
            c.kwargs["ranks"] = (ranks[0],)  # one rank writes, as in a live run
        return c.build()
    except ConfigError as e:
        raise UsageError(str(e)) from None


# -- commands ----------------------------------------------------------------------------------


def cmd_replay(args: argparse.Namespace) -> int:
    """Feed logs through subscribers; print or write what they publish."""
    files = log_files(args.logs)
    ranks = log_ranks(files)
    subs = [resolve_spec(s, ranks=ranks) for s in args.subscribe]
    inputs = {p.resolve() for p in files}
    for s in subs:
        target = getattr(s, "path", None)
        if isinstance(target, Path) and target.resolve() in inputs:
            raise UsageError(f"{target} is being replayed; write to another directory")
    if args.out and Path(args.out).resolve() in inputs:
        raise UsageError(f"--out {args.out} is being replayed; choose another file")
    r = Replayer(subs, rank=ranks[0])
    published = r.run(e for e in read_log(files) if isinstance(e, Event))
    st = r.stats()
    print(f"replayed {st.published:,} events from {len(files)} file(s) through "
          f"{', '.join(st.subscribers)}; {len(published)} published")
    if args.out:
        path = write_events(args.out, published, replayed_from=[str(p) for p in files])
        print(f"wrote {len(published)} events to {path}")
    else:
        for ev in published[:50]:
            print("  " + describe(ev))
        if len(published) > 50:
            print(f"  ... {len(published) - 50} more (use --out FILE)")
    failed = {n: s for n, s in st.subscribers.items() if s.failed}
    for n, s in failed.items():
        print(f"eventbus: warning: subscriber {n} failed on {s.failed} events ({s.error})",
              file=sys.stderr)
    return 1 if failed else 0


def cmd_summary(args: argparse.Namespace) -> int:
    """Print steps, wall time, loss, throughput, drops/failures, detections, peak memory."""
    from eventbus.report import collect, summary_dict, summary_lines

    files = log_files(args.logs)
    report = collect(files)
    if report.events == 0:
        raise UsageError(f"no events in {', '.join(map(str, files))}")
    if args.json:
        print(orjson.dumps(summary_dict(report), default=str,
                           option=orjson.OPT_NON_STR_KEYS).decode())
    else:
        print("\n".join(summary_lines(report)))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    """Draw loss, grad norm, lr, memory and step time (detections marked) into a PNG."""
    if importlib.util.find_spec("matplotlib") is None:
        return _fail("plot needs matplotlib: pip install 'eventbus[plot]'", 1)
    from eventbus.report import collect, plot

    out = Path(args.out)
    if out.suffix.lower() != ".png":
        raise UsageError(f"-o {args.out}: the plot is a PNG; name it *.png")
    files = log_files(args.logs)
    report = collect(files)
    try:
        panels = plot(report, out, title=args.title)
    except ValueError as e:
        raise UsageError(f"{', '.join(map(str, files))}: {e}") from None
    print(f"wrote {out} ({', '.join(panels)})")
    return 0


# -- tail --------------------------------------------------------------------------------------


def cmd_tail(args: argparse.Namespace) -> int:  # noqa: PLR0911 - one per stop reason
    """Print one line per step of a (live) log, then follow it."""
    files = log_files([args.log])
    if len(files) != 1:
        raise UsageError(f"tail follows one file; {args.log} holds {len(files)}: "
                         + ", ".join(p.name for p in files))
    if args.lines < 0 or (args.max_lines is not None and args.max_lines < 1):
        raise UsageError("-n and --max-lines must be positive")
    path = files[0]
    steps = StepLines()
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
        backlog.extend(steps.feed(line, path))
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
            if emit(steps.feed(line, path)):
                return 0
        if follower.truncated:
            follower.truncated = False
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


class _Follower:
    """Reads complete lines appended to a file; notices truncation (a resume)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.truncated = False

    def read_lines(self) -> Iterator[bytes]:
        try:
            size = os.stat(self.path).st_size
        except OSError as e:
            raise LogReadError(f"{self.path}: cannot read: {e.strerror or e}") from None
        if size < self.offset:
            self.offset, self.partial, self.truncated = 0, b"", True
        if size == self.offset:
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        yield from (line for line in lines if line.strip())


class StepLines:
    """Folds a step's events into one line, printed when the next step begins."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.fields: dict[str, str] = {}
        self.ended = False
        self.lineno = 0

    @property
    def pending(self) -> bool:
        return bool(self.fields)

    def feed(self, line: bytes, path: Path) -> list[str]:
        self.lineno += 1
        try:
            ev = decode(line)
        except EventDecodeError as e:
            raise LogReadError(f"{path}: line {self.lineno}: {e}") from None
        if ev is None:
            return []
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
        self.fields.update(_fields(ev))
        return out

    def flush(self) -> list[str]:
        if not self.fields:
            return []
        line = f"step {self.step:>6}  " + "  ".join(f"{k} {v}" for k, v in self.fields.items())
        self.fields = {}
        return [line]


def _notable(ev: Event) -> str | None:
    if isinstance(ev, RunStarted | RunEnded | DivergenceDetected | MemoryLeakSuspected
                  | StopRequested | CheckpointSaved | CheckpointLoaded):
        return "-- " + describe(ev)
    return None


if __name__ == "__main__":
    sys.exit(main())
