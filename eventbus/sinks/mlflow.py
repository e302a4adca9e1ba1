"""MLflowSink: the event catalogue in an MLflow run, logged off the training thread.

The real `mlflow.tracking.MlflowClient` runs in this subscriber's worker thread, in the bus's
sidecar by default. At `on_start` it gets (or creates) the experiment and creates the run;
each drained batch then becomes one `log_batch` (split only where MLflow's per-request limits
require): metrics named as TensorBoardSink's tags (`train/loss`, `eval/acc`, ...) with their
step and the event's own time, params, tags. NaN is logged as NaN; ±Inf as MLflow's store
keeps it (the SQL stores clamp it to ±1.8e308).

`RunStarted.config` becomes params: nested keys joined with "." (`model.layers`), values as
text cut to MLflow's `MAX_PARAM_VAL_LENGTH`, characters MLflow refuses in a key replaced by
"_"; one warning names every param cut or renamed. Tags: `eventbus.rank`,
`eventbus.world_size`, `eventbus.run_id` (also the run's name when `run_name` is not given),
detections and stops as `eventbus.divergence`, `eventbus.memory_leak`, `eventbus.stop`.
`RunEnded` ends the run: completed or stopped is FINISHED, failed (or unknown) FAILED,
aborted or interrupted KILLED.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson

from eventbus.core import BusHandle
from eventbus.events import (
    DivergenceDetected,
    Event,
    MemoryLeakSuspected,
    RunEnded,
    RunStarted,
    StopRequested,
)
from eventbus.log import get_logger
from eventbus.sinks._files import BuiltFromArguments, check_ranks, made_with
from eventbus.sinks._scalars import StepClock
from eventbus.sinks._tb_summaries import texts_of
from eventbus.sinks._trackers import require
from eventbus.sinks._tracking_uri import check_tracking_uri

__all__ = ["MLflowSink", "MLflowStats"]

STATUS = {  # RunEnded.status -> MLflow's RunStatus; anything else (unknown) is FAILED
    "completed": "FINISHED",
    "stopped": "FINISHED",  # asked to stop (early stopping, a monitor): it finished
    "failed": "FAILED",
    "aborted": "KILLED",
    "interrupted": "KILLED",
}
_FLAGS = {DivergenceDetected: "divergence", MemoryLeakSuspected: "memory_leak"}
_BAD_KEY = re.compile(r"[^\w./\- ]")  # what MLflow takes in a key, on every OS


@dataclass(frozen=True, slots=True)
class MLflowStats:
    """What an MLflowSink sent (the sidecar copy's, when it runs there)."""

    batches: int = 0  # log_batch calls
    metrics: int = 0  # metric values logged
    params: int = 0  # params logged
    params_truncated: int = 0  # values cut to MLflow's limit (a warning names them)
    keys_renamed: int = 0  # param, metric or tag keys with characters MLflow refuses
    params_refused: int = 0  # a param logged again with another value (MLflow keeps the first)
    runs: int = 0  # MLflow runs created
    skipped: int = 0  # events after a RunEnded and before the next RunStarted: no run open


class MLflowSink(BuiltFromArguments):
    """Log the event catalogue to an MLflow run (see the module doc for what goes where).

    `tracking_uri`: `http(s)://host:port`, `sqlite:///path.db`, `file:///dir`, a directory, ...
    (None: `MLFLOW_TRACKING_URI`, else MLflow's default in the current directory); checked
    here: an unreachable server or an unwritable path raises now. `experiment`: its name,
    created if missing (None: `MLFLOW_EXPERIMENT_NAME`, else MLflow's Default). `tags` are
    set on every run it creates.
    """

    events: ClassVar[tuple[type[Event], ...]] = (Event,)
    policy: ClassVar[str] = "drop_oldest"  # a tracker never stalls training; drops counted
    maxsize: ClassVar[int] = 100_000
    max_batch: ClassVar[int] = 2048
    ranks: tuple[int, ...] | None = (0,)
    name: ClassVar[str] = "mlflow"

    def __init__(
        self,
        tracking_uri: str | os.PathLike[str] | None = None,
        *,
        experiment: str | None = None,
        run_name: str | None = None,
        tags: Mapping[str, Any] | None = None,
        ranks: Iterable[int] | None = (0,),
    ) -> None:
        cls, made = made_with(locals(), MLflowSink)  # first: what the sidecar needs
        require("mlflow", "MLflowSink", "mlflow")
        for arg, v in (("experiment", experiment), ("run_name", run_name)):
            if v is not None and not isinstance(v, str):
                raise TypeError(f"{arg} must be a str or None, got {v!r}")
        if tags is not None and not isinstance(tags, Mapping):
            raise TypeError(f"tags must be a dict, got {type(tags).__name__}")
        uri = os.environ.get("MLFLOW_TRACKING_URI") if tracking_uri is None else tracking_uri
        self.tracking_uri = None if uri is None else os.fspath(uri)
        check_tracking_uri(self.tracking_uri, "MLflowSink")
        self.experiment = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or None
        self.ranks: tuple[int, ...] | None = check_ranks(ranks)
        # The sidecar logs to the store checked here, whatever its own environment says.
        made.update(tracking_uri=self.tracking_uri, experiment=self.experiment, ranks=self.ranks)
        self._made_with = (cls, made)
        self.run_name = run_name
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self.run_id: str | None = None  # the open MLflow run; None after RunEnded
        self._client: Any = None
        self._clock = StepClock()
        self._params: dict[str, str] = {}  # this run's params as logged (MLflow keeps the first)
        self._keys: dict[str, str] = {}  # key as given -> key as logged
        self._bus = (0, 1)  # rank, world size
        self._counts = dict.fromkeys(MLflowStats.__slots__, 0)

    # -- subscriber hooks (run in this subscriber's worker thread) ---------------------------

    def on_start(self, bus: BusHandle | None = None) -> None:
        """Get or create the experiment and create the run."""
        from mlflow.tracking import MlflowClient

        if bus is not None:
            self._bus = (bus.rank, bus.world_size)
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        self._open()

    def on_events(self, batch: list[Event]) -> None:
        """One `log_batch` for the batch's metrics, params and tags."""
        out = _Batch()
        for ev in batch:
            rank = self._bus[0] if ev.rank is None else ev.rank
            if self.ranks is not None and rank not in self.ranks:
                continue  # replaying several ranks' logs: only the chosen ranks are logged
            if isinstance(ev, RunStarted) and self.run_id is None:
                self._open()  # a second run on the same bus
            if self.run_id is None:
                self._counts["skipped"] += 1
                continue
            ms = time.time_ns() // 1_000_000 if ev.ts is None else ev.ts // 1_000_000
            for tag, value, step in self._clock.scalars(ev, rank):
                out.metrics.append((self._key(tag), value, ms, step))
            if isinstance(ev, RunStarted):
                self._started(ev, out)
            elif isinstance(ev, DivergenceDetected | MemoryLeakSuspected | StopRequested):
                step = self._clock.step_of(ev, rank)
                what = "stop" if isinstance(ev, StopRequested) else _FLAGS[type(ev)]
                out.tags[f"eventbus.{what}"] = next((t for _, t in texts_of(ev, step)), what)
            elif isinstance(ev, RunEnded):
                out.tags.update({"eventbus.status": ev.status, "eventbus.reason": ev.reason or ""})
                self._send(out)
                out = _Batch()
                self._end(STATUS.get(ev.status, "FAILED"), ms)
        self._send(out)

    def on_close(self) -> None:
        """End a run that saw no RunEnded as FINISHED (else MLflow shows it running)."""
        if self.run_id is not None:
            self._end("FINISHED", time.time_ns() // 1_000_000)

    def stats(self) -> MLflowStats:
        """Batches, metrics and params logged, what was cut or renamed (the sidecar copy's)."""
        return self.reported_or(MLflowStats, lambda: MLflowStats(**self._counts))

    # -- the MLflow run -----------------------------------------------------------------------

    def _open(self) -> None:
        rank, world = self._bus
        tags = {"eventbus.rank": str(rank), "eventbus.world_size": str(world), **self.tags}
        run = self._client.create_run(
            self._experiment_id(), run_name=self.run_name, tags=self._clean_tags(tags)
        )
        self.run_id = run.info.run_id
        self._params = {}
        self._counts["runs"] += 1

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        if self.experiment is None:
            return "0"  # MLflow's Default experiment
        found = self._client.get_experiment_by_name(self.experiment)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self._client.create_experiment(self.experiment))
        except MlflowException:  # another rank created it meanwhile
            found = self._client.get_experiment_by_name(self.experiment)
            if found is None:
                raise
            return str(found.experiment_id)

    def _end(self, status: str, ms: int) -> None:
        run_id, self.run_id = self.run_id, None
        self._client.set_terminated(run_id, status, end_time=ms)

    def _started(self, ev: RunStarted, out: _Batch) -> None:
        """The config as params (cut and renamed as MLflow requires, said once), run tags."""
        from mlflow.utils import validation

        limit = getattr(validation, "MAX_PARAM_VAL_LENGTH", 500)
        cut, renamed, refused = [], [], []
        for key, value in flatten(ev.config):
            k = self._key(key, warn=False)
            if k != key:
                renamed.append(f"{key} -> {k}")
            text = value[:limit]
            if len(value) > limit:
                cut.append(f"{k} ({len(value)} chars)")
            if self._params.get(k, text) != text or out.params.get(k, text) != text:
                refused.append(k)
                continue
            out.params[k] = text
        self._counts["params_truncated"] += len(cut)
        self._counts["params_refused"] += len(refused)
        if cut or renamed or refused:
            get_logger().warning(
                "MLflowSink: the run config's params were changed as MLflow requires",
                truncated_to=limit if cut else None,
                truncated=cut or None,
                renamed=renamed or None,
                kept_first_value=refused or None,
            )
        info = {
            "eventbus.run_id": ev.run_id,
            "eventbus.world_size": ev.world_size,
            "eventbus.total_steps": ev.total_steps,
            "eventbus.resumed_from_step": ev.resumed_from_step,
        }
        out.tags.update({k: str(v) for k, v in info.items() if v is not None})
        if self.run_name is None and ev.run_id:
            out.tags["mlflow.runName"] = ev.run_id

    def _send(self, out: _Batch) -> None:
        """`log_batch` once, or in as few calls as MLflow's per-request limits allow."""
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.utils import validation

        if self.run_id is None or not (out.metrics or out.params or out.tags):
            return
        max_tag = getattr(validation, "MAX_TAG_VAL_LENGTH", 5000)
        metrics = [Metric(k, v, ms, step) for k, v, ms, step in out.metrics]
        params = [Param(k, v) for k, v in out.params.items()]
        tags = [RunTag(k, v[:max_tag]) for k, v in self._clean_tags(out.tags).items()]
        for m, p, t in _chunks(metrics, params, tags, validation):
            self._client.log_batch(self.run_id, metrics=m, params=p, tags=t)
            self._counts["batches"] += 1
            self._counts["metrics"] += len(m)
            self._counts["params"] += len(p)
        self._params.update(out.params)

    def _key(self, key: str, *, warn: bool = True) -> str:
        """`key` as MLflow takes it (remembered; a renamed metric is said once)."""
        k = self._keys.get(key)
        if k is None:
            k = self._keys[key] = clean_key(key)
            if k != key:
                self._counts["keys_renamed"] += 1
                if warn:
                    get_logger().warning(
                        "MLflowSink: a key renamed as MLflow requires", key=key, to=k
                    )
        return k

    def _clean_tags(self, tags: Mapping[str, str]) -> dict[str, str]:
        return {self._key(k): v for k, v in tags.items()}


@dataclass(slots=True)
class _Batch:
    """What one drained batch logs: (key, value, ms, step) metrics, params, tags."""

    metrics: list[tuple[str, float, int, int]] = field(default_factory=list)
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)


def flatten(config: Mapping[Any, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(`a.b` key, value as text) for each leaf of `config`; lists and other values as JSON."""
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            yield from flatten(v, key + ".")
        elif isinstance(v, str):
            yield key, v
        elif v is None or isinstance(v, bool | int | float):
            yield key, str(v)  # as mlflow.log_param writes them (nan, inf included)
        else:
            try:
                yield key, orjson.dumps(v, option=orjson.OPT_NON_STR_KEYS, default=str).decode()
            except TypeError:
                yield key, repr(v)


def clean_key(key: str) -> str:
    """`key` with what MLflow refuses replaced: characters other than letters, digits, `_`,
    `-`, `.`, space and `/` become `_`; empty, `.` and `..` path parts go; 250 chars at most."""
    parts = [p if p not in (".", "..") else "_" * len(p) for p in _BAD_KEY.sub("_", key).split("/")]
    return "/".join(p for p in parts if p)[:250] or "_"


def _chunks(
    metrics: list[Any], params: list[Any], tags: list[Any], validation: Any
) -> Iterator[tuple[list[Any], list[Any], list[Any]]]:
    """Slices within MLflow's per-request limits (one slice in a usual batch)."""
    max_m = getattr(validation, "MAX_METRICS_PER_BATCH", 1000)
    max_pt = getattr(validation, "MAX_PARAMS_TAGS_PER_BATCH", 100)
    max_all = getattr(validation, "MAX_ENTITIES_PER_BATCH", 1000)
    while True:
        p, params = params[:max_pt], params[max_pt:]
        t, tags = tags[: max_pt - len(p)], tags[max_pt - len(p) :]
        n = min(max_m, max_all - len(p) - len(t))
        m, metrics = metrics[:n], metrics[n:]
        yield m, p, t
        if not (metrics or params or tags):
            return
