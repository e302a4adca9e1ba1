"""`ControlServer`: lets `eventbus ctl` read and steer a running job from outside (issue 17).

    eventbus ctl RUN_DIR stop --> RUN_DIR/eventbus.sock (0600, same uid) --+
    eventbus ctl --tcp H:P ...--> 127.0.0.1:PORT (token required) --------+--> ConnectionLoop
                                                                                (own thread)
         bus.control.request_stop / request_abort / request_save  <-----------------+
         status: RunView (kept from events on the bus loop) + bus.stats()

Opt-in: nothing listens unless the user subscribes one (rank 0 only, its `ranks`). The
training thread runs none of it: requests are served on the server's own thread, the few
event types it reads are handled on the bus loop. Stop and save reach every rank through the
agreed stop (`eventbus.agreement`).
"""

from __future__ import annotations

import contextlib
import hmac
import os
import socket
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from eventbus.core import BusHandle
from eventbus.core.fork import call_after_fork
from eventbus.ctl.listen import (
    bind_tcp,
    bind_unix,
    check_length,
    parse_address,
    peer_credentials,
    write_token,
)
from eventbus.ctl.protocol import COMMANDS, SOCKET_NAME, TOKEN_NAME, parse_request, refusal
from eventbus.ctl.protocol import BadRequest as _BadRequest
from eventbus.ctl.serve import ConnectionLoop, Later
from eventbus.ctl.view import RunView
from eventbus.events import (
    CheckpointSaved,
    Event,
    Loss,
    RunEnded,
    RunStarted,
    SaveRequested,
    StepEnded,
)
from eventbus.log import get_logger
from eventbus.version import __version__

__all__ = ["SOURCE", "ControlServer"]

SOURCE = "eventbus ctl"  # the `source` of the StopRequested / SaveRequested it causes


class ControlServer:
    """Listen on `run_dir/eventbus.sock` (mode 0600) for `eventbus ctl` while the bus runs.

    `tcp="HOST:PORT"` (or `"PORT"`: loopback) also listens on TCP, where every request must
    carry the bearer token written (0600) to `token_file` (default `run_dir/eventbus.token`).
    `allow`: the commands this job accepts (others are refused). `request_timeout`: seconds a
    client may take to send its request and read the reply.
    """

    events: ClassVar[tuple[type[Event], ...]] = (
        RunStarted,
        RunEnded,
        StepEnded,
        Loss,
        CheckpointSaved,
    )
    # Every checkpoint, in order (`save --wait` answers with the first after its request; a
    # `latest` queue would keep only the newer of two saved within one drain). The view's
    # work per event is a few attribute sets on the bus loop; under overload the oldest go,
    # counted.
    policy: ClassVar[str] = "drop_oldest"
    maxsize: ClassVar[int] = 1024
    ranks: ClassVar[tuple[int, ...]] = (0,)
    placement: ClassVar[str] = "thread"  # it needs this process's bus.control
    name: ClassVar[str] = "ctl"

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        tcp: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        allow: Iterable[str] = COMMANDS,
        request_timeout: float = 5.0,
        max_connections: int = 8,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.socket_path = self.run_dir / SOCKET_NAME
        check_length(self.socket_path)
        self.allow = tuple(allow)
        wrong = [c for c in self.allow if c not in COMMANDS]
        if wrong:
            raise ValueError(f"allow: unknown commands {wrong}; choose from {', '.join(COMMANDS)}")
        if request_timeout <= 0 or max_connections < 1:
            raise ValueError("request_timeout must be > 0 and max_connections >= 1")
        self._tcp = parse_address(tcp) if tcp is not None else None
        self.token_path: Path | None = None
        if self._tcp is not None:
            self.token_path = Path(token_file) if token_file else self.run_dir / TOKEN_NAME
        self.request_timeout = request_timeout
        self.max_connections = max_connections
        self.view = RunView()
        self.address: tuple[str, int] | None = None  # the TCP address bound, once started
        self._token = b""
        self._bus: BusHandle | None = None
        self._loop: ConnectionLoop | None = None
        self._inode: tuple[int, int] | None = None  # the socket file we made, to remove only it
        self._waiting = threading.Lock()
        self._waiters: list[tuple[int, Later, dict[str, Any]]] = []  # save --wait: (ticket, ...)

    # -- the subscriber's hooks --------------------------------------------------------------

    def on_start(self, bus: BusHandle) -> None:
        """Bind (replacing a stale socket; a live one is `SocketInUse`) and start serving."""
        self._bus = bus
        self.run_dir.mkdir(parents=True, exist_ok=True)
        listeners: dict[socket.socket, bool] = {}
        try:
            unix = bind_unix(self.socket_path)
            listeners[unix] = False
            st = os.stat(self.socket_path)
            self._inode = (st.st_dev, st.st_ino)
            if self._tcp is not None and self.token_path is not None:
                host, port = self._tcp
                if host not in ("127.0.0.1", "::1", "localhost"):
                    get_logger().warning("eventbus ctl listens beyond loopback", host=host)
                tcp = bind_tcp(host, port)
                listeners[tcp] = True
                self.address = tcp.getsockname()[:2]
                self._token = write_token(self.token_path).encode()
        except BaseException:
            for sock in listeners:
                sock.close()
            self._remove_files()
            raise
        self._loop = ConnectionLoop(
            listeners,
            self._answer,
            self._check_peer,
            timeout=self.request_timeout,
            max_connections=self.max_connections,
        )
        call_after_fork(self._forked)
        self._loop.start()
        get_logger().info("eventbus ctl listening", socket=str(self.socket_path), tcp=self.address)

    async def on_events(self, batch: list[Event]) -> None:
        """Keep the newest step, loss and checkpoint (on the bus loop: a few attribute sets);
        answer the `save --wait` a checkpoint (or the run's end) settles."""
        self.view.update(batch)
        if self._waiters:
            self._settle()

    def on_close(self) -> None:
        """Stop serving (a waiting `save --wait` hears why); remove the socket and token files
        this server made."""
        self._settle(closing=True)
        if self._loop is not None:
            self._loop.close()
        self._remove_files()

    def _forked(self) -> None:
        if self._loop is not None:
            self._loop.forget()  # a DataLoader worker: the parent keeps serving
            self._loop = None
        self._inode = None  # never remove the parent's files
        self._waiters = []  # the parent's clients: never answered from here
        self.token_path = None

    def _remove_files(self) -> None:
        with contextlib.suppress(OSError):
            st = os.stat(self.socket_path)
            if (st.st_dev, st.st_ino) == self._inode:
                os.unlink(self.socket_path)
        if self._token and self.token_path is not None:
            with contextlib.suppress(OSError):
                if self.token_path.read_bytes().strip() == self._token:
                    os.unlink(self.token_path)

    # -- requests (on the server's thread) ---------------------------------------------------

    def _check_peer(self, sock: socket.socket) -> str | None:
        """A second check behind the socket's 0600 mode: the peer runs as our user (or root)."""
        cred = peer_credentials(sock)
        if cred is None or cred[1] in (os.getuid(), 0):
            return None
        return f"permission denied: uid {cred[1]} is not the job's user (uid {os.getuid()})"

    def _answer(self, line: bytes, tcp: bool) -> dict[str, Any] | Later:
        try:
            req = parse_request(line)
        except _BadRequest as e:
            return refusal("bad_request", str(e))
        if tcp and not (
            self._token and hmac.compare_digest((req.token or "").encode(), self._token)
        ):
            return refusal("denied", "a valid token is required over TCP (--token-file)")
        if req.command not in self.allow:
            return refusal(
                "refused", f"this job does not allow {req.command!r} ({', '.join(self.allow)})"
            )
        if req.command == "ping":
            return self._ping()
        if req.command == "status":
            return self._status()
        return self._request(req.command, req.reason, req.wait)

    def _ping(self) -> dict[str, Any]:
        bus = self._bus
        return {
            "ok": True,
            "command": "ping",
            "pid": os.getpid(),
            "rank": getattr(bus, "rank", 0),
            "world_size": getattr(bus, "world_size", 1),
            "version": __version__,
        }

    def _status(self) -> dict[str, Any]:
        out = self._ping() | self.view.snapshot() | {"command": "status"}
        ctl = self._bus.control if self._bus is not None else None
        if ctl is not None:
            out |= {
                "stop_requested": ctl.stop_requested,
                "abort_requested": ctl.abort_requested,
                "stop_reason": ctl.reason,
                "save_pending": ctl.save_pending or ctl.save_requested,
            }
        stats = getattr(self._bus, "stats", None)  # the live bus has it; BusHandle need not
        if callable(stats):
            st = stats()
            out["subscribers"] = {n: s.state for n, s in st.subscribers.items()}
            out["stats"] = st.as_dict()
        return out

    def _wait_saved(self, out: dict[str, Any], ticket: int | None, wait: float) -> Later:
        """`save --wait`: answered with the first CheckpointSaved after the request's
        SaveRequested (`ticket`, its seq), or `gone` if the run ends first."""
        at = f"the save asked at step {out['step']}"
        later = Later(wait, refusal("timeout", f"no checkpoint within {wait:g} s of {at}"))
        if ticket is None:  # cannot happen: request_save always leaves its event
            later.give(refusal("refused", "this save cannot be waited for"))
            return later
        with self._waiting:
            self._waiters.append((ticket, later, out))
        self._settle()  # already saved, or already over
        return later

    def _settle(self, closing: bool = False) -> None:
        """Answer the waiters whose checkpoint came, or whose run ended (or whose job closes)."""
        view = self.view
        with self._waiting:
            left = []
            for ticket, later, out in self._waiters:
                saved = view.checkpoint_after(ticket)
                if saved is not None:
                    later.give(out | {"saved": saved})
                elif view.ended is not None or closing:
                    why = f"the run ended ({view.ended})" if view.ended else "the job closed"
                    later.give(refusal("gone", f"{why} before the save was done"))
                if later.reply is None and not later.abandoned:
                    left.append((ticket, later, out))
            self._waiters = left

    def _request(
        self, command: str, reason: str | None, wait: float | None
    ) -> dict[str, Any] | Later:
        if self._bus is None:
            return refusal("refused", "the job is not running yet")
        ended = self.view.ended
        if ended is not None:
            return refusal("refused", f"the run has ended ({ended}); nothing to {command}")
        ctl, step = self._bus.control, self.view.step
        reason = reason or f"{command} requested through eventbus ctl"
        if command == "save":
            new = ctl.request_save(reason, source=SOURCE, step=step)
            out = {"ok": True, "command": command, "step": step, "already": not new}
            return out if wait is None else self._wait_saved(out, _ticket(ctl.save_event), wait)
        new = not (ctl.abort_requested if command == "abort" else ctl.stop_requested)
        if command == "abort":
            ctl.request_abort(reason, source=SOURCE, step=step)
        else:
            ctl.request_stop(reason, source=SOURCE, step=step)
        return {"ok": True, "command": command, "step": step, "already": not new}


def _ticket(ev: SaveRequested | None) -> int | None:
    """The seq of the SaveRequested a save request rides on: the first CheckpointSaved with a
    higher seq answers it (`eventbus ctl save --wait`). Another thread may be stamping it
    right now (between its request and its publish): a bounded wait of microseconds."""
    deadline = time.monotonic() + 1.0
    while ev is not None and ev.seq is None and time.monotonic() < deadline:
        time.sleep(0.0005)
    return None if ev is None else ev.seq
