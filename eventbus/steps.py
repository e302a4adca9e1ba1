"""Step and phase scopes for custom loops: the standard events without boilerplate.

    with bus.step(step, samples=len(batch)) as s:      # StepStarted(step)
        with bus.phase("data"):                        # BatchLoaded(step, duration_s)
            batch = next(batches)
        with bus.phase("forward"):                     # ForwardEnded(step, duration_s)
            loss = model(batch)
        with bus.phase("backward"):                    # BackwardEnded(step, duration_s)
            loss.backward()
        with bus.phase("optimizer") as ph:             # OptimizerStepped(step, lr, grad_norm,
            ph.set(grad_norm=clip_grad_norm_(params, 1.0))  #   duration_s)
            opt.step()
        s.tokens = n_tokens                            # StepEnded(step, duration_s, samples,
                                                       #   tokens)

Durations are host wall time (`time.perf_counter`): CUDA kernels may still run when a scope
ends, and nothing here synchronises the device to wait for them. A scope left by an exception
publishes no end event. Subscribers that want more at these boundaries (a MemoryProfiler
reading allocator statistics) react to these events on the bus side.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from eventbus._capture_pending import DeviceSpan
from eventbus.events import (
    BackwardEnded,
    BatchLoaded,
    Event,
    ForwardEnded,
    OptimizerStepped,
    StepEnded,
    StepStarted,
)

if TYPE_CHECKING:
    from eventbus.core.handle import BusHandle

__all__ = ["PHASES", "PhaseScope", "StepScope", "current_step", "known_total", "on_step_change"]

PHASES: dict[str, type[Event]] = {
    "data": BatchLoaded,
    "forward": ForwardEnded,
    "backward": BackwardEnded,
    "optimizer": OptimizerStepped,
}
"""Phase name -> the event its scope publishes when it ends."""

# bus -> steps of the `bus.step` scopes open now (innermost last).
_OPEN: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()


# bus -> methods called whenever one of its `bus.step` scopes opens or closes (held weakly).
_LISTENERS: weakref.WeakKeyDictionary[Any, list[weakref.WeakMethod[Any]]] = (
    weakref.WeakKeyDictionary()
)


def on_step_change(bus: BusHandle, method: Callable[[], None]) -> None:
    """Call the bound `method` whenever a `bus.step` scope opens or closes (held weakly)."""
    _LISTENERS.setdefault(bus, []).append(weakref.WeakMethod(method))


def _step_changed(bus: BusHandle) -> None:
    listeners = _LISTENERS.get(bus)
    if listeners:
        for ref in list(listeners):
            fn = ref()
            if fn is None:
                listeners.remove(ref)
            else:
                fn()


def known_total(total_steps: Any) -> int | None:
    """A run's total steps (`RunStarted.total_steps`) when it is one, an int > 0; None when
    unknown or a placeholder (0, -1): what an ETA or a progress bar may divide by."""
    return total_steps if type(total_steps) is int and total_steps > 0 else None


def current_step(bus: BusHandle) -> int | None:
    """The step of the innermost open `bus.step(...)` scope, or None."""
    open_ = _OPEN.get(bus)
    return open_[-1] if open_ else None


def _check_count(name: str, v: Any) -> None:
    if v is None or (type(v) is int and v >= 0) or hasattr(v, "dtype"):
        return  # an int, or a tensor (captured at publish, never read here)
    raise TypeError(f"{name} must be a non-negative int, a tensor or None; got {v!r:.80}")


class StepScope:
    """`with bus.step(n, samples=..., tokens=...)`: StepStarted now, StepEnded at the end.

    `samples` and `tokens` may be set on the scope inside the block (`s.tokens = ...`);
    `duration_s` holds the step's host wall time once the block ended.
    """

    __slots__ = ("_t0", "bus", "duration_s", "samples", "step", "tokens")

    def __init__(
        self, bus: BusHandle, step: int, *, samples: Any = None, tokens: Any = None
    ) -> None:
        if type(step) is not int:
            raise TypeError(f"bus.step() takes the step number as an int; got {step!r:.80}")
        _check_count("samples", samples)
        _check_count("tokens", tokens)
        self.bus = bus
        self.step = step
        self.samples = samples
        self.tokens = tokens
        self.duration_s: float | None = None
        self._t0 = 0.0

    def __enter__(self) -> StepScope:
        _OPEN.setdefault(self.bus, []).append(self.step)
        _step_changed(self.bus)
        try:
            self.bus.publish(StepStarted(step=self.step))
        except BaseException:  # a strict bus's failure: the step never opened
            self._close()
            raise
        self._t0 = time.perf_counter()  # host wall time; never waits for the device
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.duration_s = time.perf_counter() - self._t0
        self._close()
        if et is not None:
            return  # the step did not end: no StepEnded (throughput would be wrong)
        _check_count("samples", self.samples)
        _check_count("tokens", self.tokens)
        self.bus.publish(
            StepEnded(
                step=self.step, duration_s=self.duration_s, samples=self.samples, tokens=self.tokens
            )
        )

    def _close(self) -> None:
        """This step is no longer the open one (listeners are told)."""
        open_ = _OPEN.get(self.bus)
        if open_:
            open_.pop()
        _step_changed(self.bus)


class PhaseScope:
    """`with bus.phase("data" | "forward" | "backward" | "optimizer", **fields)`: its event at
    the end.

    The step is the innermost open `bus.step` scope's unless given. `set(**fields)` adds
    fields inside the block (e.g. `grad_norm=` for "optimizer": a tensor is fine).
    `device_time=True` (CUDA; forward, backward, optimizer): two CUDA events recorded on the
    current stream at the ends of the block give the event's `device_s`, read on the bus
    thread once the device got there (~2 event launches a phase; never a sync).
    """

    __slots__ = (
        "_start",
        "_t0",
        "bus",
        "cls",
        "device_time",
        "duration_s",
        "fields",
        "name",
        "step",
    )

    def __init__(
        self,
        bus: BusHandle,
        name: str,
        step: int | None = None,
        *,
        device_time: bool = False,
        **fields: Any,
    ) -> None:
        cls = PHASES.get(name)
        if cls is None:
            raise ValueError(f"unknown phase {name!r}; use one of {', '.join(PHASES)}")
        if step is not None and type(step) is not int:
            raise TypeError(f"step must be an int or None; got {step!r:.80}")
        if device_time:
            _check_device_time(name, cls)
        self.device_time = device_time
        self._start: Any = None
        self.bus = bus
        self.name = name
        self.cls = cls
        self.step = step
        self.fields: dict[str, Any] = {}
        self.duration_s: float | None = None
        self._t0 = 0.0
        self.set(**fields)

    def set(self, **fields: Any) -> None:
        """Fields of the phase's event to publish at the end (checked against the class)."""
        allowed = _settable(self.cls)
        bad = sorted(set(fields) - allowed)
        if bad:
            raise TypeError(
                f"{self.cls.__name__} has no field(s) {', '.join(bad)}; "
                f"phase {self.name!r} takes {', '.join(sorted(allowed)) or 'none'}"
            )
        self.fields.update(fields)

    def __enter__(self) -> PhaseScope:
        if self.step is None:
            self.step = current_step(self.bus)
        self._t0 = time.perf_counter()  # host wall time; never waits for the device
        if self.device_time:
            self._start = _cuda_event()  # an enqueue on the current stream: never waits
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.duration_s = time.perf_counter() - self._t0
        if et is None:
            cls: Any = self.cls  # every phase event has duration_s
            fields = self.fields
            if self._start is not None:  # resolved on the bus thread once both completed
                fields = {**fields, "device_s": DeviceSpan(self._start, _cuda_event())}
            self.bus.publish(cls(step=self.step, duration_s=self.duration_s, **fields))


def _check_device_time(name: str, cls: type) -> None:
    """A phase may time the device only on CUDA, and only if its event has `device_s`."""
    if "device_s" not in {f.name for f in dataclasses.fields(cls)}:
        raise ValueError(f"phase {name!r} has no device time ({cls.__name__} has no device_s)")
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            "device_time=True records CUDA events and needs a CUDA device; "
            "drop it on this machine (duration_s still gives the host time)"
        )


def _cuda_event() -> Any:
    """A timing CUDA event recorded now on the current stream (enqueued: never waits)."""
    import torch

    ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    ev.record()
    return ev


_SETTABLE: dict[type, frozenset[str]] = {}


def _settable(cls: type) -> frozenset[str]:
    names = _SETTABLE.get(cls)
    if names is None:
        base = {f.name for f in dataclasses.fields(Event)} | {"duration_s", "device_s"}
        names = _SETTABLE[cls] = frozenset(
            f.name for f in dataclasses.fields(cls) if f.name not in base
        )
    return names
