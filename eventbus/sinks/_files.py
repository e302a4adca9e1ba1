"""Checks shared by the file sinks: fail at construction, with a message that says what to do."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar, SupportsIndex, TypeVar

from eventbus.core import BusHandle

__all__ = [
    "BuiltFromArguments",
    "check_ranks",
    "check_writable_dir",
    "check_writable_file",
    "made_with",
]

S = TypeVar("S")


class BuiltFromArguments:
    """A built-in sink: in the sidecar process by default, pickled as the arguments it was
    made with, so the sidecar builds its own copy (locks, threads and open files never cross).

    A user's subclass runs in the training process unless it sets `placement` itself, and one
    with an `__init__` of its own pickles as any object does.
    """

    placement: ClassVar[str] = "process"
    _made_with: tuple[type[Any], dict[str, Any]]
    _reported: Callable[[], Any] | None = None  # this sink's own stats, as its sidecar reports

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "placement" not in cls.__dict__ and cls.__module__.split(".")[0] != "eventbus":
            cls.placement = "thread"  # a user's subclass: its code runs where they expect

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        made_by, kwargs = self._made_with
        if type(self).__init__ is made_by.__init__:
            return (_build, (type(self), kwargs))
        return object.__reduce_ex__(self, protocol)

    def placed_in_sidecar(self, bus: BusHandle, reported: Callable[[], Any]) -> None:
        """The bus runs this sink's copy in its sidecar: `stats()` reads what it reports."""
        self._reported = reported

    def reported_or(self, kind: type[S], own: Callable[[], S]) -> S:
        """This sink's stats: its sidecar copy's latest report when it runs there, else `own()`."""
        if self._reported is not None:
            st = self._reported()
            if isinstance(st, kind):
                return st
        return own()


def made_with(arguments: dict[str, Any], cls: type[Any]) -> tuple[type[Any], dict[str, Any]]:
    """`cls.__init__`'s arguments, from its `locals()` taken first thing."""
    return cls, {k: v for k, v in arguments.items() if k not in ("self", "__class__")}


def _build(cls: type[Any], kwargs: dict[str, Any]) -> Any:
    return cls(**kwargs)


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


def check_ranks(ranks: Iterable[int] | None) -> tuple[int, ...] | None:
    """`ranks` as a tuple of ints (None: every rank); ValueError for anything else."""
    if ranks is None:
        return None
    if not isinstance(ranks, Iterable):
        raise TypeError(f"ranks must be a tuple of ints such as (0,), or None; got {ranks!r}")
    out = tuple(ranks)
    if not out or not all(isinstance(r, int) and not isinstance(r, bool) for r in out):
        raise ValueError(f"ranks must be a non-empty tuple of ints or None, got {out!r}")
    return out
