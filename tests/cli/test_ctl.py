"""`eventbus ctl`: one line (or JSON) per answer, one-line errors with exit codes scripts use."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from eventbus.cli import main
from eventbus.ctl import Exit
from eventbus.events import Loss, RunStarted, StepEnded
from tests.cli.conftest import one_line_error
from tests.ctl.helpers import as_nobody, reachable_dir, serving, wait

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
