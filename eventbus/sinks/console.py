"""ConsoleProgress: a progress bar for interactive runs (step, loss, steps/s, ETA).

The ETA is `SpeedMonitor`'s `TimeEstimate` when one arrives (windowed, warm-up left out,
counted down between estimates), else this bar's own average rate. Uses tqdm when installed
(`pip install 'eventbus[progress]'`), else a plain line every `refresh_interval` seconds.
Quiet when the stream is not a terminal (a log file, CI) unless `force=True`. Lossy on
purpose (`policy = "latest"`): a progress bar only needs the newest. A second `RunStarted`
(a new run on the same bus) starts a bar of its own.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time
from typing import IO, Any, ClassVar

from eventbus.events import (
    DivergenceDetected,
    Event,
    Loss,
    MemoryLeakSuspected,
    RunEnded,
    RunStarted,
    StepEnded,
    StopRequested,
    TimeEstimate,
)
from eventbus.sinks._text import describe
from eventbus.steps import known_total

__all__ = ["ConsoleProgress"]


class ConsoleProgress:
    """Show step, loss, steps/s and, when the total is known (`RunStarted.total_steps` or
    `total=`), the ETA; print detections and stop requests above the bar."""

    events: ClassVar[tuple[type[Event], ...]] = (
        RunStarted,
        Loss,
        StepEnded,
        DivergenceDetected,
        MemoryLeakSuspected,
        StopRequested,
        RunEnded,
        TimeEstimate,
    )
    policy: ClassVar[str] = "latest"
    maxsize: ClassVar[int] = 64
    ranks: ClassVar[tuple[int, ...]] = (0,)
    name: ClassVar[str] = "progress"

    def __init__(
        self,
        *,
        total: int | None = None,
        stream: IO[str] | None = None,
        force: bool | None = None,
        refresh_interval: float = 0.5,
        use_tqdm: bool | None = None,
        desc: str | None = None,
    ) -> None:
        """`force=None` shows progress only on a terminal; True always; False never."""
        if refresh_interval < 0:
            raise ValueError(f"refresh_interval must be >= 0, got {refresh_interval!r}")
        self.stream: IO[str] = stream if stream is not None else sys.stderr
        if force is None:
            isatty = getattr(self.stream, "isatty", None)
            force = bool(isatty()) if callable(isatty) else False
        self.enabled = force
        has_tqdm = importlib.util.find_spec("tqdm") is not None
        if use_tqdm and not has_tqdm:
            raise ImportError("use_tqdm=True needs tqdm: pip install 'eventbus[progress]'")
        self.use_tqdm = has_tqdm if use_tqdm is None else use_tqdm
        self.total = total
        self._given_total = total
        self.refresh_interval = refresh_interval
        self.desc = desc
        self._bar: Any = None
        self._initial = 0
        self._step: int | None = None
        self._loss: float | None = None
        self._t0: tuple[float, int] | None = None  # (monotonic, step) at the first step seen
        self._estimate: tuple[float, float] | None = None  # (eta_s, monotonic when received)
        self._last_print = 0.0

    def on_events(self, batch: list[Event]) -> None:
        """Update the bar with the newest step and loss; print notable events."""
        if not self.enabled:
            return
        for ev in batch:
            match ev:
                case RunStarted():
                    if self._step is not None:
                        self._show(final=True)
                        self._end_line()  # a new run on the same bus: its own line and ETA
                    self.total = known_total(ev.total_steps) or self._given_total  # 0: none
                    self._initial = ev.resumed_from_step or 0
                case Loss():
                    if ev.split == "train":
                        self._loss = _float(ev.value)
                    self._at(ev.step)
                case StepEnded():
                    self._at(ev.step)
                case TimeEstimate():
                    self._estimate = (float(ev.eta_s), time.monotonic())
                    self.total = self.total or ev.total_steps or None
                    self._at(ev.step)
                case RunEnded():
                    self._message(
                        f"run {ev.status} at step {self._step}"
                        + (f": {ev.reason}" if ev.reason else "")
                    )
                case _:
                    self._message(describe(ev))
        self._show()

    def on_close(self) -> None:
        """Draw the final state and release the terminal line."""
        if not self.enabled:
            return
        self._show(final=True)
        self._end_line()

    def _end_line(self) -> None:
        """Release the terminal line and forget the run's steps, rate and estimate."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._step is not None:
            self.stream.write("\n")
            self.stream.flush()
        self._step = self._t0 = self._estimate = self._loss = None

    # -- drawing -----------------------------------------------------------------------------

    def _at(self, step: int | None) -> None:
        if step is None:
            return
        if self._t0 is None:
            self._t0 = (time.monotonic(), step)
        if self._step is None or step > self._step:
            self._step = step

    def _postfix(self) -> str:
        parts = [] if self._loss is None else [f"loss={self._loss:.4g}"]
        eta = self._monitor_eta(time.monotonic())
        if eta is not None:
            parts.append(f"ETA {_hms(eta)}")  # SpeedMonitor's, next to tqdm's own
        return ", ".join(parts)

    def _monitor_eta(self, now: float) -> float | None:
        """SpeedMonitor's last estimate, counted down since it arrived (None before one)."""
        if self._estimate is None:
            return None
        eta_s, received = self._estimate
        return max(0.0, eta_s - (now - received))

    def _show(self, *, final: bool = False) -> None:
        if self._step is None:
            return
        if self.use_tqdm:
            self._show_tqdm()
        else:
            self._show_plain(final)

    def _show_tqdm(self) -> None:
        from tqdm import tqdm

        bar = self._bar
        if bar is None:
            bar = self._bar = tqdm(
                total=self.total,
                initial=self._initial,
                file=self.stream,
                unit="step",
                desc=self.desc,
                mininterval=self.refresh_interval,
                dynamic_ncols=True,
                leave=True,
            )
        if self.total is not None and bar.total != self.total:
            bar.total = self.total
        bar.set_postfix_str(self._postfix(), refresh=False)
        step = self._step or 0
        if step > bar.n:
            bar.update(step - bar.n)

    def _show_plain(self, final: bool) -> None:
        now = time.monotonic()
        if not final and now - self._last_print < self.refresh_interval:
            return
        self._last_print = now
        step = self._step or 0
        parts = [f"step {step}" + (f"/{self.total}" if self.total else "")]
        if self._loss is not None:
            parts.append(f"loss={self._loss:.4g}")
        rate = self._rate(now)
        if rate:
            parts.append(f"{rate:.2f} steps/s")
        eta = self._monitor_eta(now)
        if eta is None and rate and self.total and step < self.total:
            eta = (self.total - step) / rate
        if eta is not None:
            parts.append(f"ETA {_hms(eta)}")
        self.stream.write("\r" + "  ".join(parts) + "   ")
        self.stream.flush()

    def _rate(self, now: float) -> float | None:
        if self._t0 is None or self._step is None:
            return None
        t0, s0 = self._t0
        return (self._step - s0) / (now - t0) if now > t0 and self._step > s0 else None

    def _message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            self.stream.write(
                ("\n" if self._step is not None and not self.use_tqdm else "") + text + "\n"
            )
            self.stream.flush()


def _float(v: Any) -> float | None:
    try:
        return float(v)  # a float already (tensors reach subscribers as floats)
    except (TypeError, ValueError):
        return None


def _hms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"
