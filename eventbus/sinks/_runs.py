"""Where a run's files go: never into an earlier run's.

A file sink writes where it was told when nothing was written there before. A later run
that is not a resume gets the next free place, `DIR/run-2`, `DIR/run-3`, ... (for a named
file, `NAME.run-2.jsonl`), so TensorBoard and `eventbus summary` see separate runs instead of
one run with doubled curves. A resume (`resume_from_step`, `load_state_dict`, a first
`RunStarted(resumed_from_step=...)` or `CheckpointLoaded`, a sink rebuilt after its sidecar
died once its earlier copy wrote there) continues the newest run; `overwrite=True` replaces
the first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from eventbus.events import CheckpointLoaded, Event, RunStarted

__all__ = ["RUN_PREFIX", "is_resume", "rebuilt_on", "run_dir", "run_place"]

RUN_PREFIX = "run-"  # DIR/run-2, DIR/run-3, ...


def run_dir(base: Path, n: int) -> Path:
    """The directory of the `n`-th run written under `base` (the first: `base` itself)."""
    return base if n == 1 else base / f"{RUN_PREFIX}{n}"


def run_place(place: Callable[[int], Path], used: Callable[[Path], bool], *, resume: bool) -> Path:
    """`place(1)` if it is unused; else the first unused `place(n)`, or for a resume the
    newest used one."""
    n = 1
    while used(place(n)):
        n += 1
    return place(max(1, n - 1) if resume else n)


def is_resume(first: Iterable[Event]) -> bool:
    """Whether a run's first events say it resumes: the first `RunStarted` or
    `CheckpointLoaded` among them is a resume."""
    for ev in first:
        if isinstance(ev, CheckpointLoaded):
            return True
        if isinstance(ev, RunStarted):
            return ev.resumed_from_step is not None
    return False


def rebuilt_on(bus: Any, files: Iterable[Path]) -> bool:
    """Whether a sink rebuilt after its sidecar died (`bus.restarted`) goes on with `files`:
    only if its earlier copy wrote one of them (written since the bus's first sidecar started).
    A copy that died before it wrote leaves an earlier run's files there: its successor starts
    as it would have, never appending this run to that one."""
    since = getattr(bus, "since_ns", None)
    if not getattr(bus, "restarted", False) or since is None:
        return False
    for f in files:
        with contextlib.suppress(OSError):
            if f.stat().st_mtime_ns >= since:
                return True
    return False
