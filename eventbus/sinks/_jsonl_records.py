"""The lines `JsonlWriter` writes: each event's own, a skipped marker in its place, and the
header and stats records.

An event that cannot be a line (a field JSON cannot hold, a line over `max_line_bytes`)
becomes a counted `SKIPPED_TYPE` record naming its type, stamps and why, with a rate-limited
warning; the rest of its batch is written.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from eventbus.codec import encode
from eventbus.core import BusHandle
from eventbus.events import Event
from eventbus.log import RateLimiter, get_logger
from eventbus.logformat import SKIPPED_TYPE, STATS_TYPE, header, record
from eventbus.version import __version__

__all__ = ["LineEncoder", "header_record", "stats_record"]

_log_limit = RateLimiter(30.0)


class LineEncoder:
    """Events to lines, counting those replaced by a marker: `oversize`, `unserialisable`."""

    def __init__(self) -> None:
        self.oversize = 0  # events replaced by a marker: line over max_line_bytes
        self.unserialisable = 0  # events replaced by a marker: a field JSON cannot hold

    def line(self, ev: Event, max_line_bytes: int) -> bytes:
        """The line of `ev`, or a skipped marker naming why (a field that cannot be written,
        a line over `max_line_bytes`)."""
        t = type(ev)
        try:
            line = encode(ev)
        except Exception as e:  # EventEncodeError, or anything a user's value raised
            self.unserialisable += 1
            field = getattr(e, "field", None)
            _warn(
                "event not written: a field cannot be serialised",
                key=(t, "encode"),
                event_type=t.__name__,
                field=field,
                step=ev.step,
                error=str(e),
            )
            return _skipped(
                ev, "unserialisable", field=field, error=f"{type(e).__name__}: {e}"[:1000]
            )
        cap = max_line_bytes
        if len(line) > cap:
            self.oversize += 1
            _warn(
                "event not written: its line is over max_line_bytes",
                key=(t, "size"),
                event_type=t.__name__,
                step=ev.step,
                size=len(line),
                max_line_bytes=cap,
            )
            return _skipped(ev, "oversize", size=len(line), limit=cap)
        return line


def header_record(
    *, rank: int, world_size: int, resumed_from_step: int | None, max_line_bytes: int
) -> bytes:
    """The first line of a writer's session: who wrote it (rank, pid, host, version), when."""
    return header(
        rank=rank,
        world_size=world_size,
        pid=os.getpid(),
        host=socket.gethostname(),
        eventbus_version=__version__,
        ts=time.time_ns(),
        resumed_from_step=resumed_from_step,
        max_line_bytes=max_line_bytes,
    )


def stats_record(
    bus: BusHandle | None, *, rank: int, step: int | None, writer: dict[str, Any]
) -> bytes:
    """The last line of a writer's session: the bus's counters (if it keeps them) and
    `writer`'s own."""
    bus_stats: dict[str, Any] | None = None
    read = getattr(bus, "stats", None)  # the live bus and replay have counters
    if callable(read):
        for _ in range(3):  # other subscribers may still be closing: retry a racy read
            try:
                bus_stats = read().as_dict()
                break
            except RuntimeError:
                continue
    return record(
        STATS_TYPE,
        ts=time.time_ns(),
        rank=rank,
        step=step,
        bus=bus_stats,
        writer=writer,
    )


def _skipped(ev: Event, reason: str, **info: Any) -> bytes:
    stamps = {
        k: v if type(v) is int else None
        for k in ("step", "ts", "seq", "rank")
        for v in [getattr(ev, k, None)]
    }
    name = getattr(ev, "type_name", None) or type(ev).__name__
    return record(SKIPPED_TYPE, reason=reason, event_type=name, **stamps, **info)


def _warn(msg: str, *, key: Any, **kw: Any) -> None:
    ok, held = _log_limit.allow(key)
    if ok:
        get_logger().warning(msg, suppressed_since_last=held, **kw)
