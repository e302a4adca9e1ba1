"""Checks shared by the file sinks: fail at construction, with a message that says what to do."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["check_writable_dir", "check_writable_file"]


def _error(who: str, path: Path, e: OSError, what: str) -> OSError:
    reason = e.strerror or str(e)
    err = type(e)(
        e.errno,
        f"{who} cannot write {what} {str(path)!r}: {reason}; "
        "pass a directory this process can create and write files in",
    )
    err.filename = str(path)
    return err


def check_writable_dir(path: Path, who: str) -> Path:
    """Create `path` (and parents) and prove a file can be created there; raise OSError if not.

    A probe file rather than `os.access`: access() says yes to root on a read-only mount.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError as e:  # a regular file sits where the directory should be
        raise _error(who, path, e, "under") from None
    except OSError as e:
        raise _error(who, path, e, "under") from None
    if not path.is_dir():
        raise NotADirectoryError(
            20,
            f"{who} cannot write under {str(path)!r}: it is not a "
            "directory; pass a directory (or a *.jsonl file path)",
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".eventbus-probe-", dir=path)
    except OSError as e:
        raise _error(who, path, e, "under") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return path


def check_writable_file(path: Path, who: str) -> Path:
    """An existing file must open for appending (nothing is written); else check its directory."""
    if not path.exists():
        check_writable_dir(path.parent, who)
        return path
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    except OSError as e:
        raise _error(who, path, e, "to file") from None
    os.close(fd)
    return path
