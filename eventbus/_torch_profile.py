"""`profile()`: `torch.profiler` windows driven by `bus.step()` scopes, written off the thread.

    training thread                    writer thread ("eventbus-profile")   a child process
    with profile(bus, schedule=...):
      with bus.step(n): ...
      scope ends: prof.step()
      (wait/warmup/active/repeat)
      a window ends: torch stops
      Kineto, calls on_trace_ready:
      hand the window over (O(1)) -->  export_chrome_trace(path) (C++)
                                       run the table's process    -->  read the trace,
                                                                       key_averages().table()
                                       publish ProfileSaved       <--  TABLE.txt written

torch.profiler must be stepped on the thread that runs the model, so stepping happens where
a `bus.step` scope ends (eventbus/steps.py calls its listeners; none are called when no
profiler is attached). What stays on the training thread, being torch's own: stopping a
window (Kineto collects its buffers; with a device activity torch synchronises the device
first) and starting the next. Writing the trace runs on the writer thread; building the
table (parsing every op in pure Python, which on a thread would hold the GIL against
training) runs in a child process (`eventbus._torch_profile_table`). At most `max_pending`
windows wait for the writer; more are dropped, counted.
"""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from eventbus._torch_hooks import resolve_bus
from eventbus.events import ProfileSaved
from eventbus.log import get_logger
from eventbus.steps import current_step, on_step_change

__all__ = ["ProfileWindows", "profile"]

_RECORDING = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)
_OURS = ("schedule", "on_trace_ready", "acc_events", "activities")
# The profile() running in this process: torch runs one profiler at a time, and a second
# one started beside it breaks the first (its export crashed the process).
_ONE = threading.Lock()
_Job = list[Any]  # [the window's autograd profile, its steps, its index]; the writer empties it
# What the table may be sorted by: torch's FunctionEventAvg fields ("cuda"/"xpu" read "device").
_SORT_KEYS = frozenset(
    (
        "count",
        "cpu_time",
        "cpu_time_total",
        "self_cpu_time_total",
        "device_time",
        "device_time_total",
        "self_device_time_total",
        "cpu_memory_usage",
        "self_cpu_memory_usage",
        "device_memory_usage",
        "self_device_memory_usage",
        "flops",
    )
)


class ProfileWindows:
    """A running `profile()`: `saved` (ProfileSaved events), `dropped`, `failed`, `profiler`.

    `step(n)` steps it by hand for a loop without `bus.step` scopes.
    """

    def __init__(
        self,
        bus: Any,
        schedule: Callable[[int], ProfilerAction],
        activities: Iterable[ProfilerActivity] | None,
        out_dir: Path,
        *,
        sort_by: str | None,
        row_limit: int,
        table: bool,
        max_pending: int,
        close_timeout: float,
        options: dict[str, Any],
    ) -> None:
        self.bus = bus
        self.schedule = schedule
        self.activities = list(activities) if activities is not None else None
        self.out_dir = out_dir
        devices = [a for a in self.activities or () if a is not ProfilerActivity.CPU]
        self.sort_by = sort_by or ("self_device_time_total" if devices else "self_cpu_time_total")
        self.row_limit = row_limit
        self.table = table
        self.close_timeout = close_timeout
        self.options = options
        self.saved: list[ProfileSaved] = []
        self.dropped = 0  # windows the writer could not take (it held max_pending already)
        self.failed = 0  # windows whose export or table raised
        self.profiler: torch.profiler.profile | None = None
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=max_pending)
        self._writer: threading.Thread | None = None
        self._window: list[int] = []  # steps recorded in the window being recorded
        self._windows = 0
        self._open_step: int | None = None
        self._auto_step = 0
        self._thread = 0  # the training thread: the one that entered
        self._running = False

    # -- the training thread ----------------------------------------------------------------

    def __enter__(self) -> ProfileWindows:
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(f"profile(): cannot create out_dir {str(self.out_dir)!r}: {e}") from e
        if torch.autograd.profiler._is_profiler_enabled or not _ONE.acquire(blocking=False):
            raise RuntimeError(
                "profile(): a torch profiler is already running in this process (torch runs "
                "one at a time); end it first"
            )
        try:
            self.profiler = torch.profiler.profile(
                activities=self.activities,
                schedule=self.schedule,
                on_trace_ready=self._ready,
                **self.options,
            )
            self.profiler.start()
        except BaseException:
            _ONE.release()
            raise
        self._writer = threading.Thread(target=self._write_all, name="eventbus-profile")
        self._writer.daemon = True  # never holds the interpreter open; __exit__ joins it
        self._writer.start()
        self._thread = threading.get_ident()
        self._running = True
        on_step_change(self.bus, self._on_step_change)
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Stop (a window still recording is saved), then wait for the writer, bounded."""
        if not self._running:
            return
        self._running = False
        try:
            if self.profiler is not None:
                self.profiler.stop()
        finally:
            _ONE.release()
            # Waits only while the writer holds max_pending windows; if it times out, so
            # does the join below, and says so.
            with contextlib.suppress(queue.Full):
                self._jobs.put(None, timeout=self.close_timeout)
            writer = self._writer
            if writer is not None:
                writer.join(self.close_timeout)
                if writer.is_alive():
                    get_logger().warning(
                        "profile(): the writer is still exporting at the close deadline; "
                        "its files may appear later",
                        timeout_s=self.close_timeout,
                    )

    def step(self, n: int | None = None) -> None:
        """One step ended (numbered `n`, else one past the last): advance the schedule."""
        if not self._running or self.profiler is None:
            return
        if n is None:
            n = self._auto_step
        self._auto_step = n + 1
        if self.profiler.current_action in _RECORDING:
            self._window.append(n)
        self.profiler.step()  # may end a window: torch calls _ready here, on this thread

    def _on_step_change(self) -> None:
        """Called when a `bus.step` scope opens or closes: step when the outermost closed."""
        if not self._running or threading.get_ident() != self._thread:
            return  # scopes of other threads are not this profiler's steps
        now = current_step(self.bus)
        if now is not None:
            if self._open_step is None:
                self._open_step = now
            return
        ended, self._open_step = self._open_step, None
        if ended is not None:
            self.step(ended)

    def _ready(self, prof: Any) -> None:
        """torch's on_trace_ready, on the training thread: hand the window over; O(1)."""
        steps, self._window = self._window, []
        self._windows += 1
        job = [prof.profiler, steps, self._windows]  # the next window gets a new object
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            self.dropped += 1
            get_logger().warning(
                "profile(): the writer is still busy with earlier windows; this one is dropped "
                "(space the windows further apart, or raise max_pending)",
                window=self._windows,
                dropped=self.dropped,
            )

    # -- the writer thread ------------------------------------------------------------------

    def _write_all(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._write(job)
            except Exception as e:  # torch's export: logged and counted, the next goes on
                self.failed += 1
                get_logger().error(
                    "profile(): writing a window failed", window=job[2], error=repr(e)
                )

    def _write(self, job: _Job) -> None:
        result, steps, index = job
        job[0] = None  # our reference is the window's last: `del result` below lets it go
        last = steps[-1] if steps else None
        rank = getattr(self.bus, "rank", 0)
        stem = f"rank{rank}.window{index}" + (f".step{last}" if last is not None else "")
        path = self.out_dir / f"{stem}.pt.trace.json"
        table_path = self.out_dir / f"{stem}.table.txt"
        t0 = time.perf_counter()
        result.export_chrome_trace(str(path))  # Kineto's C++ writer
        del result  # the window's buffers go now, not when the next window comes
        table = ""
        if self.table:
            try:
                self._write_table(path, table_path)
                table = os.fspath(table_path)
            except Exception as e:  # the trace is written: the event still says where
                self.failed += 1
                get_logger().error(
                    "profile(): the window's table failed; its trace is saved",
                    path=os.fspath(path),
                    error=repr(e),
                )
        ev = ProfileSaved(
            step=last,
            path=os.fspath(path),
            table_path=table,
            first_step=steps[0] if steps else None,
            steps=len(steps),
        )
        self.saved.append(ev)
        get_logger().info(
            "profile window saved", path=ev.path, steps=ev.steps, export_s=time.perf_counter() - t0
        )
        self.bus.publish(ev)

    def _write_table(self, trace: Path, table: Path) -> None:
        """The table, by a child process: its parsing would hold our GIL (module docstring)."""
        cmd = [sys.executable, "-m", "eventbus._torch_profile_table", str(trace), str(table)]
        cmd += ["--sort-by", self.sort_by, "--row-limit", str(self.row_limit)]
        done = subprocess.run(  # waits without the GIL
            cmd, capture_output=True, text=True, timeout=self.close_timeout, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"the table of {trace.name} failed (exit {done.returncode}): "
                f"{done.stderr.strip()[-2000:]}"
            )


def profile(
    bus: Any = None,
    *,
    schedule: Callable[[int], ProfilerAction] | None = None,
    activities: Iterable[ProfilerActivity] | None = None,
    out_dir: str | os.PathLike[str] = "profiles",
    sort_by: str | None = None,
    row_limit: int = 30,
    table: bool = True,
    max_pending: int = 2,
    close_timeout: float = 60.0,
    **options: Any,
) -> ProfileWindows:
    """Profile windows of `bus.step()` steps with `torch.profiler`; a context manager.

    `schedule`: `torch.profiler.schedule(wait=, warmup=, active=, repeat=)` (default: wait 1,
    warmup 1, active 3, once), counted in `bus.step` scopes. Each window's Chrome trace and
    (`table=True`) its `key_averages().table(sort_by=, row_limit=)` go to `out_dir`, written
    off the training thread, and a `ProfileSaved` event says where. `activities` as torch's
    (None: CPU, and CUDA when available); other keyword arguments (`record_shapes=True`, ...)
    go to `torch.profiler.profile`.
    """
    bad = sorted(set(options) & set(_OURS))
    if bad:
        raise TypeError(f"profile() sets {', '.join(bad)} itself; remove it from the arguments")
    if schedule is None:
        schedule = torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1)
    if not callable(schedule):
        raise TypeError(
            "schedule must be torch.profiler.schedule(wait=..., warmup=..., active=..., "
            f"repeat=...); got {schedule!r:.80}"
        )
    key = (sort_by or "").replace("cuda", "device").replace("xpu", "device")
    if sort_by is not None and key not in _SORT_KEYS:
        raise ValueError(
            f"sort_by must be one of {', '.join(sorted(_SORT_KEYS))} (torch's table columns; "
            f"'cuda' for 'device' too); got {sort_by!r}"
        )
    for name, v in (("row_limit", row_limit), ("max_pending", max_pending)):
        if type(v) is not int or v < 1:
            raise ValueError(f"{name} must be an int >= 1; got {v!r}")
    if isinstance(close_timeout, bool) or not isinstance(close_timeout, int | float):
        raise TypeError(f"close_timeout must be a number of seconds; got {close_timeout!r}")
    if activities is not None:
        activities = list(activities)
        if not all(isinstance(a, ProfilerActivity) for a in activities):
            raise TypeError(
                f"activities must be torch.profiler.ProfilerActivity values; got {activities!r}"
            )
    return ProfileWindows(
        resolve_bus(bus),
        schedule,
        activities,
        Path(out_dir),
        sort_by=sort_by,
        row_limit=row_limit,
        table=bool(table),
        max_pending=max_pending,
        close_timeout=float(close_timeout),
        options=options,
    )
