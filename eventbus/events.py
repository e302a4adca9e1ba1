"""Typed events: the lifecycle catalogue, with the `Event` base and the name registry
(defined in `eventbus._event_base`, re-exported here).

This module imports nothing else of ours. Events are plain slotted dataclasses (not frozen:
building a frozen one costs ~4x as much). The bus stamps `ts`, `seq` and `rank` at publish.
Numeric fields may carry tensors: the bus captures them without a device sync and
subscribers see plain floats (CPU tensors when not scalar).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from eventbus._event_base import Event, Number, event_fields, event_type, registered_types

__all__ = [
    "BackwardEnded",
    "BatchLoaded",
    "BusCost",
    "CheckpointLoaded",
    "CheckpointSaved",
    "DivergenceDetected",
    "EpochEnded",
    "EpochStarted",
    "EvalEnded",
    "Event",
    "ForwardEnded",
    "Loss",
    "MemoryLeakSuspected",
    "MemorySample",
    "MemorySnapshotSaved",
    "OptimizerStepped",
    "ProfileSaved",
    "RankUnresponsive",
    "ReducedMetric",
    "RunEnded",
    "RunStarted",
    "SaveRequested",
    "Scalars",
    "StallDetected",
    "StallEnded",
    "StepEnded",
    "StepStarted",
    "StopRequested",
    "StragglerDetected",
    "TensorLayout",
    "TensorStats",
    "TimeEstimate",
    "UnknownEvent",
    "event_fields",
    "event_type",
    "registered_types",
]

# -- run / epoch / step lifecycle -------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class RunStarted(Event):
    """A run began. `config` holds hyper-parameters; `total_steps` lets progress show an ETA."""

    config: dict[str, Any] = field(default_factory=dict)
    run_id: str | None = None
    total_steps: int | None = None
    world_size: int = 1
    resumed_from_step: int | None = None


@dataclass(slots=True, kw_only=True)
class RunEnded(Event):
    """A run ended: `status` is "completed", "stopped", "aborted", "failed", "interrupted"
    or "unknown"; `reason` says why (the exception, the signal, who asked to stop).

    When the loop published a `RunStarted` and no `RunEnded`, `close()` publishes one.
    `cost`: what the bus cost this run (`BusCost`'s totals), filled in by the bus.
    `losses`: what the bus lost or saw fail up to this event (None: nothing), filled in too.
    """

    status: str = "completed"
    reason: str | None = None
    cost: dict[str, Any] | None = None
    losses: dict[str, Any] | None = None


@dataclass(slots=True, kw_only=True)
class EpochStarted(Event):
    """An epoch began."""

    epoch: int = 0


@dataclass(slots=True, kw_only=True)
class EpochEnded(Event):
    """An epoch ended."""

    epoch: int = 0
    duration_s: float | None = None


@dataclass(slots=True, kw_only=True)
class StepStarted(Event):
    """A training step began."""


@dataclass(slots=True, kw_only=True)
class StepEnded(Event):
    """A training step ended; `samples`/`tokens` feed throughput, `duration_s` step time."""

    duration_s: float | None = None
    samples: int | None = None
    tokens: int | None = None


@dataclass(slots=True, kw_only=True)
class BatchLoaded(Event):
    """A step's batch arrived; `duration_s`: how long the loop waited for it (the data phase)."""

    duration_s: float | None = None


@dataclass(slots=True, kw_only=True)
class ForwardEnded(Event):
    """The forward pass of a step ended (host-side time: kernels may still run); `device_s`:
    the device's time for it, with `bus.phase("forward", device_time=True)` on CUDA."""

    duration_s: float | None = None
    device_s: float | None = None


@dataclass(slots=True, kw_only=True)
class BackwardEnded(Event):
    """The backward pass of a step ended (host-side time; `device_s` as for forward)."""

    duration_s: float | None = None
    device_s: float | None = None


@dataclass(slots=True, kw_only=True)
class OptimizerStepped(Event):
    """The optimizer stepped; `grad_norm` may be a tensor (captured without sync)."""

    lr: Number | None = None
    grad_norm: Number | None = None
    duration_s: float | None = None
    device_s: float | None = None  # with bus.phase("optimizer", device_time=True) on CUDA


# -- metrics ---------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Loss(Event):
    """A loss value; `value` may be a (CUDA) tensor: publishing never calls `.item()`."""

    value: Number
    split: str = "train"


@dataclass(slots=True, kw_only=True)
class Scalars(Event):
    """Named scalar metrics; values may be tensors."""

    values: dict[str, Number] = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class EvalEnded(Event):
    """An evaluation ended with its metrics (a "loss" key feeds the divergence detector)."""

    metrics: dict[str, Number] = field(default_factory=dict)
    duration_s: float | None = None


@dataclass(slots=True, kw_only=True)
class CheckpointSaved(Event):
    """A checkpoint was written."""

    path: str = ""


@dataclass(slots=True, kw_only=True)
class CheckpointLoaded(Event):
    """A checkpoint was loaded (a resume): sinks drop what they logged after `step`."""

    path: str = ""


# -- monitors ----------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class MemorySample(Event):
    """Memory at a step: process RSS always, CUDA caching-allocator figures when present."""

    rss_mb: float | None = None
    rss_peak_mb: float | None = None
    allocated_mb: float | None = None
    reserved_mb: float | None = None
    peak_allocated_mb: float | None = None
    alloc_retries: int | None = None
    ooms: int | None = None
    phase: str | None = None
    device: str | None = None
    # Where the CUDA figures were read: "training" (a snapshot on the training thread at the
    # step's end) or "bus" (when the subscriber handled the step's event, `lag_s` later).
    source: str | None = None
    lag_s: float | None = None


@dataclass(slots=True, kw_only=True)
class MemoryLeakSuspected(Event):
    """Memory grew steadily across `window` steps at `rate_mb_per_step`."""

    rate_mb_per_step: float = 0.0
    window: int = 0
    metric: str = "rss_mb"


@dataclass(slots=True, kw_only=True)
class MemorySnapshotSaved(Event):
    """A CUDA memory snapshot (`torch.cuda.memory._dump_snapshot`) was written to `path`."""

    path: str = ""
    reason: str = ""


@dataclass(slots=True, kw_only=True)
class TimeEstimate(Event):
    """Time left until `total_steps` at the recent wall-clock rate (`SpeedMonitor`); `step` is
    the last step seen. `steps_per_s` includes time between steps (data loading too)."""

    eta_s: float = 0.0
    total_steps: int = 0
    steps_per_s: float | None = None


@dataclass(slots=True, kw_only=True)
class StallDetected(Event):
    """No step ended for `waited_s` > `bound_s` (`HangWatchdog`); `step`: the last that did;
    `stacks`: every thread's Python stack, also in the file `path` (if the watchdog has one)."""

    waited_s: float = 0.0
    bound_s: float = 0.0
    stacks: str = ""
    path: str | None = None


@dataclass(slots=True, kw_only=True)
class StallEnded(Event):
    """A step ended after a `StallDetected`: no step had ended for `stalled_s` seconds."""

    stalled_s: float = 0.0


@dataclass(slots=True, kw_only=True)
class StragglerDetected(Event):
    """Rank `straggler` spent `relative` x the fastest rank's time on its own work (`seconds`
    against `fastest_s`: its phases' medians over the window ending at `step`), most of the
    excess in `phase`; `history`: x its own earlier windows (None before any); `scores`: every
    rank's relative score ("rank": x)."""

    straggler: int = 0
    phase: str = ""
    relative: float = 0.0
    history: float | None = None
    seconds: float = 0.0
    fastest_s: float = 0.0
    scores: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class ReducedMetric(Event):
    """`name` (an event type, `Type.key` for a dict field) reduced over `ranks` ranks by `op`
    (`RankReducer`, on rank 0); `missing`: ranks that sent nothing for this step."""

    name: str = ""
    op: str = "mean"
    value: float = 0.0
    ranks: int = 0
    missing: list[int] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class RankUnresponsive(Event):
    """Rank `missing_rank` sent nothing to rank 0 for `waited_s` (it died, or hangs):
    `source` stops waiting for it until it sends again."""

    missing_rank: int = 0
    waited_s: float = 0.0
    source: str = ""


@dataclass(slots=True, kw_only=True)
class ProfileSaved(Event):
    """A `torch.profiler` window was written (`eventbus.torch.profile`): `path` is its Chrome
    trace (open in Perfetto), `table_path` its `key_averages()` table; `step` its last step."""

    path: str = ""
    table_path: str = ""
    first_step: int | None = None
    steps: int = 0


@dataclass(slots=True, kw_only=True)
class TensorStats(Event):
    """Statistics of one named tensor (weights, grads or activations of a module)."""

    name: str = ""
    kind: str = "weights"
    dtype: str = ""
    shape: tuple[int, ...] = ()
    norm: Number | None = None
    mean: Number | None = None
    std: Number | None = None
    absmax: Number | None = None
    nan_count: Number | None = None
    inf_count: Number | None = None
    histogram: Any = None


@dataclass(slots=True, kw_only=True)
class TensorLayout(Event):
    """Dtypes and shapes `watch(what="dtype")` saw change: host metadata, no device work.

    `changed` maps "kind/name" (e.g. "weights/fc.weight", "inputs/fc", "activations/" for the
    root's output) to {"dtype": "torch.bfloat16", "shape": [64, 32]}; the first watched step
    lists every tensor.
    `tensors` is how many were looked at.
    """

    changed: dict[str, Any] = field(default_factory=dict)
    tensors: int = 0


@dataclass(slots=True, kw_only=True)
class DivergenceDetected(Event):
    """A monitor found `metric` diverging; `step` is the step of the event that tripped it."""

    metric: str = "loss"
    value: float
    baseline: float
    reason: str = ""


@dataclass(slots=True, kw_only=True)
class StopRequested(Event):
    """Someone asked the loop to stop (or abort) through `bus.control`."""

    reason: str = ""
    abort: bool = False
    source: str | None = None


@dataclass(slots=True, kw_only=True)
class SaveRequested(Event):
    """Someone asked the loop to save a checkpoint now (`bus.control.request_save`,
    `eventbus ctl save`); the loop saves when `bus.control.save_requested` reads True."""

    reason: str = ""
    source: str | None = None


# -- the bus itself ----------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class BusCost(Event):
    """What the bus cost the training process so far (every `cost_every` steps, and at close).

    `publish_s`: time spent inside `publish` (capture and backpressure included);
    `publish_ms_p50`/`p99` per step and `step_ms_p50`, over recent steps; `share`: publish
    time over step wall time; `bus_cpu_s`: the bus thread's CPU; `subscriber_cpu_s`: each
    subscriber's CPU (in the sidecar process for those placed there).
    """

    steps: int = 0
    publish_calls: int = 0
    publish_s: float = 0.0
    publish_ms_p50: float | None = None
    publish_ms_p99: float | None = None
    step_ms_p50: float | None = None
    share: float | None = None
    bus_cpu_s: float | None = None
    subscriber_cpu_s: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class UnknownEvent(Event):
    """A logged event whose type is not registered here; written back unchanged."""

    type_name: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    # Not part of the catalogue a subscriber would ask for by default.
    catalogue: ClassVar[bool] = False
