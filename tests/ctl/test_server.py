"""eventbus.ctl.server: `ControlServer` steering real loops, and refusing whom it must (issue 17).

The loops run in subprocesses (tests/ctl/job.py) and are controlled from this process; the
refusals run against a bus in this process. Another user is simulated by a forked child that
drops to `nobody`'s ids (the tests run as root).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import socket
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from eventbus import EventBus
from eventbus.ctl import ControlServer, Denied, Gone, Refused, read_token, request
from eventbus.ctl.protocol import MAX_REQUEST
from eventbus.events import (
    CheckpointSaved,
    Event,
    Loss,
    RunEnded,
    RunStarted,
    SaveRequested,
    StepEnded,
    StopRequested,
)
from tests.ctl.helpers import as_nobody, reachable_dir, serving, wait
from tests.ctl.job import job

# -- helpers --------------------------------------------------------------------------------


def _complete(evs: list[Event], steps: int, status: str) -> None:
    """Every event of the run is there: contiguous seq, every step's loss, how it ended."""
    assert [e.seq for e in evs] == list(range(len(evs)))
    assert [e.step for e in evs if isinstance(e, Loss)] == list(range(1, steps + 1))
    assert isinstance(evs[0], RunStarted)
    assert isinstance(evs[-1], RunEnded) and evs[-1].status == status


@pytest.fixture(name="open_dir")
def _open_dir() -> Iterator[Path]:
    with reachable_dir() as d:
        yield d


def _in_thread(fn: Callable[[], dict[str, Any]]) -> tuple[threading.Thread, list[Any]]:
    """Run `fn` on a thread: (the thread, [its result or the exception it raised])."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _stop(run_dir: Path) -> int:
    request(run_dir, "stop", "not yours")
    return 0


# -- a real loop in a subprocess ------------------------------------------------------------


def test_status_and_save_steer_a_real_loop(tmp_path: Path) -> None:
    with job(tmp_path / "run", steps=30, holds="10") as j:
        j.wait_for("the listener", lambda: j.ask("ping"))
        status = j.wait_step(10)
        assert status["total_steps"] == 30 and status["run"] == "running"
        assert isinstance(status["loss"], float) and status["steps_per_s"] > 0
        assert status["subscribers"]["ctl"] == "running"
        assert status["stats"]["subscribers"]["ctl"]["failed"] == 0
        assert request(j.run_dir, "save", "before eval") == {
            "ok": True,
            "command": "save",
            "step": 10,
            "already": False,
        }
        assert request(j.run_dir, "save")["already"] is True  # coalesced: one save
        assert j.ask("status")["save_pending"] is True  # type: ignore[index]
        j.go(10)
        j.finish()
        evs = j.events()
    _complete(evs, 30, "completed")
    (saved,) = [e for e in evs if isinstance(e, CheckpointSaved)]
    assert saved.step == 10 and Path(saved.path).is_file()
    (asked,) = [e for e in evs if isinstance(e, SaveRequested)]
    assert (asked.step, asked.reason, asked.source) == (10, "before eval", "eventbus ctl")
    assert not (j.run_dir / "eventbus.sock").exists()  # removed at close


def test_stop_ends_the_loop_at_its_next_check(tmp_path: Path) -> None:
    with job(tmp_path / "run", steps=1000, holds="10") as j:
        j.wait_step(10)
        reply = request(j.run_dir, "stop", "enough")
        assert (reply["ok"], reply["already"]) == (True, False)
        j.go(10)  # its next check is the one right after the hold
        j.finish()
        evs = j.events()
    _complete(evs, 10, "stopped")
    (stop,) = [e for e in evs if isinstance(e, StopRequested)]
    assert (stop.reason, stop.source, stop.abort) == ("enough", "eventbus ctl", False)


def _raw(path: Path, data: bytes, *, shut: bool = False) -> bytes:
    """Send `data` on a fresh connection; what comes back before the server closes it."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(path))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(data)
            if shut:
                s.shutdown(socket.SHUT_WR)
        buf = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                buf += chunk
        return buf


def test_garbage_oversized_and_half_open_requests_disturb_nothing(tmp_path: Path) -> None:
    with job(tmp_path / "run", steps=40, holds="10") as j:
        j.wait_step(10)
        sock = j.run_dir / "eventbus.sock"
        half = []
        for _ in range(12):  # more than its connection slots, held open, never finished
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(sock))
            s.sendall(b'{"command": "st')
            half.append(s)
        half.append(socket.socket(socket.AF_UNIX))
        half[-1].connect(str(sock))  # and one that says nothing at all
        for junk in (
            b"\x00\xff\xfe garbage\n",
            b"[1, 2, 3]\n",
            b'{"command": "rm -rf /"}\n',
            b'{"command": "stop", "reason": {"nested": [1, 2]}}\n',
            b"[" * 3000 + b"\n",
        ):
            reply = orjson.loads(_raw(sock, junk))
            assert reply["ok"] is False and reply["kind"] == "bad_request", (junk[:20], reply)
        flood = _raw(sock, b"x" * (1 << 20))  # a megabyte, no newline: refused or cut off
        assert flood == b"" or orjson.loads(flood)["kind"] == "bad_request"
        assert _raw(sock, b"", shut=True) == b""  # connect and hang up: nothing to say
        assert j.wait_step(10)["step"] == 10  # still answering, still held
        for s in half:  # evicted, or closed at the request timeout (1 s here): no answer
            s.settimeout(10)
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(MAX_REQUEST) == b""
            s.close()
        j.go(10)
        j.finish()
        evs = j.events()
    _complete(evs, 40, "completed")
    assert not [e for e in evs if isinstance(e, StopRequested | SaveRequested)]


@pytest.mark.slow
@pytest.mark.timeout(120)  # ~15 s on 2 busy cores
def test_two_ranks_save_and_stop_at_the_same_step(tmp_path: Path) -> None:
    with job(tmp_path / "run", steps=200, holds="10,20", ranks=2) as j:
        j.wait_for("the listener", lambda: j.ask("ping"), t=90)
        assert j.ask("ping")["world_size"] == 2  # type: ignore[index]
        j.wait_step(10)
        t, waited = _in_thread(lambda: request(j.run_dir, "save", wait=60))  # save --wait
        j.wait_for("the request", lambda: (j.ask("status") or {}).get("save_pending") or None)
        j.go(10)
        t.join(60)
        j.wait_step(20)
        assert request(j.run_dir, "stop", "two ranks")["already"] is False
        j.go(20)
        j.finish(90)
        logs = {rank: j.events(rank) for rank in (0, 1)}
    saved, stopped = {}, {}
    for rank, evs in logs.items():
        assert all(e.rank == rank for e in evs)
        end = evs[-1]
        assert isinstance(end, RunEnded) and end.status == "stopped"
        assert end.step is not None
        _complete(evs, end.step, "stopped")
        saves = [e.step for e in evs if isinstance(e, CheckpointSaved)]
        assert len(saves) == 1, saves
        saved[rank], stopped[rank] = saves[0], end.step
        (asked,) = [e for e in evs if isinstance(e, SaveRequested)]
        assert asked.source == ("eventbus ctl" if rank == 0 else "rank 0")
    # Agreed with overlap (the default): seen one check after the one that carried it.
    assert saved == {0: 11, 1: 11}
    assert stopped == {0: 21, 1: 21}
    (reply,) = waited  # answered by rank 0's checkpoint, at the agreed step
    assert (reply["already"], reply["saved"]["step"]) == (False, 11)


# -- who may talk to it -----------------------------------------------------------------------


def test_another_user_is_refused_by_the_socket_mode(open_dir: Path) -> None:
    with serving(open_dir) as (bus, _):
        sock = open_dir / "eventbus.sock"
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        code, msg = as_nobody(lambda: _stop(open_dir))
        assert code == Denied.exit_code == 5, msg
        assert "permission denied" in msg and "belongs to uid 0" in msg
        assert not bus.control.stop_requested


def test_the_peers_uid_is_checked_even_when_the_mode_would_let_it_in(open_dir: Path) -> None:
    with serving(open_dir) as (bus, _):
        os.chmod(open_dir / "eventbus.sock", 0o666)  # a mistake the second check catches
        code, msg = as_nobody(lambda: _stop(open_dir))
        assert code == 5, msg
        assert f"uid {pwd.getpwnam('nobody').pw_uid} is not the job's user" in msg
        assert not bus.control.stop_requested
        assert request(open_dir, "ping")["ok"]  # the job's own user still gets in


def test_tcp_is_loopback_and_needs_the_token(tmp_path: Path) -> None:
    with serving(tmp_path, tcp="0") as (bus, srv):
        assert srv.address is not None and srv.address[0] == "127.0.0.1"
        token_file = tmp_path / "eventbus.token"
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        token = read_token(token_file)
        for wrong in (None, "", "x" * 43, token[:-1]):
            with pytest.raises(Denied, match="a valid token is required"):
                request(None, "stop", tcp=srv.address, token=wrong)
        assert not bus.control.stop_requested
        assert request(None, "status", tcp=srv.address, token=token)["run"] == "running"
        assert request(None, "stop", "over tcp", tcp=srv.address, token=token)["ok"]
        assert bus.control.stop_requested and bus.control.source == "eventbus ctl"
    assert not token_file.exists() and not (tmp_path / "eventbus.sock").exists()


# -- its life ---------------------------------------------------------------------------------


def test_a_live_socket_of_another_job_is_a_clear_error(tmp_path: Path) -> None:
    with serving(tmp_path):
        other = EventBus(drain_interval=0.005)
        other.subscribe(ControlServer(tmp_path))
        with other:
            st = wait("the failed start", lambda: other.stats()["ctl"].error)
        assert other.stats()["ctl"].state in ("disabled", "closed")
        assert f"another running job (pid {os.getpid()}) already listens here" in st
        assert request(tmp_path, "ping")["ok"]  # the first job's listener is untouched


def test_a_stale_socket_is_replaced(tmp_path: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(tmp_path / "eventbus.sock"))
    s.close()  # a killed run leaves its socket behind
    with serving(tmp_path):
        assert request(tmp_path, "ping")["pid"] == os.getpid()


def test_commands_it_does_not_allow_and_a_finished_run_are_refused(tmp_path: Path) -> None:
    with serving(tmp_path, allow=("status", "ping")) as (bus, _):
        with pytest.raises(Refused, match="does not allow 'stop'"):
            request(tmp_path, "stop")
        assert not bus.control.stop_requested
    with serving(tmp_path) as (bus, _):
        bus.publish(RunStarted(total_steps=3))
        bus.publish(RunEnded(status="completed", step=3))
        wait("the end", lambda: request(tmp_path, "status")["run"] == "completed")
        with pytest.raises(Refused, match=r"the run has ended \(completed\); nothing to save"):
            request(tmp_path, "save")
        assert not bus.control.save_requested


def test_abort_reaches_bus_control(tmp_path: Path) -> None:
    with serving(tmp_path) as (bus, _):
        bus.publish(StepEnded(step=4))
        wait("step 4", lambda: request(tmp_path, "status")["step"] == 4)
        assert request(tmp_path, "abort", "bad data")["step"] == 4
        assert bus.should_abort and (bus.control.reason, bus.control.source) == (
            "bad data",
            "eventbus ctl",
        )
        assert request(tmp_path, "abort")["already"] is True


def test_a_forked_child_leaves_the_parents_listener_alone(tmp_path: Path) -> None:
    with serving(tmp_path) as (_, srv):
        pid = os.fork()
        if pid == 0:
            try:
                srv.on_close()  # whatever the child does with it touches nothing of ours
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert (tmp_path / "eventbus.sock").exists()
        assert request(tmp_path, "ping")["pid"] == os.getpid()


# -- save --wait ------------------------------------------------------------------------------


def test_save_wait_is_answered_by_the_first_checkpoint_after_the_request(tmp_path: Path) -> None:
    with serving(tmp_path) as (bus, srv):
        bus.publish(CheckpointSaved(step=1, path="before.pt"))  # before the request: not it
        bus.publish(StepEnded(step=2))
        wait("step 2", lambda: srv.view.step == 2)
        t, out = _in_thread(lambda: request(tmp_path, "save", "now", wait=30))
        wait("the request", lambda: bus.control.save_requested)
        t2, out2 = _in_thread(lambda: request(tmp_path, "save", wait=30))  # coalesced into it
        wait("the second request", lambda: len(srv._waiters) == 2)
        assert not out and not out2  # both still waiting
        bus.publish(CheckpointSaved(step=2, path="asked.pt"))
        bus.control.save_done()
        bus.publish(CheckpointSaved(step=3, path="after.pt"))
        t.join(30)
        t2.join(30)
    (first,) = out
    (second,) = out2
    assert (first["step"], first["already"], first["saved"]["path"]) == (2, False, "asked.pt")
    assert (second["already"], second["saved"]["path"]) == (True, "asked.pt")


def test_save_wait_hears_when_the_job_closes_first(tmp_path: Path) -> None:
    with serving(tmp_path) as (bus, _):
        t, out = _in_thread(lambda: request(tmp_path, "save", wait=30))
        wait("the request", lambda: bus.control.save_requested)
    t.join(30)
    (err,) = out
    assert isinstance(err, Gone) and err.exit_code == 8
    assert "before the save was done" in str(err)
