"""The sidecar's side: a bus of its own, fed from the parent's channel instead of `publish`.

    parent --S A R B F D L C-->  reader thread: builds subscribers, puts each batch's events
                                 straight into the sidecar bus's inbox (already stamped)
    sidecar bus (the same EventBus engine: inbox, router, queues, delivery)
    parent <--ack, status, replies--  what its subscribers publish and request, their counters

The sidecar ignores SIGINT and SIGTERM: the parent decides when it ends, and closes it in
order. When the parent is gone (its end of the socket closes, or it is no longer our parent)
the sidecar drains everything it received, closes its subscribers (files) and exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from eventbus.bus import EventBus
from eventbus.core.inbox import BIG
from eventbus.core.sizing import QUICK, quick_check
from eventbus.core.subscription import Subscription
from eventbus.events import Event
from eventbus.loader import load_object
from eventbus.log import get_logger
from eventbus.process import spawn, wire
from eventbus.process.handle import SidecarHandle
from eventbus.process.logrelay import LogRelay
from eventbus.stats import BusStats

__all__ = ["Host", "describe_error", "main"]

STATUS_EVERY = 0.25  # seconds between counter reports to the parent (and on demand)
CHUNK = 4096  # of those, sent per message
ORPHAN_GRACE_S = 2.0  # parent gone: how long the reading may take to end before we close


class Host:
    """The sidecar process: one bus hosting every subscriber the parent placed here."""

    def __init__(self, conn: Connection, info: wire.StartInfo) -> None:
        self.conn = conn
        self.info = info
        self._send_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self.handle = SidecarHandle(info, self._wake)
        self.logs = LogRelay(self._wake)
        self.logs.install()
        # world_size=1: the sidecar takes part in no collective; its subscribers see the real
        # rank and world size through the handle.
        self.bus = EventBus(
            rank=info["rank"],
            world_size=1,
            name=f"{info['name']}-sidecar",
            drain_interval=info["drain_interval"],
            close_timeout=info["close_timeout"],
            hang_timeout=info["hang_timeout"],
            max_consecutive_failures=info["max_consecutive_failures"],
            handle_signals=False,
            inbox_max_bytes=info["max_bytes"],
            queue_max_bytes=info["max_bytes"],
            cost_every=None,  # the parent's publish is what costs the training thread
        )
        self.bus._loop.handle = self.handle  # subscribers publish to the parent, not here
        self.bus._loop.ending = None  # the parent ends the run: its RunEnded comes through
        self.handle.host_stats = self.bus.stats
        self.subs: dict[int, Subscription] = {}
        self.removed: dict[int, Subscription] = {}  # an END after its REMOVE still waits on it
        self.own: dict[str, Any] = {}  # subscribers with a `stats()` of their own, by name
        self._unacked = 0  # bytes of batches taken in and not yet acknowledged
        self._main_imported = False

    def serve(self) -> None:
        """Answer the parent until it closes us or goes away."""
        self.bus.start()
        threading.Thread(target=self._report, name="eventbus-sidecar-status", daemon=True).start()
        try:
            while self._serve_one():
                pass
        finally:
            self._closed.set()
            if self.bus.running:  # the parent is gone: keep what we received
                self.bus.close()
                self._send_status()

    def _serve_one(self) -> bool:
        try:
            msg = self.conn.recv_bytes()
        except (EOFError, OSError):
            return False  # the parent is gone
        op, payload = msg[:1], msg[1:]
        if op == wire.BATCH:
            inbox = self.bus._inbox  # already stamped by the parent: straight to the inbox
            for ev in _unpacked(payload):
                text = (QUICK.get(type(ev)) or quick_check(type(ev)))(ev)
                if text < 0 or text >= BIG:  # counted against the byte bound, as publish does
                    inbox.put_sized(ev)
                else:
                    inbox.put(ev)  # waits only while a lossless subscriber's queue is full
            with self._send_lock:  # acknowledged in bulk: one wake of the parent per ack
                self._unacked += len(msg)
                if self._unacked >= self.info["ack_bytes"]:
                    self._send_locked(("ack", self._unacked))
                    self._unacked = 0
        elif op == wire.ADD:
            self._add(pickle.loads(payload))
        elif op == wire.REMOVE:
            rid = pickle.loads(payload)
            sub = self.subs.pop(rid, None)
            if sub is not None:
                sub.remove()
                self.removed[rid] = sub
        elif op == wire.END:  # the removal here, in order with the batches; the wait aside
            req, (rid, timeout, parent) = pickle.loads(payload)
            sub = self._ending(rid, parent)
            threading.Thread(
                target=self._request,
                args=(op, req, (sub, timeout)),
                name="eventbus-sidecar-ask",
                daemon=True,
            ).start()
        elif op == wire.CLOSE:
            req, (timeout, self.handle.parent_stats) = pickle.loads(payload)
            self.handle.closing = True  # each subscriber was ended already, unless out of time
            st = self.bus.close(timeout)
            self._reply(req, None, (st.hung, self.handle.late))
            return False
        else:  # answered aside: a flush a hung subscriber holds must not stop our reading
            req, arg = pickle.loads(payload)
            threading.Thread(
                target=self._request, args=(op, req, arg), name="eventbus-sidecar-ask", daemon=True
            ).start()
        return True

    def parent_gone(self) -> None:
        """On the watch thread, once the parent is gone and our reading was shut: if the
        reading does not end (it waits for room that a hung lossless subscriber holds, with no
        hang timeout), close the bus from here, within its deadline: nobody is left to wait
        for, and the process must not outlive its parent (the hung one is abandoned)."""
        if not self._closed.wait(ORPHAN_GRACE_S):  # set as soon as the reading ends
            self.bus.close()

    def _add(self, add: wire.AddInfo) -> None:
        try:
            if add["main"] and not self._main_imported:
                spawn.import_main(*add["main"])
                self._main_imported = True
            sub = build(add["target"])
            if add["restarted"]:
                self.handle.rebuilt.add(add["name"])
            if callable(getattr(sub, "stats", None)):
                self.own[add["name"]] = sub
            events = pickle.loads(add["events"])
            self.subs[add["id"]] = self.bus.subscribe(
                sub,
                name=add["name"],
                events=events,
                policy=add["policy"],
                maxsize=add["maxsize"],
                max_batch=add["max_batch"],
                placement="thread",
            )
        except BaseException as e:  # user code (unpickling, the factory): the parent reports it
            self._send(("added", add["id"], describe_error(e)))
            return
        self._send(("added", add["id"], None))

    def _request(self, op: bytes, req: int, arg: Any) -> None:
        value: Any = None
        try:
            if op == wire.FLUSH:
                value = self.bus.flush(arg)
            elif op == wire.END:
                value = self._end(*arg)
            elif op == wire.STATE:
                value = self.bus.state_dict()
            elif op == wire.LOAD:
                self.bus.load_state_dict(arg)
            else:
                raise ValueError(f"unknown opcode {op!r}: parent and sidecar differ in version")
        except BaseException as e:  # the subscriber's state_dict / load_state_dict
            self._reply(req, describe_error(e), None)
            return
        self._reply(req, None, value)

    def _ending(self, rid: int, parent: BusStats) -> Subscription | None:
        """On the reading thread, as END is read: remove one subscriber, in order with the
        batches (none read after the END reaches it: the parent no longer sends it any).
        `parent`: the training process's counters, final, set before the removal (a writer's
        last stats record, at its close). None: not here (never built)."""
        self.handle.parent_stats = parent
        sub = self.subs.pop(rid, None) or self.removed.pop(rid, None)
        if sub is not None:
            sub.remove()
        return sub

    def _end(self, sub: Subscription | None, timeout: float) -> bool | None:
        """Wait (up to `timeout`) until an ended subscriber drained and closed: what it
        published in its `on_close` goes to the parent with the answer, to reach the others.
        None: not here (never built)."""
        if sub is None:
            return None
        deadline = time.monotonic() + timeout
        while not sub.closed:
            if time.monotonic() >= deadline:
                return False  # still at it: the close names it hung if it never finishes
            time.sleep(0.001)
        return True

    def _reply(self, req: int, error: str | None, value: Any) -> None:
        self._send_status()  # first: what was published and counted before the answer
        try:
            self._send(("reply", req, error, value))
        except (pickle.PicklingError, TypeError, AttributeError) as e:  # a state that won't pickle
            self._send(("reply", req, f"the answer could not be sent: {describe_error(e)}", None))

    def _report(self) -> None:
        """Send the counters, and what subscribers published, every STATUS_EVERY seconds
        or as soon as something was published."""
        while not self._closed.is_set():
            self._wake.wait(STATUS_EVERY)
            self._wake.clear()
            with contextlib.suppress(OSError):
                self._send_status()

    def _send_status(self) -> None:
        with self._send_lock:  # one status at a time: its events stay in publishing order
            published, requests = self.handle.take()
            while len(published) > CHUNK:  # a burst: in several messages, in order
                chunk, published = published[:CHUNK], published[CHUNK:]
                packed = _packed(chunk)
                if packed is not None:
                    self._send_locked(("status", 0, {}, packed, [], {}, [], self.handle.dropped))
            packed = _packed(published) if published else None
            own = {}
            for name, sub in list(self.own.items()):
                with contextlib.suppress(Exception):  # user code: its report is optional
                    own[name] = sub.stats()
            logs = self.logs.take()
            acked, self._unacked = self._unacked, 0
            subs = self.bus.stats().subscribers
            dropped = self.handle.dropped
            status = ("status", acked, subs, packed, requests, own, logs, dropped)
            try:
                self._send_locked(status)
            except (pickle.PicklingError, TypeError, AttributeError):  # a stats() that won't pickle
                self._send_locked((*status[:5], {}, logs, dropped))

    def _send(self, msg: tuple[Any, ...]) -> None:
        with self._send_lock:
            self._send_locked(msg)

    def _send_locked(self, msg: tuple[Any, ...]) -> None:
        data = wire.dumps(msg)
        with contextlib.suppress(OSError):  # the parent is gone: we still drain and close
            self.conn.send_bytes(data)


def _packed(events: list[Event]) -> bytes | None:
    """Events published here, packed for the parent; None (logged, counted) if one of them
    holds a field pickle refuses: then none of these reach the parent."""
    try:
        return wire.pack(events)
    except Exception as e:
        get_logger().error(
            "sidecar: events its subscribers published could not be sent; lost",
            lost=len(events),
            error=f"{type(e).__name__}: {e}",
        )
        return None


def _unpacked(payload: bytes) -> list[Event]:
    """A batch's events; none if it cannot be read here (a field holds an object whose class
    this process cannot import): logged, and counted lost by the parent at close."""
    try:
        return wire.unpack(payload)
    except Exception as e:
        get_logger().error(
            "sidecar: a batch of events could not be read here; its events are lost. A field "
            "holds an object of a class the sidecar cannot import (defined in your script?): "
            "publish plain values, or define the class in a module",
            error=f"{type(e).__name__}: {e}",
        )
        return []


def build(target: wire.Target) -> Any:
    """The subscriber: unpickled, or made by its factory."""
    if target[0] == "pickled":
        return pickle.loads(target[1])
    spec, args, kwargs = target[1]
    return load_object(spec)(*args, **kwargs)


def describe_error(e: BaseException) -> str:
    """An error as the parent reports it: type, message, the sidecar's traceback."""
    tb = "".join(traceback.format_exception(e)).rstrip()
    return f"{type(e).__name__}: {e}\n--- sidecar traceback ---\n{tb}"


def _watch_parent(ppid: int, sock: socket.socket, gone: Callable[[], None]) -> None:
    """A forked DataLoader worker may keep the parent's end of the socket open: look at our
    parent too, and end the reading when it is gone (the sidecar then drains and exits);
    then `gone()`."""

    def run() -> None:
        while os.getppid() == ppid:
            time.sleep(0.2)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RD)
        gone()

    threading.Thread(target=run, name="eventbus-parent-watch", daemon=True).start()


def main() -> None:
    """`python -c` entry point of the sidecar: argv[1] is the socket's fd."""
    t0 = float(sys.argv[2])
    for sig in (signal.SIGINT, signal.SIGTERM):  # the parent closes us in order
        signal.signal(sig, signal.SIG_IGN)
    paths = json.loads(os.environ.pop(spawn.PATH_ENV, "[]"))
    sys.path[:0] = [p for p in paths if p not in sys.path]
    fd = int(sys.argv[1])
    # For shutdown() only (the Connection reads); never a closed standard stream's number.
    sock = socket.socket(fileno=spawn.above_std(os.dup(fd)))
    conn = Connection(fd)
    try:
        msg = conn.recv_bytes()
    except (EOFError, OSError):
        return
    info: wire.StartInfo = pickle.loads(msg[1:])
    if info["nice"] and hasattr(os, "nice"):
        with contextlib.suppress(OSError):
            os.nice(info["nice"])  # background work: training keeps the CPU it needs
    host = Host(conn, info)
    _watch_parent(info["ppid"], sock, host.parent_gone)
    host._send(("ready", time.time() - t0))
    host.serve()
