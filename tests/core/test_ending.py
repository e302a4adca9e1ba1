"""A run that began (RunStarted) and did not end gets its RunEnded at close, with a status."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eventbus import AbortRequested, Event, EventBus
from eventbus.events import Loss, RunEnded, RunStarted
from eventbus.logformat import read_log
from eventbus.sinks import JsonlWriter


class Recorder:
    def __init__(self) -> None:
        self.got: list[Event] = []

    def on_events(self, batch: list[Event]) -> None:
        self.got.extend(batch)


def _run(body: BaseException | None = None, *, started: bool = True) -> list[Event]:
    rec = Recorder()
    bus = EventBus()
    bus.subscribe(rec)
    try:
        with bus:
            if started:
                bus.publish(RunStarted(config={"lr": 0.1}))
            for step in range(1, 4):
                bus.publish(Loss(step=step, value=1.0))
            if body is not None:
                raise body
    except BaseException as e:
        if e is not body:
            raise
    return rec.got


def _ended(got: list[Event]) -> list[RunEnded]:
    return [e for e in got if isinstance(e, RunEnded)]


def test_a_finished_run_ends_completed_after_everything_else() -> None:
    got = _run()
    (ended,) = _ended(got)
    assert got[-1] is ended  # after every event published before the close
    assert (ended.status, ended.reason, ended.step) == ("completed", None, 3)
    assert ended.cost is not None and ended.cost["steps"] == 3


@pytest.mark.parametrize(
    ("exc", "status", "reason"),
    [
        (ValueError("boom"), "failed", "ValueError: boom"),
        (RuntimeError(), "failed", "RuntimeError"),
        (KeyboardInterrupt(), "interrupted", "KeyboardInterrupt"),
        (AbortRequested("loss diverged"), "aborted", "loss diverged"),
        (SystemExit(3), "failed", "SystemExit: 3"),
        (SystemExit(0), "completed", None),
    ],
)
def test_the_exception_that_left_with_bus_is_the_status(
    exc: BaseException, status: str, reason: str | None
) -> None:
    (ended,) = _ended(_run(exc))
    assert (ended.status, ended.reason) == (status, reason)


def test_a_stop_says_who_asked() -> None:
    rec = Recorder()
    bus = EventBus()
    bus.subscribe(rec)
    with bus:
        bus.publish(RunStarted())
        bus.control.request_stop("plateau", source="EarlyStopping")
    (ended,) = _ended(rec.got)
    assert (ended.status, ended.reason) == ("stopped", "plateau by EarlyStopping")
    bus = EventBus()
    bus.subscribe(rec := Recorder())
    with bus:
        bus.publish(RunStarted())
        bus.control.request_abort("NaN loss")
    (ended,) = _ended(rec.got)
    assert (ended.status, ended.reason) == ("aborted", "NaN loss")


def test_the_loops_own_run_ended_is_the_only_one() -> None:
    rec = Recorder()
    bus = EventBus()
    bus.subscribe(rec)
    with bus:
        bus.publish(RunStarted())
        bus.publish(RunEnded(step=7, status="stopped", reason="mine"))
        bus.publish(Loss(step=8, value=1.0))  # after it: still the user's run, still one end
    assert [(e.status, e.reason) for e in _ended(rec.got)] == [("stopped", "mine")]


def test_no_run_started_no_run_ended() -> None:
    assert _ended(_run(started=False)) == []


def test_one_run_ended_reaches_a_sidecar_sink(tmp_path: Path) -> None:
    """The JsonlWriter in the sidecar writes the training process's RunEnded, once; the
    sidecar's own bus publishes none."""
    bus = EventBus()
    bus.subscribe(JsonlWriter(tmp_path))
    with bus:
        bus.publish(RunStarted())
        bus.publish(Loss(step=1, value=1.0))
    ended = [e for e in read_log(tmp_path / "events.jsonl") if isinstance(e, RunEnded)]
    assert [(e.status, e.step) for e in ended] == [("completed", 1)]


_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from eventbus import EventBus
    from eventbus.events import Loss, RunStarted
    from eventbus.sinks import JsonlWriter

    bus = EventBus(handle_signals=True)
    bus.subscribe(JsonlWriter(sys.argv[1]), placement="thread")
    bus.start()
    bus.publish(RunStarted())
    bus.publish(Loss(step=1, value=1.0))
    if sys.argv[2] == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    # "exit": no close(), the interpreter exits
    """
)


@pytest.mark.parametrize(
    ("how", "status", "reason"),
    [("sigterm", "interrupted", "SIGTERM"), ("exit", "unknown", "without close()")],
)
def test_a_signal_or_the_interpreters_exit_ends_the_run(
    tmp_path: Path, how: str, status: str, reason: str
) -> None:
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "log"), how],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == (143 if how == "sigterm" else 0), proc.stderr[-2000:]
    ended = [e for e in read_log(tmp_path / "log" / "events.jsonl") if isinstance(e, RunEnded)]
    assert len(ended) == 1, proc.stderr[-2000:]
    assert ended[0].status == status
    assert reason in (ended[0].reason or "")
