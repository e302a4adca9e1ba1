"""A daemon thread per sync subscriber: sync code runs off the event loop, in order.

Our own daemon threads rather than a pool: a hung sync subscriber can then be abandoned at
close and never keeps the interpreter from exiting, and each subscriber's calls stay in order.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eventbus.events import Event

__all__ = ["ThreadWorker", "call_each", "in_worker", "thread_state", "worker_name"]

_cpu_ns = time.thread_time_ns  # ~0.5 us a read here: once per call, never per event


class _ThreadState(threading.local):
    """Per thread: whose bus side it is (`owner`: set on a bus's loop thread and on each of
    its subscribers' workers), and whether it is a worker and of whom. Class defaults: a
    thread that set nothing reads None without an AttributeError raised and caught."""

    owner: object | None = None
    worker: bool = False
    name: str | None = None


thread_state = _ThreadState()


def in_worker() -> bool:
    """True on a subscriber's worker thread (where waiting for the bus could deadlock)."""
    return thread_state.worker


def worker_name() -> str | None:
    """The subscriber whose worker thread this is (None elsewhere)."""
    return thread_state.name


def _settle(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.done():  # the awaiting task was cancelled (close deadline): drop the result
        return
    # Failures travel as a result, raised by `call` itself: a GeneratorExit set on the future
    # would be thrown into the task, which closes the awaiting coroutine instead.
    fut.set_result((ok, value))


class ThreadWorker:
    """Runs calls one at a time in a daemon thread; `await worker.call(fn, *args)`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.owner: object | None = None  # set before the first call: whose bus side it is
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"eventbus-{name}", daemon=True)
        self._started = False
        self.cpu_ns = 0  # CPU time of the calls it ran

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if not self._started:
            self._started = True
            self._thread.start()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._q.put((fn, args, loop, fut))
        ok, value = await fut
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        """Let the thread end after the call in hand (a hung one is simply abandoned)."""
        if self._started:
            self._q.put(None)

    def _run(self) -> None:
        thread_state.worker = True
        thread_state.name = self.name
        thread_state.owner = self.owner
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, args, loop, fut = item
            t0 = _cpu_ns()
            try:
                ok, value = True, fn(*args)
            except BaseException as e:  # SystemExit too: handed to the awaiting task, counted
                ok, value = False, e
            self.cpu_ns += _cpu_ns() - t0
            try:
                loop.call_soon_threadsafe(_settle, fut, ok, value)
            except RuntimeError:  # the loop is gone: the bus closed without us
                return


def call_each(fn: Callable[[Event], Any], batch: Iterable[Event]) -> list[tuple[Event, Any]]:
    """Worker side of a plain sync function: one call per event, failures kept apart.

    Each entry is (event, None), (event, the exception) or (event, an awaitable it returned).
    """
    out: list[tuple[Event, Any]] = []
    for ev in batch:
        try:
            r = fn(ev)
        except BaseException as e:  # SystemExit and KeyboardInterrupt too: counted, isolated
            out.append((ev, e))
        else:
            out.append((ev, r if inspect.isawaitable(r) else None))
    return out
