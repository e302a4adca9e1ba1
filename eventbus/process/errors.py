"""What process placement raises. A dead or hung child raises `SubscriberGone` (the core's):
the delivery code counts that batch failed and disables the subscriber at once."""

from __future__ import annotations

from eventbus.core.subscriber import SubscriberGone

__all__ = ["ChildProcessDied", "ChildProcessHung", "RemoteError", "SubscriberGone"]


class RemoteError(RuntimeError):
    """The subscriber raised in its child process; the message carries its traceback."""


class ChildProcessDied(SubscriberGone, RuntimeError):
    """The child process of a process-placed subscriber exited unasked."""


class ChildProcessHung(SubscriberGone, RuntimeError):
    """The child did not answer within its deadline (`batch_timeout`); it was killed."""
