"""What `eventbus summary` and `eventbus plot` read out of a recorded run.

One pass over `read_log(..., records=True, located=True)` collects the series (loss, grad norm,
lr, memory, step time), the detections, the bus's stats records and the seq numbers seen. Each
event's fields are checked as it is read, so a bad value is reported as `file:line: ...`.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eventbus.cli._checks import MEMORY_FIELDS, as_float, check_event
from eventbus.events import (
    BusCost,
    DivergenceDetected,
    EvalEnded,
    Event,
    Loss,
    MemoryLeakSuspected,
    MemorySample,
    OptimizerStepped,
    RankUnresponsive,
    RunEnded,
    RunStarted,
    StallDetected,
    StallEnded,
    StepEnded,
    StopRequested,
    StragglerDetected,
    TimeEstimate,
)
from eventbus.logformat import (
    HEADER_TYPE,
    SKIPPED_TYPE,
    STATS_TYPE,
    LogLine,
    LogReadError,
    PathLike,
    read_log,
)

__all__ = ["Point", "RunReport", "SeqCounter", "collect"]

Point = tuple[int, float]


class SeqCounter:
    """Counts the seq numbers missing from one bus session, whatever order they arrive in.

    Threads publishing at once make file order differ from seq order, so a loss is a number
    never seen, not a step backwards. Memory stays bounded: numbers below the low-water mark
    are forgotten, and a hole still open after `window` later numbers arrived is set aside as
    a range (shrunk again if its numbers turn up late).
    """

    def __init__(self, window: int = 4096) -> None:
        self.window = window
        self.start: int | None = None  # the lowest seq seen
        self.high = -1  # the highest seq seen
        self.low = 0  # every seq in [start, low) was seen or lies in `holes`
        self.ahead: set[int] = set()  # seen, above `low`
        self._heap: list[int] = []  # `ahead` as a heap, for its minimum
        self.holes: list[tuple[int, int]] = []  # [a, b) ranges never seen, sorted
        self.duplicates = 0

    def add(self, seq: int) -> None:
        """Note one seq number."""
        if self.start is None:
            self.start, self.low, self.high = seq, seq + 1, seq
            return
        self.high = max(self.high, seq)
        if seq < self.start:  # the session began lower than the first line showed
            if seq + 1 < self.start:
                self.holes.insert(0, (seq + 1, self.start))
            self.start = seq
        elif seq < self.low:
            self._late(seq)
        elif seq in self.ahead:
            self.duplicates += 1
        elif seq == self.low:
            self.low += 1
            self._advance()
        else:
            self.ahead.add(seq)
            heapq.heappush(self._heap, seq)
            if len(self.ahead) > self.window:
                self.holes.append((self.low, self._heap[0]))
                self.low = self._heap[0]
                self._advance()

    def _advance(self) -> None:
        heap = self._heap
        while heap and heap[0] == self.low:
            self.ahead.discard(heapq.heappop(heap))
            self.low += 1

    def _late(self, seq: int) -> None:
        i = bisect.bisect_right(self.holes, seq, key=lambda h: h[0]) - 1
        if i >= 0 and self.holes[i][0] <= seq < self.holes[i][1]:
            a, b = self.holes[i]
            self.holes[i : i + 1] = [h for h in ((a, seq), (seq + 1, b)) if h[0] < h[1]]
        else:
            self.duplicates += 1

    @property
    def missing(self) -> int:
        """Seq numbers between the lowest and the highest seen that were never seen."""
        inside = self.high + 1 - self.low - len(self.ahead) if self.high >= self.low else 0
        return sum(b - a for a, b in self.holes) + inside


@dataclass
class RunReport:
    """Everything read from one run's logs (all ranks); series from the lowest rank."""

    files: list[str] = field(default_factory=list)
    events: int = 0
    ranks: set[int] = field(default_factory=set)
    first_ts: int | None = None
    last_ts: int | None = None
    steps: set[int] = field(default_factory=set)
    loss: dict[str, list[Point]] = field(default_factory=lambda: defaultdict(list))
    eval_metrics: dict[str, list[Point]] = field(default_factory=lambda: defaultdict(list))
    lr: list[Point] = field(default_factory=list)
    grad_norm: list[Point] = field(default_factory=list)
    memory: dict[str, list[Point]] = field(default_factory=lambda: defaultdict(list))
    step_time: list[Point] = field(default_factory=list)
    step_end_ts: list[int] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0
    detections: list[Event] = field(default_factory=list)
    stats_records: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0
    run_started: RunStarted | None = None
    run_ended: RunEnded | None = None
    bus_cost: BusCost | None = None  # the last one
    time_estimate: TimeEstimate | None = None  # SpeedMonitor's last ETA
    fresh_starts: dict[str, int] = field(default_factory=dict)  # file -> RunStarted, no resume
    # (file, session: headers seen in it, rank) -> seq numbers seen
    seqs: dict[tuple[str, int, int], SeqCounter] = field(default_factory=dict)
    _sessions: dict[str, int] = field(default_factory=dict)
    _rank0: int | None = None

    @property
    def several_runs(self) -> str | None:
        """A warning when a file holds several runs one after the other (each began with a
        RunStarted that resumed nothing): their steps mix in every figure."""
        many = {Path(p).name: n for p, n in self.fresh_starts.items() if n > 1}
        if not many:
            return None
        held = ", ".join(f"{name} holds {n} runs" for name, n in many.items())
        return (
            f"{held}, one after the other: their steps are mixed here (eventbus now writes "
            "each run to a place of its own: DIR/run-2, ...)"
        )

    @property
    def seq_gaps(self) -> int:
        """Events missing from the logs: seq numbers never seen, per file, session and rank."""
        return sum(c.missing for c in self.seqs.values())

    @property
    def seq_duplicates(self) -> int:
        """Seq numbers seen more than once in one session (one event written twice)."""
        return sum(c.duplicates for c in self.seqs.values())

    def add(self, line: LogLine) -> None:
        """Fold one line (an event, or an "eventbus.*" record dict) into the report.

        Raises `ValueError` naming the field when a value cannot be used.
        """
        item, path = line.item, str(line.path)
        if isinstance(item, dict):
            kind = item.get("type")
            if kind == HEADER_TYPE:
                self._sessions[path] = self._sessions.get(path, 0) + 1
            elif kind == STATS_TYPE:
                self.stats_records.append(item)
            elif kind == SKIPPED_TYPE:
                self.skipped += 1
                self._seq(path, item.get("rank"), item.get("seq"))
            return
        ev = item
        self.events += 1
        rank = ev.rank if ev.rank is not None else 0
        self.ranks.add(rank)
        if self._rank0 is None or rank < self._rank0:
            self._rank0 = rank
        if ev.ts is not None:
            self.first_ts = ev.ts if self.first_ts is None else min(self.first_ts, ev.ts)
            self.last_ts = ev.ts if self.last_ts is None else max(self.last_ts, ev.ts)
        self._seq(path, rank, ev.seq)
        check_event(ev)
        if type(ev) is RunStarted and ev.resumed_from_step is None:
            self.fresh_starts[path] = self.fresh_starts.get(path, 0) + 1
        if isinstance(
            ev,
            DivergenceDetected
            | MemoryLeakSuspected
            | StopRequested
            | StallDetected
            | StallEnded
            | StragglerDetected
            | RankUnresponsive,
        ):
            self.detections.append(ev)
        elif rank == self._rank0:  # series and throughput from one rank (the lowest)
            self._series(ev)

    def _seq(self, path: str, rank: Any, seq: Any) -> None:
        if type(seq) is int:
            key = (path, self._sessions.get(path, 0), rank if type(rank) is int else 0)
            counter = self.seqs.get(key)
            if counter is None:
                counter = self.seqs[key] = SeqCounter()
            counter.add(seq)

    def _series(self, ev: Event) -> None:
        step = ev.step
        if isinstance(ev, StepEnded):
            self._step_ended(ev)
        elif isinstance(ev, RunStarted):
            self.run_started = ev
        elif isinstance(ev, RunEnded):
            self.run_ended = ev
        elif isinstance(ev, BusCost):
            self.bus_cost = ev
        elif isinstance(ev, TimeEstimate):
            eta = as_float(ev.eta_s)
            if eta is None or not math.isfinite(eta) or type(ev.total_steps) is not int:
                raise ValueError("TimeEstimate needs a finite eta_s and an integer total_steps")
            self.time_estimate = ev
        elif step is None:
            return
        elif isinstance(ev, Loss):
            v = as_float(ev.value)
            if v is not None:
                self.loss[ev.split].append((step, v))
                if ev.split == "train":
                    self.steps.add(step)
        elif isinstance(ev, OptimizerStepped):
            for name, series in (("lr", self.lr), ("grad_norm", self.grad_norm)):
                v = as_float(getattr(ev, name))
                if v is not None:
                    series.append((step, v))
        elif isinstance(ev, EvalEnded):
            for k, x in ev.metrics.items():
                v = as_float(x)
                if v is not None:
                    self.eval_metrics[str(k)].append((step, v))
        elif isinstance(ev, MemorySample):
            for name in MEMORY_FIELDS:
                v = as_float(getattr(ev, name))
                if v is not None:
                    self.memory[name].append((step, v))

    def _step_ended(self, ev: StepEnded) -> None:
        step = ev.step
        if step is not None:
            self.steps.add(step)
        d = as_float(ev.duration_s)
        if ev.ts is not None:
            if d is None and self.step_end_ts:
                d = (ev.ts - self.step_end_ts[-1]) / 1e9
            self.step_end_ts.append(ev.ts)
        if d is not None and step is not None:
            self.step_time.append((step, d))
        self.samples += ev.samples or 0
        self.tokens += ev.tokens or 0


def collect(files: Iterable[PathLike]) -> RunReport:
    """A report of these logs; `LogReadError` names `file:line` of anything it cannot use."""
    paths = [Path(p) for p in files]
    r = RunReport(files=[str(p) for p in paths])
    for line in read_log(paths, records=True, located=True):
        try:
            r.add(line)
        except ValueError as e:
            raise LogReadError(f"{line.where}: {e}") from None
        except Exception as e:  # a value no check foresaw: still name the line
            raise LogReadError(
                f"{line.where}: cannot use this line: {type(e).__name__}: {e}"
            ) from None
    return r
