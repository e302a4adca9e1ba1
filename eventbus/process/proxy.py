"""`ProcessSubscriber`: the parent's side of a process-placed subscriber.

On the bus side it is an ordinary async subscriber: the runner's queue, policy, drops,
failures and latency are counted in `bus.stats()` as for any other. The pipe I/O runs in a
worker thread (the loop never blocks on a slow child). When the child dies or hangs it raises
`ChildProcessDied` / `ChildProcessHung`, both `SubscriberGone`: the delivery code disables it.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import anyio

from eventbus.core.subscriber import describe
from eventbus.core.worker import ThreadWorker
from eventbus.events import Event
from eventbus.loader import SHORT_NAMES, load_object
from eventbus.log import get_logger
from eventbus.process import spawn, wire
from eventbus.process.errors import ChildProcessDied, ChildProcessHung, RemoteError

if TYPE_CHECKING:
    from eventbus.core.handle import BusHandle

__all__ = ["ProcessSubscriber"]

_POLL_S = 0.05  # how often a waiting parent looks whether the child is still alive
_IMPORT_PATH_HINT = "pass an import path: ProcessSubscriber('package.module:factory', kwargs={...})"


class ProcessSubscriber:
    """Runs `sub` in a child process; on the bus side, a normal async subscriber.

    `sub`: a picklable subscriber (object with `on_events`, or a function of one event), or an
    import path `"package.module:factory"` (or a built-in short name) built in the child with
    `args` / `kwargs`. Its class attributes (`events`, `policy`, `maxsize`, `ranks`, `name`)
    are read here as for an in-thread subscriber. `batch_timeout`: seconds a batch may take
    before the child counts as hung and is killed (None: only the bus's close deadline).
    `nice`: added to the child's scheduling niceness, so on a busy machine the analysis
    yields the CPU to training (0 keeps the parent's priority).
    """

    def __init__(
        self,
        sub: Any,
        *,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        events: Sequence[type[Event]] | None = None,
        start_timeout: float = 120.0,
        nice: int = 10,
        batch_timeout: float | None = None,
        close_timeout: float = 10.0,
        name: str | None = None,
    ) -> None:
        kwargs = dict(kwargs or {})
        self._main: tuple[str, str] | None = None  # the parent's script, if the child needs it
        if isinstance(sub, str):
            spec = SHORT_NAMES.get(sub, sub)
            template = load_object(spec, where="ProcessSubscriber")
            self._target: wire.Target = ("factory", (spec, tuple(args), kwargs))
        else:
            if args or kwargs:
                raise TypeError(
                    "args/kwargs are for an import path 'module:factory', not an "
                    "already built subscriber"
                )
            template = sub
            data = _pickled(sub)
            self._main = _main_for(sub, data)
            self._target = ("pickled", data)
        for attr in ("events", "policy", "maxsize", "max_batch", "ranks"):
            v = getattr(template, attr, None)  # class attributes, as bus.subscribe reads them
            if v is not None and not callable(v):
                setattr(self, attr, v)
        if events is not None:
            self.events = tuple(events)
        self.name = name or (
            describe(template) if not isinstance(template, type) else template.__name__
        )
        self.batched = hasattr(template, "on_events")
        self.start_timeout = start_timeout
        self.batch_timeout = batch_timeout
        self.close_timeout = close_timeout
        self.nice = nice
        self._bus: BusHandle | None = None
        self._proc: spawn.Child | None = None
        self._conn: Connection | None = None
        self._io = ThreadWorker(f"{self.name}-io")
        self._lock = threading.Lock()  # one exchange on the pipe at a time
        self._dead: str | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._ready = threading.Event()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the child built the subscriber and ran its `on_start` (or failed to)."""
        return self._ready.wait(timeout)

    @property
    def pid(self) -> int | None:
        """The child's process id (None before start)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        """True while the child process runs."""
        return self._proc is not None and self._proc.is_alive()

    def __repr__(self) -> str:
        return f"ProcessSubscriber({self.name!r}, pid={self.pid})"

    # -- hooks the bus calls ----------------------------------------------------------

    async def on_start(self, bus: BusHandle) -> None:
        """Spawn the child and wait until it built the subscriber and ran its `on_start`."""
        self._bus = bus
        info: wire.StartInfo = {
            "rank": bus.rank,
            "world_size": bus.world_size,
            "local_rank": bus.local_rank,
            "name": self.name,
            "main": self._main,
            "nice": self.nice,
        }
        reply = await self._call(self._spawn, info)
        self._apply(reply)

    async def on_events(self, batch: list[Event]) -> None:
        """Send the batch; return when the child handled it (raise what it raised)."""
        if self._dead is not None:
            raise ChildProcessDied(self._dead)
        payload = wire.pack(batch)
        try:
            reply = await self._call(self._exchange, wire.BATCH, payload, self.batch_timeout)
        except (ChildProcessDied, ChildProcessHung) as e:
            self._gone(str(e))
            raise
        self._apply(reply)

    async def on_close(self) -> None:
        """Ask the child to run `on_close` and exit; join, then terminate, then kill."""
        proc = self._proc
        if proc is None:
            return
        try:
            if self._dead is None and proc.is_alive():
                reply = await self._call(self._exchange, wire.CLOSE, b"", self.close_timeout)
                self._apply(reply)
        except (ChildProcessDied, ChildProcessHung) as e:
            self._gone(str(e))
            raise
        finally:
            await self._call(self._reap, self.close_timeout)
            self._io.stop()

    def state_dict(self) -> Any:
        """The child subscriber's `state_dict()` (None if it has none)."""
        return self._sync_call(wire.STATE, b"")

    def load_state_dict(self, state: Any) -> None:
        """Hand `state` to the child subscriber's `load_state_dict`."""
        self._sync_call(wire.LOAD, wire.dumps(state))

    # -- plumbing ---------------------------------------------------------------------

    async def _call(self, fn: Callable[..., wire.Reply | None], *args: Any) -> Any:
        try:
            return await self._io.call(fn, *args)
        except anyio.get_cancelled_exc_class():
            # The bus abandoned us (close deadline): the child must not outlive the bus.
            self._dead = self._dead or "abandoned at the bus's close deadline"
            proc = self._proc
            if proc is not None:
                threading.Thread(target=spawn.kill, args=(proc,), daemon=True).start()
            raise

    def _sync_call(self, op: bytes, payload: bytes) -> Any:
        if self._proc is None or self._dead is not None:
            raise RuntimeError(
                f"process subscriber {self.name!r} is not running: "
                f"{self._dead or 'the bus has not started it'}"
            )
        reply = self._exchange(op, payload, self.close_timeout)
        if reply["error"]:
            raise RemoteError(reply["error"])
        return reply["value"]

    def _spawn(self, info: wire.StartInfo) -> wire.Reply:
        proc, conn = spawn.launch(self.name)
        self._proc, self._conn = proc, conn
        self._finalizer = weakref.finalize(self, spawn.kill, proc)
        try:
            conn.send_bytes(wire.encode_start(self._target, os.getpid(), info))
            reply = self._wait(self.start_timeout, wire.START)
        finally:
            self._ready.set()
        if reply["error"]:
            self._reap(self.close_timeout)
            raise RemoteError(
                f"building or starting {self.name!r} in the child failed: {reply['error']}"
            )
        return reply

    def _exchange(self, op: bytes, payload: bytes, timeout: float | None) -> wire.Reply:
        assert self._conn is not None and self._proc is not None, "on_start() first"
        with self._lock:
            try:
                self._conn.send_bytes(op + payload)
            except OSError as e:  # BrokenPipeError, ConnectionResetError
                raise ChildProcessDied(
                    self._proc.why_dead(self.name, f"pipe closed: {e}")
                ) from None
            return self._wait(timeout, op)

    def _wait(self, timeout: float | None, op: bytes) -> wire.Reply:
        deadline = None if timeout is None else time.monotonic() + timeout
        conn, proc = self._conn, self._proc
        assert conn is not None and proc is not None, "on_start() first"
        while True:
            try:
                if conn.poll(_POLL_S):
                    return wire.decode_reply(conn.recv_bytes())
            except (EOFError, OSError):
                raise ChildProcessDied(proc.why_dead(self.name, "pipe closed")) from None
            if not proc.is_alive():
                raise ChildProcessDied(proc.why_dead(self.name, "no reply"))
            if deadline is not None and time.monotonic() > deadline:
                spawn.kill(proc)
                raise ChildProcessHung(
                    f"child process {proc.pid} of {self.name!r} gave no answer to "
                    f"{wire.OP_NAMES[op]} within {timeout} s; killed it"
                )

    def _reap(self, timeout: float) -> None:
        proc = self._proc
        if proc is None:
            return
        proc.join(timeout)
        spawn.kill(proc)
        if self._conn is not None:
            self._conn.close()
        if self._finalizer is not None:
            self._finalizer.detach()

    def _gone(self, why: str) -> None:
        """The child died or hung: remember and log it (the raised `SubscriberGone` disables us)."""
        if self._dead is None:
            self._dead = why
        get_logger().error("process subscriber's child is gone", subscriber=self.name, reason=why)

    def _apply(self, reply: wire.Reply) -> None:
        """Publish what the child published; forward its stop/abort requests; raise its error."""
        bus = self._bus
        assert bus is not None, "on_start() first"
        if reply["published"]:
            for ev in wire.unpack(reply["published"]):
                bus.publish(ev)  # keeps the child's ts; seq and rank are ours
        for req in reply["requests"]:  # the child's Control published these StopRequested
            ask = bus.control.request_abort if req.abort else bus.control.request_stop
            ask(req.reason, source=req.source or self.name, step=req.step)
        if reply["error"]:
            raise RemoteError(reply["error"])


def _pickled(sub: Any) -> bytes:
    try:
        data = pickle.dumps(sub, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise TypeError(
            f"placement='process' needs a picklable subscriber; {describe(sub)!r} is not "
            f"({type(e).__name__}: {e}). Define it at module level, or {_IMPORT_PATH_HINT}"
        ) from e
    if spawn.importing_main():
        raise RuntimeError(
            "a process-placed subscriber was created while its child imported your script: "
            'guard the script\'s training code with `if __name__ == "__main__":` (as for '
            "multiprocessing), or define the subscriber in a module of its own"
        )
    return data


def _main_for(sub: Any, data: bytes) -> tuple[str, str] | None:
    try:
        return spawn.main_to_import(data)
    except ValueError:
        raise TypeError(
            f"placement='process': {describe(sub)!r} is defined interactively (a notebook or "
            f"REPL), so a child process cannot import it; define it in a module, or "
            f"{_IMPORT_PATH_HINT}"
        ) from None
