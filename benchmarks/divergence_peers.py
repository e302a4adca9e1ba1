"""Score DivergenceRule and simple renditions of peer rules on the recorded runs.

    .venv/bin/python benchmarks/divergence_peers.py            # summary + per-run table
    .venv/bin/python benchmarks/divergence_peers.py --markdown # tables for docs/divergence.md

Runs come from tests/fixtures/divergence/*.json (made by make_runs.py there). A healthy
run scores a false positive if a rule fires at all; a diverging run is scored by the
delay from its onset and from its visible departure (negative: fired before onset).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eventbus.monitors._divergence_rule import DivergenceRule

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "divergence"


class Rule(Protocol):
    def update(self, step: int, value: float) -> object | None: ...


class EmaVsBest:
    """Forgather-style: EMA of the loss against its running best (relative and absolute
    thresholds), `patience` consecutive breaches after `warmup` steps. NaN poisons the EMA,
    and comparisons with NaN are false, so non-finite values never fire on their own."""

    def __init__(
        self,
        alpha: float = 0.1,
        rel: float = 0.5,
        abs_: float = 1.0,
        patience: int = 3,
        warmup: int = 50,
    ) -> None:
        self.alpha, self.rel, self.abs = alpha, rel, abs_
        self.patience, self.warmup = patience, warmup
        self.ema: float | None = None
        self.best = math.inf
        self.n = 0
        self.count = 0

    def update(self, step: int, value: float) -> object | None:
        self.n += 1
        self.ema = value if self.ema is None else self.alpha * value + (1 - self.alpha) * self.ema
        if self.n <= self.warmup:
            self.best = min(self.best, self.ema)
            return None
        breach = self.ema > self.best * (1 + self.rel) or self.ema > self.best + self.abs
        self.best = min(self.best, self.ema)
        self.count = self.count + 1 if breach else 0
        return True if self.count >= self.patience else None


class DualEma:
    """Forgather's DualTimeScaleDivergenceDetector with its defaults: fast EMA (0.1) minus
    slow EMA (0.01) >= 2.0, in the loss's own units."""

    def __init__(self, short: float = 0.1, long: float = 0.01, threshold: float = 2.0) -> None:
        self.short, self.long, self.threshold = short, long, threshold
        self.s: float | None = None
        self.l_: float = 0.0

    def update(self, step: int, value: float) -> object | None:
        if self.s is None:
            self.s = self.l_ = value
            return None
        self.s = self.short * value + (1 - self.short) * self.s
        self.l_ = self.long * value + (1 - self.long) * self.l_
        return True if self.s - self.l_ >= self.threshold else None


class WindowMeanSpike:
    """Lightning SpikeDetection style: fire at once when the loss is non-finite or exceeds
    the mean of the last `window` losses by `rtol` times that mean (defaults 10 and 2.0)."""

    def __init__(self, window: int = 10, rtol: float = 2.0, warmup: int = 1) -> None:
        self.values: deque[float] = deque(maxlen=window)
        self.rtol, self.warmup = rtol, warmup

    def update(self, step: int, value: float) -> object | None:
        if not math.isfinite(value):
            return True
        fire = None
        if len(self.values) >= self.warmup:
            mean = statistics.fmean(self.values)
            if value - mean > self.rtol * mean:
                fire = True
        self.values.append(value)
        return fire


class KillLossSpike:
    """llm-foundry KillLossSpike style: an outlier exceeds `mult` x the mean of a full
    window of 100 losses; more than `patience` (4) consecutive outliers fire."""

    def __init__(self, window: int = 100, mult: float = 2.0, patience: int = 4) -> None:
        self.values: deque[float] = deque(maxlen=window)
        self.mult, self.patience = mult, patience
        self.count = 0

    def update(self, step: int, value: float) -> object | None:
        fire = None
        if len(self.values) == self.values.maxlen:
            if not value <= statistics.fmean(self.values) * self.mult:  # NaN counts as outlier
                self.count += 1
                fire = True if self.count > self.patience else None
            else:
                self.count = 0
        self.values.append(value)
        return fire


RULES: dict[str, Callable[[], Rule]] = {
    "DivergenceRule (ours)": DivergenceRule,
    "EMA vs best (Forgather-style)": EmaVsBest,
    "dual EMA (Forgather)": DualEma,
    "window-mean spike (Lightning)": WindowMeanSpike,
    "KillLossSpike (llm-foundry)": KillLossSpike,
}


def load_runs(directory: Path = FIXTURES) -> list[dict[str, Any]]:
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted(directory.glob("*.json"))]


def first_detection(make: Callable[[], Rule], losses: Iterable[float]) -> int | None:
    rule = make()
    for step, value in enumerate(losses, start=1):
        if rule.update(step, value) is not None:
            return step
    return None


@dataclass
class Score:
    run: dict[str, Any]
    step: int | None

    @property
    def false_positive(self) -> bool:
        if not self.run["diverges"]:
            return self.step is not None
        return self.step is not None and self.step < self.run["onset"]

    @property
    def missed(self) -> bool:
        return bool(self.run["diverges"]) and self.step is None

    def delay(self, ref: str) -> int | None:
        if self.step is None or not self.run["diverges"]:
            return None
        return self.step - int(self.run[ref])


def summarize(scores: list[Score]) -> dict[str, Any]:
    healthy = [s for s in scores if not s.run["diverges"]]
    div = [s for s in scores if s.run["diverges"]]
    on = [d for s in div if (d := s.delay("onset")) is not None and not s.false_positive]
    dep = [d for s in div if (d := s.delay("departure")) is not None and not s.false_positive]
    return {
        "healthy": len(healthy),
        "fp_healthy": sum(s.false_positive for s in healthy),
        "diverging": len(div),
        "early": sum(s.false_positive for s in div),
        "missed": sum(s.missed for s in div),
        "median_onset": statistics.median(on) if on else None,
        "max_onset": max(on) if on else None,
        "median_dep": statistics.median(dep) if dep else None,
        "max_dep": max(dep) if dep else None,
    }


def score_all(runs: list[dict[str, Any]], make: Callable[[], Rule]) -> list[Score]:
    return [Score(r, first_detection(make, r["loss"])) for r in runs]


def _fmt(v: object) -> str:
    return "-" if v is None else str(v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--dir", type=Path, default=FIXTURES)
    args = parser.parse_args(argv)
    runs = load_runs(args.dir)
    print(
        "| rule | set | healthy FP | diverging: early / missed | delay vs onset median (max)"
        " | delay vs departure median (max) |"
    )
    print("|---|---|---|---|---|---|")
    for name, make in RULES.items():
        for set_name in ("tune", "holdout"):
            subset = [r for r in runs if r["set"] == set_name]
            s = summarize(score_all(subset, make))
            print(
                f"| {name} | {set_name} | {s['fp_healthy']}/{s['healthy']} | "
                f"{s['early']} / {s['missed']} of {s['diverging']} | "
                f"{_fmt(s['median_onset'])} ({_fmt(s['max_onset'])}) | "
                f"{_fmt(s['median_dep'])} ({_fmt(s['max_dep'])}) |"
            )
    print()
    names = list(RULES)
    header = "| run | kind | onset | departure | ours: step (vs onset / vs departure) | "
    header += " | ".join(n.split(" (")[0] if n != names[0] else "" for n in names[1:]) + " |"
    print(
        "| run | kind | onset | departure | ours: step (Δonset / Δdeparture) | "
        + " | ".join(names[1:])
        + " |"
    )
    print("|---|---|---|---|---|" + "---|" * (len(names) - 1))
    all_scores = {n: score_all(runs, m) for n, m in RULES.items()}
    for i, run in enumerate(runs):
        cells = []
        for n in names:
            s = all_scores[n][i]
            if s.step is None:
                cells.append("no" if not run["diverges"] else "**missed**")
            elif not run["diverges"]:
                cells.append(f"**FP @{s.step}**")
            else:
                tag = "**early** " if s.false_positive else ""
                cells.append(f"{tag}{s.step} ({s.delay('onset')} / {s.delay('departure')})")
        print(
            f"| {run['name']} | {run['kind']} | {_fmt(run['onset'])} | "
            f"{_fmt(run['departure'])} | " + " | ".join(cells) + " |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
