"""`eventbus tail`: one line per step, following a live file."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eventbus.cli import main
from eventbus.codec import encode
from eventbus.events import Loss, RunEnded, StepEnded

ROOT = Path(__file__).resolve().parents[2]


def test_tail_no_follow_prints_the_last_steps(
    demo: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["tail", str(demo), "-n", "4", "--no-follow"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("step     58")
    assert "loss nan" in lines[0]
    assert "lr 500" in lines[0]
    assert "rss 158MB" in lines[0]
    assert lines[-1] == "-- run completed"


def test_tail_follows_a_live_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "events.jsonl"
    log.write_bytes(encode(Loss(step=1, value=1.0)))

    def grow() -> None:
        for s in range(2, 8):
            time.sleep(0.05)
            with open(log, "ab") as f:
                line = encode(Loss(step=s, value=float(s)))
                f.write(line[:10])  # a line arrives in pieces: tail waits for its end
                f.flush()
                time.sleep(0.02)
                f.write(line[10:] + encode(StepEnded(step=s, duration_s=0.1)))

    t = threading.Thread(target=grow)
    t.start()
    try:
        code = main(["tail", str(log), "--max-lines", "4", "--timeout", "10", "--interval", "0.02"])
    finally:
        t.join()
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["1", "2", "3", "4"]
    assert "time 100.0ms" in lines[1]


def test_tail_stops_at_run_end_or_after_the_idle_timeout(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = tmp_path / "events.jsonl"
    log.write_bytes(encode(Loss(step=1, value=1.0)))
    t0 = time.monotonic()
    assert main(["tail", str(log), "--timeout", "0.3", "--interval", "0.05"]) == 0
    assert time.monotonic() - t0 < 5
    assert capsys.readouterr().out.splitlines() == ["step      1  loss 1"]
    with open(log, "ab") as f:
        f.write(encode(RunEnded(status="completed")))
    assert main(["tail", str(log), "--timeout", "30"]) == 0  # returns at once: run ended
    assert capsys.readouterr().out.splitlines()[-1] == "-- run completed"


def test_tail_waits_for_a_log_that_does_not_exist_yet(tmp_path: Path) -> None:
    log = tmp_path / "run" / "events.jsonl"
    cmd = [sys.executable, "-m", "eventbus.cli", "tail", str(log), "--max-lines", "1"]
    cmd += ["--timeout", "60", "--interval", "0.02"]
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    ) as proc:
        try:
            assert proc.stderr is not None
            said = proc.stderr.readline()  # the file is written only once tail says it waits
            assert said.startswith(f"eventbus: waiting for {log} to appear"), said
            log.parent.mkdir()
            log.write_bytes(encode(Loss(step=1, value=1.0)) + encode(Loss(step=2, value=2.0)))
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 0, err
    assert out.splitlines() == ["step      1  loss 1"]


def test_tail_gives_up_waiting_after_the_timeout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "events.jsonl"
    assert main(["tail", str(log), "--timeout", "0.1", "--interval", "0.02"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"eventbus: waiting for {log} to appear (up to 0.1 s)",
        f"eventbus: error: {log}: no such file or directory after waiting 0.1 s",
    ]
