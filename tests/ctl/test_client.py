"""eventbus.ctl.client: each way a command can fail has its own error and exit code."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from eventbus.ctl.client import (
    Denied,
    NoAnswer,
    NoJob,
    Refused,
    StaleSocket,
    TokenError,
    read_token,
    request,
)
from eventbus.ctl.listen import bind_tcp


@pytest.fixture
def answering(tmp_path: Path) -> Iterator[list[bytes]]:
    """A fake job at tmp_path/eventbus.sock that answers one connection with what the test
    appends to the list (nothing appended: it accepts, reads, and closes without a word)."""
    replies: list[bytes] = []
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "eventbus.sock"))
    listener.listen()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)
            for r in replies:
                conn.sendall(r)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield replies
    t.join(5)
    listener.close()


def test_no_directory_and_no_socket_mean_no_job(tmp_path: Path) -> None:
    with pytest.raises(NoJob, match="no such directory") as e:
        request(tmp_path / "nope", "status")
    assert e.value.exit_code == 3
    with pytest.raises(NoJob, match=r"no job is listening in .*eventbus.sock does not exist"):
        request(tmp_path, "status")
    (tmp_path / "eventbus.sock").write_text("")
    with pytest.raises(NoJob, match="is not a socket"):
        request(tmp_path, "status")


def test_a_socket_nobody_listens_on_is_stale(tmp_path: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(tmp_path / "eventbus.sock"))
    s.close()
    with pytest.raises(StaleSocket, match="left by a job that is gone") as e:
        request(tmp_path, "status")
    assert e.value.exit_code == 4


def test_a_job_that_never_answers_times_out(tmp_path: Path) -> None:
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "eventbus.sock"))
    listener.listen()  # never accepts: the kernel queues the connection, nobody answers
    try:
        with pytest.raises(NoAnswer, match=r"no answer within 0.2 s") as e:
            request(tmp_path, "status", timeout=0.2)
        assert e.value.exit_code == 7
    finally:
        listener.close()


def test_a_job_that_hangs_up_without_a_word(tmp_path: Path, answering: list[bytes]) -> None:
    with pytest.raises(NoAnswer, match="closed the connection without answering"):
        request(tmp_path, "status")


def test_an_answer_that_is_not_json_is_refused(tmp_path: Path, answering: list[bytes]) -> None:
    answering.append(b"<html>\n")
    with pytest.raises(Refused, match="not JSON") as e:
        request(tmp_path, "status")
    assert e.value.exit_code == 6


def test_a_denial_is_denied_and_other_refusals_refused(
    tmp_path: Path, answering: list[bytes]
) -> None:
    answering.append(b'{"ok": false, "kind": "denied", "error": "not you"}\n')
    with pytest.raises(Denied, match="not you") as e:
        request(tmp_path, "stop")
    assert e.value.exit_code == 5


def test_nothing_on_the_tcp_port_means_no_job() -> None:
    s = bind_tcp("127.0.0.1", 0)
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(NoJob, match=f"nothing listens on 127.0.0.1:{port}"):
        request(None, "ping", tcp=("127.0.0.1", port), token="t")


def test_token_files(tmp_path: Path) -> None:
    with pytest.raises(TokenError, match="cannot read the token file") as e:
        read_token(tmp_path / "missing")
    assert e.value.exit_code == 2
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(TokenError, match="is empty"):
        read_token(tmp_path / "empty")
    (tmp_path / "t").write_text("abc\n")
    assert read_token(tmp_path / "t") == "abc"
