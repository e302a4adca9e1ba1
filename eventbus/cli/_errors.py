"""How the commands fail: bad arguments or input are one line on stderr and exit code 2."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["UsageError", "fail", "no_events"]


class UsageError(Exception):
    """A bad argument or input: printed as one line, exit code 2."""


def no_events(files: Sequence[Path]) -> UsageError:
    """The error for logs that hold no events, saying whether they are empty or headers only."""
    names = ", ".join(map(str, files))
    try:
        empty = all(p.stat().st_size == 0 for p in files)
    except OSError:
        empty = False
    what = "empty" if empty else "no events in it, only header or stats records"
    return UsageError(f"{names}: {what}; give a log the run has written events to")


def fail(message: str, code: int) -> int:
    """Print `eventbus: error: MESSAGE` as one line on stderr; return `code`."""
    print(f"eventbus: error: {' '.join(message.split())}", file=sys.stderr)
    return code
