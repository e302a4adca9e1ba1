"""The `eventbus` command: replay, summary, tail, plot, and one-line errors with exit code 2."""

from __future__ import annotations

import importlib
import importlib.util
import math
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from eventbus import Event, EventBus
from eventbus.cli import main
from eventbus.codec import encode
from eventbus.events import DivergenceDetected, Loss, RunEnded, StepEnded, StopRequested
from eventbus.replay import read_log
from eventbus.sinks import JsonlWriter
from tests.demo_run import record_demo_run


class Watcher:
    """A user subscriber made by `tests.test_cli:make_watcher`."""

    events = (Loss,)

    def on_start(self, bus: Any) -> None:
        self.bus = bus

    def on_events(self, batch: list[Event]) -> None:
        for ev in batch:
            if isinstance(ev, Loss) and not math.isfinite(ev.value):
                self.bus.publish(DivergenceDetected(step=ev.step, value=ev.value, baseline=0.0,
                                                    reason="watcher"))
                return


def make_watcher() -> Watcher:
    return Watcher()


def count_losses(ev: Event) -> None:
    """A plain function subscriber (one event)."""


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_demo_run(tmp_path_factory.mktemp("demo"), steps=60, blow_up_at=40)


def _one_line_error(capsys: pytest.CaptureFixture[str], *words: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("eventbus: error: ")
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0]
    return lines[0]


# -- summary ----------------------------------------------------------------------------------


def test_summary_of_a_recorded_run(demo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["summary", str(demo)]) == 0
    out = capsys.readouterr().out
    assert "status:     completed" in out
    assert "steps:      60 of 60 (1 to 60)" in out
    assert "wall time:" in out
    assert "loss train: first" in out
    assert "non-finite" in out  # the blow-up is not hidden
    assert "steps/s" in out
    assert "samples/s" in out
    assert "losses:     0 dropped, 0 failed" in out
    assert "peak memory: rss 160 MB" in out


def test_summary_json_has_the_numbers(demo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["summary", "--json", str(demo)]) == 0
    d = orjson.loads(capsys.readouterr().out)
    assert d["steps"] == {"count": 60, "first": 1, "last": 60}
    loss = d["loss"]["train"]
    assert loss["first"][0] == 1
    assert loss["min"][1] <= loss["first"][1]
    assert loss["non_finite"] > 0
    assert d["throughput"]["steps_per_s"] > 0
    assert d["losses"]["dropped"] == 0
    assert d["losses"]["stats_records"] == 1
    assert d["peak_memory_mb"]["rss_mb"] == 160.0


def test_summary_reports_failures_and_detections(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    def broken(ev: Event) -> None:
        raise RuntimeError("nope")

    w = JsonlWriter(tmp_path)
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(w)  # first subscribed, closed last: its stats record sees the others closed
    bus.subscribe(broken, events=[Loss], policy="block")
    with bus:
        for s in range(1, 4):
            bus.publish(Loss(step=s, value=1.0))
        bus.publish(DivergenceDetected(step=3, value=9.0, baseline=1.0, reason="spike"))
    assert main(["summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "3 failed" in out
    assert "broken" in out
    assert "divergence @3" in out
    assert "status:     no RunEnded" in out


def test_summary_of_a_crashed_run_says_losses_are_unknown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    log = tmp_path / "events.jsonl"
    log.write_bytes(b"".join(encode(Loss(step=s, value=1.0, seq=s)) for s in (1, 2, 5)))
    assert main(["summary", str(log)]) == 0
    out = capsys.readouterr().out
    assert "unknown (no stats record" in out
    assert "2 events missing from the log (seq gaps)" in out


# -- replay -----------------------------------------------------------------------------------


def test_replay_with_a_module_factory_writes_what_it_published(
    demo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "found.jsonl"
    assert main(["replay", str(demo), "--subscribe", "tests.test_cli:make_watcher",
                 "tests.test_cli:count_losses", "--out", str(out)]) == 0
    assert "1 published" in capsys.readouterr().out
    (ev,) = list(read_log(out))
    assert isinstance(ev, DivergenceDetected)
    assert ev.reason == "watcher"


def test_replay_with_the_divergence_detector(
    demo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    try:
        importlib.import_module("eventbus.monitors.divergence").DivergenceDetector  # noqa: B018
    except (ImportError, AttributeError):
        pytest.skip("eventbus.monitors.divergence.DivergenceDetector not there yet")
    out = tmp_path / "det.jsonl"
    assert main(["replay", str(demo), "-s", "divergence:action=stop", "--out", str(out)]) == 0
    got = list(read_log(out))
    div = [e for e in got if isinstance(e, DivergenceDetected)]
    assert div
    assert div[0].step is not None
    assert div[0].step >= 40  # the lr jump happens at step 40
    assert any(isinstance(e, StopRequested) for e in got)
    capsys.readouterr()
    assert main(["summary", str(demo), str(out)]) == 0
    assert "divergence @" in capsys.readouterr().out


def test_replay_into_jsonl_and_tensorboard(
    demo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("tensorboard")
    assert main(["replay", str(demo), "-s", f"jsonl:{tmp_path / 'copy'}",
                 f"tensorboard:{tmp_path / 'tb'}"]) == 0
    copy = tmp_path / "copy" / "events.jsonl"
    assert [encode(e) for e in read_log(copy)] == [encode(e) for e in read_log(demo)]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


@pytest.mark.parametrize(("spec", "words"), [
    ("bogus", ["unknown subscriber 'bogus'"]),
    ("no_such_module_xyz:make", ["cannot import 'no_such_module_xyz'"]),
    ("tests.test_cli:nothing_here", ["has no attribute 'nothing_here'"]),
    ("jsonl", ["missing a required argument: 'path'"]),
    ("progress:oops", ["too many positional arguments"]),
    ("progress:nope=1", ["unexpected keyword argument 'nope'"]),
])
def test_bad_specs_are_one_line_errors(
    demo: Path, capsys: pytest.CaptureFixture[str], spec: str, words: list[str],
) -> None:
    assert main(["replay", str(demo), "--subscribe", spec]) == 2
    _one_line_error(capsys, *words)


def test_replay_refuses_to_write_over_its_input(
    demo: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["replay", str(demo), "-s", f"jsonl:{demo.parent}"]) == 2
    _one_line_error(capsys, "is being replayed")


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    [], ["frob"], ["summary"], ["replay", "x.jsonl"], ["plot", "x.jsonl"],
    ["tail", "x", "--max-lines", "zero"],
])
def test_bad_arguments_exit_2_with_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(argv) == 2
    _one_line_error(capsys)


@pytest.mark.parametrize("command", ["summary", "plot", "tail", "replay"])
def test_unreadable_and_corrupt_files_exit_2_with_one_line(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    extra = {"plot": ["-o", str(tmp_path / "x.png")],
             "replay": ["-s", "tests.test_cli:make_watcher"],
             "tail": ["--no-follow"], "summary": []}[command]
    assert main([command, str(tmp_path / "missing.jsonl"), *extra]) == 2
    _one_line_error(capsys, "missing.jsonl")
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_bytes(encode(Loss(step=1, value=1.0)) + b"{\"type\": 12}\n"
                        + encode(Loss(step=2, value=1.0)))
    assert main([command, str(corrupt), *extra]) == 2
    _one_line_error(capsys, "corrupt.jsonl")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\x00\xff\xfe garbage\n" * 3)
    assert main([command, str(binary), *extra]) == 2
    _one_line_error(capsys, "binary.jsonl")


def test_the_installed_command_prints_no_traceback(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "eventbus.cli", "summary",
                        str(tmp_path / "nope.jsonl")], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0
    assert "no such file" in r.stderr


# -- tail -------------------------------------------------------------------------------------


def test_tail_no_follow_prints_the_last_steps(
    demo: Path, capsys: pytest.CaptureFixture[str],
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
        code = main(["tail", str(log), "--max-lines", "4", "--timeout", "10",
                     "--interval", "0.02"])
    finally:
        t.join()
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["1", "2", "3", "4"]
    assert "time 100.0ms" in lines[1]


def test_tail_stops_at_run_end_or_after_the_idle_timeout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
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


# -- plot -------------------------------------------------------------------------------------


def test_plot_writes_a_png(demo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "report.png"
    assert main(["plot", str(demo), "-o", str(png)]) == 0
    out = capsys.readouterr().out
    for panel in ("loss", "grad norm", "learning rate", "memory", "step time"):
        assert panel in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000


def test_plot_errors(
    demo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert main(["plot", str(demo), "-o", str(tmp_path / "x.jpg")]) == 2
    _one_line_error(capsys, "PNG")
    empty = tmp_path / "e.jsonl"
    empty.write_bytes(encode(RunEnded(status="completed")))
    assert main(["plot", str(empty), "-o", str(tmp_path / "x.png")]) == 2
    _one_line_error(capsys, "no plottable events")
    real = importlib.util.find_spec

    def no_matplotlib(name: str, *a: Any) -> Any:
        return None if name == "matplotlib" else real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", no_matplotlib)
    assert main(["plot", str(demo), "-o", str(tmp_path / "x.png")]) == 1
    _one_line_error(capsys, "pip install 'eventbus[plot]'")
