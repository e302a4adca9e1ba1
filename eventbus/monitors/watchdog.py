"""`HangWatchdog`: when no step has ended for too long, say where the training process is stuck.

    training thread: publishes StepEnded (bus.step)      bus loop: on_events notes the time
    ... blocks (a collective, a dead DataLoader, a lock)  watchdog thread: wakes every `check_s`,
                                                           sees no StepEnded for `bound`:
                                                           every thread's stack -> file, log,
                                                           StallDetected; the next StepEnded:
                                                           StallEnded (how long it lasted)

The bound is `factor` x the median gap between recent `StepEnded` (their publish stamps),
clamped to [`floor_s`, `ceiling_s`]; until `warmup_steps` steps have ended (compilation, a
first eval) it is `ceiling_s`. The clock starts at `RunStarted` or the first `StepStarted`.
Events not yet routed (the bus behind, not the loop) defer a report. A pause published as
such is not a stall: `with watchdog.pause("save"):` around a checkpoint save or an eval loop
(two attribute writes; no publish), and a `CheckpointSaved` or `EvalEnded` counts as progress.
The training thread pays nothing: the watchdog reads what the loop already publishes, on the
bus loop and on a thread of its own.
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
    StepStarted,
)
from eventbus.log import get_logger

__all__ = ["HangWatchdog", "thread_stacks"]

WRITE_S = 5.0  # the longest the stacks' file may take before the event goes out without it


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
    (`stall-rank<r>-pid<pid>-<n>.txt`, fsynced before the event goes out); None: no file."""

    events: ClassVar[tuple[type[Event], ...]] = (
        StepStarted,
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
        if self.check_s <= 0:
            raise ValueError(f"check_s must be > 0; got {check_s}")
        self.stalls = 0  # StallDetected published
        self._gaps: deque[float] = deque(maxlen=window)  # seconds a step, recent steps
        self._ended = 0  # StepEnded seen since the run (re)started
        self._last: tuple[int | None, int] | None = None  # (step, ts) of the last StepEnded
        # _since, _paused and the stall's state: bus loop, watchdog and training threads. Never
        # held while publishing (a full inbox may make publish wait for the bus loop).
        self._lock = threading.Lock()
        self._since: float | None = None  # monotonic time of the last progress; None: idle
        self._paused = 0
        self._stalled_at: float | None = None  # when the current stall began (its _since)
        self._detected = False  # its StallDetected went out
        self._resumed: tuple[int | None, float] | None = None  # it ended before that
        self._abort_at: float | None = None  # when this stall's abort was requested
        self._over = False  # RunEnded seen: no stall until a run or a step starts again
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
        """Start the watchdog's thread (again, for a watchdog subscribed anew)."""
        self._bus = bus
        self._closing = False
        self._wake.clear()
        self._new_run(None)
        self._thread = threading.Thread(target=self._watch, name="eventbus-watchdog", daemon=True)
        self._thread.start()

    async def on_events(self, batch: list[Event]) -> None:
        """Note progress: the time of each step (bus loop; a few attribute writes)."""
        for ev in batch:
            if isinstance(ev, StepEnded):
                self._step_ended(ev)
            elif isinstance(ev, StepStarted):
                with self._lock:
                    if self._since is None and not self._over:  # the first step: watch it
                        self._since = time.monotonic()
            elif isinstance(ev, CheckpointSaved | EvalEnded):
                with self._lock:
                    if self._since is not None:
                        self._since = time.monotonic()
            elif isinstance(ev, RunStarted):
                self._new_run(time.monotonic())
            elif isinstance(ev, RunEnded):
                self._new_run(None)
                self._over = True  # nothing is a stall until a run starts again

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

    # -- inside: the bus loop ----------------------------------------------------------------

    def _new_run(self, since: float | None) -> None:
        """Forget the steps and any stall of the run before (a run starts, ends or restarts)."""
        self._gaps.clear()
        self._ended, self._last, self._over = 0, None, False
        with self._lock:
            self._since = since
            self._stalled_at = self._abort_at = self._resumed = None
            self._detected = False

    def _step_ended(self, ev: StepEnded) -> None:
        step, ts = ev.step, ev.ts
        last = self._last
        if step is not None and last is not None and last[0] is not None and step < last[0]:
            self._gaps.clear()  # the counter went back (a resume): learn the pace again
            self._ended = 0
        elif ts is not None and last is not None and ts > last[1]:
            self._gaps.append((ts - last[1]) / 1e9)  # between two StepEnded, as a stall is
        if ts is not None:
            self._last = (step, ts)
        self._ended += 1
        self._over = False
        now = time.monotonic()
        ended: tuple[int | None, float] | None = None
        with self._lock:
            stalled_at, self._stalled_at = self._stalled_at, None
            self._abort_at = None
            self._since = now
            if stalled_at is not None:
                lasted = round(now - stalled_at, 3)
                if self._detected:
                    self._detected = False
                    ended = (step, lasted)
                else:  # its StallDetected is not out yet: the watchdog thread follows it up
                    self._resumed = (step, lasted)
        if ended is not None:
            self._stall_ended(*ended)

    def _stall_ended(self, step: int | None, lasted: float) -> None:
        """StallEnded, after its StallDetected (a storm in the inbox may drop it: counted)."""
        if self._bus is not None:
            self._bus.publish(StallEnded(step=step, stalled_s=lasted))
        get_logger().warning("training resumed after a stall", step=step, stalled_s=lasted)

    # -- inside: the watchdog's thread -------------------------------------------------------

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
            since, stalled = self._since, self._stalled_at is not None
            if since is None or self._paused:
                return
        waited = time.monotonic() - since
        if stalled:
            if self.action == "abort" and self._detected:
                self._escalate(waited, bound)
            return
        if waited < bound or self._bus_behind():
            return
        with self._lock:
            if self._since != since or self._stalled_at is not None:  # a step came meanwhile
                return
            self._stalled_at = since
        self._report(waited, bound, thread_stacks(skip=me))
        with self._lock:
            resumed, self._resumed = self._resumed, None
            self._detected = resumed is None and self._stalled_at is not None
        if resumed is not None:  # the step ended while the report was being made
            self._stall_ended(*resumed)

    def _bus_behind(self) -> bool:
        """Events wait to be routed or delivered: the bus is late (a slow lossless subscriber
        holding the router up, a long drain at close), not necessarily the loop stuck."""
        stats = getattr(self._bus, "stats", None)  # EventBus.stats(); another handle: no check
        if stats is None:
            return False
        st = stats()
        return st.inbox_size > 0 or any(s.queued > 0 for s in st.subscribers.values())

    def _escalate(self, waited: float, bound: float) -> None:
        """action="abort": ask the loop to abort; if it never does, end the process."""
        bus = self._bus
        after = bound if self.abort_after_s is None else self.abort_after_s
        if bus is None or waited < bound + after or self._closing:
            return
        now = time.monotonic()
        with self._lock:
            first, due = self._abort_at is None, False
            if first:
                self._abort_at = now
            elif self._abort_at is not None and now - self._abort_at >= self.exit_after_s:
                due = True
        if first:
            step = self._last[0] if self._last is not None else None
            reason = f"stalled: no step ended for {waited:.0f} s (bound {bound:.0f} s)"
            bus.control.request_abort(reason, source="watchdog", step=step)
        elif due:
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
            # The handler runs in the main thread between two bytecodes (one stuck inside a
            # call that signals do not interrupt never gets there); its drain may take the
            # bus's close_timeout, and 5 s more.
            drain = float(getattr(self._bus, "close_timeout", 30.0)) + 6.0
            threading.Event().wait(max(self.exit_after_s, drain))
        get_logger().error("SIGTERM did not end the process: exiting now (status 70)")
        os._exit(70)

    def _report(self, waited: float, bound: float, stacks: str) -> None:
        self.stalls += 1
        step = self._last[0] if self._last is not None else None
        bus = self._bus
        rank = bus.rank if bus is not None else 0
        get_logger().warning(
            "no step ended within the bound: the training process may be stuck",
            step=step,
            waited_s=round(waited, 1),
            bound_s=round(bound, 1),
            stacks=stacks,
        )
        path = self._write(rank, waited, bound, step, stacks) if self.dir is not None else None
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

    def _write(
        self, rank: int, waited: float, bound: float, step: int | None, text: str
    ) -> str | None:
        """The stacks on disk (fsynced), on a thread of its own: a hung filesystem (often the
        cause of the stall) must not hold up the log and the event for more than WRITE_S."""
        assert self.dir is not None
        path = self.dir / f"stall-rank{rank}-pid{os.getpid()}-{self.stalls}.txt"
        head = f"no step ended for {waited:.1f} s (bound {bound:.1f} s); last step {step}\n\n"
        done: list[BaseException | None] = []

        def write() -> None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(head + text)
                    f.flush()
                    os.fsync(f.fileno())  # on disk before a kill that may follow
                done.append(None)
            except OSError as e:  # a full or unwritable disk: the event still goes out
                done.append(e)

        writer = threading.Thread(target=write, name="eventbus-watchdog-write", daemon=True)
        writer.start()
        writer.join(WRITE_S)
        if not done or done[0] is not None:
            why = repr(done[0]) if done else f"not done within {WRITE_S} s"
            get_logger().warning(
                "the watchdog could not write the stacks", path=str(path), error=why
            )
            return None
        return str(path)
