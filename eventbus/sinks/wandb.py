"""WandbSink: the event catalogue in a Weights & Biases run, logged off the training thread.

The real `wandb` client runs in this subscriber's worker thread, in the bus's sidecar by
default: `wandb.init` at `on_start`, then one `run.log(values, step=s)` per step present in a
drained batch (never one per scalar). The names are TensorBoardSink's (`eventbus.sinks._scalars`):
`train/loss`, `train/lr`, `train/grad_norm`, `eval/{metric}`, `memory/{field}`, `perf/...`,
`eventbus/...`, each `Scalars` key as given. NaN and ±Inf are logged as floats: W&B shows them.

`RunStarted.config` updates the run's config (its `run_id` names the run when `run_name` is
not given). `DivergenceDetected`, `MemoryLeakSuspected` and `StopRequested` become W&B alerts
and summary fields (the summary alone where the client refuses the alert). `RunEnded` finishes
the run: `exit_code` 0 for completed or stopped, 1 otherwise, `run/status` in the summary.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from eventbus.core import BusHandle
from eventbus.events import (
    DivergenceDetected,
    Event,
    MemoryLeakSuspected,
    RunEnded,
    RunStarted,
    StopRequested,
)
from eventbus.log import RateLimiter, get_logger
from eventbus.sinks._files import BuiltFromArguments, check_ranks, check_writable_dir, made_with
from eventbus.sinks._scalars import StepClock, num
from eventbus.sinks._tb_summaries import texts_of
from eventbus.sinks._trackers import SUCCEEDED, require

__all__ = ["WandbSink", "WandbStats"]

_MODES = (None, "online", "offline", "disabled", "shared")
# Set by the sink itself: `name` is `run_name`; the rest are named arguments already.
_OWN = frozenset({"name", "project", "config", "mode", "dir"})


@dataclass(frozen=True, slots=True)
class WandbStats:
    """What a WandbSink sent to W&B (the sidecar copy's, when it runs there)."""

    logged: int = 0  # run.log calls: one per step present in a drained batch
    values: int = 0  # scalars logged
    late: int = 0  # scalars for a step before the last one logged: logged at that step
    alerts: int = 0  # detections and stops sent as W&B alerts
    alerts_refused: int = 0  # alerts the client refused: in the summary only (logged)
    runs: int = 0  # W&B runs opened
    skipped: int = 0  # events after a RunEnded and before the next RunStarted: no run open


class WandbSink(BuiltFromArguments):
    """Log the event catalogue to a W&B run (see the module doc for what goes where).

    `project`, `run_name`, `config`, `mode` ("online", "offline", "disabled", "shared"; None:
    W&B's own default, `WANDB_MODE`) and `dir` go to `wandb.init`, as does any other keyword
    it takes (`entity=`, `group=`, `tags=`, `id=`, `resume=`, `settings=`, ...). Each W&B run is
    made with `reinit="create_new"`, so a run of your own stays as it is.
    """

    events: ClassVar[tuple[type[Event], ...]] = (Event,)
    policy: ClassVar[str] = "drop_oldest"  # a tracker never stalls training; drops counted
    maxsize: ClassVar[int] = 100_000
    max_batch: ClassVar[int] = 2048
    ranks: tuple[int, ...] | None = (0,)
    name: ClassVar[str] = "wandb"

    def __init__(
        self,
        project: str | None = None,
        *,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        mode: str | None = None,
        dir: str | os.PathLike[str] | None = None,  # wandb.init's own name
        ranks: Iterable[int] | None = (0,),
        **init_kwargs: Any,
    ) -> None:
        cls, made = made_with(locals(), WandbSink)  # first: what the sidecar needs
        require("wandb", "WandbSink", "wandb")
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES[1:]} or None, got {mode!r}")
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f"config must be a dict, got {type(config).__name__}")
        _check_init_kwargs(init_kwargs)
        self.ranks: tuple[int, ...] | None = check_ranks(ranks)
        made.update(made.pop("init_kwargs"), ranks=self.ranks)  # a spent generator: its tuple
        self._made_with = (cls, made)
        self.project = project
        self.run_name = run_name
        self.config = dict(config or {})
        self.mode = mode
        self.dir = None if dir is None else check_writable_dir(Path(dir), "WandbSink")
        self.init_kwargs = init_kwargs
        self._run: Any = None  # the open W&B run; None after RunEnded
        self._clock = StepClock()
        self._logged_step = -1  # the last step given to run.log (W&B's steps only increase)
        self._bus_rank = 0
        self._counts = dict.fromkeys(WandbStats.__slots__, 0)
        self._refused_log = RateLimiter(60.0)

    # -- subscriber hooks (run in this subscriber's worker thread) ---------------------------

    def on_start(self, bus: BusHandle | None = None) -> None:
        """Open the W&B run (`wandb.init`)."""
        if bus is not None:
            self._bus_rank = bus.rank
        self._open()

    def on_events(self, batch: list[Event]) -> None:
        """Log the batch's scalars, one `run.log` per step; alerts and summary fields."""
        rows: dict[int, dict[str, float]] = {}  # step -> values (with its first event's time)
        for ev in batch:
            rank = self._bus_rank if ev.rank is None else ev.rank
            if self.ranks is not None and rank not in self.ranks:
                continue  # replaying several ranks' logs: only the chosen ranks are logged
            if isinstance(ev, RunStarted) and self._run is None:
                self._open()  # a second run on the same bus
            if self._run is None:
                self._counts["skipped"] += 1
                continue
            for tag, value, step in self._clock.scalars(ev, rank):
                row = rows.get(step)
                if row is None:
                    row = rows[step] = {} if ev.ts is None else {"_timestamp": ev.ts / 1e9}
                row[tag] = value
            if isinstance(ev, RunStarted):
                self._started(ev)
            elif isinstance(ev, DivergenceDetected | MemoryLeakSuspected | StopRequested):
                self._flag(ev, self._clock.step_of(ev, rank))
            elif isinstance(ev, RunEnded):
                self._log(rows)
                rows = {}
                self._end(ev)
        self._log(rows)

    def on_close(self) -> None:
        """Finish a run that saw no RunEnded (W&B writes what it holds)."""
        run, self._run = self._run, None
        if run is not None:
            run.finish()

    def stats(self) -> WandbStats:
        """Log calls, values, alerts and runs (the sidecar copy's, when it runs there)."""
        return self.reported_or(WandbStats, lambda: WandbStats(**self._counts))

    # -- the W&B run --------------------------------------------------------------------------

    def _open(self) -> None:
        import wandb

        args: dict[str, Any] = {
            "project": self.project,
            "name": self.run_name,
            "config": dict(self.config),
            "mode": self.mode,
            "dir": None if self.dir is None else str(self.dir),
            "reinit": "create_new",  # never finish or reuse a run the user opened
        }
        args = {k: v for k, v in args.items() if v is not None}
        self._run = wandb.init(**{**args, **self.init_kwargs})
        self._logged_step = -1
        self._counts["runs"] += 1

    def _log(self, rows: dict[int, dict[str, float]]) -> None:
        """One `run.log` per step, in step order, at its events' own time (`_timestamp`); a
        step below the last logged is logged at that one (W&B would drop it), counted `late`."""
        run = self._run
        if run is None or not rows:
            return
        merged: dict[int, dict[str, float]] = {}
        for step in sorted(rows):
            values = rows[step]
            at = max(step, self._logged_step)
            if at != step:
                self._counts["late"] += len(values) - ("_timestamp" in values)
                values.pop("_timestamp", None)  # the row logged at `at` keeps its own time
            merged.setdefault(at, {}).update(values)
            self._logged_step = at
        for step, values in merged.items():
            run.log(values, step=step)  # NaN and ±Inf as floats: W&B shows them as such
            self._counts["logged"] += 1
            self._counts["values"] += len(values) - ("_timestamp" in values)

    def _started(self, ev: RunStarted) -> None:
        run = self._run
        if ev.config:
            run.config.update(ev.config, allow_val_change=True)
        if self.run_name is None and ev.run_id:
            run.name = ev.run_id
        info = {
            "run/run_id": ev.run_id,
            "run/world_size": ev.world_size,
            "run/total_steps": ev.total_steps,
            "run/resumed_from_step": ev.resumed_from_step,
        }
        run.summary.update({k: v for k, v in info.items() if v is not None})

    def _flag(self, ev: Event, step: int) -> None:
        """A detection or a stop: summary fields, and an alert where the client takes one."""
        level = "WARN"
        if isinstance(ev, DivergenceDetected):
            title = "eventbus: divergence detected"
            level = "ERROR"
            summary = {
                "divergence/step": step,
                "divergence/metric": ev.metric,
                "divergence/value": num(ev.value),
                "divergence/baseline": num(ev.baseline),
                "divergence/reason": ev.reason,
            }
        elif isinstance(ev, MemoryLeakSuspected):
            title = "eventbus: memory leak suspected"
            summary = {
                "memory/leak_step": step,
                "memory/leak_metric": ev.metric,
                "memory/leak_window": ev.window,
            }
        else:
            assert isinstance(ev, StopRequested)
            kind = "abort" if ev.abort else "stop"
            title = f"eventbus: {kind} requested"
            level = "ERROR" if ev.abort else "WARN"
            summary = {
                "run/stop_step": step,
                "run/stop_kind": kind,
                "run/stop_reason": ev.reason,
                "run/stop_source": ev.source,
            }
        self._run.summary.update({k: v for k, v in summary.items() if v is not None})
        text = next((t for _, t in texts_of(ev, step)), title)
        self._alert(title, text, level)

    def _alert(self, title: str, text: str, level: str) -> None:
        try:
            self._run.alert(title=title, text=text, level=level)
        except Exception as e:  # wandb's own refusal (offline, a version without alerts)
            self._counts["alerts_refused"] += 1
            log, held = self._refused_log.allow("alert")
            if log:
                get_logger().warning(
                    "W&B refused an alert; it is in the run's summary only",
                    title=title,
                    error=f"{type(e).__name__}: {e}",
                    refused_so_far=self._counts["alerts_refused"],
                    not_logged_since=held,
                )
            return
        self._counts["alerts"] += 1

    def _end(self, ev: RunEnded) -> None:
        run, self._run = self._run, None
        run.summary.update({"run/status": ev.status, "run/reason": ev.reason or ""})
        run.finish(exit_code=0 if ev.status in SUCCEEDED else 1)


def _check_init_kwargs(kwargs: Mapping[str, Any]) -> None:
    """Keywords `wandb.init` would refuse fail here, where they were written (wandb is
    imported for this only when there are some)."""
    if "name" in kwargs:
        raise TypeError("WandbSink takes the run's name as run_name=, not name=")
    if not kwargs:
        return
    import inspect

    import wandb

    known = set(inspect.signature(wandb.init).parameters) - _OWN
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(
            f"WandbSink: wandb.init() takes no argument {', '.join(map(repr, unknown))}; "
            f"it takes {', '.join(sorted(known))}"
        )
