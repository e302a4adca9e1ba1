"""`eventbus ctl`: one line (or JSON) per answer, one-line errors with exit codes scripts use."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from eventbus.cli import main
from eventbus.ctl import Exit, request
from eventbus.events import CheckpointSaved, Loss, RunStarted, SaveRequested, StepEnded
from tests.cli.conftest import one_line_error
from tests.ctl.helpers import as_nobody, reachable_dir, serving, wait
from tests.ctl.job import Job, job

ROOT = Path(__file__).resolve().parents[2]


def _out(capsys: pytest.CaptureFixture[str]) -> str:
    out = capsys.readouterr().out
    assert out.count("\n") == 1, out
    return out.strip()


def _at_step(run_dir: Path, capsys: pytest.CaptureFixture[str], step: int) -> None:
    def there() -> bool:
        main(["ctl", str(run_dir), "status", "--json"])
        return bool(orjson.loads(capsys.readouterr().out)["step"] == step)

    wait(f"step {step}", there)


def test_ping_status_save_and_stop_answer_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with serving(tmp_path) as (bus, _):
        assert main(["ctl", str(tmp_path), "ping"]) == 0
        assert _out(capsys).startswith(f"pong from pid {os.getpid()} (rank 0 of 1, eventbus ")
        bus.publish(RunStarted(total_steps=10))
        for step in range(1, 6):
            bus.publish(Loss(step=step, value=0.25))
            bus.publish(StepEnded(step=step))
        _at_step(tmp_path, capsys, 5)
        assert main(["ctl", str(tmp_path), "status"]) == 0
        line = _out(capsys)
        assert line.startswith("step 5/10  loss 0.25  ") and "  running  " in line
        assert "subscribers: ctl running" in line
        assert main(["ctl", str(tmp_path), "save", "for the record"]) == 0
        assert _out(capsys) == "save requested at step 5: the loop saves at its next check"
        assert main(["ctl", str(tmp_path), "save"]) == 0
        assert _out(capsys) == "a save is already pending at step 5"
        assert main(["ctl", str(tmp_path), "status"]) == 0
        assert "  save pending  " in _out(capsys)
        assert main(["ctl", str(tmp_path), "stop", "enough now"]) == 0
        assert _out(capsys) == "stop requested at step 5: the loop stops at its next check"
        assert bus.should_stop and bus.control.save_requested
        assert (bus.control.reason, bus.control.source) == ("enough now", "eventbus ctl")
        assert main(["ctl", str(tmp_path), "status"]) == 0
        assert "  stop requested (enough now)  " in _out(capsys)


def test_json_gives_the_whole_reply(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with serving(tmp_path) as (bus, _):
        assert main(["ctl", str(tmp_path), "status", "--json"]) == 0
        reply = orjson.loads(_out(capsys))
        assert reply["ok"] is True and reply["command"] == "status"
        assert reply["stats"]["subscribers"]["ctl"]["state"] == "running"
        assert set(reply["subscribers"]) == set(bus.stats().subscribers)


def test_no_job_and_a_stale_socket_have_their_own_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ctl", str(tmp_path), "status"]) == Exit.NO_JOB == 3
    one_line_error(capsys, "no job is listening in", "eventbus.sock does not exist")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(tmp_path / "eventbus.sock"))
    s.close()
    assert main(["ctl", str(tmp_path), "stop"]) == Exit.STALE == 4
    one_line_error(capsys, "left by a job that is gone")
    assert main(["ctl", str(tmp_path), "stop", "--json"]) == 4
    captured = capsys.readouterr()
    assert orjson.loads(captured.out)["exit_code"] == 4
    assert captured.err.startswith("eventbus: error: ")


def test_a_command_the_job_does_not_allow_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with serving(tmp_path, allow=("status", "ping")) as (bus, _):
        assert main(["ctl", str(tmp_path), "abort"]) == Exit.REFUSED == 6
        one_line_error(capsys, "this job does not allow 'abort'")
        assert not bus.should_stop


def test_another_user_is_denied(capsys: pytest.CaptureFixture[str]) -> None:
    with reachable_dir() as d, serving(d) as (bus, _):
        code, _ = as_nobody(lambda: main(["ctl", str(d), "stop"]))
        assert code == Exit.DENIED == 5
        assert not bus.should_stop


def test_tcp_with_a_wrong_token_is_denied_and_with_the_right_one_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with serving(tmp_path, tcp="0") as (bus, srv):
        assert srv.address is not None
        where = f"127.0.0.1:{srv.address[1]}"
        wrong = tmp_path / "wrong.token"
        wrong.write_text("guess\n")
        assert main(["ctl", str(tmp_path), "stop", "--tcp", where, "--token-file", str(wrong)]) == 5
        one_line_error(capsys, "a valid token is required over TCP")
        assert not bus.should_stop
        assert main(["ctl", str(tmp_path), "ping", "--tcp", where]) == 0  # RUN_DIR's token
        assert _out(capsys).startswith("pong from pid")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["status", "why"], ("status takes no reason",)),
        (["launch"], ("invalid choice: 'launch'",)),
        (["status", "--timeout", "0"], ("--timeout must be positive",)),
        (["stop", "--wait"], ("--wait goes with save",)),
        (["save", "--wait", "--timeout", "-1"], ("--timeout must be positive",)),
        (["save", "--wait", "--timeout", "1e6"], ("--timeout with --wait: at most 86400 s",)),
        (["status", "--token-file", "t"], ("--token-file goes with --tcp",)),
        (["status", "--tcp", "localhost:http"], ("--tcp:", "numeric port")),
        (["status", "--tcp", "127.0.0.1:1"], ("cannot read the token file",)),
    ],
)
def test_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], words: tuple[str, ...]
) -> None:
    assert main(["ctl", str(tmp_path), *args]) == Exit.USAGE == 2
    one_line_error(capsys, *words)


def test_the_installed_command_runs_it() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "eventbus.cli", "ctl", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0
    assert "6 refused by the job" in proc.stdout


# -- save --wait, against a real loop in a subprocess ----------------------------------------


def _ctl(run_dir: Path, *args: str) -> subprocess.Popen[str]:
    """`eventbus ctl RUN_DIR ARGS...` in a process of its own, as a user runs it."""
    return subprocess.Popen(
        [sys.executable, "-m", "eventbus.cli", "ctl", str(run_dir), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _done(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out.strip(), err.strip()


def _save_waits_for_its_checkpoint(j: Job, step: int, *more: str) -> str:
    """`save --wait` asked while the loop stands at `step`: what it prints once the loop went
    on and saved there."""
    client = _ctl(j.run_dir, "save", f"at {step}", "--wait", "--timeout", "60", *more)
    j.wait_for("the request", lambda: (j.ask("status") or {}).get("save_pending") or None)
    assert client.poll() is None  # nothing saved yet: still waiting
    j.go(step)
    code, out, err = _done(client)
    assert code == 0, err
    return out


@pytest.mark.slow
def test_save_twice_in_one_run_each_waits_for_its_own_checkpoint(tmp_path: Path) -> None:
    with job(tmp_path / "run", steps=30, holds="10,20") as j:
        j.wait_step(10)
        first: dict[str, Any] = orjson.loads(_save_waits_for_its_checkpoint(j, 10, "--json"))
        j.wait_step(20)  # the request cleared: a second one is a new save
        second = _save_waits_for_its_checkpoint(j, 20)
        j.finish()
        evs = j.events()
    saved = [e for e in evs if isinstance(e, CheckpointSaved)]
    assert [e.step for e in saved] == [10, 20]
    assert (first["step"], first["already"]) == (10, False)
    assert first["saved"] == {"step": 10, "path": saved[0].path, "seq": saved[0].seq}
    assert second == f"saved at step 20: {saved[1].path} (asked at step 20)"
    assert all(Path(e.path).is_file() for e in saved)
    asked = [e for e in evs if isinstance(e, SaveRequested)]
    assert [(e.step, e.reason) for e in asked] == [(10, "at 10"), (20, "at 20")]


@pytest.mark.slow
def test_save_wait_says_when_no_save_came_in_time_and_when_the_run_ended_first(
    tmp_path: Path,
) -> None:
    with job(tmp_path / "run", steps=30, holds="10,20") as j:
        j.wait_step(10)  # held: the loop cannot save
        code, out, err = _done(_ctl(j.run_dir, "save", "--wait", "--timeout", "1"))
        assert code == Exit.NO_ANSWER == 7, (out, err)
        assert "no checkpoint within 1 s of the save asked at step 10" in err
        j.go(10)  # the request stays: the loop saves at step 10
        j.wait_step(20)
        client = _ctl(j.run_dir, "save", "--wait", "--timeout", "60")
        j.wait_for("the request", lambda: (j.ask("status") or {}).get("save_pending") or None)
        assert request(j.run_dir, "stop", "before the save")["ok"]
        j.go(20)  # should_stop is read first: the loop stops without saving
        code, out, err = _done(client)
        assert code == Exit.GONE == 8, (out, err)
        assert "the run ended (stopped) before the save was done" in err
        j.finish()
        evs = j.events()
    assert [e.step for e in evs if isinstance(e, CheckpointSaved)] == [10]


@pytest.mark.slow
def test_save_wait_says_when_the_job_died_first(tmp_path: Path) -> None:
    with job(tmp_path / "run", steps=30, holds="10") as j:
        j.wait_step(10)
        client = _ctl(j.run_dir, "save", "--wait", "--timeout", "60")
        j.wait_for("the request", lambda: (j.ask("status") or {}).get("save_pending") or None)
        os.killpg(j.proc.pid, signal.SIGKILL)
        code, out, err = _done(client)
    assert code == Exit.GONE == 8, (out, err)
    assert "the job went away before the save was done" in err
