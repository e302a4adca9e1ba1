"""The straggler rule, pure: which rank stands out in a window of phase times of every rank.

A rank's own time in a window is the sum, over the phases it spends on its own work, of its
median time in each (the caller leaves out the phases that hold a collective). Its relative
score is that time over the fastest rank's; its history score, over its own median of earlier
windows. A rank stands out when its relative score is >= `threshold` and it is slower than the
fastest by at least `min_excess_s` (sub-millisecond loops name no one for a few microseconds);
it is named after `patience` windows in a row, once, until a window where it no longer stands
out, with the phase where it lost the most time. Summing the phases keeps a short phase's noise
(a 0.5 ms optimizer step doubled by a context switch) from naming anyone.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["Straggler", "StragglerRule"]


@dataclass(frozen=True, slots=True)
class Straggler:
    """A rank named: the phase where it lost most, its scores, every rank's relative score."""

    rank: int
    phase: str
    relative: float
    history: float | None
    seconds: float
    fastest_s: float
    scores: dict[int, float] = field(default_factory=dict)


class StragglerRule:
    """`window(times)` with {rank: {phase: seconds}} for one window: the ranks named now."""

    def __init__(
        self,
        *,
        threshold: float = 1.5,
        min_excess_s: float = 0.002,
        patience: int = 3,
        history: int = 20,
    ) -> None:
        if threshold <= 1.0:
            raise ValueError(f"threshold must be > 1 (x the fastest rank); got {threshold}")
        if min_excess_s < 0 or patience < 1 or history < 1:
            raise ValueError("min_excess_s must be >= 0, patience and history >= 1")
        self.threshold = threshold
        self.min_excess_s = min_excess_s
        self.patience = patience
        self.history = history
        self.windows = 0  # windows scored
        self.named: set[int] = set()  # ranks standing out now, already named
        self._streak: dict[int, int] = {}
        self._past: dict[int, deque[float]] = {}  # a rank's own time, earlier windows

    def window(self, times: Mapping[int, Mapping[str, float]]) -> list[Straggler]:
        """Score one window; only phases every rank sent count."""
        self.windows += 1
        ranks = sorted(times)
        if len(ranks) < 2:
            return []
        phases = sorted(set.intersection(*(set(times[r]) for r in ranks)))
        own = {r: math.fsum(times[r][p] for p in phases) for r in ranks}
        fastest = min(own.values())
        scores = {r: round(t / fastest, 3) if fastest > 0 else 1.0 for r, t in own.items()}
        best = {p: min(times[r][p] for r in ranks) for p in phases}
        standing: dict[int, Straggler] = {}
        for r in ranks:
            if scores[r] >= self.threshold and own[r] - fastest >= self.min_excess_s:
                phase = max(phases, key=lambda p: times[r][p] - best[p])  # where it lost most
                history = self._history(r, own[r])
                standing[r] = Straggler(r, phase, scores[r], history, own[r], fastest, scores)
        for r in ranks:
            self._past.setdefault(r, deque(maxlen=self.history)).append(own[r])
        named = []
        for r in ranks:
            if r not in standing:
                self._streak[r] = 0
                self.named.discard(r)
                continue
            self._streak[r] = self._streak.get(r, 0) + 1
            if self._streak[r] >= self.patience and r not in self.named:
                self.named.add(r)
                named.append(standing[r])
        return named

    def _history(self, rank: int, t: float) -> float | None:
        past = self._past.get(rank)
        if not past:
            return None
        typical = statistics.median(past)
        return round(t / typical, 3) if typical > 0 else None
