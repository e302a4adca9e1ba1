"""Bounded windows that keep their order statistics up to date as values come and go.

The divergence rule runs on the bus thread for every step; sorting its windows afresh each
step held the training thread's GIL for ~13 us a step. These keep a sorted copy (bisect,
O(window) moves in C) and give the same numbers, bit for bit, as sorting every time.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable, Sequence

__all__ = ["QuietWindow", "SortedWindow", "median_of_sorted"]


def median_of_sorted(s: Sequence[float]) -> float:
    """`statistics.median` of an already sorted, non-empty sequence."""
    i = len(s) // 2
    return s[i] if len(s) % 2 else (s[i - 1] + s[i]) / 2


class SortedWindow:
    """The last `size` values, in arrival order (`values`) and sorted (`sorted`)."""

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self.sorted: list[float] = []

    def __len__(self) -> int:
        return len(self.values)

    def append(self, v: float) -> None:
        values = self.values
        if len(values) == values.maxlen:
            del self.sorted[bisect_left(self.sorted, values[0])]
        values.append(v)
        insort(self.sorted, v)

    def fill(self, values: Iterable[float]) -> None:
        """Replace the contents (a restored state): the newest `size` of `values`."""
        self.values.clear()
        self.values.extend(values)
        self.sorted = sorted(self.values)

    def clear(self) -> None:
        self.values.clear()
        self.sorted.clear()

    def median(self) -> float:
        return median_of_sorted(self.sorted)


class QuietWindow(SortedWindow):
    """A `SortedWindow` that also keeps, sorted, the differences of successive logs (for
    the noise in ratio space); they are complete while every value held is > 0."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.logs: deque[float] = deque(maxlen=size)  # log(v), or nan for v <= 0
        self.log_diffs: list[float] = []  # log(b) - log(a) for successive values both > 0

    def append(self, v: float) -> None:
        values, logs = self.values, self.logs
        if len(values) == values.maxlen and values[0] > 0 and values[1] > 0:
            del self.log_diffs[bisect_left(self.log_diffs, logs[1] - logs[0])]
        lv = math.log(v) if v > 0 else math.nan
        if values and values[-1] > 0 and v > 0:
            insort(self.log_diffs, lv - logs[-1])
        logs.append(lv)
        super().append(v)

    def fill(self, values: Iterable[float]) -> None:
        self.clear()
        for v in values:
            self.append(v)

    def clear(self) -> None:
        super().clear()
        self.logs.clear()
        self.log_diffs.clear()
