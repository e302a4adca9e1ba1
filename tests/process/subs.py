"""Subscribers that run in a child process (module level: picklable by reference), and helpers."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from eventbus import Event
from eventbus.core.handle import BusHandle
from eventbus.events import Loss, Scalars


class Tally:
    """Writes every step it receives to a file, one per line; publishes a summary at close."""

    policy = "block"
    events = (Loss,)

    def __init__(
        self,
        path: str,
        fail_on: int | None = None,
        die_on: int | None = None,
        hang_on: int | None = None,
    ) -> None:
        self.path = path
        self.fail_on, self.die_on, self.hang_on = fail_on, die_on, hang_on
        self.bus: BusHandle | None = None
        self.n = 0

    def on_start(self, bus: BusHandle) -> None:
        self.bus = bus
        Path(self.path).write_text("")

    async def on_events(self, batch: list[Event]) -> None:
        assert self.bus is not None
        with open(self.path, "a") as f:
            f.writelines(f"{ev.step}\n" for ev in batch)
        self.n += len(batch)
        steps = {ev.step for ev in batch}
        if self.die_on in steps:
            os._exit(7)
        if self.hang_on in steps:
            time.sleep(3600)
        if self.fail_on in steps:
            raise ValueError(f"bad step {self.fail_on}")
        if 50 in steps:
            self.bus.control.request_stop("saw step 50", source="tally", step=50)
            self.bus.control.request_save("saw step 50", source="tally", step=50)

    def on_close(self) -> None:
        assert self.bus is not None
        self.bus.publish(Scalars(values={"received": self.n, "pid": os.getpid()}))


def broken_factory(path: str) -> Tally:
    raise RuntimeError("cannot build: no GPU here")


def on_one(ev: Event) -> None:
    """A plain function subscriber (one event per call)."""
    if ev.step == 3:
        raise KeyError("three")


_RAISE: dict[str, type[BaseException]] = {
    "SystemExit": SystemExit,
    "KeyboardInterrupt": KeyboardInterrupt,
    "GeneratorExit": GeneratorExit,
}


class Raiser:
    """Raises the BaseException `what` where told (`where`: a hook name, or steps in `on`)."""

    policy = "block"
    events = (Loss,)

    def __init__(
        self, path: str, what: str, on: tuple[int, ...] = (), where: str = "", sync: bool = False
    ) -> None:
        self.path, self.what, self.on, self.where, self.sync = path, what, on, where, sync

    def _maybe(self, where: str) -> None:
        if where == self.where:
            raise _RAISE[self.what](f"{self.what} in {where}")

    def on_start(self, bus: BusHandle) -> None:
        Path(self.path).write_text("")
        self._maybe("on_start")

    def on_events(self, batch: list[Event]) -> Any:
        if not self.sync:
            return self._async_on_events(batch)
        self._handle(batch)
        return None

    async def _async_on_events(self, batch: list[Event]) -> None:
        await asyncio.sleep(0)
        self._handle(batch)

    def _handle(self, batch: list[Event]) -> None:
        with open(self.path, "a") as f:
            f.writelines(f"{ev.step}\n" for ev in batch)
        if any(ev.step in self.on for ev in batch):
            raise _RAISE[self.what](f"{self.what} at step {batch[0].step}")

    def on_close(self) -> None:
        self._maybe("on_close")

    def state_dict(self) -> dict[str, Any]:
        self._maybe("state_dict")
        return {"ok": True}


def exit_on_even(ev: Event) -> None:
    """A plain function that calls sys.exit on even steps."""
    assert ev.step is not None
    if ev.step % 2 == 0:
        raise SystemExit(f"step {ev.step}")


async def _write_step(path: str, ev: Event) -> None:
    await asyncio.sleep(0)
    with open(path, "a") as f:
        f.write(f"{ev.step}\n")


class ReturnsCoroutine:
    """A plain (sync) callable returning a coroutine, as `lambda ev: coro(ev)` does; picklable."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, ev: Event) -> Any:
        return _write_step(self.path, ev)


class Handle:
    """Reports from the child what its `bus` is: a BusHandle, with the one Control class."""

    policy = "block"

    def __init__(self) -> None:
        self.bus: Any = None

    def on_start(self, bus: BusHandle) -> None:
        self.bus = bus

    async def on_events(self, batch: list[Event]) -> None:
        from eventbus.control import Control

        bus = self.bus
        bus.control.request_abort("enough", step=batch[0].step)
        bus.publish(
            Scalars(
                step=batch[0].step,
                values={
                    "is_handle": float(isinstance(bus, BusHandle)),
                    "real_control": float(type(bus.control) is Control),
                    "should_stop": float(bus.should_stop),
                    "rank": float(bus.rank),
                    "world_size": float(bus.world_size),
                    "local_rank": float(bus.local_rank),
                },
            )
        )


def steps_in(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()]


def gone(pid: int, within: float) -> bool:
    """Wait until `pid` exited (or is a zombie); False if it still runs after `within` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


class DieOnce:
    """SIGKILLs its own (sidecar) process at step `at`, once per `marker` file: a crash."""

    policy = "block"
    events = (Loss,)

    def __init__(self, marker: str, at: int) -> None:
        self.marker, self.at = marker, at

    def on_events(self, batch: list[Event]) -> None:
        if any(ev.step == self.at for ev in batch) and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


class Gate:
    """Blocks each batch until the file `gate` exists: a slow, lossless sidecar subscriber."""

    policy = "block"

    def __init__(self, gate: str) -> None:
        self.gate = gate
        self.n = 0

    def on_events(self, batch: list[Event]) -> None:
        while not os.path.exists(self.gate):
            time.sleep(0.01)
        self.n += len(batch)

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


class SlowState:
    """Its `state_dict()` waits until the file `gate` exists: a checkpoint answered late."""

    def __init__(self, gate: str) -> None:
        self.gate = gate

    def on_events(self, batch: list[Event]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        while not os.path.exists(self.gate):
            time.sleep(0.01)
        return {"big": "x" * (1 << 20)}


@dataclass(slots=True, kw_only=True)
class BigBlob(Event):
    """A big event (a MiB of text, say) for the byte bounds."""

    data: str = ""


class WhereAmI:
    """Writes the process id it runs in to `path` when started."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_start(self, bus: BusHandle) -> None:
        Path(self.path).write_text(str(os.getpid()))

    def on_events(self, batch: list[Event]) -> None:
        return None


class Storm:
    """Publishes `n` Scalars for every Loss it receives: a feedback storm from the sidecar."""

    events = (Loss,)
    policy = "block"

    def __init__(self, n: int) -> None:
        self.n = n
        self.bus: Any = None

    def on_start(self, bus: BusHandle) -> None:
        self.bus = bus

    def on_events(self, batch: list[Event]) -> None:
        for ev in batch:
            for _ in range(self.n):
                self.bus.publish(Scalars(step=ev.step, values={"x": 1.0}))


class Burner:
    """Pure-Python CPU work per event: `ms` of this process's thread CPU time."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def on_events(self, batch: list[Event]) -> None:
        for _ in batch:
            end = time.thread_time() + self.ms / 1e3
            while time.thread_time() < end:
                pass


class SaveAsker:
    """Asks for a checkpoint (`bus.control.request_save`) at each step in `at`, and publishes
    what each request returned, so a test in the parent sees it."""

    events = (Loss,)
    policy = "block"

    def __init__(self, at: tuple[int, ...]) -> None:
        self.at = at
        self.bus: Any = None

    def on_start(self, bus: BusHandle) -> None:
        self.bus = bus

    def on_events(self, batch: list[Event]) -> None:
        for ev in batch:
            if ev.step in self.at:
                asked = self.bus.control.request_save(f"step {ev.step}", step=ev.step)
                self.bus.publish(Scalars(step=ev.step, values={"asked": float(asked)}))


class SlowStartNoFlush:
    """Its `on_start` waits (polling, bounded) for the file `gate`; it writes what happens, in
    order, to `log`: start, started, each step it receives."""

    events = (Loss,)
    policy = "block"

    def __init__(self, gate: str, log: str) -> None:
        self.gate, self.log = gate, log

    def _say(self, what: str) -> None:
        with open(self.log, "a") as f:
            f.write(what + "\n")

    def on_start(self, bus: BusHandle) -> None:
        self._say("start")
        deadline = time.monotonic() + 60
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.005)
        self._say("started")

    def on_events(self, batch: list[Event]) -> None:
        for ev in batch:
            self._say(f"step {ev.step}")


class SlowStart(SlowStartNoFlush):
    """`SlowStartNoFlush` with an `on_flush`, which says "flushed"."""

    def on_flush(self) -> None:
        self._say("flushed")


class Echo:
    """Answers each Loss with a Scalars of the same step, published from where it runs."""

    events = (Loss,)
    policy = "block"

    def __init__(self) -> None:
        self.bus: Any = None

    def on_start(self, bus: BusHandle) -> None:
        self.bus = bus

    def on_events(self, batch: list[Event]) -> None:
        for ev in batch:
            self.bus.publish(Scalars(step=ev.step, values={"echo": 1.0}))


class Summary:
    """Counts the Loss events it got; publishes the count from its `on_close` only."""

    events = (Loss,)
    policy = "block"

    def __init__(self) -> None:
        self.bus: Any = None
        self.n = 0

    def on_start(self, bus: BusHandle) -> None:
        self.bus = bus

    def on_events(self, batch: list[Event]) -> None:
        self.n += len(batch)

    def on_close(self) -> None:
        self.bus.publish(Scalars(step=None, values={"summary_count": float(self.n)}))


class LateEnd(Tally):
    """A `Tally` whose sidecar answers END on a thread that starts late (patched there, in
    `on_start`): as a sidecar busy with other subscribers may schedule it."""

    def on_start(self, bus: BusHandle) -> None:
        from eventbus.process import child

        end = child.Host._end

        def late(host: Any, *args: Any) -> Any:
            time.sleep(0.3)
            return end(host, *args)

        child.Host._end = late  # type: ignore[method-assign,assignment]
        super().on_start(bus)


class Printer:
    """Prints each batch to its standard output (a user's progress line), as a `Tally`."""

    policy = "block"
    events = (Loss,)

    def on_events(self, batch: list[Event]) -> None:
        print(f"got {len(batch)} events, the last of step {batch[-1].step}", flush=True)
