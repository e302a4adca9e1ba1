"""The listening sockets of `eventbus ctl`: a 0600 Unix socket in the run directory, and a TCP
port with a bearer token only when asked.

The Unix socket is bound in a fresh 0700 directory, made 0600 and listening there, then
hard-linked into place: no moment exists at which another user could connect, and the link
fails rather than replace a socket that appeared meanwhile. A socket already in place is
probed: nothing listening (connection refused) means a dead run left it, and it is replaced;
a live one belongs to a running job, and that is an error.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import socket
import stat
import struct
import tempfile
from pathlib import Path

__all__ = [
    "MAX_PATH",
    "SocketInUse",
    "bind_tcp",
    "bind_unix",
    "parse_address",
    "peer_credentials",
    "probe",
    "write_token",
]

MAX_PATH = 107  # bytes of a Unix socket path (sun_path holds 108, NUL included)


class SocketInUse(RuntimeError):
    """A live job already listens on this run directory's socket."""


def check_length(path: Path) -> None:
    """A clear error for a path the kernel would refuse or cut short."""
    n = len(os.fsencode(path))
    if n > MAX_PATH:
        raise ValueError(
            f"{path}: a Unix socket path is at most {MAX_PATH} bytes, this one is {n}; "
            "use a shorter run directory"
        )


def peer_credentials(sock: socket.socket) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of a Unix socket's peer (SO_PEERCRED, Linux); None where unavailable."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("3i"))
    except OSError:
        return None
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def probe(path: Path, timeout: float = 1.0) -> tuple[str, int | None]:  # noqa: PLR0911
    """What listens at `path`: ("absent" | "stale" | "live" | "foreign", pid or None).

    `stale`: a socket nothing listens on (its run died); `foreign`: not ours to reach (another
    user's) or not a socket at all.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "absent", None
    if not stat.S_ISSOCK(st.st_mode):
        return "foreign", None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(os.fspath(path))
    except ConnectionRefusedError:
        return "stale", None
    except FileNotFoundError:
        return "absent", None
    except PermissionError:
        return "foreign", None
    except OSError:  # a timeout: a listener too busy to accept is still a listener
        return "live", None
    else:
        cred = peer_credentials(s)
        return "live", cred[0] if cred else None
    finally:
        s.close()


def bind_unix(path: Path, backlog: int = 16) -> socket.socket:
    """A listening Unix socket at `path`, mode 0600; a stale one is replaced (see the module)."""
    check_length(path)
    tmp = Path(tempfile.mkdtemp(prefix=".eventbus-sock-", dir=path.parent))  # mode 0700
    try:
        staging = tmp / "s"
        check_length(staging)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(os.fspath(staging))
            os.chmod(staging, 0o600)  # before listen(): nobody could connect until now anyway
            sock.listen(backlog)
            _link_into_place(staging, path)
        except BaseException:
            sock.close()
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sock


def _link_into_place(staging: Path, path: Path) -> None:
    for _ in range(3):  # a stale socket removed, then a race with another starter: try again
        try:
            os.link(staging, path)
            return
        except FileExistsError:
            pass
        state, pid = probe(path)
        if state == "live":
            who = f" (pid {pid})" if pid is not None else ""
            raise SocketInUse(
                f"{path}: another running job{who} already listens here; give this run a "
                "directory of its own, or stop that job first (eventbus ctl DIR stop)"
            )
        if state == "foreign":
            raise SocketInUse(
                f"{path}: exists and is not a socket this user can reach; move it away "
                "or give this run another directory"
            )
        if state == "stale":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # left by a run that is gone: nothing listens on it
    raise OSError(errno.EEXIST, f"{path}: could not take its place (another job is starting)")


def parse_address(text: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """`HOST:PORT`, `:PORT` or `PORT` as (host, port); loopback unless a host is named."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host = ""
    host = host.strip("[]") or default_host
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"{text!r}: expected HOST:PORT with a numeric port") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"{text!r}: port {number} is not in 0..65535")
    return host, number


def bind_tcp(host: str, port: int, backlog: int = 16) -> socket.socket:
    """A listening TCP socket (IPv6 when `host` is an IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def write_token(path: Path) -> str:
    """A fresh bearer token, written to `path` with mode 0600 (atomically replaced)."""
    token = secrets.token_urlsafe(32)
    fd, tmp = tempfile.mkstemp(prefix=".eventbus-token-", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(token + "\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return token
