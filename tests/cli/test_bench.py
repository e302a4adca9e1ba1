"""`eventbus bench`: the table, JSON and plot; bad input is one line and exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eventbus.cli import main
from tests.cli.conftest import one_line_error

QUICK = ["--steps", "5", "--rounds", "1", "--warmup", "1"]


def test_the_table_has_every_variant(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "bench",
            "tests.bench.subs:quick_step",
            "--subscribe",
            "tests.bench.subs:Sleeper:ms=0.1",
            "tests.bench.subs:Locked",
            *QUICK,
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    rows = {line.split()[0] for line in out.splitlines() if line[:1].strip()}
    assert {
        "bare",
        "inline:Sleeper",
        "inline:Locked",
        "bus:Sleeper",
        "bus:Locked",
        "bus:all",
        "process:Sleeper",
        "process:Locked",
    } <= rows
    assert "process:Locked: skipped: placement='process' needs a picklable subscriber" in out


def test_json_to_stdout_parses_and_to_a_file_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "tests.bench.subs:quick_step", "-s", "tests.bench.subs:Locked", *QUICK]
    assert main([*args, "--only", "inline", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert list(d["variants"]) == ["bare", "inline:Locked"]
    assert d["variants"]["inline:Locked"]["delivered"] == 6
    out = tmp_path / "bench.json"
    assert main([*args, "--only", "bus", "--json", str(out)]) == 0
    assert "bus:Locked" in capsys.readouterr().out  # the table, and the file
    assert json.loads(out.read_text())["variants"]["bus:Locked"]["step_ms_p50"] > 0


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    args = ["bench", "tests.bench.subs:quick_step", "-s", "tests.bench.subs:Locked", *QUICK]
    assert main([*args, "--only", "inline", "--plot", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_failing_subscriber_is_reported_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "tests.bench.subs:quick_step", "-s", "tests.bench.subs:Failing", *QUICK]
    assert main([*args, "--only", "inline"]) == 1
    err = capsys.readouterr().err
    assert "inline:Failing: 6 events failed (RuntimeError: planted failure)" in err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["-s", "no_such_builtin"], ["unknown subscriber 'no_such_builtin'"]),
        (["-s", "tests.bench.subs:Nope"], ["no attribute 'Nope'"]),
        (["-s", "divergence", "--steps", "0"], ["steps must be a positive int, got 0"]),
        (["-s", "divergence", "--rounds", "-2"], ["rounds must be a positive int"]),
        (["-s", "divergence", "--only", "nope"], ["unknown variant(s) 'nope'"]),
        (["-s", "divergence", "--steps", "x"], ["--steps", "invalid int value"]),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    argv: list[str], words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "tests.bench.subs:quick_step", *argv]) == 2
    one_line_error(capsys, *words)


@pytest.mark.parametrize(
    ("step", "words"),
    [
        ("no_such_module_xyz:step", ["cannot import 'no_such_module_xyz'"]),
        ("tests.bench.subs:STEP_MS", ["not callable"]),
        ("tests.bench.subs:raising_step", ["step 3", "ZeroDivisionError: planted at step 3"]),
    ],
)
def test_a_step_that_does_not_import_or_raises_is_one_line_and_exit_2(
    step: str, words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", step, "-s", "tests.bench.subs:Locked", *QUICK]) == 2
    one_line_error(capsys, *words)


def test_plot_without_matplotlib_says_so_before_running(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a)
    )
    argv = ["bench", "tests.bench.subs:raising_step", "-s", "divergence", "--plot", "x.png"]
    assert main(argv) == 1  # not 2: the step never ran
    one_line_error(capsys, "pip install 'eventbus[plot]'")


def test_the_installed_command_runs_a_step_from_a_file(tmp_path: Path) -> None:
    """A real process: `path/to/file.py:function`, and a subscriber importable from the
    working directory (as under `python -m`: a console script does not put it on sys.path)."""
    (tmp_path / "steps").mkdir()
    (tmp_path / "steps" / "my_train.py").write_text(
        "from eventbus.events import Loss\n"
        "def step(step, bus):\n"
        "    bus.publish(Loss(step=step, value=float(step)))\n",
        encoding="utf-8",
    )
    (tmp_path / "my_subs.py").write_text("def on_loss(ev):\n    pass\n", encoding="utf-8")
    command = Path(sys.executable).parent / "eventbus"  # the console script pip installed
    if not command.exists():
        pytest.skip("no installed `eventbus` command beside this interpreter")
    step = "steps/my_train.py:step"
    proc = subprocess.run(
        [str(command), "bench", step, "-s", "my_subs:on_loss", *QUICK, "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["variants"]["process:on_loss"]["delivered"] == 6
    assert d["variants"]["inline:on_loss"]["delivered"] == 6
