"""Running the variants in interleaved rounds, and what is measured around each step.

    warm-up: `warmup` bare steps, once
    round r: every variant once, the order rotated by r (drift and heat spread evenly)
      open the variant (fresh subscribers, a bus)      not timed
      `warmup` steps, then wait for the subscribers    not timed
      `steps` steps, each timed (perf_counter_ns)      step time; training-thread CPU
      wait for the subscribers, then close             close time; bus-side and sidecar CPU
    on CUDA: one more pass per variant, untimed, counting device syncs (sync debug mode "warn")

Bus-side CPU is the process's CPU (`time.process_time`) less the training thread's
(`time.thread_time`), from the first timed step until the subscribers caught up: the bus
thread, subscriber workers, and any other thread (torch's intra-op pool: bare's row shows it).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import psutil

from eventbus.bench.report import BenchResult, VariantResult, environment
from eventbus.bench.sources import BenchError, StepFn, check_step, load_step, sources
from eventbus.bench.variants import BARE, Counts, Session, Variant, plan

__all__ = ["Progress", "cuda_available", "run"]

Progress = Callable[[int, int, str], None]
"""Called after each variant run with (runs done, runs in all, the variant's name)."""

SYNC_STEPS = 20  # steps of the sync-counting pass, at most


def run(
    step: StepFn | str,
    subscribers: Iterable[Any] | str,
    *,
    steps: int = 200,
    rounds: int = 5,
    warmup: int = 20,
    only: Iterable[str] | None = None,
    count_syncs: bool | None = None,
    progress: Progress | None = None,
) -> BenchResult:
    """Time `step(n, bus)` bare, with each subscriber inline, on the bus, all on the bus and
    in the sidecar; `count_syncs` (default: when CUDA is available) adds the sync pass."""
    _count("steps", steps, 1)
    _count("rounds", rounds, 1)
    _count("warmup", warmup, 0)
    fn = load_step(step) if isinstance(step, str) else check_step(step)
    srcs = sources(subscribers)
    variants = plan(srcs, only)
    live = [v for v in variants if v.skipped is None]
    syncs = cuda_available() if count_syncs is None else count_syncs
    if syncs and count_syncs and not cuda_available():
        raise BenchError("count_syncs=True needs a CUDA device; torch sees none")
    tallies = {v.name: _Tally() for v in live}
    total, done = rounds * len(live) + (len(live) if syncs else 0), 0
    _steps(fn, Variant(BARE, BARE).open().bus, 1, warmup, BARE)
    for r in range(rounds):
        k = r % len(live)
        for v in live[k:] + live[:k]:
            _once(v, fn, steps, warmup, tallies[v.name])
            done += 1
            if progress is not None:
                progress(done, total, v.name)
    if syncs:
        for v in live:
            tallies[v.name].syncs = _count_syncs(v, fn, min(steps, SYNC_STEPS), warmup)
            done += 1
            if progress is not None:
                progress(done, total, f"{v.name} (device syncs)")
    bare = tallies[BARE].result(variants[0], None)
    results = {
        v.name: VariantResult.skip(v.name, v.kind, v.skipped)
        if v.skipped is not None
        else tallies[v.name].result(v, bare)
        for v in variants
    }
    return BenchResult(
        step=_step_name(step, fn),
        steps=steps,
        rounds=rounds,
        warmup=warmup,
        subscribers=tuple(s.name for s in srcs),
        variants=results,
        syncs_counted=syncs,
        env=environment(),
    )


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (decided once per bench run)."""
    import torch

    return bool(torch.cuda.is_available())


@dataclass
class _Tally:
    """One variant's figures, summed over its rounds."""

    times_ns: list[int] = field(default_factory=list)
    steps: int = 0
    train_cpu_s: float = 0.0
    bus_cpu_s: float = 0.0
    sidecar_cpu_s: float | None = None
    close_s: list[float] = field(default_factory=list)
    counts: list[Counts] = field(default_factory=list)
    settled: bool = True
    syncs: float | None = None

    def result(self, v: Variant, bare: VariantResult | None) -> VariantResult:
        errors = tuple(dict.fromkeys(e for c in self.counts for e in c.errors))
        if not self.settled:
            errors += ("its subscribers did not catch up in time: CPU figures are partial",)
        n = max(1, self.steps)
        return VariantResult.measured(
            v.name,
            v.kind,
            self.times_ns,
            bare=bare,
            rounds=len(self.close_s),
            train_cpu_ms=self.train_cpu_s * 1e3 / n,
            bus_cpu_ms=self.bus_cpu_s * 1e3 / n,
            sidecar_cpu_ms=None if self.sidecar_cpu_s is None else self.sidecar_cpu_s * 1e3 / n,
            syncs_per_step=self.syncs,
            close_ms=sorted(self.close_s)[len(self.close_s) // 2] * 1e3,
            delivered=sum(c.delivered for c in self.counts),
            dropped=sum(c.dropped for c in self.counts),
            failed=sum(c.failed for c in self.counts),
            errors=errors,
        )


def _once(v: Variant, fn: StepFn, steps: int, warmup: int, tally: _Tally) -> None:
    """One run of `v`: warm up, settle, time `steps` steps, settle, close; add to `tally`."""
    session = _open(v)
    try:
        _steps(fn, session.bus, 1, warmup, v.name)
        tally.settled &= session.settle()
        pid = session.sidecar_pid()  # process:, and bus:all with sidecar subscribers
        side0 = _cpu_of(pid)
        p0, c0 = time.process_time(), time.thread_time()
        tally.times_ns += _timed(fn, session.bus, warmup + 1, steps, v.name)
        c1, t0 = time.thread_time(), time.perf_counter()
        tally.settled &= session.settle()
        p1, c2, side1 = time.process_time(), time.thread_time(), _cpu_of(pid)
    except BaseException:
        with contextlib.suppress(Exception):
            session.close()
        raise
    tally.counts.append(session.close())
    tally.close_s.append(time.perf_counter() - t0)
    tally.steps += steps
    tally.train_cpu_s += c1 - c0
    tally.bus_cpu_s += max(0.0, (p1 - p0) - (c2 - c0))
    if side0 is not None and side1 is not None:
        tally.sidecar_cpu_s = (tally.sidecar_cpu_s or 0.0) + max(0.0, side1 - side0)


def _open(v: Variant) -> Session:
    try:
        return v.open()
    except BenchError:
        raise
    except (TypeError, ValueError, RuntimeError) as e:  # subscribe() refused it: say which
        raise BenchError(f"variant {v.name} could not start: {type(e).__name__}: {e}") from e


def _timed(fn: StepFn, bus: Any, first: int, n: int, variant: str) -> list[int]:
    """Each step's wall time in ns; a step that raises becomes a `BenchError` naming it."""
    out = [0] * n
    clock = time.perf_counter_ns
    i = 0
    try:
        for i in range(n):
            t0 = clock()
            fn(first + i, bus)
            out[i] = clock() - t0
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # user code may raise anything
        raise _raised(first + i, variant, e) from e
    return out


def _steps(fn: StepFn, bus: Any, first: int, n: int, variant: str) -> None:
    """`n` untimed steps (warm-up, the sync pass)."""
    step = first
    try:
        for step in range(first, first + n):
            fn(step, bus)
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        raise _raised(step, variant, e) from e


def _raised(step: int, variant: str, e: BaseException) -> BenchError:
    return BenchError(f"the step raised at step {step} ({variant}): {type(e).__name__}: {e}")


def _cpu_of(pid: int | None) -> float | None:
    """User + system CPU seconds of process `pid` (the sidecar), None if unreadable."""
    if pid is None:
        return None
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return float(t.user + t.system)


def _count_syncs(v: Variant, fn: StepFn, n: int, warmup: int) -> float:
    """Device syncs per step over `n` steps of `v`, untimed: torch's sync debug mode warns
    on each synchronising CUDA call (the training thread's and the bus threads')."""
    import torch

    session = _open(v)
    try:
        _steps(fn, session.bus, 1, warmup, v.name)
        session.settle()
        before = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                _steps(fn, session.bus, warmup + 1, n, v.name)
                session.settle()
            finally:
                torch.cuda.set_sync_debug_mode(before)
    finally:
        session.close()
    syncs = 0
    for w in caught:
        if "synchroniz" in str(w.message):
            syncs += 1
        else:  # not ours to swallow
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return syncs / n


def _count(name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        what = "a positive int" if least else "an int >= 0"
        raise BenchError(f"{name} must be {what}, got {value!r}")


def _step_name(step: StepFn | str, fn: StepFn) -> str:
    if isinstance(step, str):
        return step
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
