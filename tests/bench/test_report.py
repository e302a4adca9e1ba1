"""`eventbus.bench.report`: the figures from raw step times, as a table, a dict and a plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eventbus.bench.report import BenchResult, VariantResult, percentile


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile(values, 1.0) == 100.0
    assert percentile([7.0], 0.99) == 7.0


def _result() -> BenchResult:
    ms = 1_000_000
    bare = VariantResult.measured("bare", "bare", [2 * ms] * 99 + [4 * ms], bare=None, rounds=2)
    inline = VariantResult.measured(
        "inline:S",
        "inline",
        [7 * ms] * 98 + [20 * ms] * 2,
        bare=bare,
        rounds=2,
        failed=3,
        errors=("RuntimeError: planted",),
    )
    skipped = VariantResult.skip("process:S", "process", "cannot be pickled")
    return BenchResult(
        step="m:step",
        steps=50,
        rounds=2,
        warmup=5,
        subscribers=("S",),
        variants={v.name: v for v in (bare, inline, skipped)},
        syncs_counted=False,
        env={"device": "CPU (no CUDA device)"},
    )


def test_figures_are_compared_with_bare() -> None:
    r = _result()
    bare, inline = r["bare"], r["inline:S"]
    assert (bare.step_ms_p50, bare.step_ms_p99, bare.ratio_p50) == (2.0, 2.0, 1.0)
    assert (inline.step_ms_p50, inline.step_ms_p99) == (7.0, 20.0)
    assert inline.ratio_p50 == 3.5
    assert inline.ratio_p99 == 10.0
    assert inline.delta_ms_p50 == 5.0
    assert inline.step_ms_mean == pytest.approx((7 * 98 + 40) / 100)
    assert inline.round_p50_ms == (7.0, 7.0)  # two rounds of 50 steps


def test_the_table_shows_every_variant_skipped_ones_with_why() -> None:
    text = _result().table()
    rows = {line.split()[0]: line for line in text.splitlines() if line[:1].strip()}
    assert "3.50x" in rows["inline:S"]
    assert "+5.00" in rows["inline:S"]
    assert rows["process:S"].split()[1] == "skipped"
    assert "process:S: skipped: cannot be pickled" in text
    assert "inline:S: RuntimeError: planted" in text
    assert "n/a" in rows["bare"]  # syncs, without CUDA


def test_as_dict_is_json() -> None:
    d = json.loads(json.dumps(_result().as_dict()))
    assert d["variants"]["inline:S"]["delta_ms_p50"] == 5.0
    assert d["variants"]["process:S"]["skipped"] == "cannot be pickled"
    assert d["subscribers"] == ["S"]
    assert d["steps"] == 50


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = _result().plot(tmp_path / "sub" / "bench.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_what_a_variant_adds_is_paired_by_round_so_a_disturbed_round_moves_little() -> None:
    ms, n = 1_000_000, 10
    bare = VariantResult.measured(
        "bare", "bare", [2 * ms] * n + [2 * ms] * n + [10 * ms] * n, bare=None, rounds=3
    )
    # its second round was disturbed (+8 ms), bare's third: pooled p50s would say +9 ms
    v = VariantResult.measured(
        "bus:S", "bus", [3 * ms] * n + [11 * ms] * n + [11 * ms] * n, bare=bare, rounds=3
    )
    assert v.round_p50_ms == (3.0, 11.0, 11.0)
    assert (v.step_ms_p50, bare.step_ms_p50) == (11.0, 2.0)
    assert v.ratio_p50 == 5.5
    assert v.delta_ms_p50 == 1.0  # the median of (1, 9, 1)
