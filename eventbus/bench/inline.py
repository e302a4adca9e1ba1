"""The stand-in buses the step gets in the bare and inline variants.

`NullBus` (bare): `publish` does nothing, so the step costs only what it does itself.
`InlineBus` (inline): each event is handed to the subscriber at once, on the training thread,
the way HF, Lightning and Composer run their callbacks. Tensor fields become numbers first,
as an inline callback's `.item()` would (a device sync on CUDA: part of what inline costs).
Both offer what a step uses of `EventBus`: `publish`, `apublish`, `step`, `phase`, `control`,
`should_stop`, `rank`, `world_size`.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from eventbus.capture import PLAIN, capturable_fields
from eventbus.control import Control
from eventbus.core.sizing import not_an_event, published_twice
from eventbus.core.subscriber import event_types, takes_argument
from eventbus.events import Event
from eventbus.steps import PhaseScope, StepScope

__all__ = ["FEEDBACK_LIMIT", "InlineBus", "NullBus"]

FEEDBACK_LIMIT = 10_000  # events a subscriber may publish back per event the step publishes


class NullBus:
    """What the step gets in the bare variant: the bus's surface, with `publish` a no-op."""

    rank = 0
    local_rank = 0
    world_size = 1

    def __init__(self) -> None:
        self.control = Control(self.publish)

    def publish(self, ev: Event) -> None:
        """Nothing: the bare step's cost is the step's own."""

    async def apublish(self, ev: Event) -> None:
        """`publish` for async code."""
        self.publish(ev)

    def step(self, step: int, *, samples: Any = None, tokens: Any = None) -> StepScope:
        """`with bus.step(n)`, as on `EventBus`."""
        return StepScope(self, step, samples=samples, tokens=tokens)

    def phase(self, name: str, *, step: int | None = None, **fields: Any) -> PhaseScope:
        """`with bus.phase(name)`, as on `EventBus`."""
        return PhaseScope(self, name, step, **fields)

    @property
    def should_stop(self) -> bool:
        """True once a stop was requested (the bench runs every step regardless)."""
        return self.control.should_stop

    @property
    def should_abort(self) -> bool:
        """True once an abort was requested."""
        return self.control.should_abort


class InlineBus(NullBus):
    """What the step gets in an inline variant: `publish` calls the subscriber before it
    returns. Failures are counted, not raised; events it publishes back reach it in turn."""

    def __init__(self, sub: Any, events: Any = None) -> None:
        super().__init__()
        self.sub = sub
        self.events = event_types(events if events is not None else getattr(sub, "events", None))
        self.batched = hasattr(sub, "on_events")
        self._fn: Callable[..., Any] = sub.on_events if self.batched else sub
        self._loop: asyncio.AbstractEventLoop | None = None  # made once, for async code
        self._seq = itertools.count()
        self._pending: deque[Event] = deque()
        self._dispatching = False
        self.delivered = 0
        self.failed = 0
        self.dropped = 0  # feedback beyond FEEDBACK_LIMIT, or everything once on_start failed
        self.error: str | None = None
        self.disabled = False

    def publish(self, ev: Event) -> None:
        """Stamp `ev` (ts if unset, seq, rank) and hand it to the subscriber now."""
        if not isinstance(ev, Event):
            raise not_an_event(ev)
        if ev.seq is not None:
            raise published_twice(ev)
        if ev.ts is None:
            ev.ts = time.time_ns()
        ev.seq = next(self._seq)
        ev.rank = self.rank
        self._pending.append(ev)
        if self._dispatching:  # published by the subscriber: handled after the current one
            return
        self._dispatching = True
        budget = FEEDBACK_LIMIT + 1
        try:
            while self._pending:
                one = self._pending.popleft()
                budget -= 1
                if budget < 0 or self.disabled:
                    self.dropped += 1
                elif isinstance(one, self.events):
                    self._deliver(one)
        finally:
            self._dispatching = False

    def _deliver(self, ev: Event) -> None:
        _plain(ev)
        try:
            self._call(self._fn, [ev] if self.batched else ev)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # user code: counted, as the bus counts it
            self.failed += 1
            self.error = f"{type(e).__name__}: {e}"
        else:
            self.delivered += 1

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        result = fn(*args)
        if inspect.isawaitable(result):  # async code runs on our own loop, to completion
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            return self._loop.run_until_complete(_awaited(result))
        return result

    def start(self) -> None:
        """Call the subscriber's `on_start(bus)` (with this stand-in); a failure disables it."""
        self._hook("on_start", self)

    def close(self) -> None:
        """Call its `on_close()` and close the event loop made for it."""
        try:
            self._hook("on_close")
        finally:
            if self._loop is not None:
                self._loop.close()

    def _hook(self, name: str, *args: Any) -> None:
        fn = getattr(self.sub, name, None) if self.batched else None
        if fn is None or not callable(fn):
            return
        try:
            self._call(fn, *(args if takes_argument(fn) else ()))
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # as the bus does: named, and on_start's failure disables
            self.error = f"{name}: {type(e).__name__}: {e}"
            self.disabled = self.disabled or name == "on_start"


async def _awaited(aw: Awaitable[Any]) -> Any:
    return await aw


def _plain(ev: Event) -> None:
    """Tensor fields as numbers (one element) or CPU tensors, as the bus delivers them."""
    for name in capturable_fields(type(ev)):
        v = getattr(ev, name)
        if type(v) not in PLAIN:
            setattr(ev, name, _plain_value(v))


def _plain_value(v: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(v, torch.Tensor):
        t = v.detach()
        # The inline callback's read: a CPU-GPU sync point on CUDA, as `loss.item()` is.
        return t.item() if t.numel() == 1 else t.cpu()
    if type(v) is dict:
        return {k: _plain_value(x) for k, x in v.items()}
    if type(v) is list:
        return [_plain_value(x) for x in v]
    if type(v) is tuple:
        return tuple(_plain_value(x) for x in v)
    return v
