"""`SpeedMonitor`: step time, throughput and MFU from `StepEnded`, as `Scalars` every N steps.

Step time is `StepEnded.duration_s` when the loop gives it, else the wall-clock gap between
consecutive `StepEnded` events (their publish `ts`, divided by the steps between them when
some were not seen). Figures are windowed over the last `window` steps, after dropping the
first `warmup_steps` (compilation, cold caches, the optimizer allocating its state).

When the run's length is known (`RunStarted.total_steps`, or `total_steps=`), each publish
also carries a `TimeEstimate`: the steps left at the window's wall-clock rate (publish `ts` of
its first and last `StepEnded`, so time between steps, data loading included, counts).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import ClassVar

from eventbus.core import BusHandle
from eventbus.events import Event, RunStarted, Scalars, StepEnded, TimeEstimate
from eventbus.steps import known_total

__all__ = ["SpeedMonitor"]


class _Step:
    __slots__ = ("samples", "seconds", "steps", "tokens")

    def __init__(self, seconds: float, steps: int, samples: int | None, tokens: int | None):
        self.seconds = seconds
        self.steps = steps
        self.samples = samples
        self.tokens = tokens


class SpeedMonitor:
    """Publishes `Scalars` with "speed/..." keys at every multiple of `every` steps (and once
    at close for the steps left over).

    MFU needs `peak_flops` (the hardware's peak FLOP/s for the run's dtype, all devices the
    step uses) and either `flops_per_step` or `flops_per_token` (e.g. 6 x parameters for a
    decoder-only transformer's training step). `total_steps` (else `RunStarted.total_steps`)
    adds a `TimeEstimate` (the ETA) to each publish.
    """

    events: ClassVar[tuple[type[Event], ...]] = (StepEnded, RunStarted)
    policy: ClassVar[str] = "drop_oldest"
    maxsize: ClassVar[int] = 10_000
    name = "speed"

    def __init__(
        self,
        *,
        every: int = 10,
        window: int = 50,
        warmup_steps: int = 1,
        flops_per_step: float | None = None,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        prefix: str = "speed/",
        total_steps: int | None = None,
    ) -> None:
        for name, v, lo in (
            ("every", every, 1),
            ("window", window, 1),
            ("warmup_steps", warmup_steps, 0),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        if total_steps is not None and (
            not isinstance(total_steps, int) or isinstance(total_steps, bool) or total_steps < 1
        ):
            raise ValueError(f"total_steps must be an int >= 1 or None, got {total_steps!r}")
        for name, f in (
            ("flops_per_step", flops_per_step),
            ("flops_per_token", flops_per_token),
            ("peak_flops", peak_flops),
        ):
            if f is not None and not (isinstance(f, int | float) and math.isfinite(f) and f > 0):
                raise ValueError(f"{name} must be a positive finite number, got {f!r}")
        if flops_per_step is not None and flops_per_token is not None:
            raise ValueError("give flops_per_step or flops_per_token, not both")
        if (flops_per_step is not None or flops_per_token is not None) != (peak_flops is not None):
            raise ValueError(
                "MFU needs both the model's FLOPs (flops_per_step= or flops_per_token=) and "
                "the hardware's peak_flops= (FLOP/s); give both or neither"
            )
        self.every = every
        self.window = window
        self.warmup_steps = warmup_steps
        self.flops_per_step = flops_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.prefix = prefix
        self.total_steps = total_steps  # given: wins over RunStarted.total_steps
        self.last_estimate: TimeEstimate | None = None
        self._run_total: int | None = None
        self._clock: deque[tuple[int, int]] = deque(maxlen=window + 1)  # (step, ts) after warmup
        self._bus: BusHandle | None = None
        self._steps: deque[_Step] = deque(maxlen=window)
        self._prev: tuple[int, int] | None = None  # (step, ts) of the last StepEnded
        self._seen = 0
        self._last_step: int | None = None
        self._last_published: int | None = None

    def on_start(self, bus: BusHandle) -> None:
        """Keep the bus to publish on."""
        self._bus = bus

    async def on_events(self, batch: list[Event]) -> None:
        """Fold each StepEnded into the window; publish every `every` steps."""
        for ev in batch:
            if isinstance(ev, StepEnded) and ev.step is not None:
                self.update(ev)
            elif isinstance(ev, RunStarted):
                self._run_total = known_total(ev.total_steps)  # 0 or less: no ETA

    def on_close(self) -> None:
        """Publish what the last `every` steps left unpublished."""
        if self._last_step is not None and self._last_step != self._last_published:
            self._publish(self._last_step)

    def update(self, ev: StepEnded) -> dict[str, float] | None:
        """Add one step; the figures when this step is due for publishing (else None)."""
        step = ev.step
        assert step is not None
        prev = self._prev
        if prev is not None and step <= prev[0]:  # a resume or a new run: start afresh
            self._steps.clear()
            self._clock.clear()
            prev = self._last_published = None
            self._seen = 0
        if ev.ts is not None:
            self._prev = (step, ev.ts)
        gap = step - prev[0] if prev is not None else 1
        if ev.duration_s is not None:
            seconds, steps = float(ev.duration_s), 1
        elif prev is not None and ev.ts is not None:
            seconds, steps = (ev.ts - prev[1]) / 1e9, gap  # steps we did not see share the gap
        else:
            seconds, steps = math.nan, 1  # the first step without duration_s: no interval
        self._seen += 1
        self._last_step = step
        if self._seen > self.warmup_steps and math.isfinite(seconds) and seconds >= 0:
            self._steps.append(_Step(seconds, steps, ev.samples, ev.tokens))
        if self._seen >= self.warmup_steps and ev.ts is not None:
            self._clock.append((step, ev.ts))  # the last warm-up step's end starts the clock
        last = self._last_published
        if (
            (step // self.every > last // self.every)
            if last is not None
            else (step % self.every == 0)
        ):
            return self._publish(step)
        return None

    def figures(self) -> dict[str, float]:
        """The windowed figures now, keyed like the published `Scalars`."""
        w = list(self._steps)
        seconds = sum(s.seconds for s in w)
        steps = sum(s.steps for s in w)
        if not w or seconds <= 0:
            return {}
        p = self.prefix
        out = {
            f"{p}step_time_s": seconds / steps,
            f"{p}step_time_median_s": statistics.median(s.seconds / s.steps for s in w),
            f"{p}steps_per_s": steps / seconds,
        }
        for key, attr in (("samples_per_s", "samples"), ("tokens_per_s", "tokens")):
            known = [s for s in w if getattr(s, attr) is not None]
            t = sum(s.seconds for s in known)
            if known and t > 0:
                out[f"{p}{key}"] = sum(getattr(s, attr) for s in known) / t
        achieved: float | None = None
        if self.flops_per_step is not None:
            achieved = self.flops_per_step * out[f"{p}steps_per_s"]
        elif self.flops_per_token is not None and f"{p}tokens_per_s" in out:
            achieved = self.flops_per_token * out[f"{p}tokens_per_s"]
        if achieved is not None and self.peak_flops is not None:
            out[f"{p}flops_per_s"] = achieved
            out[f"{p}mfu"] = achieved / self.peak_flops
        return out

    def estimate(self, step: int) -> TimeEstimate | None:
        """The time left after `step` at the window's rate, when the total is known."""
        total = self.total_steps or self._run_total
        if total is None:
            return None
        rate: float | None = None
        if len(self._clock) >= 2:
            (s0, t0), (s1, t1) = self._clock[0], self._clock[-1]
            if t1 > t0 and s1 > s0:
                rate = (s1 - s0) / ((t1 - t0) / 1e9)  # wall clock: time between steps counts
        if rate is None:  # no publish timestamps: the step times alone
            rate = self.figures().get(f"{self.prefix}steps_per_s")
        if not rate:
            return None
        left = max(0, total - step)
        return TimeEstimate(step=step, eta_s=left / rate, total_steps=total, steps_per_s=rate)

    def _publish(self, step: int) -> dict[str, float] | None:
        values = self.figures()
        if not values:
            return None
        self._last_published = step
        eta = self.last_estimate = self.estimate(step)
        if self._bus is not None:
            self._bus.publish(Scalars(step=step, values=dict(values)))
            if eta is not None:  # an event of its own: a "latest" display keeps it apart
                self._bus.publish(eta)
        return values
