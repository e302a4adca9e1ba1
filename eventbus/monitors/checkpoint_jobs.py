"""`CheckpointJobs`: run a command, or call a function, for each `CheckpointSaved`.

    bus.subscribe(CheckpointJobs(command=["python", "eval.py", "--ckpt", "{path}"]))
    bus.subscribe(CheckpointJobs(fn=evaluate, max_concurrent=2, timeout=600))

Each job runs in a process of its own (a subprocess for a command; a spawned interpreter for
a function), awaited on the bus's loop, never on the training thread. What it reports comes
back as `EvalEnded(step=<the checkpoint's step>, metrics=...)`: the command's last stdout line
(a JSON object), or the dict the function returned. A job that fails (non-zero exit, an
exception, unusable output, a timeout) is counted `failed` and logged as any subscriber's
failure; the jobs that ran beside it and succeeded count as delivered. Up to
`max_concurrent` jobs run at once (a batch); up to `max_queued` checkpoints wait in the queue
beyond them, and past that the oldest is dropped, counted.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pickle
import re
import shlex
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio

from eventbus.core import BusHandle
from eventbus.events import CheckpointSaved, EvalEnded, Event
from eventbus.log import get_logger
from eventbus.monitors._job_run import JobFailed, metrics_of, run_command, run_function

__all__ = ["CheckpointJobError", "CheckpointJobs"]


_FIELDS = re.compile(r"\{path\}|\{step\}")  # what a command's arguments may name


class CheckpointJobError(RuntimeError):
    """One or more jobs of a batch failed; the message names each checkpoint and why.

    `events_failed`: how many; the bus counts the batch's other jobs delivered."""

    def __init__(self, failed: list[str]) -> None:
        super().__init__("; ".join(failed))
        self.events_failed = len(failed)


class CheckpointJobs:
    """For each `CheckpointSaved`: run `command` ("{path}" and "{step}" replaced in each
    argument; the path appended when no argument names it) or call `fn(path)` (a module-level
    function or "module:function"), each in its own process; publish its metrics as
    `EvalEnded`. `timeout` (seconds) kills a job that runs longer; close waits for running
    jobs within the bus's close deadline, then kills them.
    """

    events: tuple[type[Event], ...] = (CheckpointSaved,)
    policy: str = "drop_oldest"  # a backlog drops the oldest checkpoint, counted; never stalls
    name: str = "checkpoint_jobs"

    def __init__(
        self,
        command: Sequence[str] | str | None = None,
        fn: Callable[[str], Any] | str | None = None,
        *,
        max_concurrent: int = 1,
        max_queued: int = 16,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        if (command is None) == (fn is None):
            raise ValueError("CheckpointJobs needs command=[...] or fn=..., exactly one of them")
        for what, v in (("max_concurrent", max_concurrent), ("max_queued", max_queued)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{what} must be an int >= 1, got {v!r}")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0
        ):
            raise ValueError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
        self.command = _command(command) if command is not None else None
        self.fn = _function(fn) if fn is not None else None
        self.max_concurrent = max_concurrent
        self.max_batch = max_concurrent  # a batch is the jobs that run together
        self.maxsize = max_queued
        self.timeout = None if timeout is None else float(timeout)
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.cwd = None if cwd is None else os.fspath(cwd)
        self.results: list[EvalEnded] = []  # what the jobs published, in completion order
        self.failures: list[str] = []
        self.bus: BusHandle | None = None

    def on_start(self, bus: BusHandle) -> None:
        """Keep the bus to publish the jobs' `EvalEnded` on."""
        self.bus = bus

    async def on_events(self, batch: list[Event]) -> None:
        """Run the batch's jobs together and wait for them; raise if any failed."""
        jobs = [ev for ev in batch if isinstance(ev, CheckpointSaved)]
        errors: list[str | None] = [None] * len(jobs)
        async with anyio.create_task_group() as tg:
            for i, ev in enumerate(jobs):
                tg.start_soon(self._job, ev, errors, i)
        failed = [e for e in errors if e is not None]
        if failed:
            self.failures += failed
            raise CheckpointJobError(failed)

    async def _job(self, ev: CheckpointSaved, errors: list[str | None], i: int) -> None:
        t0 = time.monotonic()
        what = f"checkpoint job for step {ev.step} ({ev.path})"
        if not ev.path:
            errors[i] = f"{what}: CheckpointSaved carries no path"
            return
        try:
            limit = anyio.fail_after(self.timeout) if self.timeout else contextlib.nullcontext()
            with limit:
                out = await self._run(ev)
            metrics = metrics_of(out, "the command's last line" if self.command else "fn's result")
        except TimeoutError:
            errors[i] = f"{what} timed out after {self.timeout:g} s and was killed"
            return
        except JobFailed as e:
            errors[i] = f"{what} failed: {e}"
            return
        if metrics is None:  # the job reported nothing: done, nothing to publish
            get_logger().info("checkpoint job done", step=ev.step, path=ev.path)
            return
        result = EvalEnded(step=ev.step, metrics=metrics, duration_s=time.monotonic() - t0)
        self.results.append(result)
        if self.bus is not None:
            self.bus.publish(result)

    async def _run(self, ev: CheckpointSaved) -> Any:
        path, step = ev.path, "" if ev.step is None else str(ev.step)
        if self.cwd is not None:  # a relative path names a file from our directory, not cwd's
            path = os.path.abspath(path)
        if self.fn is not None:
            return await run_function(self.fn, path, self.env, self.cwd)
        assert self.command is not None
        fill = {"{path}": path, "{step}": step}.__getitem__  # one pass: a path's "{step}" stays
        argv = [_FIELDS.sub(lambda m: fill(m[0]), a) for a in self.command]
        if not any("{path}" in a for a in self.command):
            argv.append(path)
        env = {
            **os.environ,
            "EVENTBUS_CHECKPOINT_PATH": path,
            "EVENTBUS_CHECKPOINT_STEP": step,
            **self.env,
        }
        return await run_command(argv, env, self.cwd)


def _command(command: Sequence[str] | str) -> list[str]:
    """The command as argv (a string is split like a shell would, and never run by one)."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"command must be a non-empty list of strings, got {command!r}")
    exe = argv[0]
    if shutil.which(exe) is None and not os.path.isfile(exe):
        raise ValueError(f"command {exe!r} is not found (not on PATH, not a file)")
    return argv


def _function(fn: Callable[[str], Any] | str) -> Callable[[str], Any] | str:
    """A function the job's process can import: by reference, or a "module:function" path."""
    if isinstance(fn, str):
        module, _, name = fn.partition(":")
        if not module or not name:
            raise ValueError(f"fn as a string must be 'module:function', got {fn!r}")
        try:  # found here, imported only in the job's process (it may be heavy)
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ValueError(
                f"fn={fn!r}: no module {module!r} is importable here, so the job's process "
                "cannot import it either: check the name, or install or add it to sys.path"
            )
        return fn
    if not callable(fn):
        raise TypeError(f"fn must be a function of one argument (the path), got {fn!r:.80}")
    try:
        pickle.dumps(fn)
    except Exception as e:  # a lambda, a closure, a local function: not importable by name
        raise TypeError(
            f"fn={fn!r:.80} cannot reach the job's process ({type(e).__name__}): it runs in "
            "a fresh interpreter that imports it by name: define it at module level (and keep "
            "the training under `if __name__ == '__main__':`), or pass 'module:function'"
        ) from None
    return fn
