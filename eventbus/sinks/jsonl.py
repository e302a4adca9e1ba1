"""JsonlWriter: every event as one JSON line, written in batches from the bus side.

Lossless by default (`policy = "block"`). Each batch the bus hands over becomes one
`os.write` on an unbuffered, append-only descriptor (the file: `eventbus.sinks._jsonl_file`;
its lines: `eventbus.sinks._jsonl_records`), so a `tail -f` sees lines within a drain
interval. A write that fails (disk full, I/O error) marks the writer failed: it raises from
`on_events` from then on, so the bus counts every event it could not keep, and after the
bus's consecutive-failure limit the bus disables it.
Lines held by `flush_interval` and lost in a later write are counted exactly in `lines_lost`,
carried by the next error raised (`JsonlWriteError.earlier_lost`) and reported at close.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from eventbus.core import BusHandle
from eventbus.events import CheckpointLoaded, Event, RunStarted
from eventbus.log import get_logger
from eventbus.sinks._files import (
    BuiltFromArguments,
    check_writable_dir,
    check_writable_file,
    made_with,
)
from eventbus.sinks._jsonl_file import JsonlFile, JsonlWriteError
from eventbus.sinks._jsonl_records import LineEncoder, header_record, stats_record
from eventbus.sinks._runs import RUN_PREFIX, is_resume, rebuilt_on, run_dir, run_place

__all__ = ["JsonlWriteError", "JsonlWriter", "JsonlWriterStats"]

_WRITERS: list[JsonlWriter] = []  # for the fork hook; a writer removes itself at close


@dataclass(frozen=True, slots=True)
class JsonlWriterStats:
    """What the writer did, beyond the bus's delivered/failed counts."""

    path: str | None
    lines_written: int  # event lines now in the file (this session)
    bytes_written: int
    skipped_oversize: int  # events replaced by a marker: line over `max_line_bytes`
    skipped_unserialisable: int  # events replaced by a marker: a field JSON cannot hold
    lines_lost: int  # events handed to the writer that never reached the file (I/O errors)
    lines_lost_held: int  # of those, events held by flush_interval when a later write failed
    lines_truncated: int  # lines removed by a resume (step > the resume step)
    torn_lines_repaired: int  # partial last lines (a crash mid-write) removed on open
    failed: str | None  # the I/O error that stopped the writer, if any


_RESUMES = (CheckpointLoaded, RunStarted)  # events that may carry a resume step


def _used(path: Path) -> bool:
    """An earlier run wrote this file."""
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


class JsonlWriter(BuiltFromArguments):
    """Write events as JSON lines under a directory (`events.jsonl`, or per rank
    `events.rank{r}.jsonl` when the world size is > 1), or to a given `*.jsonl` file.

    `resume_from_step=N` (or `load_state_dict({"step": N})`) keeps the lines with step <= N
    and drops later ones, so each step appears once after a resume; a `CheckpointLoaded`
    event or a `RunStarted(resumed_from_step=N)` does the same mid-stream.
    """

    events: ClassVar[tuple[type[Event], ...]] = (Event,)
    policy: ClassVar[str] = "block"
    maxsize: ClassVar[int] = 65_536
    max_batch: ClassVar[int] = 4096
    name: ClassVar[str] = "jsonl"
    filename: ClassVar[str] = "events"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        flush_interval: float = 0.0,
        buffer_bytes: int = 1 << 20,
        fsync: bool = False,
        max_line_bytes: int = 1 << 20,
        resume_from_step: int | None = None,
        truncate_on_resume: bool = True,
        overwrite: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        """`flush_interval=0` writes each batch as it arrives (one `os.write` per batch);
        a positive value holds lines up to that many seconds (or `buffer_bytes`) for fewer,
        larger writes. `fsync=True` syncs the file to disk at close."""
        self._made_with = made_with(locals(), JsonlWriter)  # first: the sidecar builds from these
        if flush_interval < 0:
            raise ValueError(f"flush_interval must be >= 0 seconds, got {flush_interval!r}")
        if max_line_bytes < 256:
            raise ValueError(f"max_line_bytes must be >= 256, got {max_line_bytes!r}")
        if resume_from_step is not None and not isinstance(resume_from_step, int):
            raise TypeError(f"resume_from_step must be an int step, got {resume_from_step!r}")
        p = Path(path)
        self._file_mode = p.suffix == ".jsonl" or (p.exists() and not p.is_dir())
        if self._file_mode:
            check_writable_file(p, "JsonlWriter")
        else:
            check_writable_dir(p, "JsonlWriter")
        self._target = p
        self.flush_interval = float(flush_interval)
        self.buffer_bytes = buffer_bytes
        self.fsync = fsync
        self.max_line_bytes = max_line_bytes
        self.truncate_on_resume = truncate_on_resume
        self.overwrite = overwrite
        self.rank = rank
        self.world_size = world_size
        self._resume_from = resume_from_step
        self._bus: BusHandle | None = None
        self._lock = threading.RLock()
        self._file = JsonlFile()
        self._last_step: int | None = None
        self._closed = False
        self._timer: threading.Thread | None = None
        self._timer_stop = threading.Event()
        self._lines = LineEncoder()  # counts the events replaced by a marker line
        self._unreported = 0  # held lines lost in the timer thread, not yet raised to the bus
        self._undecided = False  # an earlier run's file is where ours would go: not open yet

    # -- where ----------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        """The file written (as the sidecar's copy reports, when it runs there): final once
        the bus started, or once the first events came when an earlier run wrote here."""
        reported = self.stats().path if self._reported is not None else None
        if self._file.path is not None or reported:
            return self._file.path or Path(str(reported))
        return self._place(resume=self._resume_from is not None)

    def _resolve(self, rank: int, world_size: int, run: int = 1) -> Path:
        """The file of this rank in the `run`-th run written here (`eventbus.sinks._runs`)."""
        t = self._target
        if not self._file_mode:
            name = self.filename if world_size <= 1 else f"{self.filename}.rank{rank}"
            return run_dir(t, run) / f"{name}.jsonl"
        if run > 1:
            t = t.with_name(f"{t.stem}.{RUN_PREFIX}{run}{t.suffix}")
        if world_size <= 1:
            return t
        if t.suffix == ".jsonl":
            return t.with_name(f"{t.stem}.rank{rank}.jsonl")
        return t.with_name(f"{t.name}.rank{rank}")

    def _place(self, *, resume: bool) -> Path:
        """This run's file: a new run never appends to an earlier one; a resume continues it."""
        rank, world = self.rank or 0, self.world_size or 1
        if self.overwrite and not resume:
            return self._resolve(rank, world)
        return run_place(lambda n: self._resolve(rank, world, n), _used, resume=resume)

    # -- subscriber hooks (run in the bus's worker thread for this writer) -----------------

    def on_start(self, bus: BusHandle | None = None) -> None:
        """Open the file for this rank: repair a torn last line, apply a resume, add a header."""
        self._bus = bus
        if bus is not None:
            self.rank = bus.rank if self.rank is None else self.rank
            self.world_size = bus.world_size if self.world_size is None else self.world_size
        restarted = rebuilt_on(bus, [self._place(resume=True)])
        if restarted:  # rebuilt after its sidecar died: append to what its earlier copy wrote
            self._resume_from, self.overwrite = None, False
        with self._lock:
            resume = restarted or self._resume_from is not None
            first = self._resolve(self.rank or 0, self.world_size or 1)
            if resume or self.overwrite or not _used(first):
                self._open(self._place(resume=resume))
            else:  # an earlier run wrote here: this run's first events say if it resumes it
                self._undecided = True

    def on_events(self, batch: list[Event]) -> None:
        """Encode the batch into one buffer and write it (now, or when the interval is due).

        An event that cannot be encoded (any exception) becomes a counted marker line naming
        its type and field; the rest of the batch is written.
        """
        f = self._file
        with self._lock:
            if f.fd is None and f.error is None:  # undecided, or never started
                resume = self._resume_from is not None or is_resume(batch)
                self._open(self._place(resume=resume))
            if f.error is not None:
                err = f.refuse(len(batch))
                err.earlier_lost, self._unreported = self._unreported, 0
                raise err
            lines = bytearray()
            n = 0
            try:
                for ev in batch:
                    if self.truncate_on_resume and isinstance(ev, _RESUMES):
                        step = ev.step if isinstance(ev, CheckpointLoaded) else ev.resumed_from_step
                        if step is not None:
                            f.hold(lines, n)
                            lines.clear()
                            n = 0
                            f.truncate_after(step)
                    lines += self._lines.line(ev, self.max_line_bytes)
                    n += 1
                    s = ev.step
                    if type(s) is int and (self._last_step is None or s > self._last_step):
                        self._last_step = s
            finally:
                f.hold(lines, n)
            if (
                self.flush_interval == 0.0
                or f.held_bytes >= self.buffer_bytes
                or time.monotonic() - f.last_write >= self.flush_interval
            ):
                try:
                    f.write_out()
                except JsonlWriteError as e:  # this batch is counted failed by the bus
                    e.earlier_lost = max(0, e.earlier_lost - len(batch))
                    raise

    def on_flush(self) -> None:
        """Write what is held (a `flush_interval` > 0 holds lines between writes)."""
        with self._lock:
            if self._file.error is None and not self._undecided:
                try:
                    self._file.write_out()
                except JsonlWriteError as e:  # held lines, delivered earlier: the next batch
                    self._unreported += e.earlier_lost  # raises them to the bus
                    e.earlier_lost = 0
                    raise

    def on_close(self) -> None:
        """Write what is held, append the stats record, fsync if asked, close the file.

        After a write failure the stats record is still tried (the disk may have room again)
        and the loss is logged with its exact counts.
        """
        self._timer_stop.set()
        f = self._file
        with self._lock:
            if self._closed:
                return
            if self._undecided:  # nothing came: a run of its own, with its header and stats
                self._open(self._place(resume=False))
            self._closed = True
            try:
                if f.fd is not None:
                    if f.error is None:
                        with contextlib.suppress(JsonlWriteError):
                            f.write_out()
                    self._append_stats()
                    if self.fsync and f.error is None:
                        f.fsync()
            finally:
                self._close_file()
                if f.error is not None:
                    get_logger().error(
                        "JSONL writer closed after a write failure: events were lost",
                        path=str(f.path),
                        error=str(f.error),
                        lines_written=f.lines_written,
                        lines_lost=f.lines_lost,
                        lines_lost_held=f.lines_lost_held,
                    )

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The last step written and the file: `load_state_dict` on resume drops later lines."""
        with self._lock:
            return {
                "step": self._last_step,
                "path": str(self.path),
                "lines": self._file.lines_written,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state["step"]`: lines with a later step are removed (now, or at open)."""
        step = state.get("step")
        if step is None:
            return
        if not isinstance(step, int):
            raise TypeError(f"state['step'] must be an int, got {step!r}")
        with self._lock:
            if self._file.fd is None:
                self._resume_from = step
            elif self._file.error is None:
                self._file.write_out()
                self._file.truncate_after(step)

    def placed_in_sidecar(self, bus: BusHandle, reported: Callable[[], Any]) -> None:
        """Its copy runs in the sidecar: `path` and `stats()` say what that copy does."""
        super().placed_in_sidecar(bus, reported)
        self.rank = bus.rank if self.rank is None else self.rank
        self.world_size = bus.world_size if self.world_size is None else self.world_size

    def stats(self) -> JsonlWriterStats:
        """This writer's own counters (lines, skipped events, lost lines, resume repairs);
        in the sidecar's copy when it runs there (as its latest report says)."""
        return self.reported_or(JsonlWriterStats, self._own_stats)

    def _own_stats(self) -> JsonlWriterStats:
        f = self._file
        return JsonlWriterStats(
            path=str(f.path) if f.path else None,
            lines_written=f.lines_written,
            bytes_written=f.bytes_written,
            skipped_oversize=self._lines.oversize,
            skipped_unserialisable=self._lines.unserialisable,
            lines_lost=f.lines_lost,
            lines_lost_held=f.lines_lost_held,
            lines_truncated=f.lines_truncated,
            torn_lines_repaired=f.torn_lines_repaired,
            failed=str(f.error) if f.error else None,
        )

    # -- the file (called with the lock held) -------------------------------------------------

    def _open(self, path: Path) -> None:
        if self._closed:
            raise RuntimeError("this JsonlWriter was closed; create a new one")
        self._undecided = False
        path.parent.mkdir(parents=True, exist_ok=True)  # DIR/run-2
        self._file.open(
            path,
            truncate=self.overwrite and self._resume_from is None,
            resume_from=self._resume_from,
        )
        self._file.hold_record(
            header_record(
                rank=self.rank or 0,
                world_size=self.world_size or 1,
                resumed_from_step=self._resume_from,
                max_line_bytes=self.max_line_bytes,
            )
        )
        self._resume_from = None
        if self.flush_interval > 0 and self._timer is None:
            self._timer = threading.Thread(
                target=self._tick, name="eventbus-jsonl-flush", daemon=True
            )
            self._timer.start()
        _WRITERS.append(self)

    def _append_stats(self) -> None:
        writer = {k: v for k, v in dataclasses.asdict(self.stats()).items() if k != "path"}
        self._file.hold_record(
            stats_record(self._bus, rank=self.rank or 0, step=self._last_step, writer=writer)
        )
        with contextlib.suppress(JsonlWriteError):
            self._file.write_out()

    def _close_file(self) -> None:
        self._file.close()
        with contextlib.suppress(ValueError):
            _WRITERS.remove(self)

    def _tick(self) -> None:
        """Timer thread (flush_interval > 0): write held lines once they are due."""
        interval = self.flush_interval
        f = self._file
        while not self._timer_stop.wait(interval / 2):
            with self._lock:
                if (
                    f.held_bytes
                    and f.error is None
                    and not self._closed
                    and time.monotonic() - f.last_write >= interval
                ):
                    try:
                        f.write_out()
                    except JsonlWriteError as e:  # no batch in hand: the next one raises it
                        self._unreported += e.earlier_lost

    def _forked(self) -> None:
        self._file.forget_held()
        self._lock = threading.RLock()


def _after_fork_in_child() -> None:
    for w in list(_WRITERS):
        w._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
