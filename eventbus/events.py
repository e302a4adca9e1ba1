"""Typed events: the `Event` base, the lifecycle catalogue, and the name registry.

This module imports nothing of ours. Events are plain slotted dataclasses (not frozen:
building a frozen one costs ~4x as much). The bus stamps `ts`, `seq` and `rank` at publish.
Numeric fields may carry tensors: the bus captures them without a device sync and
subscribers see plain floats (CPU tensors when not scalar).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "BackwardEnded",
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
    "RunEnded",
    "RunStarted",
    "SaveRequested",
    "Scalars",
    "StepEnded",
    "StepStarted",
    "StopRequested",
    "TensorLayout",
    "TensorStats",
    "TimeEstimate",
    "UnknownEvent",
    "event_fields",
    "event_type",
    "registered_types",
]

# Type name -> class. Filled by `Event.__init_subclass__`, so user subclasses register
# themselves on definition; `replay` rebuilds them by name and never imports anything.
_REGISTRY: dict[str, type[Event]] = {}

Number = Any
"""A float, an int, or a tensor (captured at publish; subscribers see a float)."""


@dataclass(slots=True, kw_only=True)
class Event:
    """Base of every event. `ts` (ns, wall clock), `seq` and `rank` are stamped at publish."""

    step: int | None = None
    ts: int | None = None
    seq: int | None = None
    rank: int | None = None

    def __init_subclass__(cls) -> None:
        # No zero-argument super() here: `slots=True` re-creates the class, which breaks it.
        _register(cls)


def _register(cls: type[Event]) -> None:
    name = cls.__name__
    old = _REGISTRY.get(name)
    # `@dataclass(slots=True)` re-creates the class (with a provisional qualname), and
    # notebooks re-run cells: a class from the same module replaces the old one silently.
    if old is not None and old.__module__ != cls.__module__:
        warnings.warn(
            f"event type name {name!r} is defined by both {old.__module__}.{old.__qualname__} "
            f"and {cls.__module__}.{cls.__qualname__}; JSONL logs and replay will use the "
            "latter. Rename one of them.",
            RuntimeWarning,
            stacklevel=3,
        )
    _REGISTRY[name] = cls


def event_type(name: str) -> type[Event] | None:
    """The registered event class called `name`, or None."""
    return _REGISTRY.get(name)


def registered_types() -> dict[str, type[Event]]:
    """A copy of the registry: type name -> event class."""
    return dict(_REGISTRY)


def event_fields(cls: type) -> tuple[dataclasses.Field[Any], ...]:
    """The dataclass fields of an event class; `TypeError` if a subclass was not decorated.

    `__init_subclass__` runs before `@dataclass` can, so this check runs where a class is first
    published or encoded (the per-class caches call it once per class).
    """
    fields = dataclasses.fields(cls)
    known = {f.name for f in fields}
    for klass in cls.__mro__:
        if klass is Event or klass is object:
            break
        own = inspect.get_annotations(klass)
        lost = [n for n, a in own.items() if n not in known and "ClassVar" not in str(a)]
        if lost:
            raise TypeError(
                f"{klass.__qualname__} subclasses eventbus.Event but is not a dataclass, so its "
                f"fields {', '.join(lost)} would be lost: decorate it with "
                "@dataclass(slots=True, kw_only=True)"
            )
    return fields


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
    """

    status: str = "completed"
    reason: str | None = None
    cost: dict[str, Any] | None = None


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
class ForwardEnded(Event):
    """The forward pass of a step ended (host-side time: kernels may still run)."""

    duration_s: float | None = None


@dataclass(slots=True, kw_only=True)
class BackwardEnded(Event):
    """The backward pass of a step ended (host-side time)."""

    duration_s: float | None = None


@dataclass(slots=True, kw_only=True)
class OptimizerStepped(Event):
    """The optimizer stepped; `grad_norm` may be a tensor (captured without sync)."""

    lr: Number | None = None
    grad_norm: Number | None = None
    duration_s: float | None = None


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
