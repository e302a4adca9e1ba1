"""`RankLink`: a monitor's thread that carries parts from every rank to rank 0, and `Gathering`,
rank 0's table of them: a key is ready once every rank sent its part for it.

    bus loop: link.put(key, part)   link thread, every tick_s:
      (a deque append)                rank r > 0: one message of what was put -> RankChannel
                                      rank 0: its own parts + every message waiting -> Gathering
                                              -> on_ready(key, parts, missing) for keys complete

A rank that sent nothing for a key within `timeout_s` of the key's first part is reported lost
(`on_lost`) and no longer waited for; a part from it later brings it back (its parts for keys
already done are counted `late`). At close a rank sends what it has and an end mark; rank 0
waits up to `close_wait_s` for every other rank's end mark, then completes what it has.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import orjson

from eventbus.log import get_logger
from eventbus.ranks import ChannelError, RankChannel

__all__ = ["Gathering", "Key", "RankLink", "decode_float", "encode_float"]

Key = tuple[str, int]  # (series, index): a metric's name and step, or a window's number
Ready = tuple[Key, dict[int, Any], tuple[int, ...]]  # key, rank -> part, ranks missing


def encode_float(x: float) -> float | str:
    """JSON has no NaN or infinity: those travel as strings."""
    return x if math.isfinite(x) else repr(x)


def decode_float(x: float | str) -> float:
    return float(x)


def _key(k: Any) -> Key:
    """A key back from JSON ([series, index])."""
    series, index = k
    return str(series), int(index)


class Gathering:
    """Rank 0's parts by key. `add` them, `end` a rank that sent its last, `ready(now)` the keys
    complete (or timed out); ranks found missing at a timeout are in `take_lost()`."""

    def __init__(self, world_size: int, *, timeout_s: float, max_pending: int = 100_000) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.lost: set[int] = set()
        self.ended: set[int] = set()
        self.late = 0  # parts for keys already done
        self.overflow = 0  # keys completed early because too many were pending
        self._pending: OrderedDict[Key, tuple[float, dict[int, Any]]] = OrderedDict()
        self._dirty: dict[Key, None] = {}  # keys with a new part since the last ready()
        self._rescan = False  # every pending key may have completed (a rank lost, ended, ...)
        self._done: OrderedDict[Key, None] = OrderedDict()  # recent keys, to spot late parts
        self._latest: list[dict[str, int]] = [{} for _ in range(world_size)]
        self._newly_lost: list[tuple[int, float]] = []

    @property
    def pending(self) -> int:
        return len(self._pending)

    def expected(self, key: Key | None = None) -> set[int]:
        """Ranks still waited for (for `key`: not those that went past it)."""
        ranks = set(range(self.world_size)) - self.lost - self.ended
        if key is None:
            return ranks
        series, index = key
        return {r for r in ranks if self._latest[r].get(series, index) <= index}

    def add(self, rank: int, key: Key, part: Any, now: float) -> bool:
        """One rank's part for `key` = (series, index); True if that rank was lost and is back.

        A rank sends a series in index order, so a part for index i also says it will send
        nothing for the indices it skipped below i (a dropped or unlogged step): those keys no
        longer wait for it."""
        back = rank in self.lost
        if back:
            self.lost.discard(rank)
            self._rescan = True
        series, index = key
        latest = self._latest[rank]
        last = latest.get(series)
        if last is None or index > last:
            latest[series] = index
            if last is None or index > last + 1:
                self._rescan = True  # it skipped indices: keys below may complete without it
        if key in self._done:
            self.late += 1
            return back
        entry = self._pending.get(key)
        if entry is None:
            entry = self._pending[key] = (now, {})
        entry[1][rank] = part
        self._dirty[key] = None
        return back

    def end(self, rank: int) -> None:
        """`rank` will send nothing more: stop waiting for it."""
        self.ended.add(rank)
        self._rescan = True

    def take_lost(self) -> list[tuple[int, float]]:
        """(rank, seconds waited) for each rank found missing since the last call."""
        out, self._newly_lost = self._newly_lost, []
        return out

    def ready(self, now: float, *, final: bool = False) -> list[Ready]:
        """Keys complete now, oldest first; `final`: every pending key, complete or not."""
        out: list[Ready] = []
        pending = self._pending
        while pending:  # the oldest first: past its timeout, or too many waiting
            key, (first, parts) = next(iter(pending.items()))
            waited = now - first
            if not final and waited <= self.timeout_s and len(pending) <= self.max_pending:
                break
            missing = self.expected(key) - parts.keys()
            if not final and waited > self.timeout_s and missing:
                self.lost |= missing
                self._newly_lost += [(r, waited) for r in sorted(missing)]
                self._rescan = True
            elif not final and missing:
                self.overflow += 1
            out.append(self._finish(key))
        check = list(pending) if self._rescan else [k for k in pending if k in self._dirty]
        for key in check:  # pending order: oldest first
            if self.expected(key) <= pending[key][1].keys():
                out.append(self._finish(key))
        self._dirty.clear()
        self._rescan = False
        return out

    def _finish(self, key: Key) -> Ready:
        _, parts = self._pending.pop(key)
        self._done[key] = None
        if len(self._done) > 2 * self.max_pending:
            self._done.popitem(last=False)
        missing = tuple(r for r in range(self.world_size) if r not in parts)
        return key, parts, missing


class RankLink:
    """A thread per monitor: `put(key, part)` from the bus loop on every rank; on rank 0,
    `on_ready(key, parts, missing)` and `on_lost(rank, waited_s)` run on this thread."""

    def __init__(
        self,
        name: str,
        *,
        on_ready: Callable[[Key, dict[int, Any], tuple[int, ...]], None],
        on_lost: Callable[[int, float], None],
        tick_s: float,
        timeout_s: float,
        close_wait_s: float,
        max_queued: int = 100_000,
    ) -> None:
        self.name = name
        self.on_ready = on_ready
        self.on_lost = on_lost
        self.tick_s = tick_s
        self.timeout_s = timeout_s
        self.close_wait_s = close_wait_s
        self.sent = 0  # messages pushed to the store
        self.received = 0  # messages popped (rank 0)
        self.failed = 0  # sends or receives that raised (what they carried is in `dropped`)
        self.dropped = 0  # parts lost: the outbox full, a failed send, no channel
        self.error: str | None = None  # why the channel could not open
        self.gathering: Gathering | None = None
        self._out: deque[tuple[Key, Any]] = deque()
        self._max_queued = max_queued
        self._rank = 0
        self._seq = 0
        self._channel: RankChannel | None = None
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None

    def start(self, rank: int, world_size: int) -> None:
        self._rank = rank
        self._channel = RankChannel(self.name, rank=rank, world_size=world_size)
        if rank == 0:
            self.gathering = Gathering(world_size, timeout_s=self.timeout_s)
        self._thread = threading.Thread(target=self._run, name=f"eventbus-{self.name}", daemon=True)
        self._thread.start()

    def put(self, key: Key, part: Any) -> None:
        """Queue this rank's part for `key` (bus loop; a deque append, drops counted)."""
        if len(self._out) >= self._max_queued or self.error is not None:
            self.dropped += 1
            return
        self._out.append((key, part))

    def close(self) -> None:
        """Send what is left (rank 0: wait for the others'), then stop the thread."""
        self._closing = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.close_wait_s + self.timeout_s / 10 + 5)

    def stats(self) -> dict[str, Any]:
        g = self.gathering
        return {
            "sent": self.sent,
            "received": self.received,
            "failed": self.failed,
            "dropped": self.dropped,
            "late": g.late if g is not None else 0,
            "overflow": g.overflow if g is not None else 0,
            "lost": sorted(g.lost) if g is not None else [],
            "error": self.error,
        }

    # -- the link's thread -------------------------------------------------------------------

    def _run(self) -> None:
        ch = self._channel
        assert ch is not None
        try:
            ch.connect()
        except (ChannelError, ImportError) as e:
            self.error = str(e)
            self.dropped += len(self._out)
            self._out.clear()
            get_logger().error(
                "cross-rank channel could not open: this monitor does nothing",
                monitor=self.name,
                error=self.error,
            )
            return
        while not self._closing:
            self._wake.wait(self.tick_s)
            self._round(ch, final=False)
        self._finish(ch)
        ch.close()

    def _round(self, ch: RankChannel, *, final: bool, end: bool = False) -> None:
        try:
            if self._rank == 0:
                self._gather(ch, final=final)
            else:
                self._send(ch, end=end)
        except Exception as e:  # never die silently: counted, and the next tick tries again
            self.failed += 1
            get_logger().warning("cross-rank round failed", monitor=self.name, error=repr(e))

    def _send(self, ch: RankChannel, *, end: bool) -> None:
        items = [self._out.popleft() for _ in range(len(self._out))]
        if not items and not end:
            return
        msg = {"r": self._rank, "n": self._seq, "items": items, "end": end}
        try:
            ch.send(orjson.dumps(msg))
        except Exception:
            self.dropped += len(items)
            raise
        self._seq += 1
        self.sent += 1

    def _gather(self, ch: RankChannel, *, final: bool) -> None:
        g = self.gathering
        assert g is not None
        now = time.monotonic()
        for key, part in [self._out.popleft() for _ in range(len(self._out))]:
            g.add(0, key, part, now)
        for raw in ch.receive():
            self.received += 1
            msg = orjson.loads(raw)
            rank = int(msg["r"])
            back = False
            for key, part in msg["items"]:
                back |= g.add(rank, _key(key), part, now)
            if back:
                get_logger().warning("a rank reported lost is sending again", rank=rank)
            if msg.get("end"):
                g.end(rank)
        for key, parts, missing in g.ready(now, final=final):
            self.on_ready(key, parts, missing)
        for rank, waited in g.take_lost():
            self.on_lost(rank, waited)

    def _finish(self, ch: RankChannel) -> None:
        """Closing: a rank sends the rest and its end mark; rank 0 waits for everyone's."""
        if self._rank != 0:
            self._round(ch, final=True, end=True)
            return
        g = self.gathering
        assert g is not None
        g.end(0)
        deadline = time.monotonic() + self.close_wait_s
        while g.expected() and time.monotonic() < deadline:
            self._round(ch, final=False)
            if g.expected():
                threading.Event().wait(self.tick_s)  # the others' last messages: a poll
        if g.expected():
            get_logger().warning(
                "ranks never sent their last parts before close",
                monitor=self.name,
                ranks=sorted(g.expected()),
                waited_s=self.close_wait_s,
            )
        self._round(ch, final=True)
