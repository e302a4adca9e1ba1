"""eventbus.ctl.listen: a 0600 socket with no window, stale ones replaced, live ones kept."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from eventbus.ctl.listen import (
    MAX_PATH,
    SocketInUse,
    bind_tcp,
    bind_unix,
    parse_address,
    peer_credentials,
    probe,
    write_token,
)


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """umask 0: anything we create is as open as its mode says (the worst case for us)."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _stale(path: Path) -> None:
    """A socket file nothing listens on, as a killed run leaves it."""
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()


@pytest.mark.usefixtures("loose_umask")
def test_the_socket_is_0600_even_under_umask_0_and_leaves_nothing_behind(tmp_path: Path) -> None:
    path = tmp_path / "eventbus.sock"
    sock = bind_unix(path)
    try:
        mode = os.stat(path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        assert sorted(p.name for p in tmp_path.iterdir()) == ["eventbus.sock"]  # staging gone
        c = socket.socket(socket.AF_UNIX)
        c.connect(str(path))
        cred = peer_credentials(c)
        assert cred is not None and cred[:2] == (os.getpid(), os.getuid())
        c.close()
    finally:
        sock.close()


def test_a_stale_socket_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "eventbus.sock"
    _stale(path)
    old = os.stat(path).st_ino
    assert probe(path) == ("stale", None)
    sock = bind_unix(path)
    try:
        assert os.stat(path).st_ino != old
        assert probe(path) == ("live", os.getpid())
    finally:
        sock.close()


def test_a_live_socket_is_a_clear_error_and_stays(tmp_path: Path) -> None:
    path = tmp_path / "eventbus.sock"
    first = bind_unix(path)
    try:
        with pytest.raises(SocketInUse, match=rf"another running job \(pid {os.getpid()}\)"):
            bind_unix(path)
        assert probe(path)[0] == "live"
    finally:
        first.close()


def test_a_file_that_is_not_a_socket_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "eventbus.sock"
    path.write_text("mine")
    with pytest.raises(SocketInUse, match="not a socket"):
        bind_unix(path)
    assert path.read_text() == "mine"
    assert probe(tmp_path / "absent") == ("absent", None)


def test_a_path_too_long_for_a_socket_is_refused_before_binding(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * (MAX_PATH - len(str(tmp_path))))
    deep.mkdir()
    with pytest.raises(ValueError, match="use a shorter run directory"):
        bind_unix(deep / "eventbus.sock")
    assert list(deep.iterdir()) == []


def test_addresses_default_to_loopback() -> None:
    assert parse_address("7000") == ("127.0.0.1", 7000)
    assert parse_address(":7000") == ("127.0.0.1", 7000)
    assert parse_address("0.0.0.0:7000") == ("0.0.0.0", 7000)
    assert parse_address("[::1]:7000") == ("::1", 7000)
    with pytest.raises(ValueError, match="numeric port"):
        parse_address("localhost:http")
    with pytest.raises(ValueError, match=r"not in 0\.\.65535"):
        parse_address("70000")


def test_tcp_binds_where_asked() -> None:
    s = bind_tcp("127.0.0.1", 0)
    try:
        host, port = s.getsockname()[:2]
        assert host == "127.0.0.1" and port > 0
    finally:
        s.close()


@pytest.mark.usefixtures("loose_umask")
def test_the_token_is_fresh_0600_and_replaces_an_old_one(tmp_path: Path) -> None:
    path = tmp_path / "eventbus.token"
    path.write_text("old\n")
    os.chmod(path, 0o644)
    a = write_token(path)
    assert path.read_text() == a + "\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(a) >= 40 and write_token(path) != a
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eventbus.token"]
