"""The bounded windows keep the same order statistics as sorting afresh, bit for bit."""

from __future__ import annotations

import math
import random
import statistics
from itertools import pairwise

import pytest

from eventbus.monitors._windows import QuietWindow, SortedWindow, median_of_sorted


@pytest.mark.parametrize("seed", range(5))
def test_sorted_window_matches_sorting_every_time(seed: int) -> None:
    rng = random.Random(seed)
    w = SortedWindow(7)
    kept: list[float] = []
    for _ in range(300):
        v = rng.choice([rng.gauss(0, 1), 0.0, -0.0, 1.0, rng.random()])
        w.append(v)
        kept = [*kept, v][-7:]
        assert list(w.values) == kept and w.sorted == sorted(kept)
        assert w.median() == statistics.median(kept)


@pytest.mark.parametrize("seed", range(5))
def test_quiet_window_keeps_the_log_differences_while_every_value_is_positive(
    seed: int,
) -> None:
    rng = random.Random(seed)
    w = QuietWindow(6)
    kept: list[float] = []
    for _ in range(400):
        v = rng.choice([abs(rng.gauss(1, 0.3)), abs(rng.gauss(1, 0.3)), 0.0, -1.0, 5e-324])
        w.append(v)
        kept = [*kept, v][-6:]
        assert w.sorted == sorted(kept)
        if min(kept) > 0:
            logs = [math.log(x) for x in kept]
            assert w.log_diffs == sorted(b - a for a, b in pairwise(logs))


def test_fill_restores_the_newest_values_and_their_statistics() -> None:
    w = QuietWindow(4)
    w.fill([5.0, 1.0, 2.0, 3.0, 4.0])
    assert list(w.values) == [1.0, 2.0, 3.0, 4.0] and w.sorted == [1.0, 2.0, 3.0, 4.0]
    assert len(w.log_diffs) == 3 and w.median() == 2.5
    w.clear()
    assert len(w) == 0 and w.log_diffs == [] and w.sorted == []


def test_median_of_sorted_is_statistics_median() -> None:
    for n in range(1, 9):
        s = sorted(random.Random(n).random() for _ in range(n))
        assert median_of_sorted(s) == statistics.median(s)
