"""What process placement raises."""

from __future__ import annotations

__all__ = ["RemoteError", "RemoteTimeout"]


class RemoteError(RuntimeError):
    """A sidecar subscriber raised (state_dict, load_state_dict) or the sidecar died while we
    waited for its answer; the message carries its traceback."""


class RemoteTimeout(RemoteError, TimeoutError):
    """The sidecar did not answer in the time given."""
