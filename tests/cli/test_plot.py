"""`eventbus plot`: the run's curves into a PNG."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest

from eventbus.cli import main
from eventbus.codec import encode
from eventbus.events import (
    EvalEnded,
    Loss,
    MemorySample,
    OptimizerStepped,
    RunEnded,
    RunStarted,
)
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


# -- robust limits, eval markers, constant series, titles, overlays (issue 15, items 4 and 6) --


def test_y_limits_leave_out_a_spike_but_keep_a_curve_and_its_decades() -> None:
    from eventbus.cli.plot import y_limits

    curve = [4 * math.exp(-s / 60) + 1 for s in range(300)]
    spiked = [*curve[:150], 5e4, *curve[151:]]
    (lo, hi), log = y_limits(spiked) or ((0.0, 0.0), True)
    assert not log
    assert lo < min(curve) and max(curve) < hi < 6  # the first, high steps stay in view
    assert y_limits(curve) == y_limits([*curve[:150], curve[150], *curve[151:]])
    flat = [2.0] * 50
    (lo, hi), _ = y_limits([*flat, 100.0]) or ((0.0, 0.0), True)
    assert lo < 2.0 < hi < 3  # a flat curve and one spike: the spike is off the axis
    (lo, hi), _ = y_limits([*flat, -100.0]) or ((0.0, 0.0), True)
    assert -1 < lo < 2.0 < hi  # downwards too
    # a divergence is no outlier: many points past the gap stay, on a log axis (decades)
    diverged = [*curve[:200], *(10.0 ** (s / 10) for s in range(100))]
    (lo, hi), log = y_limits(diverged) or ((0.0, 0.0), False)
    assert log
    assert lo < 1.1 and hi > 1e9
    # two decades or less: linear
    assert y_limits([1.0, 50.0, 100.0]) is not None
    assert not (y_limits([1.0, 50.0, 100.0]) or ((0, 0), True))[1]
    assert y_limits([math.nan, math.inf]) is None


def _drawn(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The figures `eventbus plot` saves, kept for the test to look at."""
    from matplotlib.figure import Figure

    figures: list[Any] = []
    real = Figure.savefig

    def spy(self: Any, *a: Any, **kw: Any) -> Any:
        figures.append(self)
        return real(self, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", spy)
    return figures


def _record(d: Path, *, run_id: str | None, spike_at: int | None, lr: float) -> None:
    d.mkdir(parents=True)
    events: list[Any] = [RunStarted(config={"lr": lr}, run_id=run_id)]
    for s in range(1, 201):
        v = 4 * math.exp(-s / 40) + 1 + 0.01 * (s % 7)
        events.append(Loss(step=s, value=5e4 if s == spike_at else v))
        events.append(OptimizerStepped(step=s, lr=lr, grad_norm=1.0 + (s % 5) / 10))
        events.append(MemorySample(step=s, rss_mb=100.0))
        if s % 50 == 0:
            events.append(EvalEnded(step=s, metrics={"loss": v + 0.1, "accuracy": s / 400}))
    events.append(RunEnded(status="completed"))
    (d / "events.jsonl").write_bytes(b"".join(encode(e) for e in events))


def test_a_spike_stays_off_the_axis_eval_is_markers_constants_have_no_panel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    figures = _drawn(monkeypatch)
    _record(tmp_path / "exp7", run_id=None, spike_at=100, lr=0.1)
    png = tmp_path / "p.png"
    assert main(["plot", str(tmp_path / "exp7"), "-o", str(png)]) == 0
    out = capsys.readouterr().out
    assert "(loss, eval accuracy, grad norm)" in out
    assert "constant, not drawn: lr 0.1, rss_mb 100" in out
    (fig,) = figures
    assert fig.get_suptitle() == "exp7"  # the run's directory: it has no run_id
    loss_ax, eval_ax, _ = fig.axes
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "eval accuracy", "grad norm"]
    low, high = loss_ax.get_ylim()
    assert high < 6  # the 5e4 spike does not squash the curve (values 1 to 5)
    assert loss_ax.get_yscale() == "linear"
    lines = {line.get_label(): line for line in loss_ax.get_lines()}
    assert lines["train loss"].get_marker() in ("None", None, "")
    assert lines["eval loss"].get_marker() == "o"
    beyond = lines["train loss off the axis"]
    assert list(beyond.get_xdata()) == [100]
    assert low < beyond.get_ydata()[0] < high  # drawn whole, inside the axis
    assert eval_ax.get_lines()[0].get_marker() == "o"


def test_runs_overlaid_with_a_legend_title_from_run_ids_or_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    figures = _drawn(monkeypatch)
    _record(tmp_path / "a", run_id="baseline", spike_at=None, lr=0.1)
    _record(tmp_path / "b", run_id="warmup", spike_at=None, lr=0.3)
    png = tmp_path / "x.png"
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(png)]) == 0
    out = capsys.readouterr().out
    assert "learning rate" in out  # constant in each run, but not the same in both
    assert "constant, not drawn: baseline rss_mb 100, warmup rss_mb 100" in out
    (fig,) = figures
    assert fig.get_suptitle() == "baseline vs warmup"
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == [
        "baseline train loss",
        "warmup train loss",
        "baseline eval loss",
        "warmup eval loss",
    ]
    colors = {line.get_label(): line.get_color() for line in fig.axes[0].get_lines()}
    assert colors["baseline train loss"] == colors["baseline eval loss"]
    assert colors["baseline train loss"] != colors["warmup train loss"]
    assert main(["plot", str(tmp_path), "-o", str(png), "--title", "lr sweep"]) == 0
    assert figures[-1].get_suptitle() == "lr sweep"
    assert len(figures[-1].axes[0].get_legend().get_texts()) == 4  # found under tmp_path
