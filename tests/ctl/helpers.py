"""Shared by the ctl tests: a bus in this process that serves, and a client as another user."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from eventbus import EventBus
from eventbus.ctl import ControlServer, CtlError, request


def wait(what: str, fn: Callable[[], Any], timeout: float = 10) -> Any:
    """Poll `fn` until it returns something true; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (got := fn()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)
    return got


def answers(run_dir: Path, **kw: Any) -> dict[str, Any] | None:
    """The reply to a ping, or None while nothing answers."""
    try:
        return request(run_dir, "ping", **kw)
    except CtlError:
        return None


@contextlib.contextmanager
def serving(run_dir: Path, **kw: Any) -> Iterator[tuple[EventBus, ControlServer]]:
    """A bus in this process with a ControlServer, answering pings."""
    bus = EventBus(drain_interval=0.005, close_timeout=10)
    srv = ControlServer(run_dir, **kw)
    bus.subscribe(srv)
    with bus:
        wait("the listener", lambda: answers(run_dir))
        yield bus, srv


@contextlib.contextmanager
def reachable_dir() -> Iterator[Path]:
    """A run directory any user can reach (tmp_path's parents are 0700): only the socket's
    own mode keeps others out."""
    d = Path(tempfile.mkdtemp(prefix="ctl-", dir="/tmp"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def as_nobody(fn: Callable[[], int]) -> tuple[int, str]:
    """Run `fn` in a forked child as `nobody`: (what it returned, or a CtlError's exit code;
    the error's message)."""
    if os.getuid() != 0:
        pytest.skip("needs root, to become another user")
    try:
        pw = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody'")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code, msg = 99, ""
        try:
            os.setgroups([])
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
            code = fn()
        except CtlError as e:
            code, msg = int(e.exit_code), str(e)
        except BaseException as e:
            code, msg = 98, f"{type(e).__name__}: {e}"
        finally:
            os.write(w, msg.encode()[:4000])
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        msg = f.read().decode()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), msg
