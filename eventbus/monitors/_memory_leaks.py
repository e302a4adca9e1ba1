"""`MemoryProfiler`'s leak report: the leak rule on RSS and on CUDA allocated memory, its verdicts
logged and published as `MemoryLeakSuspected`.

Pure bookkeeping on numbers already read (`eventbus.monitors._memory_read` reads them): no
torch call, no device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eventbus.events import Event, MemoryLeakSuspected
from eventbus.log import get_logger
from eventbus.monitors._leak_rule import LeakRule, LeakVerdict
from eventbus.monitors._memory_summary import Reading

__all__ = ["LeakWatch"]


class LeakWatch:
    """One `LeakRule` per watched metric (`rss_mb`, `allocated_mb`) and the verdicts so far."""

    def __init__(
        self, *, window: int, min_growth_mb: float, cooldown: int | None, warmup: int
    ) -> None:
        self.rules = {
            m: LeakRule(
                window=window,
                min_growth_mb=min_growth_mb,
                cooldown=cooldown,
                warmup=warmup,
            )
            for m in ("rss_mb", "allocated_mb")
        }
        self.verdicts: list[LeakVerdict] = []

    def check(self, r: Reading, publish: Callable[[Event], None]) -> None:
        """Feed `r` to each metric's rule; log and `publish` each leak it suspects."""
        for metric, value in (("rss_mb", r.rss), ("allocated_mb", r.allocated)):
            if value is None:
                continue
            v = self.rules[metric].update(r.step, value)
            if v is None:
                continue
            self.verdicts.append(v)
            get_logger().warning(
                "memory grows steadily: leak suspected",
                metric=metric,
                step=v.step,
                rate_mb_per_step=round(v.rate_mb_per_step, 3),
                growth_mb=round(v.growth_mb, 1),
                window=v.window,
            )
            publish(
                MemoryLeakSuspected(
                    step=v.step, rate_mb_per_step=v.rate_mb_per_step, window=v.window, metric=metric
                )
            )

    def state_dict(self) -> dict[str, Any]:
        """Each rule's window, by metric."""
        return {m: r.state_dict() for m, r in self.rules.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (metrics not watched here are ignored)."""
        for m, s in state.items():
            if m in self.rules:
                self.rules[m].load_state_dict(s)
