"""The divergence decision, as a pure streaming rule: no bus, no torch.

`DivergenceRule.update(step, value)` sees one metric value at a time (training loss,
grad norm, eval loss) and returns a `Detection` the first time the run diverges.
The rule and its defaults are explained, with measured results, in docs/divergence.md.
"""

from __future__ import annotations

import math
import operator
from collections import deque
from dataclasses import dataclass
from itertools import islice, pairwise
from typing import Any

from eventbus.monitors._windows import QuietWindow, SortedWindow, median_of_sorted

__all__ = ["Detection", "DivergenceRule"]

_STATE_VERSION = 2
# 1.4826 * MAD estimates a Gaussian standard deviation; a difference of two independent
# noisy values has sqrt(2) times the noise of one.
_MAD_TO_SIGMA = 1.4826 / math.sqrt(2.0)


@dataclass(slots=True)
class Detection:
    """Why the rule fired: the tripping step and value, the baseline it departed from."""

    step: int
    value: float
    baseline: float
    reason: str


@dataclass(slots=True)
class _Baseline:
    """The reference an excursion is measured against, frozen when the excursion starts."""

    log: bool  # ratios (log space) when every recent value is > 0, else differences
    center: float  # median of the recent values, in the space above
    threshold: float  # excess over `center` that counts as elevated, same space
    low: float  # a lower excess that counts when it lasts one step longer

    def level(self) -> float:
        """The baseline in the metric's own units."""
        return math.exp(self.center) if self.log else self.center


class DivergenceRule:
    """Flags a metric that goes non-finite or rises and stays up; ignores spikes that return.

    Against a baseline (the lowest recent rolling median) and the step-to-step noise of the
    values before the excursion, the rule fires on: a non-finite value at once; `persist`
    values above `sigmas` x noise among the last `persist` to `persist + slack` (no value in
    between back near the baseline; still rising, or the smallest excess at least `hold` x
    the largest, or a 2-step peak past `spike_ratio` x the baseline); `persist + 1`
    consecutive values above `long_sigmas` x noise (same `hold`, waived when all are above
    `sigmas` x noise); or two consecutive values `fast_ratio` x the baseline. Work is in log
    space, so no default depends on the metric's scale.
    docs/divergence.md explains the defaults.
    """

    def __init__(
        self,
        *,
        warmup: int = 10,
        window: int = 20,
        memory: int = 30,
        noise_window: int = 50,
        sigmas: float = 3.0,
        long_sigmas: float = 2.0,
        min_rise: float = 0.4,
        persist: int = 3,
        slack: int = 1,
        dip: float = 0.5,
        hold: float = 0.5,
        fast_ratio: float = 12.0,
        spike_ratio: float = 10.0,
        once: bool = True,
    ) -> None:
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        if memory < 1:
            raise ValueError(f"memory must be >= 1, got {memory}")
        if window < 3 or noise_window < 3:
            raise ValueError(f"window and noise_window must be >= 3, got {window}, {noise_window}")
        if sigmas < 0 or min_rise < 0:
            raise ValueError(f"sigmas and min_rise must be >= 0, got {sigmas}, {min_rise}")
        if persist < 1:
            raise ValueError(f"persist must be >= 1, got {persist}")
        if slack < 0:
            raise ValueError(f"slack must be >= 0, got {slack}")
        if not 0.0 <= dip <= 1.0:
            raise ValueError(f"dip must be in [0, 1], got {dip}")
        if not 0.0 <= hold <= 1.0:
            raise ValueError(f"hold must be in [0, 1], got {hold}")
        if fast_ratio <= 1.0 or spike_ratio <= 1.0:
            raise ValueError(
                f"fast_ratio and spike_ratio must be > 1, got {fast_ratio}, {spike_ratio}"
            )
        self.warmup = warmup
        self.window = window
        self.memory = memory
        self.noise_window = noise_window
        self.sigmas = sigmas
        self.long_sigmas = long_sigmas
        self.min_rise = min_rise
        self.persist = persist
        self.slack = slack
        self.dip = dip
        self.hold = hold
        self.fast_ratio = fast_ratio
        self.spike_ratio = spike_ratio
        self.once = once
        self._values = SortedWindow(window)
        # Values that were not elevated when they came: the noise and the recent high are
        # measured on these, so an earlier spike or excursion cannot inflate the threshold.
        self._quiet = QuietWindow(noise_window + 1)
        self._centers: deque[float] = deque(maxlen=memory)  # recent rolling medians (log)
        self._seen = 0  # finite values seen, for the warmup
        self._scale = 0.0  # largest |value| seen: the run's own unit when values reach <= 0
        self._excursion: list[float] = []  # excess of each consecutive elevated value
        self._frozen: _Baseline | None = None
        self._fired = False  # a detection happened (the rule stays quiet if `once`)
        self._armed = True  # False from a detection until the excursion that caused it ends

    @property
    def fired(self) -> bool:
        """Whether the rule has detected a divergence since construction or `reset()`."""
        return self._fired

    def reset(self) -> None:
        """Forget everything: the next value starts a new warmup."""
        self._values.clear()
        self._quiet.clear()
        self._centers.clear()
        self._seen = 0
        self._scale = 0.0
        self._excursion.clear()
        self._frozen = None
        self._fired = False
        self._armed = True

    def update(self, step: int, value: float) -> Detection | None:
        """Feed the value logged at `step`; returns a `Detection` when this value trips the rule."""
        if self._fired and self.once:
            return None
        value = float(value)
        if not math.isfinite(value):
            baseline = self._frozen or self._baseline()
            self._excursion.append(math.inf)
            level = baseline.level() if baseline is not None else math.nan
            return self._fire(step, value, level, f"non-finite value ({value})")
        detection = None
        quiet = True
        if self._seen >= self.warmup:
            baseline = self._frozen or self._baseline()
            if baseline is not None:
                detection = self._judge(step, value, baseline)
                quiet = not self._excursion
        self._values.append(value)
        if quiet:
            self._quiet.append(value)
        self._centers.append(self._values.median())
        self._seen += 1
        self._scale = max(self._scale, abs(value))
        return detection

    def _judge(self, step: int, value: float, baseline: _Baseline) -> Detection | None:
        if baseline.log:
            excess = math.log(value) - baseline.center if value > 0 else -math.inf
        else:
            excess = value - baseline.center
        run = self._excursion
        if excess <= baseline.low and not run:
            self._armed = True
            return None
        run.append(excess)
        if len(run) > self.slack and max(run[-(self.slack + 1) :]) <= baseline.low:
            # `slack + 1` values back near the baseline in a row: the excursion is over.
            run.clear()
            self._frozen = None
            self._armed = True
            return None
        self._frozen = baseline
        why = self._why(baseline)
        if why is None:
            return None
        rise = _ratio(excess) if baseline.log else f"{excess:.3g} above"
        return self._fire(step, value, baseline.level(), f"{rise} the baseline, {why}")

    def _why(self, baseline: _Baseline) -> str | None:
        """Which test the excursion so far passes, in words; None while it could be a spike."""
        run, threshold = self._excursion, baseline.threshold
        long = run[-(self.persist + 1) :]
        # `hold` is waived when every value is elevated: no spike lasts that long.
        if (
            len(long) > self.persist
            and min(long) > baseline.low
            and (min(long) > threshold or _holds(long, self.hold))
        ):
            return f"raised for {len(long)} steps"
        if run[-1] <= threshold:
            return None
        if baseline.log and len(run) >= 2 and min(run[-2:]) >= math.log(self.fast_ratio):
            return "for 2 steps"
        if self._sustained(threshold, baseline.log):
            return f"elevated in {sum(e > threshold for e in run)} of {len(run)} steps"
        return None

    def _sustained(self, threshold: float, log: bool) -> bool:
        """Whether the excursion's latest values make a new level rather than a spike.

        `persist` elevated values among the last `persist` to `persist + slack`, every value
        in that span above `dip` x the threshold (a dip that stays raised is noise on a new
        level; a return to the baseline is a spike ending), and either the span ends on its
        highest value (still rising: a ramp), or the smallest elevated excess is at least
        `hold` x the largest (falling from a peak much higher than the rest is a spike's
        tail), or the span holds two consecutive values `spike_ratio` x the baseline (a peak
        taller than the corrupted-batch spikes the rule must ignore is no spike's).
        """
        run = self._excursion
        for width in range(self.persist, min(len(run), self.persist + self.slack) + 1):
            span = run[-width:]
            high = [e for e in span if e > threshold]
            if (
                len(high) >= self.persist
                and min(span) > self.dip * threshold
                and (
                    span[-1] >= max(span)
                    or _holds(high, self.hold)
                    or (log and _peak(span) >= math.log(self.spike_ratio))
                )
            ):
                return True
        return False

    def _fire(self, step: int, value: float, level: float, reason: str) -> Detection | None:
        if not self._armed:
            return None
        self._fired = True
        self._armed = False
        return Detection(step=step, value=value, baseline=level, reason=reason)

    def _baseline(self) -> _Baseline | None:
        """The reference level, and the excess over it that counts as elevated.

        The level is the lowest rolling median of the last `memory` steps (a running best
        that forgets), so a divergence that creeps up cannot drag its own baseline along.
        The threshold is the largest of: `sigmas` x step-to-step noise, `min_rise`, and the
        recent high (a smooth metric that wanders back up to where it just was is no news).
        """
        values, noisy = self._values, self._quiet
        if len(values) < 3 or len(noisy) < 3:
            return None
        level = min(self._centers)
        if values.sorted[0] > 0 and noisy.sorted[0] > 0 and level > 0:
            # log is monotonic: the high of the logs is the log of the high
            high = math.log(_high(noisy.sorted))
            noise = _noise(noisy.log_diffs, len(noisy), self.noise_window)
            floor = max(math.log1p(self.min_rise), high - math.log(level))
            return _Baseline(
                True,
                math.log(level),
                max(self.sigmas * noise, floor),
                max(self.long_sigmas * noise, floor),
            )
        # A value <= 0 rules out ratios: measure raw differences instead, floored relative
        # to the level or, when that is 0, to the largest value the run has logged.
        floor = self.min_rise * (abs(level) or self._scale)
        raw = noisy.values
        steps = list(map(operator.sub, islice(raw, 1, None), raw))  # b - a, in C
        # Deviations from `steps` in arrival order: near the float range they hold nan
        # (inf - inf), and sorting a list with nan depends on its order (as the rule has).
        noise = _noise(sorted(steps), len(noisy), self.noise_window, steps)
        floor = max(floor, _high(noisy.sorted) - level)
        return _Baseline(
            False, level, max(self.sigmas * noise, floor), max(self.long_sigmas * noise, floor)
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume with the same baseline: plain floats, lists and bools."""
        frozen = self._frozen
        return {
            "version": _STATE_VERSION,
            "values": list(self._values.values),
            "quiet": list(self._quiet.values),
            "centers": list(self._centers),
            "seen": self._seen,
            "scale": self._scale,
            "excursion": list(self._excursion),
            "frozen": None
            if frozen is None
            else [frozen.log, frozen.center, frozen.threshold, frozen.low],
            "fired": self._fired,
            "armed": self._armed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict()` returned (the constructor's parameters are not saved)."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"unknown DivergenceRule state version {state.get('version')!r} (this version "
                f"reads {_STATE_VERSION}): start the detector without it, it re-learns its "
                "baseline after the warmup"
            )
        self._values.fill(float(v) for v in state["values"])
        self._quiet.fill(float(v) for v in state["quiet"])
        self._centers.clear()
        self._centers.extend(float(v) for v in state["centers"])
        self._seen = int(state["seen"])
        self._scale = float(state["scale"])
        self._excursion = [float(e) for e in state["excursion"]]
        frozen = state["frozen"]
        self._frozen = (
            None
            if frozen is None
            else _Baseline(bool(frozen[0]), float(frozen[1]), float(frozen[2]), float(frozen[3]))
        )
        self._fired = bool(state["fired"])
        self._armed = bool(state["armed"])


def _ratio(log_excess: float) -> str:
    """A ratio in words, from its log (past a float's range, ~e^709.78: e to the power)."""
    try:
        return f"{math.exp(log_excess):.3g}x"
    except OverflowError:
        return f"e^{log_excess:.4g}x"


def _peak(excesses: list[float]) -> float:
    """The larger of the smaller of each two consecutive excesses: a 2-step peak's height."""
    return max((min(a, b) for a, b in pairwise(excesses)), default=-math.inf)


def _holds(excesses: list[float], hold: float) -> bool:
    """Whether the smallest excess is at least `hold` x the largest: a level, not a spike."""
    return min(excesses) >= hold * max(excesses)


def _noise(diffs: list[float], count: int, full: int, arrival: list[float] | None = None) -> float:
    """Robust standard deviation of one value's noise, from successive differences.

    Differences cancel a trend (the fast early fall of a loss), and the median absolute
    deviation ignores the few large jumps a spike makes. Measured on fewer than `full`
    values (early in a run) the estimate is itself noisy and often far too low: it is
    widened by sqrt(full / count), so 3 sigma from 12 values counts as about 6 sigma.
    `diffs`: the successive differences of `count` values, sorted; `arrival`: the same in
    arrival order, where they may be infinite (the deviations are then taken from it).
    """
    mid = median_of_sorted(diffs)
    widen = max(1.0, math.sqrt(full / count))
    ordered = diffs if arrival is None else arrival
    deviations = sorted(map(abs, map(mid.__rsub__, ordered)))  # |d - mid|, in C
    return widen * _MAD_TO_SIGMA * median_of_sorted(deviations)


def _high(ascending: list[float]) -> float:
    """The third largest of >= 3 sorted values: the recent high, ignoring a two-step spike."""
    return ascending[-3]
