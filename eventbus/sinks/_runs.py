"""Where a run's files go: never into an earlier run's.

A file sink writes where it was told when nothing was written there before. A later run
that is not a resume gets the next free place, `DIR/run-2`, `DIR/run-3`, ... (for a named
file, `NAME.run-2.jsonl`), so TensorBoard and `eventbus summary` see separate runs instead of
one run with doubled curves. A resume (`resume_from_step`, `load_state_dict`, a first
`RunStarted(resumed_from_step=...)` or `CheckpointLoaded`, a sink rebuilt after its sidecar
died) continues the newest run; `overwrite=True` replaces the first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from eventbus.events import CheckpointLoaded, Event, RunStarted

__all__ = ["RUN_PREFIX", "is_resume", "run_dir", "run_place"]

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
