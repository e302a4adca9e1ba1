"""`eventbus replay`: subscribers from SPECs, what they publish shown or written."""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any

import pytest

from eventbus import Event
from eventbus.cli import main
from eventbus.codec import encode
from eventbus.events import DivergenceDetected, Loss, StopRequested
from eventbus.logformat import read_log
from tests.cli.conftest import one_line_error


class Watcher:
    """A user subscriber made by `tests.cli.test_replay:make_watcher`."""

    events = (Loss,)

    def on_start(self, bus: Any) -> None:
        self.bus = bus

    def on_events(self, batch: list[Event]) -> None:
        for ev in batch:
            if isinstance(ev, Loss) and not math.isfinite(ev.value):
                self.bus.publish(
                    DivergenceDetected(step=ev.step, value=ev.value, baseline=0.0, reason="watcher")
                )
                return


def make_watcher() -> Watcher:
    return Watcher()


def count_losses(ev: Event) -> None:
    """A plain function subscriber (one event)."""


def test_replay_with_a_module_factory_writes_what_it_published(
    demo: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "found.jsonl"
    assert (
        main(
            [
                "replay",
                str(demo),
                "--subscribe",
                "tests.cli.test_replay:make_watcher",
                "tests.cli.test_replay:count_losses",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "1 published" in capsys.readouterr().out
    (ev,) = list(read_log(out))
    assert isinstance(ev, DivergenceDetected)
    assert ev.reason == "watcher"


def test_replay_with_the_divergence_detector(
    demo: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
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
    demo: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("tensorboard")
    assert (
        main(
            [
                "replay",
                str(demo),
                "-s",
                f"jsonl:{tmp_path / 'copy'}",
                f"tensorboard:{tmp_path / 'tb'}",
            ]
        )
        == 0
    )
    copy = tmp_path / "copy" / "events.jsonl"
    assert [encode(e) for e in read_log(copy)] == [encode(e) for e in read_log(demo)]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("bogus", ["unknown subscriber 'bogus'"]),
        ("no_such_module_xyz:make", ["cannot import 'no_such_module_xyz'"]),
        ("tests.cli.test_replay:nothing_here", ["has no attribute 'nothing_here'"]),
        ("jsonl", ["missing a required argument: 'path'"]),
        ("progress:oops", ["too many positional arguments"]),
        ("progress:nope=1", ["unexpected keyword argument 'nope'"]),
    ],
)
def test_bad_specs_are_one_line_errors(
    demo: Path,
    capsys: pytest.CaptureFixture[str],
    spec: str,
    words: list[str],
) -> None:
    assert main(["replay", str(demo), "--subscribe", spec]) == 2
    one_line_error(capsys, *words)


def test_replay_refuses_to_write_over_its_input(
    demo: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["replay", str(demo), "-s", f"jsonl:{demo.parent}"]) == 2
    one_line_error(capsys, "is being replayed")


@pytest.mark.parametrize("spec", ["memory", "memory:every=5", "eventbus.monitors:MemoryProfiler"])
def test_replay_refuses_the_memory_profiler(
    demo: Path, tmp_path: Path, spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = ["replay", str(demo), "-s", f"jsonl:{out}", spec]
    assert main(args) == 2
    one_line_error(capsys, spec, "MemoryProfiler measures the process it runs in")
    assert not out.exists()  # refused before anything ran
