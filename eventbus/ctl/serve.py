"""`ConnectionLoop`: one thread that accepts, reads one bounded request line per connection,
has it answered, writes the reply and closes; nothing a client sends can stop it.

Every socket is non-blocking under one selector, so a client that connects and says nothing,
sends half a line, never reads its reply or floods bytes costs one slot until its deadline
(`timeout`), never the thread. At most `max_connections` are open; a newcomer evicts the
oldest. A request longer than `MAX_REQUEST` bytes is refused as soon as that is clear. A
reply may come `Later` (`save --wait`): the connection then waits for it, up to its own time.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from eventbus.ctl.protocol import MAX_REQUEST, encode, refusal
from eventbus.log import RateLimiter, get_logger

__all__ = ["ConnectionLoop", "Later"]


class Later:
    """A reply given later, from any thread (`save --wait`): the connection stays open until
    `give(reply)`, or until `seconds` pass and `timed_out` is the reply."""

    def __init__(self, seconds: float, timed_out: dict[str, Any]) -> None:
        self.seconds = seconds
        self.timed_out = timed_out
        self.reply: dict[str, Any] | None = None
        self.abandoned = False  # the client hung up: nobody to give it to
        self.wake: Callable[[], None] = lambda: None  # set by the loop that holds it

    def give(self, reply: dict[str, Any]) -> None:
        """The reply (the first one given counts)."""
        if self.reply is None:
            self.reply = reply
            self.wake()


Answer = Callable[[bytes, bool], "dict[str, Any] | Later"]  # (line, came over TCP) -> reply
PeerCheck = Callable[[socket.socket], str | None]  # a Unix peer -> why it is refused, or None

_log = RateLimiter(10.0)


class _Conn:
    __slots__ = ("buf", "deadline", "denied", "later", "out", "sock", "tcp")

    def __init__(self, sock: socket.socket, tcp: bool, deadline: float) -> None:
        self.sock = sock
        self.tcp = tcp
        self.deadline = deadline
        self.buf = bytearray()
        self.out: bytes | None = None  # the reply, once there is one
        self.denied: str | None = None  # the peer may not ask anything: why
        self.later: Later | None = None  # answered, the reply to come


class ConnectionLoop:
    """Serves `listeners` (socket -> is TCP) on a daemon thread until `close()`."""

    def __init__(
        self,
        listeners: dict[socket.socket, bool],
        answer: Answer,
        check_peer: PeerCheck,
        *,
        timeout: float = 5.0,
        max_connections: int = 8,
        name: str = "eventbus-ctl-listener",
    ) -> None:
        self.listeners = listeners
        self.answer = answer
        self.check_peer = check_peer
        self.timeout = timeout
        self.max_connections = max_connections
        self.served = 0  # replies sent in full
        self.dropped = 0  # connections closed without a full reply (timeouts, evictions, resets)
        self._sel = selectors.DefaultSelector()
        self._conns: dict[socket.socket, _Conn] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start serving on the loop's own thread."""
        for sock in self.listeners:
            sock.setblocking(False)
            self._sel.register(sock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread, close every connection and listener (idempotent); replies given
        by then (`Later`) are sent first, each within `timeout`."""
        self._closing = True
        self._wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        for c in list(self._conns.values()):  # the thread is done with them: ours now
            self._last_words(c, timeout)
        for sock in [*self._conns, *self.listeners, self._wake_r, self._wake_w]:
            with contextlib.suppress(OSError):
                sock.close()
        self._conns.clear()
        with contextlib.suppress(Exception):
            self._sel.close()

    def forget(self) -> None:
        """In a forked child: close the inherited copies of our descriptors. The parent's
        sockets and their selector registrations are untouched (nothing is unregistered)."""
        self._closing = True
        for sock in [*self._conns, *self.listeners, self._wake_r, self._wake_w]:
            with contextlib.suppress(OSError):
                sock.close()
        self._conns.clear()
        with contextlib.suppress(Exception):
            self._sel.close()  # closes this process's copy of the epoll descriptor only

    @property
    def alive(self) -> bool:
        """Whether the thread serves."""
        return self._thread.is_alive()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _last_words(self, c: _Conn, timeout: float) -> None:
        """At close: send a reply that is ready, blocking at most `timeout`."""
        if c.out is None and c.later is not None and c.later.reply is not None:
            c.out = encode(c.later.reply)
        if c.out:
            with contextlib.suppress(OSError):
                c.sock.settimeout(timeout)
                c.sock.sendall(c.out)
                self.served += 1

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closing:
            try:
                self._once()
            except Exception as e:  # our own bug: log it, keep serving
                self._complain("control server error", e)

    def _once(self) -> None:
        now = time.monotonic()
        first = min((c.deadline for c in self._conns.values()), default=None)
        wait = None if first is None else max(0.0, first - now)  # idle: asleep until a client
        for key, _ in self._sel.select(wait):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if sock is self._wake_r:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
                if self._closing:
                    return
            elif sock in self.listeners:
                self._accept(sock, self.listeners[sock])
            elif sock in self._conns:
                self._serve(self._conns[sock])
        now = time.monotonic()
        for c in list(self._conns.values()):
            if c.later is not None and c.out is None:
                if c.later.reply is not None:
                    self._reply(c, c.later.reply)  # given meanwhile, on another thread
                elif c.deadline <= now:
                    self._reply(c, c.later.timed_out)
            elif c.deadline <= now:
                self._drop(c)  # silent too long, or never read its reply

    def _accept(self, listener: socket.socket, tcp: bool) -> None:
        try:
            sock, _ = listener.accept()
        except OSError:
            return  # the client gave up already, or we ran out of descriptors
        sock.setblocking(False)
        if len(self._conns) >= self.max_connections:
            self._drop(min(self._conns.values(), key=lambda c: c.deadline))
        conn = _Conn(sock, tcp, time.monotonic() + self.timeout)
        self._conns[sock] = conn
        if not tcp:  # refused once its request is read: closing unread data would reset it
            conn.denied = self.check_peer(sock)
        self._sel.register(sock, selectors.EVENT_READ, None)

    def _serve(self, c: _Conn) -> None:
        if c.out is not None:
            self._write(c)
            return
        if c.later is not None:  # waiting for its reply: more bytes are ignored, a hang-up ends it
            try:
                data = c.sock.recv(MAX_REQUEST)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                c.later.abandoned = True
                self._drop(c)
            return
        try:
            data = c.sock.recv(MAX_REQUEST)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(c)
            return
        if not data:  # the client shut its side: what it sent is the whole request
            if c.buf.strip():
                self._answer(c, bytes(c.buf))
            else:
                self._drop(c)
            return
        c.buf += data
        end = c.buf.find(b"\n")
        if 0 <= end < MAX_REQUEST:
            self._answer(c, bytes(c.buf[:end]))
        elif len(c.buf) >= MAX_REQUEST:
            why = refusal("bad_request", f"request longer than {MAX_REQUEST} bytes")
            self._reply(c, why if c.denied is None else refusal("denied", c.denied))

    def _answer(self, c: _Conn, line: bytes) -> None:
        if c.denied is not None:
            self._reply(c, refusal("denied", c.denied))
            return
        try:
            reply = self.answer(line, c.tcp)
        except Exception as e:  # our own bug: the client hears of it, the thread goes on
            self._complain("control command failed", e)
            reply = refusal("refused", f"the job failed to answer: {type(e).__name__}: {e}")
        if isinstance(reply, Later):
            c.later, c.buf = reply, bytearray()
            c.deadline = time.monotonic() + reply.seconds
            reply.wake = self._wake
            if reply.reply is None:
                return  # the loop looks again when woken, or at the deadline
            reply = reply.reply
        self._reply(c, reply)

    def _reply(self, c: _Conn, reply: dict[str, Any]) -> None:
        c.out = encode(reply)
        c.deadline = time.monotonic() + self.timeout  # time to read it
        try:
            self._sel.modify(c.sock, selectors.EVENT_WRITE, None)
        except KeyError:
            self._sel.register(c.sock, selectors.EVENT_WRITE, None)
        self._write(c)

    def _write(self, c: _Conn) -> None:
        assert c.out is not None
        try:
            n = c.sock.send(c.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(c)
            return
        c.out = c.out[n:]
        if not c.out:
            self.served += 1
            self._close(c)

    def _drop(self, c: _Conn) -> None:
        self.dropped += 1
        self._close(c)

    def _close(self, c: _Conn) -> None:
        if c.later is not None:
            c.later.abandoned = True  # its reply (if any) went out, or never will
        self._conns.pop(c.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(c.sock)
        with contextlib.suppress(OSError):
            c.sock.close()

    def _complain(self, what: str, e: BaseException) -> None:
        ok, held = _log.allow(what)
        if ok:
            get_logger().error(what, error=f"{type(e).__name__}: {e}", suppressed=held, exc_info=e)
