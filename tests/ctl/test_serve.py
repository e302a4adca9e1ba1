"""eventbus.ctl.serve: one bounded request per connection; nothing a client does stops it."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from eventbus.ctl.listen import bind_unix
from eventbus.ctl.protocol import MAX_REQUEST
from eventbus.ctl.serve import ConnectionLoop, Later

Answer = Callable[[bytes, bool], "dict[str, Any] | Later"]


class Served:
    """A ConnectionLoop on a fresh socket, answering with `answer`; closed after the test."""

    def __init__(self, path: Path, answer: Answer, **kw: Any) -> None:
        self.path = path
        self.lines: list[bytes] = []

        def record(line: bytes, tcp: bool) -> dict[str, Any] | Later:
            self.lines.append(line)
            return answer(line, tcp)

        self.loop = ConnectionLoop({bind_unix(path): False}, record, kw.pop("peer", _ok), **kw)
        self.loop.start()

    def connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(5)
        s.connect(str(self.path))
        return s

    def ask(self, data: bytes) -> dict[str, Any]:
        with self.connect() as s:
            s.sendall(data)
            return _reply(s)


def _ok(sock: socket.socket) -> str | None:
    return None


def _echo(line: bytes, tcp: bool) -> dict[str, Any]:
    return {"ok": True, "got": line.decode("latin-1")}


def _reply(s: socket.socket) -> dict[str, Any]:
    buf = b""
    while chunk := s.recv(65536):
        buf += chunk
    assert buf.endswith(b"\n") and buf.count(b"\n") == 1, buf
    out: dict[str, Any] = orjson.loads(buf)
    return out


def _closed_by_server(s: socket.socket, within: float) -> bool:
    """Whether the server closes `s` (EOF or reset) within `within` seconds."""
    s.settimeout(within)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Callable[..., Served]]:
    made: list[Served] = []

    def make(answer: Answer = _echo, **kw: Any) -> Served:
        made.append(Served(tmp_path / f"s{len(made)}.sock", answer, **kw))
        return made[-1]

    yield make
    for s in made:
        s.loop.close()
        assert not s.loop.alive


def test_one_line_in_one_line_out_then_closed(served: Callable[..., Served]) -> None:
    srv = served()
    assert srv.ask(b'{"command": "ping"}\nignored after the line') == {
        "ok": True,
        "got": '{"command": "ping"}',
    }
    assert srv.lines == [b'{"command": "ping"}']
    assert srv.loop.served == 1


def test_a_request_ended_by_shutdown_is_answered(served: Callable[..., Served]) -> None:
    srv = served()
    with srv.connect() as s:
        s.sendall(b"half a request")
        s.shutdown(socket.SHUT_WR)
        assert _reply(s)["got"] == "half a request"


def test_an_oversized_request_is_refused_without_reading_on(served: Callable[..., Served]) -> None:
    srv = served()
    with srv.connect() as s:
        s.sendall(b"x" * MAX_REQUEST)
        reply = _reply(s)
    assert reply["kind"] == "bad_request" and "longer than 4096" in reply["error"]
    assert srv.lines == []  # never handed to the answer function
    assert srv.ask(b"next\n")["got"] == "next"


def test_silent_and_half_open_clients_are_closed_at_their_deadline(
    served: Callable[..., Served],
) -> None:
    srv = served(timeout=0.3)
    silent, half = srv.connect(), srv.connect()
    half.sendall(b'{"command": "sta')
    t0 = time.monotonic()
    assert _closed_by_server(silent, 5) and _closed_by_server(half, 5)
    assert time.monotonic() - t0 < 4
    assert srv.loop.dropped == 2 and srv.lines == []
    silent.close()
    half.close()
    assert srv.ask(b"still here\n")["got"] == "still here"


def test_a_newcomer_evicts_the_oldest_when_full(served: Callable[..., Served]) -> None:
    srv = served(max_connections=2, timeout=30)
    hogs = [srv.connect() for _ in range(5)]  # would hold every slot for 30 s
    assert srv.ask(b"room for me\n")["got"] == "room for me"
    assert [_closed_by_server(h, 2) for h in hogs[:4]] == [True] * 4  # oldest first
    assert not _closed_by_server(hogs[4], 0.2)  # the newest hog still has its slot
    for h in hogs:
        h.close()


def test_an_answer_that_raises_is_a_refusal_and_the_thread_goes_on(
    served: Callable[..., Served],
) -> None:
    calls = []

    def flaky(line: bytes, tcp: bool) -> dict[str, Any]:
        calls.append(line)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return {"ok": True}

    srv = served(flaky)
    reply = srv.ask(b"a\n")
    assert reply["kind"] == "refused" and "RuntimeError: boom" in reply["error"]
    assert srv.ask(b"b\n") == {"ok": True}
    assert srv.loop.alive


def test_a_refused_peer_is_told_so_and_never_asks(served: Callable[..., Served]) -> None:
    srv = served(peer=lambda sock: "permission denied: not you")
    reply = srv.ask(b'{"command": "stop"}\n')
    assert reply == {"ok": False, "kind": "denied", "error": "permission denied: not you"}
    assert srv.lines == []


def test_close_stops_serving(served: Callable[..., Served]) -> None:
    srv = served()
    srv.loop.close()
    assert not srv.loop.alive
    with pytest.raises(ConnectionRefusedError):
        srv.connect()


# -- replies given later (save --wait) --------------------------------------------------------


class Waiting:
    """Answers every request `Later`, keeping each for the test to give."""

    def __init__(self, seconds: float = 60.0) -> None:
        self.seconds = seconds
        self.later: list[Later] = []

    def __call__(self, line: bytes, tcp: bool) -> Later:
        self.later.append(Later(self.seconds, {"ok": False, "kind": "timeout", "error": "late"}))
        return self.later[-1]

    def asked(self, n: int) -> list[Later]:
        deadline = time.monotonic() + 10
        while len(self.later) < n:
            assert time.monotonic() < deadline, "the request never reached the answer"
            time.sleep(0.002)
        return self.later


def test_a_later_reply_is_sent_when_given_and_others_are_served_meanwhile(
    served: Callable[..., Served],
) -> None:
    waiting = Waiting()
    srv = served(waiting)
    with srv.connect() as s:
        s.sendall(b"save\n")
        (later,) = waiting.asked(1)
        with srv.connect() as other:  # the thread still serves: this one is answered now
            other.sendall(b"ping\n")
            (_, meanwhile) = waiting.asked(2)
            meanwhile.give({"ok": True, "n": 2})
            assert _reply(other) == {"ok": True, "n": 2}
        later.give({"ok": True, "n": 1})
        later.give({"ok": True, "n": "ignored: the first one counts"})
        assert _reply(s) == {"ok": True, "n": 1}


def test_a_later_reply_not_given_in_time_is_its_timeout(served: Callable[..., Served]) -> None:
    srv = served(Waiting(seconds=0.2))
    assert srv.ask(b"save\n") == {"ok": False, "kind": "timeout", "error": "late"}


def test_a_client_that_hangs_up_abandons_its_later_reply(served: Callable[..., Served]) -> None:
    waiting = Waiting()
    srv = served(waiting)
    with srv.connect() as s:
        s.sendall(b"save\n")
        (later,) = waiting.asked(1)
    deadline = time.monotonic() + 10
    while not later.abandoned:
        assert time.monotonic() < deadline, "the hang-up was not noticed"
        time.sleep(0.002)


def test_close_sends_the_later_replies_given_by_then(served: Callable[..., Served]) -> None:
    waiting = Waiting()
    srv = served(waiting)
    with srv.connect() as s:
        s.sendall(b"save\n")
        (later,) = waiting.asked(1)
        later.wake = lambda: None  # the thread does not hear of it: close() sends it
        later.give({"ok": False, "kind": "gone", "error": "closing"})  # as on_close does
        srv.loop.close()
        assert _reply(s) == {"ok": False, "kind": "gone", "error": "closing"}
