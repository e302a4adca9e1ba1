"""`HangWatchdog`: when no step has ended for too long, say where the training process is stuck.

    training thread: publishes StepEnded (bus.step)      bus loop: on_events notes the time
    ... blocks (a collective, a dead DataLoader, a lock)  watchdog thread: wakes every `check_s`,
                                                           sees no StepEnded for `bound`:
                                                           every thread's stack -> file, log,
                                                           StallDetected; the next StepEnded:
                                                           StallEnded (how long it lasted)

The bound is `factor` x the median gap between recent steps (their publish stamps), clamped to
[`floor_s`, `ceiling_s`]; until `warmup_steps` steps have ended (compilation, a first eval)
it is `ceiling_s`. A pause published as such is not a stall: `with watchdog.pause("save"):`
around a checkpoint save or an eval loop (two attribute writes; no publish), and a
`CheckpointSaved` or `EvalEnded` counts as progress. The training thread pays nothing: the
watchdog reads what the loop already publishes, on the bus loop and on a thread of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from eventbus.core import BusHandle
from eventbus.events import (
    CheckpointSaved,
    EvalEnded,
    Event,
    RunEnded,
    RunStarted,
    StallDetected,
    StallEnded,
    StepEnded,
)
from eventbus.log import get_logger

__all__ = ["HangWatchdog", "thread_stacks"]


def thread_stacks(skip: int | None = None) -> str:
    """Every thread's Python stack, the main thread first (`skip`: a thread ident to leave out)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    frames = sorted(sys._current_frames().items(), key=lambda kv: kv[0] != main)
    parts = []
    for ident, frame in frames:
        if ident == skip:
            continue
        stack = "".join(traceback.format_stack(frame))
        parts.append(f'Thread "{names.get(ident, "?")}" (ident {ident}):\n{stack}')
    return "\n".join(parts)


class HangWatchdog:
    """Publishes `StallDetected` (with every thread's stack) when no step ended within the
    bound, and `StallEnded` when one does again. `dir`: where each stall's stacks are written
    (`stall-rank<r>-<n>.txt`, flushed to disk before the event goes out); None: no file."""

    events: ClassVar[tuple[type[Event], ...]] = (
        StepEnded,
        CheckpointSaved,
        EvalEnded,
        RunStarted,
        RunEnded,
    )
    policy: ClassVar[str] = "drop_oldest"
    maxsize: ClassVar[int] = 10_000
    name = "watchdog"

    def __init__(
        self,
        *,
        factor: float = 10.0,
        floor_s: float = 60.0,
        ceiling_s: float = 1800.0,
        warmup_steps: int = 2,
        window: int = 50,
        dir: str | os.PathLike[str] | None = None,
        check_s: float | None = None,
        action: str = "warn",
        abort_after_s: float | None = None,
        exit_after_s: float = 60.0,
    ) -> None:
        if not 0 < floor_s <= ceiling_s:
            raise ValueError(f"need 0 < floor_s <= ceiling_s; got {floor_s} and {ceiling_s}")
        if factor <= 0 or window < 1 or warmup_steps < 0:
            raise ValueError("factor must be > 0, window >= 1 and warmup_steps >= 0")
        if action not in ("warn", "abort"):
            raise ValueError(f'action must be "warn" or "abort"; got {action!r}')
        if (abort_after_s is not None and abort_after_s < 0) or exit_after_s <= 0:
            raise ValueError("abort_after_s must be >= 0 and exit_after_s > 0")
        self.action = action
        self.abort_after_s = abort_after_s
        self.exit_after_s = exit_after_s
        self.factor = factor
        self.floor_s = floor_s
        self.ceiling_s = ceiling_s
        self.warmup_steps = warmup_steps
        self.dir = Path(dir) if dir is not None else None
        self.check_s = check_s if check_s is not None else min(1.0, floor_s / 4)
        self.stalls = 0  # StallDetected published
        self._gaps: deque[float] = deque(maxlen=window)  # seconds a step, recent steps
        self._ended = 0  # StepEnded seen since the run (re)started
        self._last: tuple[int, int] | None = None  # (step, ts) of the last StepEnded
        self._lock = threading.Lock()  # _since, _paused, _stalled_at: bus loop and two threads
        self._since: float | None = None  # monotonic time of the last progress; None: idle
        self._paused = 0
        self._stalled_at: float | None = None  # when the current stall began (its _since)
        self._detected = False  # its StallDetected went out
        self._resumed: tuple[int | None, float] | None = None  # it ended before that
        self._abort_at: float | None = None  # when this stall's abort was requested
        self._bus: BusHandle | None = None
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None

    def __reduce__(self) -> Any:
        """Refused: in the sidecar it would watch the sidecar, not the training process."""
        raise TypeError(
            "HangWatchdog reads the stacks of the process it runs in: keep it in the training "
            "process (placement='thread', the default); its events still reach the sidecar"
        )

    # -- the subscriber's hooks --------------------------------------------------------------

    def on_start(self, bus: BusHandle) -> None:
        """Start the watchdog's thread."""
        self._bus = bus
        self._thread = threading.Thread(target=self._watch, name="eventbus-watchdog", daemon=True)
        self._thread.start()

    async def on_events(self, batch: list[Event]) -> None:
        """Note progress: the time of each step (bus loop; a few attribute writes)."""
        for ev in batch:
            if isinstance(ev, StepEnded):
                self._step_ended(ev)
            elif isinstance(ev, CheckpointSaved | EvalEnded):
                self._progress()
            elif isinstance(ev, RunStarted):
                self._gaps.clear()
                self._ended, self._last = 0, None
                self._progress()
            elif isinstance(ev, RunEnded):
                with self._lock:
                    self._since = None  # the run is over: nothing to wait for

    def on_close(self) -> None:
        """Stop the thread (it wakes at once)."""
        self._closing = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # -- what the loop calls -----------------------------------------------------------------

    @contextlib.contextmanager
    def pause(self, reason: str = "") -> Iterator[None]:
        """A phase that may outlast the bound on purpose (a save, an eval): not a stall."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                if self._since is not None:
                    self._since = time.monotonic()  # the bound counts from the pause's end

    def bound(self) -> float:
        """Seconds without a step that make a stall, from the recent step times."""
        gaps = list(self._gaps)  # a copy (one C call under the GIL): the bus loop appends
        if self._ended < self.warmup_steps or not gaps:
            return self.ceiling_s
        typical = statistics.median(gaps)
        return min(self.ceiling_s, max(self.floor_s, self.factor * typical))

    # -- inside ------------------------------------------------------------------------------

    def _progress(self) -> None:
        with self._lock:
            self._since = time.monotonic()

    def _step_ended(self, ev: StepEnded) -> None:
        step, ts = ev.step, ev.ts
        if step is not None and ts is not None:
            last = self._last
            if last is not None and step > last[0] and ts > last[1]:
                self._gaps.append((ts - last[1]) / 1e9 / (step - last[0]))
            elif last is not None and step <= last[0]:  # a resume or a new run: start afresh
                self._gaps.clear()
                self._ended = 0
            self._last = (step, ts)
        self._ended += 1
        now = time.monotonic()
        with self._lock:
            stalled_at, self._stalled_at = self._stalled_at, None
            self._abort_at = None
            self._since = now
            if stalled_at is not None:
                lasted = round(now - stalled_at, 3)
                if self._detected:  # else the watchdog thread publishes it after its report
                    self._ended_stall(step, lasted)
                else:
                    self._resumed = (step, lasted)

    def _ended_stall(self, step: int | None, lasted: float) -> None:
        """StallEnded (lock held: after its StallDetected, never before)."""
        self._detected = False
        if self._bus is not None:
            self._bus.publish(StallEnded(step=step, stalled_s=lasted))
        get_logger().warning("training resumed after a stall", step=step, stalled_s=lasted)

    def _watch(self) -> None:
        me = threading.get_ident()
        while not self._closing:
            self._wake.wait(self.check_s)
            if self._closing:
                return
            try:
                self._check(me)
            except Exception as e:  # never die silently: the next check tries again
                get_logger().warning("the watchdog's check failed", error=repr(e))

    def _check(self, me: int) -> None:
        bound = self.bound()
        with self._lock:
            since = self._since
            if since is None or self._paused:
                return
            if self._stalled_at is not None:
                if self.action == "abort" and self._detected:
                    self._escalate(time.monotonic() - since, bound)
                return
            waited = time.monotonic() - since
            if waited < bound:
                return
            self._stalled_at = since
        self._report(waited, bound, thread_stacks(skip=me))
        with self._lock:
            resumed, self._resumed = self._resumed, None
            if resumed is not None:  # the step ended while the report was being made
                self._ended_stall(*resumed)

    def _escalate(self, waited: float, bound: float) -> None:
        """action="abort" (lock held): ask the loop to abort; if it never does, end the process."""
        bus = self._bus
        after = bound if self.abort_after_s is None else self.abort_after_s
        if bus is None or waited < bound + after:
            return
        now = time.monotonic()
        if self._abort_at is None:
            self._abort_at = now
            step = self._last[0] if self._last is not None else None
            reason = f"stalled: no step ended for {waited:.0f} s (bound {bound:.0f} s)"
            bus.control.request_abort(reason, source="watchdog", step=step)
        elif now - self._abort_at >= self.exit_after_s and not self._closing:
            self._closing = True  # once: the process ends below
            exiting = threading.Thread(target=self._end_process, name="eventbus-watchdog-exit")
            exiting.daemon = True  # a process ending by SIGTERM does not wait for it
            exiting.start()

    def _end_process(self) -> None:
        """The loop never read `should_stop`: SIGTERM ourselves, so the bus's handler drains
        every lossless subscriber and exits 143; if even that cannot run, exit 70."""
        get_logger().error(
            "the training loop did not stop within exit_after_s of the abort request: ending "
            "the process (SIGTERM: the bus drains, then exits)",
            exit_after_s=self.exit_after_s,
        )
        handler = signal.getsignal(signal.SIGTERM)
        if handler not in (signal.SIG_DFL, signal.SIG_IGN, None):  # someone drains on SIGTERM
            os.kill(os.getpid(), signal.SIGTERM)
            # The handler runs in the main thread between two bytecodes; one stuck inside a
            # call that signals do not interrupt never gets there.
            threading.Event().wait(self.exit_after_s)
        get_logger().error("SIGTERM did not end the process: exiting now (status 70)")
        os._exit(70)

    def _report(self, waited: float, bound: float, stacks: str) -> None:
        self.stalls += 1
        step = self._last[0] if self._last is not None else None
        bus = self._bus
        rank = bus.rank if bus is not None else 0
        path = None
        if self.dir is not None:
            try:
                path = self._write(rank, waited, bound, step, stacks)
            except OSError as e:  # a full or unwritable disk: the event still goes out
                get_logger().warning("the watchdog could not write the stacks", error=repr(e))
        get_logger().warning(
            "no step ended within the bound: the training process may be stuck",
            step=step,
            waited_s=round(waited, 1),
            bound_s=round(bound, 1),
            path=path,
            stacks=stacks,
        )
        with self._lock:
            self._detected = True
            if bus is not None:
                bus.publish(
                    StallDetected(
                        step=step,
                        waited_s=round(waited, 3),
                        bound_s=round(bound, 3),
                        stacks=stacks,
                        path=path,
                    )
                )

    def _write(self, rank: int, waited: float, bound: float, step: int | None, text: str) -> str:
        assert self.dir is not None
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"stall-rank{rank}-{self.stalls}.txt"
        head = f"no step ended for {waited:.1f} s (bound {bound:.1f} s); last step {step}\n\n"
        with open(path, "w", encoding="utf-8") as f:
            f.write(head + text)
            f.flush()
            os.fsync(f.fileno())  # on disk before a kill that may follow
        return str(path)
