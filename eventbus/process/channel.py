"""`Channel`: one sidecar process and its socket, with a thread that sends and one that reads.

Callers never block on the socket: they post, the sender thread writes. Only the reader closes
the socket, once the sender is done: a closed descriptor number is soon another socket's.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from eventbus.process import spawn, wire
from eventbus.process.errors import RemoteError

__all__ = ["Channel"]


class Channel:
    """One sidecar process and its socket: a sender thread (callers never block on the
    socket) and a reader thread (acks, reports, replies)."""

    def __init__(
        self, name: str, start: bytes, adds: list[bytes], read: Callable[[Channel], None]
    ) -> None:
        self.t0 = time.time()
        self.proc, self.conn = spawn.launch(name, self.t0)
        self.finalizer = weakref.finalize(self, spawn.kill, self.proc)
        # Only when collected, never at interpreter exit: the bus's own exit hook closes the
        # sidecar in order (its events drained), and may run after this one would have.
        self.finalizer.atexit = False
        self.out: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.in_flight = 0  # bytes of batches posted and not yet acknowledged
        self.dead: str | None = None
        self.spawn_s: float | None = None
        self.storm_dropped = 0  # what its subscribers published beyond what it holds for us
        self.replies: dict[int, tuple[str | None, Any]] = {}
        self.abandoned: set[int] = set()  # requests given up on: their late answers let go
        self._asked = itertools.count(1)
        self.post(start)
        for add in adds:  # a restart rebuilds them all, in order
            self.post(add)
        self.sender = threading.Thread(target=self._send_loop, name="eventbus-sidecar-send")
        self.sender.daemon = True
        self.sender.start()
        self.reader = threading.Thread(
            target=read, args=(self,), name="eventbus-sidecar-read", daemon=True
        )
        self.reader.start()

    def post(self, data: bytes | None) -> None:
        self.out.put(data)

    def ask(self, op: bytes, arg: Any) -> int:
        """Post a request; its answer, by the number returned, comes through `answer`."""
        req = next(self._asked)
        self.post(op + wire.dumps((req, arg)))
        return req

    def answer(self, req: int) -> tuple[Any] | None:
        """`(value,)` once the sidecar answered `req`, None until then; `RemoteError` for
        its error, or its death before it answered."""
        got = self.replies.pop(req, None)
        if got is None:
            if self.dead is not None:
                raise RemoteError(f"the sidecar died: {self.dead}")
            return None
        error, value = got
        if error is not None:
            raise RemoteError(error)
        return (value,)

    def forget(self, req: int) -> None:
        """Its asker gave up on `req` (under the lock the reader stores replies under): an
        answer coming later is dropped, not kept for ever under a number nobody asks for."""
        if self.replies.pop(req, None) is None:
            self.abandoned.add(req)

    def _send_loop(self) -> None:
        try:
            while (data := self.out.get()) is not None:
                self.conn.send_bytes(data)
        except OSError:
            return  # the reader sees the death and reports it
        self.shutdown(socket.SHUT_WR)  # the sidecar reads to here, drains, closes its files, exits

    def stop(self) -> None:
        """After what was posted, end our side (never waiting on a sidecar that does not read)."""
        self.post(None)

    def shutdown(self, how: int) -> None:
        """Shut the socket down without closing our descriptor, which the other thread may be
        using: a closed number is soon another socket's, and its reads would steal that data."""
        with contextlib.suppress(OSError, ValueError):
            s = socket.socket(fileno=os.dup(self.conn.fileno()))
            try:
                s.shutdown(how)
            finally:
                s.close()

    def finish(self) -> None:
        """The reader is done: stop the sender, then (no thread uses it now) close the socket."""
        self.shutdown(socket.SHUT_RDWR)  # a sender blocked on a sidecar that does not read
        self.post(None)
        self.sender.join()
        self.conn.close()
