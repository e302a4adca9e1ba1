"""What `eventbus.bench.run` returns: per-variant figures, as a table, a dict or a plot."""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["BenchResult", "VariantResult", "environment", "percentile"]


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank `q` quantile (0 < q <= 1) of values sorted ascending."""
    n = len(sorted_values)
    return sorted_values[min(n - 1, max(0, math.ceil(q * n) - 1))]


@dataclass(frozen=True, slots=True)
class VariantResult:
    """One variant's figures; times in ms, CPU in ms per timed step, None where not measured."""

    name: str  # "bare", "inline:NAME", "bus:NAME", "bus:all", "process:NAME"
    kind: str  # "bare", "inline", "bus", "all" or "process"
    skipped: str | None = None  # why it did not run (a subscriber the sidecar cannot take)
    step_ms_p50: float | None = None  # over every timed step of every round
    step_ms_p99: float | None = None
    step_ms_mean: float | None = None  # what sets the run's wall time (GIL stalls are bimodal)
    ratio_p50: float | None = None  # over bare's
    ratio_p99: float | None = None
    delta_ms_p50: float | None = None  # what it adds to a step: the median over rounds of its
    # p50 less bare's p50 in the same round
    train_cpu_ms: float | None = None  # the training thread's CPU (`time.thread_time`)
    bus_cpu_ms: float | None = None  # the rest of this process (bus thread, workers, ...)
    sidecar_cpu_ms: float | None = None  # the sidecar process (process variants)
    syncs_per_step: float | None = None  # device syncs (CUDA only, an untimed pass)
    close_ms: float | None = None  # after the last step: subscribers catching up, then close
    delivered: int = 0  # events handled, over every run (warm-up included)
    dropped: int = 0
    failed: int = 0
    errors: tuple[str, ...] = ()  # subscribers' last errors, and other notes
    round_p50_ms: tuple[float, ...] = ()  # each round's p50, in the order the rounds ran

    @classmethod
    def skip(cls, name: str, kind: str, why: str) -> VariantResult:
        """A variant that could not run, and why."""
        return cls(name, kind, skipped=why)

    @classmethod
    def measured(
        cls,
        name: str,
        kind: str,
        times_ns: Sequence[int],
        *,
        bare: VariantResult | None,
        rounds: int = 1,
        **figures: Any,
    ) -> VariantResult:
        """Figures from every timed step's duration (`rounds` runs of equal length, in round
        order), compared with `bare` (None: it is bare)."""
        ms = sorted(t / 1e6 for t in times_ns)
        p50, p99 = percentile(ms, 0.5), percentile(ms, 0.99)
        base50 = p50 if bare is None else bare.step_ms_p50
        base99 = p99 if bare is None else bare.step_ms_p99
        per = max(1, len(times_ns) // max(1, rounds))
        chunks = [sorted(times_ns[i : i + per]) for i in range(0, len(times_ns), per)]
        by_round = tuple(percentile(c, 0.5) / 1e6 for c in chunks if c)
        # Paired by round (bare ran in the same round, beside it), then the median: a round
        # that something else disturbed moves both, or only one of several pairs.
        base = bare.round_p50_ms if bare is not None else by_round
        pairs = [a - b for a, b in zip(by_round, base, strict=True)]
        return cls(
            name,
            kind,
            step_ms_p50=p50,
            step_ms_p99=p99,
            step_ms_mean=sum(ms) / len(ms),
            ratio_p50=p50 / base50 if base50 else None,
            ratio_p99=p99 / base99 if base99 else None,
            delta_ms_p50=statistics.median(pairs) if pairs else None,
            round_p50_ms=by_round,
            **figures,
        )


@dataclass(frozen=True)
class BenchResult:
    """Every variant's figures (`variants`, by name, in the table's order) and the setting."""

    step: str
    steps: int  # timed steps per variant and round
    rounds: int
    warmup: int
    subscribers: tuple[str, ...]
    variants: dict[str, VariantResult]
    syncs_counted: bool  # False without CUDA: syncs_per_step is None ("n/a")
    env: dict[str, str]

    def __getitem__(self, name: str) -> VariantResult:
        return self.variants[name]

    def as_dict(self) -> dict[str, Any]:
        """Plain dicts, lists and numbers, ready for JSON."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["subscribers"] = list(self.subscribers)
        out["variants"] = {n: dataclasses.asdict(v) for n, v in self.variants.items()}
        return out

    def table(self) -> str:
        """The figures as a text table, one row per variant, notes below."""
        head = (
            f"step {self.step}: {self.steps} steps x {self.rounds} rounds per variant "
            f"(warm-up {self.warmup}); {self.env.get('device', '?')}"
        )
        rows = [[c[0] for c in _COLUMNS]]
        notes: list[str] = []
        for v in self.variants.values():
            if v.skipped is not None:
                rows.append([v.name, "skipped"] + [""] * (len(_COLUMNS) - 2))
                notes.append(f"{v.name}: skipped: {v.skipped}")
                continue
            rows.append([v.name] + [fmt(v) for _, fmt in _COLUMNS[1:]])
            notes += [f"{v.name}: {e}" for e in v.errors]
        widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
        lines = [head, ""]
        for r in rows:
            cells = [r[0].ljust(widths[0])] + [
                c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)
            ]
            lines.append("  ".join(cells).rstrip())
        lines += ["", _LEGEND]
        lines += [" ".join(n.split()) for n in notes]
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str]) -> Path:
        """Step time (p50 bars, p99 marks) and CPU per step by variant, into a PNG."""
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt

        runs = [v for v in self.variants.values() if v.skipped is None]
        names = [v.name for v in runs]
        ys = list(range(len(runs)))
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.45 * len(runs) + 2.2), sharey=True)
        ax1.barh(ys, [v.step_ms_p50 or 0.0 for v in runs], color="tab:blue", label="p50")
        ax1.plot([v.step_ms_p99 or 0.0 for v in runs], ys, "|", color="black", ms=12, label="p99")
        ax1.set_xlabel("step time (ms)")
        ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, fontsize=8)
        left = [0.0] * len(runs)
        for label, key in (("training thread", "train"), ("bus side", "bus"), ("sidecar", "sc")):
            vals = [_cpu(v, key) for v in runs]
            ax2.barh(ys, vals, left=left, label=label)
            left = [a + b for a, b in zip(left, vals, strict=True)]
        ax2.set_xlabel("CPU per step (ms)")
        ax2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, fontsize=8)
        ax1.set_yticks(ys, names)
        ax1.invert_yaxis()
        for ax in (ax1, ax2):
            ax.grid(axis="x", alpha=0.3)
        fig.suptitle(f"eventbus bench: {self.step}", fontsize=10)
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out


def environment() -> dict[str, str]:
    """Where the figures were taken: Python, torch, CPUs, the device."""
    import torch

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "cpus": str(os.cpu_count()),
        "device": torch.cuda.get_device_name() if cuda else "CPU (no CUDA device)",
    }


def _cpu(v: VariantResult, key: str) -> float:
    value = {"train": v.train_cpu_ms, "bus": v.bus_cpu_ms, "sc": v.sidecar_cpu_ms}[key]
    return value or 0.0


def _num(value: float | None, spec: str = ".2f", *, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _dash(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else f"{value:{spec}}"


_COLUMNS: list[tuple[str, Callable[[VariantResult], str]]] = [
    ("variant", lambda v: v.name),
    ("p50 ms", lambda v: _num(v.step_ms_p50)),
    ("p99 ms", lambda v: _num(v.step_ms_p99)),
    ("mean ms", lambda v: _num(v.step_ms_mean)),
    ("vs bare", lambda v: _num(v.ratio_p50, suffix="x")),
    ("p99 vs bare", lambda v: _num(v.ratio_p99, suffix="x")),
    ("+p50 ms", lambda v: _num(v.delta_ms_p50, "+.2f")),
    ("train CPU", lambda v: _num(v.train_cpu_ms)),
    ("bus CPU", lambda v: _num(v.bus_cpu_ms)),
    ("sidecar CPU", lambda v: _dash(v.sidecar_cpu_ms)),
    ("syncs", lambda v: _num(v.syncs_per_step, ".1f")),
    ("close ms", lambda v: _num(v.close_ms, ".0f")),
    ("delivered", lambda v: f"{v.delivered:,}"),
    ("dropped", lambda v: f"{v.dropped:,}"),
    ("failed", lambda v: f"{v.failed:,}"),
]

_LEGEND = (
    "p50/p99/mean: step wall time over every timed step; vs bare: ratio to bare's; +p50: median "
    "over rounds of p50 less bare's p50 in the same round; CPU columns: "
    "ms per step (bus CPU: this process less the training thread); syncs: device syncs per "
    "step (n/a without CUDA); close: subscribers catching up after the last step, then close; "
    "delivered/dropped/failed: events, over all rounds with warm-up."
)
