"""The client side of `eventbus ctl`: send one command to a running job, get its reply.

`request(run_dir, "status")` returns the reply (a dict with `"ok": True`) or raises a
`CtlError` whose `exit_code` (`protocol.Exit`) tells a script what went wrong: no job, a stale
socket, permission denied, refused by the job, or no answer in time. `request(run_dir, "save",
wait=60)` answers once the checkpoint that serves the request is saved (its step and path in
`reply["saved"]`), or raises `Gone` if the run ends first.
"""

from __future__ import annotations

import os
import socket
import stat
import time
from pathlib import Path
from typing import Any, ClassVar

import orjson

from eventbus.ctl.protocol import MAX_REPLY, SOCKET_NAME, Exit, encode

__all__ = [
    "CtlError",
    "Denied",
    "Gone",
    "NoAnswer",
    "NoJob",
    "Refused",
    "StaleSocket",
    "TokenError",
    "read_token",
    "request",
]


class CtlError(Exception):
    """Why a command got no positive answer; `exit_code` is what `eventbus ctl` returns."""

    exit_code: ClassVar[Exit] = Exit.BUG


class TokenError(CtlError):
    """The token file is missing or unreadable."""

    exit_code = Exit.USAGE


class NoJob(CtlError):
    """Nothing to talk to: no socket (no run, or it ended), or nothing on the TCP port."""

    exit_code = Exit.NO_JOB


class StaleSocket(CtlError):
    """A socket left by a job that is gone: nothing listens on it."""

    exit_code = Exit.STALE


class Denied(CtlError):
    """Another user's job, or a missing or wrong token."""

    exit_code = Exit.DENIED


class Refused(CtlError):
    """The job answered, and said no."""

    exit_code = Exit.REFUSED


class NoAnswer(CtlError):
    """Connected, but no (complete) answer within the timeout."""

    exit_code = Exit.NO_ANSWER


class Gone(CtlError):
    """`save --wait`: the run ended, or the job went away, before the save was done."""

    exit_code = Exit.GONE


def read_token(path: str | os.PathLike[str]) -> str:
    """The bearer token in `path` (what `ControlServer(tcp=...)` wrote there)."""
    try:
        token = Path(path).read_text(encoding="ascii").strip()
    except PermissionError:
        raise Denied(f"permission denied reading the token file {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or e
        raise TokenError(f"cannot read the token file {path}: {why}") from None
    if not token:
        raise TokenError(f"the token file {path} is empty")
    return token


def request(
    run_dir: str | os.PathLike[str] | None,
    command: str,
    reason: str | None = None,
    *,
    tcp: tuple[str, int] | None = None,
    token: str | None = None,
    timeout: float = 5.0,
    wait: float | None = None,
) -> dict[str, Any]:
    """Send `command` to the job listening in `run_dir` (or on `tcp`); return its reply.

    `wait` (save only): the job answers once the checkpoint is saved, within `wait` seconds
    (`NoAnswer` after), or `Gone` if the run ends or the job dies first.
    """
    deadline = time.monotonic() + timeout + (wait or 0.0)
    msg: dict[str, Any] = {"command": command}
    if reason is not None:
        msg["reason"] = reason
    if token is not None:
        msg["token"] = token
    if wait is not None:
        msg["wait"] = wait
    sock = _connect_tcp(tcp, timeout) if tcp is not None else _connect_unix(run_dir, timeout)
    with sock:
        try:
            sock.sendall(encode(msg))
            raw = _read_reply(sock, deadline)
        except TimeoutError:
            raise NoAnswer(f"no answer within {timeout:g} s") from None
        except OSError as e:  # reset: the job refused to read any further, or died
            if wait is not None:
                raise Gone(f"the job went away before the save was done: {e}") from None
            raise NoAnswer(f"the job closed the connection: {e.strerror or e}") from None
    if not raw.strip():
        if wait is not None:  # it answers a wait at its end: it died
            raise Gone("the job went away before the save was done")
        raise NoAnswer("the job closed the connection without answering")
    try:
        reply = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise Refused(f"the job answered something that is not JSON: {raw[:80]!r}") from None
    if not isinstance(reply, dict):
        raise Refused(f"the job answered something that is not an object: {raw[:80]!r}")
    if reply.get("ok") is not True:
        error = str(reply.get("error") or "refused")
        raise _KINDS.get(str(reply.get("kind")), Refused)(error)
    return reply


_KINDS: dict[str, type[CtlError]] = {"denied": Denied, "timeout": NoAnswer, "gone": Gone}


def _connect_unix(run_dir: str | os.PathLike[str] | None, timeout: float) -> socket.socket:
    if run_dir is None:
        raise NoJob("no run directory given")
    path = Path(run_dir) / SOCKET_NAME
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if not Path(run_dir).is_dir():
            raise NoJob(f"{run_dir}: no such directory") from None
        raise NoJob(
            f"no job is listening in {run_dir}: {path} does not exist (the run has not "
            "started, has ended, or was started without ControlServer)"
        ) from None
    except PermissionError:
        raise Denied(f"permission denied: cannot reach {path}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise NoJob(f"{path} is not a socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(os.fspath(path))
    except BaseException as e:
        sock.close()
        if isinstance(e, ConnectionRefusedError):
            raise StaleSocket(
                f"{path} was left by a job that is gone (nothing listens on it); the next run "
                "there replaces it, or remove it"
            ) from None
        if isinstance(e, PermissionError):
            raise Denied(
                f"permission denied: {path} belongs to uid {st.st_uid}, not to you "
                f"(uid {os.getuid()})"
            ) from None
        if isinstance(e, TimeoutError):
            raise NoAnswer(f"{path}: the job did not accept within {timeout:g} s") from None
        if isinstance(e, FileNotFoundError):
            raise NoJob(f"{path} went away: the job has ended") from None
        raise
    return sock


def _connect_tcp(address: tuple[str, int], timeout: float) -> socket.socket:
    host, port = address
    try:
        return socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError:
        raise NoJob(f"nothing listens on {host}:{port}") from None
    except TimeoutError:
        raise NoAnswer(f"{host}:{port}: no connection within {timeout:g} s") from None
    except OSError as e:
        raise NoJob(f"cannot reach {host}:{port}: {e.strerror or e}") from None


def _read_reply(sock: socket.socket, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < MAX_REPLY:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
        if buf.endswith(b"\n"):
            break
    return bytes(buf)
