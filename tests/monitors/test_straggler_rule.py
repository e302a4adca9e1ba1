"""The straggler rule on its own: phase times in, ranks named out."""

from __future__ import annotations

import pytest

from eventbus.monitors._straggler_rule import StragglerRule

EVEN = {"data": 0.001, "forward": 0.010, "optimizer": 0.002}


def _times(slow: dict[int, float] | None = None, ranks: int = 4) -> dict[int, dict[str, float]]:
    """Every rank at EVEN, the ranks in `slow` with their forward multiplied."""
    out = {r: dict(EVEN) for r in range(ranks)}
    for r, x in (slow or {}).items():
        out[r]["forward"] *= x
    return out


def test_a_rank_slow_for_patience_windows_is_named_once_with_its_scores() -> None:
    rule = StragglerRule(threshold=1.5, patience=2)
    assert rule.window(_times()) == []
    assert rule.window(_times({2: 3.0})) == []  # one window is not enough
    (s,) = rule.window(_times({2: 3.0}))
    assert (s.rank, s.phase) == (2, "forward")
    assert s.relative == pytest.approx(33 / 13, abs=1e-3)  # own work over the fastest's
    assert s.history == pytest.approx(33 / 23, abs=1e-3)  # over its median of earlier windows
    assert s.scores == {0: 1.0, 1: 1.0, 2: s.relative, 3: 1.0}
    assert rule.window(_times({2: 3.0})) == []  # named already: not again
    assert rule.window(_times()) == []  # it recovers
    rule.window(_times({2: 3.0}))
    assert [x.rank for x in rule.window(_times({2: 3.0}))] == [2]  # a new episode


def test_noise_below_the_threshold_or_the_minimum_excess_names_no_one() -> None:
    rule = StragglerRule(threshold=1.5, min_excess_s=0.002, patience=1)
    for _ in range(5):
        assert rule.window(_times({1: 1.4})) == []  # 1.31 x the fastest: under 1.5
    tiny = {r: {"forward": 1e-5 * (r + 1)} for r in range(2)}  # 2 x, but 10 microseconds
    assert rule.window(tiny) == []


def test_a_short_phase_doubled_does_not_name_its_rank() -> None:
    """Phases are summed: a 2 ms optimizer step that takes 4 ms is 1.15 x the own work."""
    rule = StragglerRule(threshold=1.5, patience=1)
    times = _times()
    times[3]["optimizer"] *= 2
    assert rule.window(times) == []


def test_only_phases_every_rank_sent_count_and_one_rank_names_no_one() -> None:
    rule = StragglerRule(threshold=1.5, patience=1)
    times = _times(ranks=2)
    times[1]["extra"] = 1.0  # a phase rank 0 never published
    assert rule.window(times) == []
    assert rule.window({0: dict(EVEN)}) == []


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="threshold must be > 1"):
        StragglerRule(threshold=1.0)
    with pytest.raises(ValueError, match="patience and history >= 1"):
        StragglerRule(patience=0)
