"""The child's side: build the subscriber, then answer the parent's messages one at a time.

    parent --start, then S/B/C/D/L--> serve() --> SubscriberCalls (the only caller of user code)
           <--one reply each--------- ChildBus  (events it published, its Control's requests)

The child ignores SIGINT (the parent decides when it ends), ends when the parent sends CLOSE
or the socket closes, and exits by itself within ~0.2 s when the parent process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Coroutine, Sequence
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from eventbus.control import Control
from eventbus.core.delivery import Delivery
from eventbus.events import Event, StopRequested
from eventbus.loader import load_object
from eventbus.process import spawn, wire

__all__ = ["ChildBus", "SubscriberCalls", "main", "serve"]

T = TypeVar("T")


class ChildBus:
    """What a process-placed subscriber gets as `bus` (a `BusHandle`): what it publishes and
    the stop/abort requests of its `control` go back to the parent with the next reply."""

    def __init__(self, info: wire.StartInfo) -> None:
        self.rank = info["rank"]
        self.world_size = info["world_size"]
        self.local_rank = info["local_rank"]
        self.published: list[Event] = []
        self.requests: list[StopRequested] = []
        # The one Control class: the StopRequested events it publishes are the requests the
        # parent replays on its own control (which publishes them on the bus).
        self.control = Control(self.requests.append)

    def publish(self, ev: Event) -> None:
        """Queue `ev` for the parent bus (sent with this message's reply)."""
        if not isinstance(ev, Event):
            raise TypeError(f"publish() takes an eventbus Event, got {type(ev).__qualname__}")
        if ev.ts is None:
            ev.ts = time.time_ns()
        self.published.append(ev)

    @property
    def should_stop(self) -> bool:
        """True once this subscriber requested a stop or an abort."""
        return self.control.should_stop

    def reply(self, error: str | None = None, value: Any = None) -> bytes:
        """The reply to the current message, carrying (and clearing) what was published."""
        published, requests = self.published, self.requests[:]
        self.published, self.requests[:] = [], []
        try:
            return wire.encode_reply(error, value, published=published, requests=requests)
        except BaseException as e:  # a state or event field that won't pickle
            lost = f"; {len(published)} published events lost" if published else ""
            return wire.encode_reply(
                f"the reply could not be sent{lost}: {describe_error(e)}", requests=requests
            )


class SubscriberCalls:
    """The child's caller of subscriber code: the bus's own `Delivery`, on a private loop.

    Whatever the subscriber raises, `BaseException` included (SystemExit, KeyboardInterrupt,
    GeneratorExit), comes back as an error text for the parent to count; the child goes on.
    Awaitables are awaited, also when a plain function returns one (`lambda ev: coro(ev)`).
    """

    def __init__(self, sub: Any) -> None:
        # The parent counts, logs and disables; here the delivery only calls and reports.
        self.delivery = Delivery(sub, name="child", max_consecutive_failures=None, report=False)
        self._loop = asyncio.new_event_loop()

    def hook(self, name: str, *args: Any) -> tuple[Any, str | None]:
        """Call an optional hook: (its value, None) or (None, the error); (None, None) if absent.

        Hooks belong to subscriber objects; a function's attributes are not called.
        """
        d = self.delivery
        if name in ("on_start", "on_close", "on_flush"):
            d.last_hook_error = None
            self._run(d.call_hook(name, *args))
            err = d.last_hook_error
            return None, describe_error(err) if err is not None else None
        try:
            return self._run(d.call_method(name, *args)), None
        except BaseException as e:  # user code: counted by the parent
            return None, describe_error(e)

    def deliver(self, events: list[Event]) -> str | None:
        """Hand `events` over (one batch, or one call per event); None, or the first failure."""
        d = self.delivery
        failed = d.failed
        self._run(d.deliver(events))
        if d.first_failure is None:
            return None
        ev, first = d.first_failure
        if d.batched:
            return describe_error(first, [ev])
        return (
            f"{d.failed - failed} of {len(events)} events failed; first: "
            f"{describe_error(first, [ev])}"
        )

    def close(self) -> None:
        self.delivery.worker.stop()
        self._loop.close()

    def _run(self, aw: Coroutine[Any, Any, T]) -> T:
        return self._loop.run_until_complete(aw)


def describe_error(e: BaseException, events: Sequence[Event] = ()) -> str:
    """The error as the parent reports it: type, message, first event, child traceback."""
    tb = "".join(traceback.format_exception(e)).rstrip()
    where = f" (event type {type(events[0]).__name__}, step {events[0].step})" if events else ""
    return f"{type(e).__name__}: {e}{where}\n--- child traceback ---\n{tb}"


def build(target: wire.Target, info: wire.StartInfo) -> Any:
    """The subscriber: unpickled (after importing the parent's script if it needs it) or made
    by its factory."""
    if target[0] == "pickled":
        if info["main"]:
            spawn.import_main(*info["main"])
        return pickle.loads(target[1])
    spec, args, kwargs = target[1]
    return load_object(spec)(*args, **kwargs)


def serve(conn: Connection, target: wire.Target, ppid: int, info: wire.StartInfo) -> None:
    """The child's loop: build the subscriber, then answer the parent's messages."""
    _watch_parent(ppid)
    if info["nice"] and hasattr(os, "nice"):
        with contextlib.suppress(OSError):
            os.nice(info["nice"])  # background analysis: training keeps the CPU it needs
    bus = ChildBus(info)
    try:
        calls = SubscriberCalls(build(target, info))
    except BaseException as e:  # user code (unpickling, the factory)
        _send(conn, bus.reply(describe_error(e)))
        return
    _, err = calls.hook("on_start", bus)
    if not _send(conn, bus.reply(err)) or err:
        return
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the parent is gone
        op, payload = msg[:1], msg[1:]
        value: Any = None
        if op == wire.BATCH:
            events, err = _decode(wire.unpack, payload)
            err = err or calls.deliver(events)
        elif op == wire.CLOSE:
            _, err = calls.hook("on_close")
            calls.close()
            _send(conn, bus.reply(err))
            conn.close()
            return
        elif op == wire.STATE:
            value, err = calls.hook("state_dict")
        elif op == wire.LOAD:
            state, err = _decode(pickle.loads, payload)
            if err is None:
                _, err = calls.hook("load_state_dict", state)
        else:
            err = f"unknown opcode {op!r}: parent and child run different eventbus versions"
        if not _send(conn, bus.reply(err, value)):
            return


def _decode(load: Callable[[bytes], Any], payload: bytes) -> tuple[Any, str | None]:
    try:
        return load(payload), None
    except BaseException as e:  # unpickling runs user classes' code
        return None, describe_error(e)


def _send(conn: Connection, data: bytes) -> bool:
    try:
        conn.send_bytes(data)
    except OSError:
        return False  # the parent is gone
    return True


def _watch_parent(ppid: int) -> None:
    def run() -> None:
        while True:
            if os.getppid() != ppid:
                os._exit(3)  # the parent is gone: never outlive it
            time.sleep(0.2)

    threading.Thread(target=run, name="eventbus-parent-watch", daemon=True).start()


def main() -> None:
    """`python -c` entry point of the child: argv[1] is the socket's fd."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent closes us in order
    paths = json.loads(os.environ.pop(spawn.PATH_ENV, "[]"))
    sys.path[:0] = [p for p in paths if p not in sys.path]
    conn = Connection(int(sys.argv[1]))
    try:
        target, ppid, info = wire.decode_start(conn.recv_bytes())
    except (EOFError, OSError):
        return
    serve(conn, target, ppid, info)
