"""What the experiment-tracker sinks (W&B, MLflow) share: their extra, ranks, run outcomes."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

__all__ = ["SUCCEEDED", "check_ranks", "require"]

# RunEnded.status values that end a run well: asked to stop (early stopping, a monitor) is a
# finish, not a failure. "failed", "aborted", "interrupted" and "unknown" are not.
SUCCEEDED = frozenset({"completed", "stopped"})


def require(package: str, who: str, extra: str) -> None:
    """Raise a one-line ImportError naming the extra when `package` is not installed
    (found without importing it: the training process need not pay for the import)."""
    if importlib.util.find_spec(package) is None:
        raise ImportError(f"{who} needs the {package} package: pip install 'eventbus[{extra}]'")


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
