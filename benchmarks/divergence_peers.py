"""Score DivergenceRule and simple renditions of peer rules on the recorded runs.

    .venv/bin/python benchmarks/divergence_peers.py         # summary table (markdown)
    .venv/bin/python benchmarks/divergence_peers.py --runs  # and the per-run table
    .venv/bin/python benchmarks/divergence_peers.py --runs --before REV  # and the rule at REV

Runs come from tests/fixtures/divergence/*.json (made by make_runs.py there). A healthy
run scores a false positive if a rule fires at all; a diverging run that fires before its
onset scores "early"; the others are scored by the delay from onset and from the step the
loss visibly departs, under three definitions (`DEPARTURES`; make_runs.py computes them):
strict (first step beyond the pre-onset max or 1.5x median: often a single noise step) and
sustained at 1.5x / 2x (first step from which 10 values stay above that multiple of the
pre-onset median). A negative delay: fired after onset but before that departure. "late":
runs detected more than `LATE` steps after the sustained 1.5x departure.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import types
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eventbus.monitors._divergence_rule import DivergenceRule

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "divergence"
# Departure definitions scored side by side, and the fixture field each is stored in
# (computed by tests/fixtures/divergence/make_runs.py: `departures()` there says how).
DEPARTURES = {
    "strict": "departure",
    "sustained 1.5x": "departure_s15",
    "sustained 2x": "departure_s2",
}
SETS = ("tune", "holdout", "fresh", "blind")  # table order; other set names follow, sorted
LATE = 2  # the budget of issue #18: detected at most this many steps after departure


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


def rule_at(rev: str) -> Callable[[], Rule]:
    """`DivergenceRule` as git revision `rev` had it: the "before" of a before/after table."""
    path = "eventbus/monitors/_divergence_rule.py"
    cmd = ["git", "-C", str(ROOT), "show", f"{rev}:{path}"]
    got = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if got.returncode != 0:
        raise SystemExit(f"--before {rev}: git cannot show {path} there: {got.stderr.strip()}")
    module = types.ModuleType(f"_divergence_rule_at_{rev}")
    sys.modules[module.__name__] = module  # dataclasses look their module up by name
    exec(compile(got.stdout, f"{rev}:{path}", "exec"), module.__dict__)
    rule: Callable[[], Rule] = module.DivergenceRule
    return rule


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

    def delay(self, field: str) -> int | None:
        """Steps from the run's `field` (onset or a departure) to detection."""
        ref = self.run.get(field)
        if self.step is None or not self.run["diverges"] or ref is None:
            return None
        return self.step - int(ref)


def summarize(scores: list[Score]) -> dict[str, Any]:
    healthy = [s for s in scores if not s.run["diverges"]]
    div = [s for s in scores if s.run["diverges"]]
    out: dict[str, Any] = {
        "healthy": len(healthy),
        "fp_healthy": sum(s.false_positive for s in healthy),
        "diverging": len(div),
        "early": sum(s.false_positive for s in div),
        "missed": sum(s.missed for s in div),
    }
    for name, field in {"onset": "onset", **DEPARTURES}.items():
        delays = [d for s in div if not s.false_positive and (d := s.delay(field)) is not None]
        out[name] = (statistics.median(delays), max(delays)) if delays else None
        out[f"late {name}"] = sum(d > LATE for d in delays)
    return out


def score_all(runs: list[dict[str, Any]], make: Callable[[], Rule]) -> list[Score]:
    return [Score(r, first_detection(make, r["loss"])) for r in runs]


def _fmt(v: object) -> str:
    return "-" if v is None else str(v)


def _pair(v: tuple[float, int] | None) -> str:
    return "-" if v is None else f"{v[0]:g} ({v[1]})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dir", type=Path, default=FIXTURES)
    parser.add_argument("--runs", action="store_true", help="also print the per-run table")
    parser.add_argument("--before", metavar="REV", help="also score DivergenceRule at git REV")
    args = parser.parse_args(argv)
    rules = dict(RULES)
    if args.before:
        rules = {f"DivergenceRule @{args.before} (before)": rule_at(args.before), **rules}
    runs = load_runs(args.dir)
    present = {r["set"] for r in runs}
    sets = [name for name in SETS if name in present] + sorted(present - set(SETS))
    print(
        "| rule | set | healthy FP | diverging: early / missed | delay median (max) vs: onset | "
        + " | ".join(f"{d} departure" for d in DEPARTURES)
        + f" | > {LATE} late vs sustained 1.5x |"
    )
    print("|---|---|---|---|---|" + "---|" * (len(DEPARTURES) + 1))
    for name, make in rules.items():
        for set_name in sets:
            s = summarize(score_all([r for r in runs if r["set"] == set_name], make))
            print(
                f"| {name} | {set_name} | {s['fp_healthy']}/{s['healthy']} | "
                f"{s['early']} / {s['missed']} of {s['diverging']} | {_pair(s['onset'])} | "
                + " | ".join(_pair(s[d]) for d in DEPARTURES)
                + f" | {s['late sustained 1.5x']} |"
            )
    if not args.runs:
        return 0
    print()
    names = list(rules)
    print("| run | kind | onset | departure: strict / s1.5x / s2x | " + " | ".join(names) + " |")
    print("|---|---|---|---|" + "---|" * len(names))
    all_scores = {n: score_all(runs, m) for n, m in rules.items()}
    for i, run in enumerate(runs):
        cells = []
        for n in names:
            sc = all_scores[n][i]
            if sc.step is None:
                cells.append("no" if not run["diverges"] else "**missed**")
            elif not run["diverges"]:
                cells.append(f"**FP @{sc.step}**")
            else:
                tag = "**early** " if sc.false_positive else ""
                deltas = " / ".join(_fmt(sc.delay(f)) for f in DEPARTURES.values())
                cells.append(f"{tag}{sc.step} ({deltas})")
        deps = " / ".join(_fmt(run.get(f)) for f in DEPARTURES.values())
        print(
            f"| {run['name']} | {run['kind']} | {_fmt(run['onset'])} | {deps} | "
            + " | ".join(cells)
            + " |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
