"""How one checkpoint job runs: a command in a subprocess, or a function in a spawned process.

Both are awaited on the bus's event loop without blocking it, killed when cancelled (a
timeout, the close deadline), and give back the job's metrics: the command's last stdout line
as a JSON object, or the dict the function returned. Failures raise `JobFailed` with what
the job said (its stderr tail, its traceback).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import anyio
from anyio.abc import ByteReceiveStream

from eventbus.loader import load_object

__all__ = ["JobFailed", "metrics_of", "run_command", "run_function"]

_STDOUT_TAIL = 64 * 1024  # bytes of stdout kept: the last line is what counts
_STDERR_TAIL = 4 * 1024  # bytes of stderr kept for the error message


class JobFailed(Exception):
    """One job failed: a non-zero exit, an exception, unusable output."""


def metrics_of(out: Any, what: str) -> dict[str, float] | None:
    """`out` as EvalEnded metrics (a dict of str -> number), None for None; else JobFailed."""
    if out is None:
        return None
    if not isinstance(out, dict):
        raise JobFailed(f"{what} must be a dict of metric name -> number; got {type(out).__name__}")
    bad = [
        k
        for k, v in out.items()
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int | float)
    ]
    if bad:
        raise JobFailed(f"{what}: metrics must be numbers; not for {', '.join(map(repr, bad))}")
    return dict(out)


async def _tail(stream: ByteReceiveStream | None, keep: int, into: list[bytes]) -> None:
    """Read `stream` to its end, keeping only its last `keep` bytes (memory stays bounded)."""
    if stream is None:
        return
    buf = b""
    async for chunk in stream:
        buf = (buf + chunk)[-keep:]
    into.append(buf)


async def run_command(argv: Sequence[str], env: dict[str, str], cwd: str | None) -> Any:
    """Run `argv`; its stdout's last non-empty line parsed as JSON (None for no output)."""
    out: list[bytes] = []
    err: list[bytes] = []
    try:
        # A session of its own: a timeout kills what the job started too (a shell's children,
        # torchrun's workers), not only the job; and a Ctrl-C at the terminal is ours to handle.
        process = await anyio.open_process(list(argv), env=env, cwd=cwd, start_new_session=True)
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in an argument or env
        raise JobFailed(f"cannot run {argv[0]!r}: {e}") from None
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_tail, process.stdout, _STDOUT_TAIL, out)
            tg.start_soon(_tail, process.stderr, _STDERR_TAIL, err)
            code = await process.wait()
    except BaseException:  # cancelled (a timeout, the close deadline): the whole group goes
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)  # its leader's pid names the group
        raise
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            if process.returncode is None:  # cancelled (timeout, close deadline): kill it
                process.kill()
            await process.aclose()  # its pipes, and the exit status (no zombie)
    stderr = (err[0] if err else b"").decode(errors="replace").strip()
    if code != 0:
        tail = stderr.splitlines()[-5:] if stderr else []
        raise JobFailed(f"exited with {code}" + (": " + " | ".join(tail) if tail else ""))
    text = (out[0] if out else b"").decode(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]  # blank ones: spaces, a \r
    if not lines:
        return None
    try:
        return json.loads(lines[-1])
    except ValueError:
        raise JobFailed(
            f"stdout's last line is not JSON (print the metrics last, e.g. "
            f'{{"eval_loss": 1.2}}): {lines[-1][-200:]!r}'
        ) from None


class _Remote(Exception):
    """The traceback of the job's process, as text (chained to the JobFailed it caused)."""


def _call(
    fn: Callable[[str], Any] | str, path: str, env: dict[str, str], cwd: str | None, conn: Any
) -> None:
    """The spawned process's side: call `fn(path)` with `env` added and in `cwd`, send back
    ("ok", result) or ("error", text). In a session of its own: a timeout kills what the
    function started too."""
    with contextlib.suppress(OSError):
        os.setsid()
    # Daemonic only for the parent's sake (it terminates us at its exit): the job itself may
    # start processes of its own (a DataLoader's workers), which a daemonic process may not.
    multiprocessing.current_process().daemon = False
    try:
        os.environ.update(env)  # before the function imports anything that reads it (CUDA)
        if cwd is not None:
            os.chdir(cwd)
        target = load_object(fn) if isinstance(fn, str) else fn
        result = target(path)
        conn.send(("ok", result))
    except BaseException as e:  # anything the user's function raises goes back as text
        text = "".join(traceback.format_exception(e)).strip()
        try:
            conn.send(("error", text))
        except BaseException:
            os._exit(3)  # the pipe is gone: the exit code says it
    finally:
        conn.close()


def _wait(conn: Any, sentinel: int) -> None:
    multiprocessing.connection.wait([conn, sentinel])


async def run_function(
    fn: Callable[[str], Any] | str, path: str, env: dict[str, str], cwd: str | None
) -> Any:
    """Call `fn(path)` in a fresh spawned process with `env` added, in `cwd`; what it returned
    (picklable), or JobFailed."""
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_call, args=(fn, path, env, cwd, send), name="eventbus-checkpoint-job"
    )
    proc.daemon = True
    reply: tuple[str, Any] | None = None
    answered = False
    try:
        await anyio.to_thread.run_sync(proc.start)  # spawning takes milliseconds: off the loop
        send.close()
        await anyio.to_thread.run_sync(_wait, recv, proc.sentinel, abandon_on_cancel=True)
        answered = True
        reply = recv.recv() if recv.poll() else None
    except EOFError:
        reply = None
    finally:
        pid = proc.pid
        if not answered and pid is not None and proc.is_alive():  # cancelled (a timeout, the
            with contextlib.suppress(OSError):  # close deadline): what it started goes too
                os.killpg(pid, signal.SIGKILL)  # its group (none yet if it is still starting)
            proc.kill()  # never left behind
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(proc.join, 5)
        if proc.is_alive():
            proc.kill()
        recv.close()
    if reply is None:
        raise JobFailed(f"the job's process died (exit code {proc.exitcode}) without an answer")
    kind, value = reply
    if kind == "error":
        raise JobFailed(value.splitlines()[-1] if value else "raised") from _Remote(value)
    return value
