"""One JSONL log file: opened append-only, repaired, resumed, written with exact loss counts.

Each write is one `os.write` loop on an unbuffered, append-only descriptor: nothing sits in a
Python file buffer, so a forked child (a DataLoader worker) has nothing of ours to flush a
second time. On open a torn last line (a crash mid-write) is cut off, and a resume drops the
lines after its step. A write that fails marks the file failed: the event lines it lost are
counted exactly (lines held since earlier batches included) and carried by the
`JsonlWriteError` raised (`earlier_lost`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path

import orjson

from eventbus.log import get_logger

__all__ = ["JsonlFile", "JsonlWriteError"]


class JsonlWriteError(OSError):
    """The log could not be written (disk full, I/O error); the writer is marked failed.

    `earlier_lost`: events of earlier batches (held by `flush_interval`, so counted delivered
    when handed over) that this failure lost, besides the batch being handed over now.
    """

    earlier_lost: int = 0


class JsonlFile:
    """The file a `JsonlWriter` writes and the bytes held for it; called under the writer's lock.

    Counters: `lines_written`, `bytes_written`; `lines_lost`, event lines handed over that
    never reached the file (of them `lines_lost_held`: held lines a later write lost);
    `lines_truncated` by a resume; `torn_lines_repaired`, partial last lines cut off.
    """

    def __init__(self) -> None:
        self.path: Path | None = None
        self.fd: int | None = None
        self.error: OSError | None = None  # the write failure that stopped this file
        self.last_write = time.monotonic()
        self._pid = os.getpid()
        self._buf = bytearray()
        self._buf_lines = 0  # event lines (markers included) in the buffer
        self._buf_records = 0  # header / stats records in the buffer
        self.lines_written = 0
        self.bytes_written = 0
        self.lines_lost = 0
        self.lines_lost_held = 0
        self.lines_truncated = 0
        self.torn_lines_repaired = 0

    @property
    def held_bytes(self) -> int:
        """Bytes held for the next write."""
        return len(self._buf)

    # -- open, repair, resume ----------------------------------------------------------------

    def open(self, path: Path, *, truncate: bool, resume_from: int | None) -> None:
        """Open `path` for appending (emptied first if `truncate`); on a regular file, keep
        only lines with step <= `resume_from`, or else cut off a torn last line."""
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
        if truncate:
            flags |= os.O_TRUNC
        try:
            self.fd = os.open(path, flags, 0o644)
        except OSError as e:
            raise type(e)(e.errno, f"JsonlWriter cannot open {str(path)!r}: {e.strerror}") from e
        self._pid = os.getpid()
        if _regular(self.fd):
            self._repair_and_resume(path, resume_from)

    def _repair_and_resume(self, path: Path, resume_from: int | None) -> None:
        if resume_from is not None:
            self.truncate_after(resume_from)
            return
        size = os.fstat(self.fd).st_size  # type: ignore[arg-type]
        if size == 0:
            return
        with open(path, "rb") as f:  # a torn last line would glue onto our header: cut it
            f.seek(max(0, size - (1 << 16)))
            tail = f.read()
        if tail.endswith(b"\n"):
            return
        nl = tail.rfind(b"\n")
        keep = size - len(tail) + nl + 1 if nl >= 0 else (0 if size <= (1 << 16) else None)
        if keep is None:  # a torn line longer than 64 KiB: scan the whole file
            self.truncate_after(None)
            return
        os.truncate(path, keep)
        self.torn_lines_repaired += 1
        get_logger().warning(
            "JSONL log ended with a partial line (a crash mid-write); removed",
            path=str(path),
            bytes_removed=size - keep,
        )

    def truncate_after(self, step: int | None) -> None:
        """Keep lines with step <= `step`, and step-less lines before the first later step;
        drop the rest and a torn last line. `None` only repairs the torn line."""
        self.write_out()
        path = self.path
        if path is None or self.fd is None or not _regular(self.fd):
            return
        cut: int | None = None
        kept_after: list[bytes] = []
        dropped = 0
        end = 0
        torn = False
        with open(path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    torn = True
                    break
                s = _step_of(line)
                if cut is None:
                    if step is not None and s is not None and s > step:
                        cut = end
                        dropped += 1
                elif s is not None and step is not None and s <= step:
                    kept_after.append(line)
                else:
                    dropped += 1
                end += len(line)
        if torn:
            self.torn_lines_repaired += 1
            get_logger().warning(
                "JSONL log ended with a partial line (a crash mid-write); removed", path=str(path)
            )
        if cut is None:
            if torn:
                os.ftruncate(self.fd, end)
            return
        if not kept_after:
            os.ftruncate(self.fd, cut)
        else:  # lines for earlier steps after the cut (a late eval, a monitor): rewrite
            tmp = path.with_name(path.name + ".resume-tmp")
            with open(path, "rb") as src, open(tmp, "wb") as dst:
                dst.write(src.read(cut))
                dst.writelines(kept_after)
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(tmp, path)
            os.close(self.fd)
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self.lines_truncated += dropped
        get_logger().info(
            "JSONL log resumed: later steps removed",
            path=str(path),
            resume_step=step,
            lines_removed=dropped,
        )

    # -- writing -----------------------------------------------------------------------------

    def hold(self, data: bytes | bytearray, lines: int) -> None:
        """Hold `lines` event lines (markers included) for the next write."""
        self._buf += data
        self._buf_lines += lines

    def hold_record(self, data: bytes) -> None:
        """Hold one header or stats record (not an event line) for the next write."""
        self._buf += data
        self._buf_records += 1

    def refuse(self, n: int) -> JsonlWriteError:
        """Count `n` events lost to an earlier failure; the error that says so."""
        assert self.error is not None
        self.lines_lost += n
        return JsonlWriteError(
            self.error.errno,
            f"JSONL writer failed earlier ({self.error}); {n} events not written to {self.path}",
        )

    def write_out(self) -> None:
        """Write the buffer; on an error count exactly the event lines lost, raise."""
        buf = self._buf
        if not buf or self.fd is None:
            return
        n_lines, n_records = self._buf_lines, self._buf_records
        data = bytes(buf)
        buf.clear()
        self._buf_lines = self._buf_records = 0
        self.last_write = time.monotonic()
        if os.getpid() != self._pid:
            return  # a forked child: the parent owns these lines and this file
        if self.error is not None:  # only the stats record is tried after a failure
            with contextlib.suppress(_PartialWrite):
                self._write_all(data)
            return
        try:
            self._write_all(data)
        except _PartialWrite as p:
            e = p.error
            # Complete lines that made it before the error (records come first in a buffer).
            written = min(n_lines, max(0, data.count(b"\n", 0, p.done) - n_records))
            lost = n_lines - written
            self.lines_written += written
            self._fail(e, lost)
            err = JsonlWriteError(
                e.errno,
                f"JSONL writer failed: {e.strerror or e} writing {self.path}; "
                f"{self.lines_lost} events lost so far, later events are not written",
            )
            err.earlier_lost = lost
            raise err from e
        self.lines_written += n_lines
        self.bytes_written += len(data)

    def _write_all(self, data: bytes) -> None:
        """`os.write` until done; a failure cuts a partial line off (a regular file)."""
        assert self.fd is not None
        view = memoryview(data)
        done = 0
        try:
            while done < len(data):
                done += os.write(self.fd, view[done:])
        except OSError as e:
            whole = data.rfind(b"\n", 0, done) + 1
            if done > whole:  # half a line on disk: remove it, so the log stays readable
                with contextlib.suppress(OSError):
                    if _regular(self.fd):
                        os.ftruncate(self.fd, os.fstat(self.fd).st_size - (done - whole))
            self.bytes_written += whole
            raise _PartialWrite(e, done) from e

    def _fail(self, e: OSError, lost: int) -> None:
        self.error = e
        self.lines_lost += lost
        self.lines_lost_held += lost
        get_logger().error(
            "JSONL writer failed; it writes nothing more in this run",
            path=str(self.path),
            error=f"{type(e).__name__}: {e}",
            disk_full=e.errno in (errno.ENOSPC, errno.EDQUOT),
            events_lost=lost,
        )

    # -- closing, forking ----------------------------------------------------------------------

    def fsync(self) -> None:
        """Sync the file to disk."""
        assert self.fd is not None
        os.fsync(self.fd)

    def close(self) -> None:
        """Close the descriptor (idempotent); what is still held is not written."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    def forget_held(self) -> None:
        """In a forked child: drop the parent's held lines (the parent writes them)."""
        self._buf = bytearray()
        self._buf_lines = self._buf_records = 0


class _PartialWrite(Exception):
    """An `os.write` failed after `done` bytes of a buffer."""

    def __init__(self, error: OSError, done: int) -> None:
        super().__init__(str(error))
        self.error = error
        self.done = done


def _regular(fd: int) -> bool:
    import stat

    return stat.S_ISREG(os.fstat(fd).st_mode)


def _step_of(line: bytes) -> int | None:
    try:
        d = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    s = d.get("step") if type(d) is dict else None
    return s if type(s) is int else None
