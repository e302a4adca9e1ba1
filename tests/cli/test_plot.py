"""`eventbus plot`: the run's curves into a PNG."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from eventbus.cli import main
from eventbus.codec import encode
from eventbus.events import RunEnded
from tests.cli.conftest import one_line_error


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
    demo: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert main(["plot", str(demo), "-o", str(tmp_path / "x.jpg")]) == 2
    one_line_error(capsys, "PNG")
    empty = tmp_path / "e.jsonl"
    empty.write_bytes(encode(RunEnded(status="completed")))
    assert main(["plot", str(empty), "-o", str(tmp_path / "x.png")]) == 2
    one_line_error(capsys, "no plottable events")
    real = importlib.util.find_spec

    def no_matplotlib(name: str, *a: Any) -> Any:
        return None if name == "matplotlib" else real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", no_matplotlib)
    assert main(["plot", str(demo), "-o", str(tmp_path / "x.png")]) == 1
    one_line_error(capsys, "pip install 'eventbus[plot]'")
