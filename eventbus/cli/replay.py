"""`eventbus replay`: feed logs through the subscribers SPECs name; show what they publish."""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from eventbus.cli._checks import check_event
from eventbus.cli._errors import UsageError, no_events
from eventbus.config import ConfigError, SubscriberConfig, parse_spec
from eventbus.events import Event
from eventbus.logformat import LogLine, LogReadError, log_files, log_ranks, read_log, write_events
from eventbus.monitors import MemoryProfiler
from eventbus.replay import Replayer
from eventbus.sinks._runs import RUN_PREFIX
from eventbus.sinks._text import describe

__all__ = ["add_parser", "resolve_spec", "run"]


def add_parser(sub: Any) -> None:
    """Register `eventbus replay LOG... --subscribe SPEC... [--out FILE]`."""
    r = sub.add_parser("replay", help="feed logs through subscribers; write what they publish")
    r.add_argument("logs", nargs="+", metavar="LOG", help="JSONL files or directories")
    r.add_argument(
        "--subscribe",
        "-s",
        nargs="+",
        action="extend",
        required=True,
        metavar="SPEC",
        help="jsonl:DIR, tensorboard:DIR, divergence, memory, progress, or module:factory",
    )
    r.add_argument("--out", "-o", metavar="FILE", help="write the published events as JSONL")
    r.set_defaults(func=run)


def resolve_spec(spec: str, *, ranks: Sequence[int] = (0,)) -> Any:
    """Build the subscriber a SPEC names (`eventbus.config` rules); `UsageError` when it cannot,
    or when it is a MemoryProfiler (it would measure the replaying process)."""
    return _build(_parse(spec, ranks), spec)


def _parse(spec: str, ranks: Sequence[int]) -> SubscriberConfig:
    """A SPEC checked without building anything (a sink creates its files when built)."""
    try:
        c = parse_spec(spec)
        factory = c.factory_object()
    except ConfigError as e:
        raise UsageError(str(e)) from None
    if isinstance(factory, type) and issubclass(factory, MemoryProfiler):
        raise _measures_replay(spec)
    if c.factory in ("tensorboard", "tb") and "ranks" not in c.kwargs:
        c.kwargs["ranks"] = (ranks[0],)  # one rank writes, as in a live run
    return c


def _build(c: SubscriberConfig, spec: str) -> Any:
    try:
        sub = c.build()
    except ConfigError as e:
        raise UsageError(str(e)) from None
    if isinstance(sub, MemoryProfiler):  # a user's factory that returns one
        raise _measures_replay(spec)
    return sub


def _measures_replay(spec: str) -> UsageError:
    return UsageError(
        f"{spec}: MemoryProfiler measures the process it runs in, which here would be this "
        "replay, not the run; the run's MemorySample events are in its log already "
        "(eventbus summary / plot show them)"
    )


def _run_base(path: Path) -> Path:
    """The directory a run was written to (`DIR` for `DIR/run-2/events.jsonl` too)."""
    d = path.resolve().parent
    return d.parent if d.name.startswith(RUN_PREFIX) else d


def run(args: argparse.Namespace) -> int:
    """Feed logs through subscribers; print or write what they publish."""
    files = log_files(args.logs)
    ranks = log_ranks(files)
    inputs = {p.resolve() for p in files}
    if args.out and Path(args.out).resolve() in inputs:
        raise UsageError(f"--out {args.out} is being replayed; choose another file")
    # The first event is read before any subscriber is built: a log that is not one, or holds
    # no events, fails before a sink creates its files.
    events = _checked(read_log(files, located=True))
    first = next(events, None)
    if first is None:
        raise no_events(files)
    configs = [_parse(s, ranks) for s in args.subscribe]  # all checked before one is built
    subs = [_build(c, s) for c, s in zip(configs, args.subscribe, strict=True)]
    for s in subs:
        target = getattr(s, "path", None)
        if isinstance(target, Path) and _run_base(target) in {_run_base(p) for p in inputs}:
            raise UsageError(f"{target.parent} is being replayed; write to another directory")
    r = Replayer(subs, rank=ranks[0])
    published = r.run(itertools.chain([first], events))
    st = r.stats()
    print(
        f"replayed {st.published:,} events from {len(files)} file(s) through "
        f"{', '.join(st.subscribers)}; {len(published)} published"
    )
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
        print(
            f"eventbus: warning: subscriber {n} failed on {s.failed} events ({s.error})",
            file=sys.stderr,
        )
    return 1 if failed else 0


def _checked(lines: Iterator[LogLine]) -> Iterator[Event]:
    """The events of a log, each checked as the summary checks it: a bad one is `file:line`."""
    for line in lines:
        ev = line.item
        if isinstance(ev, Event):
            try:
                check_event(ev)
            except ValueError as e:
                raise LogReadError(f"{line.where}: {e}") from None
            yield ev
