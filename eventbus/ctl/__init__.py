"""`eventbus ctl`: read and steer a running job from outside (status, stop, abort, save, ping).

In the training script (rank 0 listens; nothing listens unless subscribed):

    bus.subscribe(ControlServer("runs/exp1"))   # runs/exp1/eventbus.sock, mode 0600

From a shell: `eventbus ctl runs/exp1 status`; from Python: `request("runs/exp1", "status")`.
"""

from eventbus.ctl.client import (
    CtlError,
    Denied,
    Gone,
    NoAnswer,
    NoJob,
    Refused,
    StaleSocket,
    TokenError,
    read_token,
    request,
)
from eventbus.ctl.listen import SocketInUse
from eventbus.ctl.protocol import COMMANDS, Exit
from eventbus.ctl.server import ControlServer

__all__ = [
    "COMMANDS",
    "ControlServer",
    "CtlError",
    "Denied",
    "Exit",
    "Gone",
    "NoAnswer",
    "NoJob",
    "Refused",
    "SocketInUse",
    "StaleSocket",
    "TokenError",
    "read_token",
    "request",
]
