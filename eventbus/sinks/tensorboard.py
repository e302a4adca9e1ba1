"""TensorBoardSink: events as TensorBoard scalars, histograms and text, written off the loop.

The real `torch.utils.tensorboard.SummaryWriter` runs in this subscriber's worker thread (its
`on_events` is sync), never on the training thread. It flushes every `flush_secs` (5 s, not
torch's 120) and at close, so the last scalars of a short run are on disk. One rank writes
by default: two writers in one directory confuse TensorBoard's reader.

Tags: `{split}/loss` (train/loss), each `Scalars` key as given, `train/lr`, `train/grad_norm`,
`eval/{metric}`, `memory/{field}`, `perf/step_time_s`, `perf/steps_per_s`,
`perf/samples_per_s`, `perf/tokens_per_s`, `{kind}/{name}/{stat}` and the histogram
`{kind}/{name}` for TensorStats, text `run/config`, `divergence/detected` (+ scalar
`divergence/marker` = 1 at the step), `memory/leak_suspected`, `run/stop`, `run/ended`.
`RunStarted.config` reaches the HParams plugin at `RunEnded` (or close), with the run's
`{split}/loss` and `eval/{metric}` tags as its metrics.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from eventbus.core import BusHandle
from eventbus.events import (
    CheckpointLoaded,
    EvalEnded,
    Event,
    Loss,
    RunEnded,
    RunStarted,
    TensorStats,
)
from eventbus.log import RateLimiter, get_logger
from eventbus.sinks._files import BuiltFromArguments, check_ranks, check_writable_dir, made_with
from eventbus.sinks._runs import is_resume, rebuilt_on, run_dir, run_place
from eventbus.sinks._scalars import scalars as _scalars
from eventbus.sinks._tb_summaries import (
    HParamsRun,
    Unusable,
    histogram,
    hparams_summaries,
    texts_of,
)

__all__ = ["TensorBoardSink", "TensorBoardStats"]


@dataclass(frozen=True, slots=True)
class TensorBoardStats:
    """What a TensorBoardSink wrote beyond scalars, and what it could not use."""

    histograms: int = 0
    histograms_unusable: int = 0  # TensorStats.histogram of a shape it cannot draw (logged)
    hparams_runs: int = 0  # runs whose config reached the HParams plugin


class TensorBoardSink(BuiltFromArguments):
    """Write the event catalogue to TensorBoard under `log_dir` (see the module doc for tags).

    `resume_from_step=N` (or `load_state_dict({"step": N})`, a `CheckpointLoaded`, or a
    `RunStarted(resumed_from_step=N)`) opens the writer with `purge_step=N + 1`, so steps
    logged after the checkpoint disappear from TensorBoard. `ranks=None` lets every rank
    write, each under `log_dir/rank{r}`.
    """

    events: ClassVar[tuple[type[Event], ...]] = (Event,)
    policy: ClassVar[str] = "drop_oldest"  # never stall training for a dashboard; drops counted
    maxsize: ClassVar[int] = 100_000
    max_batch: ClassVar[int] = 2048
    ranks: tuple[int, ...] | None = (0,)
    name: ClassVar[str] = "tensorboard"

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        flush_secs: float = 5.0,
        resume_from_step: int | None = None,
        ranks: Iterable[int] | None = (0,),
        max_queue: int = 1000,
    ) -> None:
        self._made_with = made_with(locals(), TensorBoardSink)  # first: what the sidecar needs
        if importlib.util.find_spec("tensorboard") is None:
            raise ImportError(
                "TensorBoardSink needs the tensorboard package: pip install 'eventbus[tensorboard]'"
            )
        # Imported here, on the constructing thread: a first `import torch` in our worker
        # thread would race the training thread's own use of a half-imported torch.
        import torch.utils.tensorboard  # noqa: F401

        if flush_secs <= 0:
            raise ValueError(f"flush_secs must be > 0 seconds, got {flush_secs!r}")
        if resume_from_step is not None and not isinstance(resume_from_step, int):
            raise TypeError(f"resume_from_step must be an int step, got {resume_from_step!r}")
        self.ranks: tuple[int, ...] | None = check_ranks(ranks)
        self._made_with[1]["ranks"] = self.ranks  # a generator given is spent: its tuple
        self.log_dir = check_writable_dir(Path(log_dir), "TensorBoardSink")
        self.flush_secs = flush_secs
        self.max_queue = max_queue
        self._purge_step = None if resume_from_step is None else resume_from_step + 1
        self._restarted = False  # rebuilt after the sidecar died: append to its run
        self._run_dir: Path | None = None  # chosen at the first events
        self._writers: dict[int, Any] = {}
        # (rank, step) -> ([(tag, value)], walltime of the first event): this batch's scalars
        self._pending: dict[tuple[int, int], tuple[list[tuple[str, float]], float | None]] = {}
        self._bus_rank = 0
        self._last_step: dict[int, int] = {}
        self._last_step_end: dict[int, int] = {}  # rank -> ts of the previous StepEnded
        self._hparams: dict[int, HParamsRun] = {}  # rank -> its run's config and metric tags
        self._counts = {"histograms": 0, "histograms_unusable": 0, "hparams_runs": 0}
        self._unusable_log = RateLimiter(30.0)  # one warning per 30 s, with the count

    # -- subscriber hooks (run in this subscriber's worker thread) ---------------------------

    def on_start(self, bus: BusHandle | None = None) -> None:
        """Learn this process's rank (events without one are written as this rank's)."""
        if bus is not None:
            self._bus_rank = bus.rank
        last = run_place(lambda n: run_dir(self.log_dir, n), self._used, resume=True)
        if rebuilt_on(bus, self._files(last)):  # its sidecar died: append to its run
            self._purge_step, self._restarted = None, True

    def on_events(self, batch: list[Event]) -> None:
        """Write each event's scalars, histograms and text."""
        if self._run_dir is None:  # a run's first events: say whether it resumes the last
            self._run_dir = self._place(resume=is_resume(batch))
        for ev in batch:
            rank = self._bus_rank if ev.rank is None else ev.rank
            if self.ranks is not None and rank not in self.ranks:
                continue  # replaying several ranks' logs: only the chosen ranks write
            self._write(ev, rank)
        self._write_scalars()

    def _write_scalars(self) -> None:
        """One TensorBoard event per (rank, step) holding all of the batch's scalars for it:
        `add_scalar` costs ~100 us a value here, a summary of 7 values ~110 us in all."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        pending, self._pending = self._pending, {}
        for (rank, step), (values, wall) in pending.items():
            summary = Summary(value=[Summary.Value(tag=tag, simple_value=v) for tag, v in values])
            self._writer(rank).file_writer.add_summary(summary, step, wall)

    def on_flush(self) -> None:
        """Flush every open writer to disk."""
        for w in self._writers.values():
            w.flush()

    def on_close(self) -> None:
        """Write the HParams of runs without a RunEnded, then flush and close the writers."""
        for rank in list(self._hparams):
            self._write_hparams(rank, None)
        writers, self._writers = self._writers, {}
        for w in writers.values():
            w.close()

    def stats(self) -> TensorBoardStats:
        """Histograms written and refused, runs given to the HParams plugin (the sidecar's copy
        when it runs there)."""
        return self.reported_or(TensorBoardStats, lambda: TensorBoardStats(**self._counts))

    def state_dict(self) -> dict[str, Any]:
        """The last step written (a checkpoint's resume point)."""
        return {"step": max(self._last_step.values(), default=None)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state["step"]`: later steps are purged from TensorBoard."""
        step = state.get("step")
        if step is not None:
            self._resume(int(step))

    @property
    def run_dir(self) -> Path:
        """Where this run writes: `log_dir`, or `log_dir/run-N` when an earlier run wrote
        there and this one does not resume it (`eventbus.sinks._runs`)."""
        return self._place(resume=False) if self._run_dir is None else self._run_dir

    def _place(self, *, resume: bool) -> Path:
        """The run directory: a new one, or the newest for a resume (said here or before)."""
        resume = resume or self._restarted or self._purge_step is not None
        return run_place(lambda n: run_dir(self.log_dir, n), self._used, resume=resume)

    def _used(self, d: Path) -> bool:
        """An earlier run wrote this rank's TensorBoard files in run directory `d`."""
        return any(self._files(d))

    def _files(self, d: Path) -> Iterator[Path]:
        """This rank's TensorBoard files in run directory `d`."""
        single = self.ranks is not None and len(self.ranks) == 1
        return (d if single else d / f"rank{self._bus_rank}").glob("events.out.tfevents.*")

    # -- writing ------------------------------------------------------------------------------

    def _resume(self, step: int) -> None:
        """Purge from `step + 1` on: TensorBoard hides what was logged after it."""
        purge = step + 1
        if self._purge_step == purge and not self._writers:
            return
        self._purge_step = purge  # a writer opened from now on starts with it
        for w in self._writers.values():
            _purge(w, purge)
        for r, s in list(self._last_step.items()):
            self._last_step[r] = min(s, step)

    def _writer(self, rank: int) -> Any:
        w = self._writers.get(rank)
        if w is None:
            from torch.utils.tensorboard import SummaryWriter

            single = self.ranks is not None and len(self.ranks) == 1
            self._run_dir = base = self.run_dir  # chosen for good once a file is opened
            d = base if single else base / f"rank{rank}"
            w = SummaryWriter(
                str(d),
                purge_step=self._purge_step,
                flush_secs=self.flush_secs,
                max_queue=self.max_queue,
            )
            self._writers[rank] = w
        return w

    def _write(self, ev: Event, rank: int) -> None:
        if isinstance(ev, CheckpointLoaded) and ev.step is not None:
            self._write_scalars()  # what came before the resume goes to the old writer
            self._resume(ev.step)
            return
        if isinstance(ev, RunStarted):
            self._hparams[rank] = HParamsRun(ev.config)
            if ev.resumed_from_step is not None:
                self._write_scalars()
                self._resume(ev.resumed_from_step)
        step = ev.step
        if step is None:
            step = self._last_step.get(rank, 0)
        elif step > self._last_step.get(rank, -1):
            self._last_step[rank] = step
        wall = ev.ts / 1e9 if ev.ts is not None else None
        scalars = list(_scalars(ev, step, self._last_step_end, rank))
        texts = list(texts_of(ev, step))
        hist = self._histogram(ev) if isinstance(ev, TensorStats) else None
        run = self._hparams.get(rank)
        if run is not None and isinstance(ev, Loss | EvalEnded):
            run.metrics.update((tag, v) for tag, v, _ in scalars)
        if isinstance(ev, RunEnded):
            self._write_scalars()  # the metrics' last values before the session ends
            self._write_hparams(rank, ev.status)
        if not (scalars or texts or hist):
            return
        for tag, value, s in scalars:  # written together at the end of the batch
            self._pending.setdefault((rank, s), ([], wall))[0].append((tag, value))
        if not (texts or hist):
            return
        w = self._writer(rank)
        for tag, text in texts:
            w.add_text(tag, text, step, walltime=wall)
        if hist is not None and isinstance(ev, TensorStats):
            tag = f"{ev.kind}/{ev.name}" if ev.name else ev.kind
            if hist[0] == "raw":
                w.add_histogram_raw(tag, global_step=step, walltime=wall, **hist[1])
            else:
                w.add_histogram(tag, hist[1], step, walltime=wall)
            self._counts["histograms"] += 1

    def _histogram(self, ev: TensorStats) -> tuple[str, Any] | None:
        """What to write for `ev.histogram`; a shape it cannot use is counted and logged."""
        h = histogram(ev.histogram)
        if not isinstance(h, Unusable):
            return h
        self._counts["histograms_unusable"] += 1
        log, held = self._unusable_log.allow("histogram")
        if log:
            get_logger().warning(
                "TensorStats.histogram not written: " + h.reason,
                name=f"{ev.kind}/{ev.name}",
                unusable_so_far=self._counts["histograms_unusable"],
                not_logged_since=held,
            )
        return None

    def _write_hparams(self, rank: int, status: str | None) -> None:
        """The run's config and metric tags to the HParams plugin, once per RunStarted."""
        run = self._hparams.pop(rank, None)
        if run is None:
            return
        fw = self._writer(rank).file_writer
        for summary in hparams_summaries(run, status):
            fw.add_summary(summary, self._last_step.get(rank, 0))
        self._counts["hparams_runs"] += 1


def _purge(writer: Any, step: int) -> None:
    """What `SummaryWriter(purge_step=step)` writes first, written into an open file: a new
    file would be read after the old one only if its name sorted later, and within one second
    TensorBoard's names end in a counter that sorts "10" before "9"."""
    from tensorboard.compat.proto.event_pb2 import Event as TBEvent
    from tensorboard.compat.proto.event_pb2 import SessionLog

    start = SessionLog(status=SessionLog.START)
    writer.file_writer.add_event(TBEvent(step=step, session_log=start))
