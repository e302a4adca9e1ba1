"""Leak suspicion: a sustained, robust rise of one memory series over a window of readings.

Pure arithmetic on (step, MB) pairs, no torch, no bus: `MemoryProfiler` feeds it and the
tests drive it with synthetic series. A window is suspected of leaking when all of these hold:

1. it grows by at least `min_growth_mb` (median of its last block minus that of its first);
2. most of it grows: of the consecutive block medians (the window cut into `blocks`
   pieces), at least `min_rising_fraction` rise. Per-block medians instead of per-step
   differences, so the staircase of an allocator that grows in chunks still counts as
   "most steps grow", and noise cannot fake it;
3. it rarely falls: the drops add up to at most `max_drop_ratio` of the rises (a caching
   allocator's sawtooth or a garbage collector gives back what it took; a leak does not),
   measured on medians of short runs of readings so per-step noise is not a drop;
4. no single jump carries it: the largest rise is at most `max_jump_fraction` of the net
   growth (the first optimizer step allocating its state is one jump, not a leak);
5. the Theil-Sen slope (median of pairwise slopes: robust to outliers) is positive; it is
   the reported rate.

A sawtooth whose period is longer than the window looks like a leak until it drops: make
the window longer than the allocator's or the collector's cycle.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

__all__ = ["LeakRule", "LeakVerdict", "theil_sen_slope"]

_MAX_SLOPE_POINTS = 64  # Theil-Sen over at most this many points: bounded cost (~2k pairs)


@dataclass(slots=True)
class LeakVerdict:
    """Why a window was suspected: its robust rate, net growth and span in steps."""

    step: int
    rate_mb_per_step: float
    growth_mb: float
    window: int


def theil_sen_slope(xs: list[float], ys: list[float]) -> float:
    """Median of the slopes of every pair of points with distinct x (0.0 if none)."""
    slopes = [
        (ys[j] - ys[i]) / (xs[j] - xs[i])
        for i in range(len(xs))
        for j in range(i + 1, len(xs))
        if xs[j] != xs[i]
    ]
    return statistics.median(slopes) if slopes else 0.0


def _block_medians(ys: list[float], blocks: int) -> list[float]:
    """The medians of `ys` cut into `blocks` consecutive pieces (fewer if `ys` is short)."""
    blocks = min(blocks, len(ys))
    size = len(ys) / blocks
    return [statistics.median(ys[int(i * size) : int((i + 1) * size)]) for i in range(blocks)]


class LeakRule:
    """Feed `update(step, mb)` once per reading; returns a `LeakVerdict` when it fires.

    Fires once, or again `cooldown` steps after the last time when `cooldown` is given.
    """

    def __init__(
        self,
        *,
        window: int = 100,
        min_growth_mb: float = 32.0,
        blocks: int = 8,
        min_rising_fraction: float = 0.75,
        max_drop_ratio: float = 0.5,
        max_jump_fraction: float = 0.5,
        tolerance_mb: float = 0.05,
        warmup: int = 10,
        cooldown: int | None = None,
    ) -> None:
        if blocks < 3:
            raise ValueError(f"blocks must be >= 3, got {blocks!r}")
        if not isinstance(window, int) or window < 2 * blocks:
            raise ValueError(
                f"window must be an int >= 2 * blocks ({2 * blocks}) readings, got {window!r}"
            )
        if min_growth_mb <= 0:
            raise ValueError(f"min_growth_mb must be > 0 MB, got {min_growth_mb!r}")
        for name, v in (
            ("min_rising_fraction", min_rising_fraction),
            ("max_drop_ratio", max_drop_ratio),
            ("max_jump_fraction", max_jump_fraction),
        ):
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {v!r}")
        if tolerance_mb < 0 or warmup < 0:
            raise ValueError("tolerance_mb and warmup must be >= 0")
        if cooldown is not None and cooldown < 1:
            raise ValueError(f"cooldown must be None (fire once) or >= 1 step, got {cooldown!r}")
        self.window = window
        self.min_growth_mb = min_growth_mb
        self.blocks = blocks
        self.min_rising_fraction = min_rising_fraction
        self.max_drop_ratio = max_drop_ratio
        self.max_jump_fraction = max_jump_fraction
        self.tolerance_mb = tolerance_mb
        self.warmup = warmup
        self.cooldown = cooldown
        self._points: deque[tuple[int, float]] = deque(maxlen=window)
        self._seen = 0
        self._fired_at: int | None = None

    def update(self, step: int, mb: float) -> LeakVerdict | None:
        """Add one reading (a later step than the last); a verdict when this one fires."""
        self._seen += 1
        if self._seen <= self.warmup or math.isnan(mb):  # warm-up readings and NaN: skipped
            return None
        pts = self._points
        if pts and step <= pts[-1][0]:
            pts.clear()  # steps went back (a resume or a new run): start a new window
        pts.append((step, mb))
        if len(pts) < self.window:
            return None
        if self._fired_at is not None and (
            self.cooldown is None or step - self._fired_at < self.cooldown
        ):
            return None
        verdict = self.judge(list(pts))
        if verdict is not None:
            self._fired_at = step
            pts.clear()  # the next verdict needs a fresh window of evidence
        return verdict

    def judge(self, pts: list[tuple[int, float]]) -> LeakVerdict | None:
        """The verdict on one window of (step, MB) readings, cheapest tests first."""
        ys = [y for _, y in pts]
        n = len(ys)
        size = n / self.blocks
        growth = (
            statistics.median(ys[n - int(size) :])  # the cheapest test first: a steady
            - statistics.median(ys[: int(size)])
        )  # loop stops here (~5 us)
        if growth < self.min_growth_mb:
            return None
        medians = _block_medians(ys, self.blocks)
        growth = medians[-1] - medians[0]
        tol = self.tolerance_mb
        rising = sum(1 for a, b in itertools.pairwise(medians) if b > a + tol)
        if rising < self.min_rising_fraction * (self.blocks - 1):
            return None
        fine = _block_medians(ys, 4 * self.blocks)  # light smoothing: noise is not a drop
        diffs = [b - a for a, b in itertools.pairwise(fine)]
        rises = sum(d for d in diffs if d > tol)
        drops = -sum(d for d in diffs if d < -tol)
        if rises <= 0 or drops > self.max_drop_ratio * rises:
            return None
        if max(b - a for a, b in itertools.pairwise(ys)) > self.max_jump_fraction * growth:
            return None
        stride = max(1, n // _MAX_SLOPE_POINTS)
        sample = pts[::stride]
        rate = theil_sen_slope([float(x) for x, _ in sample], [y for _, y in sample])
        if rate <= 0:
            return None
        return LeakVerdict(
            step=pts[-1][0],
            rate_mb_per_step=rate,
            growth_mb=growth,
            window=pts[-1][0] - pts[0][0] + 1,
        )

    def state_dict(self) -> dict[str, Any]:
        """The window and whether it fired, for a resumed run."""
        return {"points": list(self._points), "seen": self._seen, "fired_at": self._fired_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self._points = deque(((int(s), float(v)) for s, v in state["points"]), maxlen=self.window)
        self._seen = int(state["seen"])
        self._fired_at = state["fired_at"]
