"""Replay recorded JSONL logs through subscribers, offline and deterministically.

Events are rebuilt through the type registry (a user type must be defined, i.e. its module
imported by the caller; a log never makes us import anything) and keep their recorded
ts/seq/rank/step. Several files (one per rank) are interleaved by step, then ts, each file
keeping its own order. A small in-thread driver stands in for the bus: subscribers get the
same protocol (`on_start(bus)`, `on_events(batch)` or a function of one event, `on_close()`,
`bus.publish`, `bus.control`), and what they publish is delivered to the others and returned.
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
import os
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import anyio
import orjson

from eventbus._log import RateLimiter, get_logger
from eventbus.codec import RECORD_PREFIX, EventDecodeError, decode, encode, header
from eventbus.control import Control
from eventbus.events import Event
from eventbus.stats import BusStats, SubscriberStats
from eventbus.subscription import describe, takes_argument

__all__ = ["LogReadError", "Replayer", "log_files", "read_log", "replay"]

PathLike = str | os.PathLike[str]
_log_limit = RateLimiter(10.0)
_RECORD_MARK = b'"type":"' + RECORD_PREFIX.encode()


class LogReadError(EventDecodeError):
    """A log file is missing, unreadable, or holds a line that is not an event record."""


def log_files(paths: PathLike | Iterable[PathLike]) -> list[Path]:
    """The files to read: each path as given, a directory as its `*.jsonl` files (sorted)."""
    items = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    if not items:
        raise LogReadError("no log files given")
    out: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(p.glob("*.jsonl"))
            if not found:
                raise LogReadError(f"{p}: no *.jsonl files in this directory")
            out.extend(found)
        elif p.exists():
            out.append(p)
        else:
            raise LogReadError(f"{p}: no such file or directory")
    return out


def iter_file(path: Path, *, records: bool = False) -> Iterator[Event | dict[str, Any]]:
    """One file's events in order (and its "eventbus.*" records as dicts if `records`).

    A partial last line (a crash or a writer mid-write) is skipped; a bad line elsewhere
    raises `LogReadError` naming the file and line.
    """
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed in the finally below (a generator)
    except OSError as e:
        raise LogReadError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                if _RECORD_MARK in line[:32]:
                    if records:
                        d = orjson.loads(line)
                        if type(d) is dict:
                            yield d
                    continue
                ev = decode(line)
            except (EventDecodeError, orjson.JSONDecodeError) as e:
                if not line.endswith(b"\n"):
                    get_logger().warning("skipped a partial last line", path=str(path),
                                         line=lineno)
                    return
                raise LogReadError(f"{path}:{lineno}: {e}") from None
            if ev is not None:
                yield ev
    except OSError as e:
        raise LogReadError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise LogReadError(f"{path}: not a text file: {e}") from None
    finally:
        f.close()


def read_log(
    paths: PathLike | Iterable[PathLike], *, records: bool = False, sources: bool = False
) -> Iterator[Any]:
    """Events of one or more logs in replay order: by step, then ts, each file's order kept.

    A step-less event (RunStarted, RunEnded) sorts with the last step its own file showed.
    `records=True` adds the "eventbus.*" records as dicts; `sources=True` yields
    (file index, item) pairs.
    """
    files = log_files(paths)
    streams = [_keyed(iter_file(p, records=records), i) for i, p in enumerate(files)]
    merged = streams[0] if len(streams) == 1 else heapq.merge(*streams, key=lambda kv: kv[0])
    for key, item in merged:
        yield (key[2], item) if sources else item


def _keyed(
    items: Iterator[Event | dict[str, Any]], index: int
) -> Iterator[tuple[tuple[int, int, int], Event | dict[str, Any]]]:
    last = -1
    for item in items:
        step, ts = (item.get("step"), item.get("ts")) if type(item) is dict else (
            item.step, item.ts)  # type: ignore[union-attr]
        if type(step) is int:
            last = step
        yield (last, ts if type(ts) is int else 0, index), item


def _file_rank(path: Path) -> int | None:
    """The rank named by a file's header or first event (a cheap peek)."""
    try:
        with open(path, "rb") as f:
            for line in itertools.islice(f, 16):
                try:
                    r = orjson.loads(line).get("rank")
                except (orjson.JSONDecodeError, AttributeError):
                    continue
                if type(r) is int:
                    return r
    except OSError:
        return None
    return None


def log_ranks(paths: PathLike | Iterable[PathLike]) -> list[int]:
    """The ranks the files of these logs were written by (sorted; 0 if none is named)."""
    ranks = {_file_rank(p) for p in log_files(paths)}
    return sorted(r for r in ranks if r is not None) or [0]


# -- the driver ---------------------------------------------------------------------------


class _Sub:
    """One subscriber in a replay: its event filter, its counters, how to call it."""

    def __init__(self, obj: Any, name: str) -> None:
        if not (hasattr(obj, "on_events") or callable(obj)):
            raise TypeError(
                "replay() takes subscribers: objects with on_events(batch) or functions of one "
                f"event; got {type(obj).__qualname__}: {obj!r:.80}"
            )
        self.obj = obj
        self.name = name
        self.batched = hasattr(obj, "on_events")
        types = getattr(obj, "events", None) if self.batched else None
        self.types: tuple[type[Event], ...] = (
            (Event,) if types is None else (types,) if isinstance(types, type) else tuple(types))
        self.delivered = 0
        self.failed = 0
        self.consecutive = 0
        self.published = 0
        self.state = "pending"
        self.error: str | None = None

    def stats(self) -> SubscriberStats:
        return SubscriberStats(
            name=self.name, policy="block", state=self.state, published=self.published,
            delivered=self.delivered, dropped=0, failed=self.failed, queued=0,
            queue_high_water=0, latency_p50_ms=None, latency_p99_ms=None, latency_max_ms=None,
            error=self.error,
        )


class Replayer:
    """Feeds recorded events through subscribers in the caller's order; see `replay`."""

    def __init__(
        self,
        subscribers: Any,
        *,
        batch_size: int = 256,
        rank: int = 0,
        world_size: int = 1,
        max_consecutive_failures: int | None = 100,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        subs = [subscribers] if (hasattr(subscribers, "on_events") or callable(subscribers)) \
            else list(subscribers)
        names: set[str] = set()
        self._subs: list[_Sub] = []
        for s in subs:
            base = describe(s)
            name, i = base, 2
            while name in names:
                name, i = f"{base}#{i}", i + 1
            names.add(name)
            self._subs.append(_Sub(s, name))
        self.batch_size = batch_size
        self.rank = rank
        self.local_rank = rank
        self.world_size = world_size
        self.max_consecutive_failures = max_consecutive_failures
        self.control = Control(self.publish)
        self.published: list[Event] = []
        self._pending: deque[Event] = deque()
        self._seq = itertools.count()
        self._clock: int | None = None
        self._routed = 0
        self._running = False

    # -- what subscribers see as `bus` ------------------------------------------------------

    def publish(self, ev: Event) -> None:
        """Stamp (ts = the replay clock if unset, seq, rank) and deliver after the current batch."""
        if not isinstance(ev, Event):
            raise TypeError(f"publish() takes an eventbus Event, got {type(ev).__qualname__}")
        if ev.ts is None:
            ev.ts = self._clock
        ev.seq = next(self._seq)
        ev.rank = self.rank
        self.published.append(ev)
        self._pending.append(ev)

    async def apublish(self, ev: Event) -> None:
        """`publish` for async subscribers."""
        self.publish(ev)

    def flush(self, timeout: float | None = None) -> bool:
        """Nothing to wait for: a replay delivers synchronously."""
        return True

    @property
    def should_stop(self) -> bool:
        """True once a subscriber asked to stop (the replay still feeds the whole log)."""
        return self.control.should_stop

    @property
    def running(self) -> bool:
        """True while the replay runs."""
        return self._running

    def stats(self) -> BusStats:
        """Counters in the bus's shape: events routed, per-subscriber delivered/failed."""
        return BusStats(
            published=self._routed, rejected=0, inbox_size=0, inbox_high_water=0,
            blocked_s=0.0, wakeups=0, subscribers={s.name: s.stats() for s in self._subs},
        )

    # -- running ----------------------------------------------------------------------------

    def run(self, events: Iterable[Event]) -> list[Event]:
        """Feed `events` through the subscribers; returns the events they published."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            anyio.run(self._main, events, backend="asyncio")
            return self.published
        # Called from async code (a notebook): run the driver on a thread of its own.
        error: list[BaseException] = []

        def target() -> None:
            try:
                anyio.run(self._main, events, backend="asyncio")
            except BaseException as e:
                error.append(e)

        t = threading.Thread(target=target, name="eventbus-replay")
        t.start()
        t.join()
        if error:
            raise error[0]
        return self.published

    async def _main(self, events: Iterable[Event]) -> None:
        self._running = True
        try:
            for s in self._subs:
                if await self._hook(s, "on_start", self):
                    s.state = "running"
                else:
                    s.state = "disabled"
            batch: list[Event] = []
            for ev in events:
                batch.append(ev)
                if len(batch) >= self.batch_size:
                    await self._route(batch)
                    batch = []
            if batch:
                await self._route(batch)
        finally:
            # Newest first, like the bus; what one publishes while closing reaches the rest.
            for s in reversed(self._subs):
                if s.state in ("running", "disabled"):
                    await self._hook(s, "on_close")
                    s.state = "closed"
                    await self._route([])
            self._running = False

    async def _route(self, batch: list[Event]) -> None:
        while True:
            if batch:
                self._clock = next((e.ts for e in reversed(batch) if e.ts is not None),
                                   self._clock)
                self._routed += len(batch)
                for s in self._subs:
                    if s.state != "running":
                        continue
                    mine = [e for e in batch if isinstance(e, s.types)]
                    if mine:
                        s.published += len(mine)
                        await self._deliver(s, mine)
            if not self._pending:
                return
            batch = list(self._pending)
            self._pending.clear()

    async def _deliver(self, s: _Sub, batch: list[Event]) -> None:
        if s.batched:
            try:
                r = s.obj.on_events(batch)
                if inspect.isawaitable(r):
                    await r
            except Exception as e:
                self._failed(s, e, batch[0], len(batch))
            else:
                s.delivered += len(batch)
                s.consecutive = 0
            return
        for ev in batch:
            try:
                r = s.obj(ev)
                if inspect.isawaitable(r):
                    await r
            except Exception as e:
                self._failed(s, e, ev, 1)
            else:
                s.delivered += 1
                s.consecutive = 0

    def _failed(self, s: _Sub, e: Exception, ev: Event, n: int) -> None:
        s.failed += n
        s.consecutive += 1
        s.error = f"{type(e).__name__}: {e}"
        ok, held = _log_limit.allow((s.name, type(e)))
        if ok:
            get_logger().warning("subscriber failed during replay", subscriber=s.name,
                                 event_type=type(ev).__name__, step=ev.step, error=s.error,
                                 suppressed_since_last=held, exc_info=e)
        limit = self.max_consecutive_failures
        if limit is not None and s.consecutive >= limit and s.state == "running":
            s.state = "disabled"
            get_logger().error("subscriber disabled during replay", subscriber=s.name,
                               reason=f"{limit} consecutive failures; last: {s.error}")

    async def _hook(self, s: _Sub, hook: str, *args: Any) -> bool:
        fn = getattr(s.obj, hook, None) if s.batched else None
        if fn is None or not callable(fn):
            return True
        if args and not takes_argument(fn):
            args = ()
        try:
            r = fn(*args)
            if inspect.isawaitable(r):
                await r
        except Exception as e:
            s.error = f"{type(e).__name__}: {e}"
            get_logger().warning("subscriber hook failed during replay", subscriber=s.name,
                                 hook=hook, error=s.error, exc_info=e)
            return False
        return True


def replay(
    path_or_paths: PathLike | Iterable[PathLike],
    subscribers: Any,
    *,
    out: PathLike | None = None,
    batch_size: int = 256,
) -> list[Event]:
    """Feed recorded logs through `subscribers`; return (and write to `out`) what they publish.

    `subscribers`: one subscriber or a list (objects with `on_events`, or functions of one
    event). Published events get `ts` from the replay clock (the recorded time of the batch
    being fed), so they line up with the log. A stop request is recorded, not obeyed: the
    whole log is fed.
    """
    files = log_files(path_or_paths)
    rank = log_ranks(files)[0]
    r = Replayer(subscribers, batch_size=batch_size, rank=rank)
    published = r.run(e for e in read_log(files) if isinstance(e, Event))
    if out is not None:
        write_events(out, published, replayed_from=[str(p) for p in files])
    return published


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

