"""Launching the child: a fresh interpreter over a socket pair, and ending it; the parent's
`__main__`, imported in the child only when the subscriber's pickle refers to it.

Unlike multiprocessing's spawn the child never re-imports the parent's `__main__` by default:
a training script without an `if __name__ == "__main__":` guard would otherwise start training
again inside the child. Linux and macOS (the child gets its socket by fd).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import os
import pickletools
import runpy
import socket
import subprocess
import sys
import types
from multiprocessing.connection import Connection

__all__ = [
    "Child",
    "above_std",
    "import_main",
    "importing_main",
    "kill",
    "launch",
    "main_to_import",
]

_BOOT = "from eventbus.process.child import main; main()"
PATH_ENV = "EVENTBUS_CHILD_SYS_PATH"  # the parent's sys.path, so the child finds the same code


class Child:
    """The child process: a fresh interpreter running `eventbus.process.child.main`."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()  # negative: killed by that signal

    def join(self, timeout: float | None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.terminate()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.kill()

    def why_dead(self, name: str, what: str) -> str:
        """A sentence for the error: which child died, how, and what we saw."""
        self.join(0.5)
        code = self.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return f"child process {self.pid} of {name!r} died ({how}; {what})"


def launch(name: str, t0: float) -> tuple[Child, Connection]:
    """Start a fresh interpreter (spawn semantics: no inherited threads, locks or CUDA state)
    connected to us by a socket pair."""
    ours, theirs = (_socket_above_std(s) for s in socket.socketpair())
    env = {**os.environ, PATH_ENV: json.dumps([p for p in sys.path if p])}
    try:
        popen = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(theirs.fileno()), repr(t0), name],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )
    finally:
        theirs.close()  # the child's copy stays open: it sees EOF only when we are gone
    return Child(popen), Connection(ours.detach())


def above_std(fd: int) -> int:
    """A copy of `fd` numbered above stdin, stdout and stderr (not inherited); `fd` closed.
    Where one of those is closed its number is the lowest free: a socket given it would get
    what is printed (or read from stdin) there, taken for the channel's messages."""
    if fd > 2:
        return fd
    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    finally:
        os.close(fd)


def _socket_above_std(s: socket.socket) -> socket.socket:
    return s if s.fileno() > 2 else socket.socket(fileno=above_std(s.detach()))


def kill(proc: Child) -> None:
    """Terminate, then kill, a child still alive (also a finaliser at interpreter exit)."""
    try:
        if proc.is_alive():
            proc.terminate()
            proc.join(1.0)
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
    except OSError:  # already reaped
        pass


# -- the parent's __main__ -------------------------------------------------------------------

_importing_main = False  # True in a child while it imports the parent's script


def importing_main() -> bool:
    """True while this (child) process imports the parent's script."""
    return _importing_main


def main_to_import(data: bytes) -> tuple[str, str] | None:
    """How the child can import the `__main__` the pickle refers to: ("name", module) for
    `python -m module`, ("path", file) for a script; None when it refers to none.

    Raises ValueError when `__main__` is interactive (a notebook or REPL): nothing to import.
    """
    if not refers_to_main(data):
        return None
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return ("name", spec.name)
    path = getattr(main, "__file__", None)
    if path:
        return ("path", os.path.abspath(path))
    raise ValueError("defined interactively")


def import_main(kind: str, where: str) -> None:
    """Import the parent's script as `__mp_main__` (its `if __name__ == "__main__":` block
    does not run) and make it `__main__`, so its classes unpickle: multiprocessing's rule."""
    global _importing_main
    _importing_main = True
    try:
        if kind == "name":
            module = importlib.import_module(where)
        else:
            module = types.ModuleType("__mp_main__")
            module.__file__ = where
            sys.modules["__mp_main__"] = module
            module.__dict__.update(runpy.run_path(where, run_name="__mp_main__"))
    finally:
        _importing_main = False
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def refers_to_main(data: bytes) -> bool:
    """Whether a pickle names a class or function of `__main__` (the script being run)."""
    strings = set()
    has_global = False
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("GLOBAL", "INST") and str(arg).startswith("__main__ "):
            return True
        if op.name == "STACK_GLOBAL":
            has_global = True
        elif isinstance(arg, str):
            strings.add(arg)
    return has_global and "__main__" in strings
