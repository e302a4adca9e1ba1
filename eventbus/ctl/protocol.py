"""The `eventbus ctl` wire: one JSON object per line each way, one request per connection.

    client                                   ControlServer (rank 0, a thread of its own)
    {"command": "stop", "reason": "x"}\\n -->  bounded read (MAX_REQUEST), checked, answered
    <-- {"ok": true, "command": "stop", ...}\\n   then the connection closes

Over TCP a request also carries `"token"`; a save may carry `"wait": SECONDS`, and is answered
once the checkpoint is saved. A refusal is `{"ok": false, "kind": KIND, "error": "..."}` with
KIND one of `bad_request`, `denied`, `refused`, and for a wait `timeout` or `gone`. The exit
codes of `eventbus ctl` live here too, so the client library and the command agree.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import orjson

__all__ = [
    "COMMANDS",
    "MAX_REASON",
    "MAX_REPLY",
    "MAX_REQUEST",
    "MAX_WAIT",
    "SOCKET_NAME",
    "TOKEN_NAME",
    "BadRequest",
    "Exit",
    "Request",
    "encode",
    "parse_request",
    "refusal",
]

SOCKET_NAME = "eventbus.sock"  # in the run directory
TOKEN_NAME = "eventbus.token"  # beside it, only when a TCP endpoint was asked for
COMMANDS = ("status", "stop", "abort", "save", "ping")
MAX_REQUEST = 4096  # bytes of one request line, newline included: more is refused
MAX_REASON = 1000  # characters of a reason
MAX_REPLY = 4 << 20  # bytes a client reads of one reply (a status with many subscribers)
MAX_WAIT = 86_400.0  # seconds a `save --wait` may hold its connection open


class Exit(enum.IntEnum):
    """`eventbus ctl`'s exit codes, one per thing a script may want to tell apart."""

    OK = 0
    BUG = 1  # an unexpected error in eventbus itself
    USAGE = 2  # bad arguments, an unreadable token file
    NO_JOB = 3  # no socket (no run, or it ended), nothing listening on the TCP port
    STALE = 4  # a socket left by a job that is gone: nothing listens on it
    DENIED = 5  # another user's job, or a missing or wrong token
    REFUSED = 6  # the job answered no: a command it does not allow, a run that has ended
    NO_ANSWER = 7  # connected, but no answer within --timeout (save --wait: no save in time)
    GONE = 8  # save --wait: the run ended, or the job went away, before the save was done


class BadRequest(ValueError):
    """A request that is not one JSON object of the expected shape."""


class Request(NamedTuple):
    """One checked request."""

    command: str
    reason: str | None
    token: str | None
    wait: float | None = None  # save: answer once the checkpoint is saved, within this many s


def encode(obj: dict[str, Any]) -> bytes:
    """One line of JSON (non-finite floats become null, as JSON has no NaN)."""
    return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS) + b"\n"


def refusal(kind: str, error: str) -> dict[str, Any]:
    """The reply that says no: `kind` is bad_request, denied or refused."""
    return {"ok": False, "kind": kind, "error": error}


def parse_request(line: bytes) -> Request:
    """Check one request line; `BadRequest` says what is wrong with it."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        raise BadRequest("not JSON: send one JSON object per line") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - {"command", "reason", "token", "wait"})
    if unknown:
        raise BadRequest(f"unknown keys: {', '.join(unknown)[:100]}")
    command, reason, token = obj.get("command"), obj.get("reason"), obj.get("token")
    wait = obj.get("wait")
    if command not in COMMANDS:
        raise BadRequest(f"command must be one of {', '.join(COMMANDS)}; got {command!r:.40}")
    if reason is not None and (not isinstance(reason, str) or len(reason) > MAX_REASON):
        raise BadRequest(f"reason must be a string of at most {MAX_REASON} characters")
    if token is not None and not isinstance(token, str):
        raise BadRequest("token must be a string")
    if wait is not None:
        if command != "save":
            raise BadRequest("wait goes with save only")
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 < wait <= MAX_WAIT:
            raise BadRequest(f"wait must be a number of seconds in (0, {MAX_WAIT}]")
        wait = float(wait)
    return Request(command, reason, token, wait)
