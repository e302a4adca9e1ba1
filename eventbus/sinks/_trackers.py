"""What the experiment-tracker sinks (W&B, MLflow) share: their extra, run outcomes."""

from __future__ import annotations

import importlib.util

__all__ = ["SUCCEEDED", "require"]

# RunEnded.status values that end a run well: asked to stop (early stopping, a monitor) is a
# finish, not a failure. "failed", "aborted", "interrupted" and "unknown" are not.
SUCCEEDED = frozenset({"completed", "stopped"})


def require(package: str, who: str, extra: str) -> None:
    """Raise a one-line ImportError naming the extra when `package` is not installed
    (found without importing it: the training process need not pay for the import)."""
    if importlib.util.find_spec(package) is None:
        raise ImportError(f"{who} needs the {package} package: pip install 'eventbus[{extra}]'")
