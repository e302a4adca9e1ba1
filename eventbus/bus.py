"""`EventBus`: the public face. It checks its arguments and delegates to the core.

    training thread                        bus thread (core.loop)
    bus.publish(ev): stamp, capture  --->  core.inbox --> core.router --> core.queue (one per
      core.inbox.put: O(1), no wake          subscriber) --> core.delivery --> on_events

`publish` stamps the event, captures its tensors without a device sync, and appends it to the
inbox; the loop routes on a timer. The one place a publisher waits is a full inbox while a
lossless (`block`) subscriber is attached: backpressure, by choice.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from eventbus._compiling import compiling, teach_torch, traced_publish
from eventbus.agreement import StopAgreement
from eventbus.control import Control
from eventbus.core.checkpoint import in_a_fork, load_states, states
from eventbus.core.cost import CostMeter, PublishClock, cpu_of
from eventbus.core.delivery import Delivery
from eventbus.core.ending import RunEnding
from eventbus.core.fork import call_after_fork
from eventbus.core.inbox import BIG, Attach, Detach, Flush, Inbox, InboxMode
from eventbus.core.loop import BusLoop
from eventbus.core.signals import SignalDrain
from eventbus.core.sizing import QUICK, not_an_event, published_twice, quick_check
from eventbus.core.subscriber import State, check_bus_args, name_for, subscribe_options, timeout_of
from eventbus.core.subscription import Subscription, refuse_twice
from eventbus.dist import rank_info
from eventbus.events import Event
from eventbus.stats import BusStats, log_close
from eventbus.steps import PhaseScope, StepScope

if TYPE_CHECKING:
    from eventbus.process.sidecar import Sidecar

__all__ = ["EventBus", "Subscription"]

F = TypeVar("F", bound=Callable[..., Any])

_NEW, _RUNNING, _CLOSED, _FORKED = "new", "running", "closed", "forked"
_time_ns = time.time_ns  # a module global: one lookup less on the hot path


class EventBus:
    """A non-blocking bus: `publish` from the training loop, subscribers on a bus thread.

    Use `with EventBus() as bus:` (or `start()` / `close()`). `drain_interval`: how often the
    bus thread wakes to route (each wake costs CPU and a GIL hand-over; 50 ms: a stop a
    monitor requests reaches `should_stop` within about that). The inbox is bounded in events
    (`inbox_maxsize`) and bytes (`inbox_max_bytes`, events of 1 KiB or more), each queue in
    bytes (`queue_max_bytes`). `hang_timeout`: a lossless subscriber stuck in one call this
    long while its full queue holds the bus up is disabled (None: wait forever).
    `handle_signals`: drain on SIGTERM, then run the handler that was there. `cost_every`:
    steps between `BusCost` events (the totals: `stats().cost`, `RunEnded.cost`; None: off).
    `strict`: raise the first subscriber failure from the next `publish` or from `close()`.
    """

    def __init__(
        self,
        *,
        drain_interval: float = 0.05,
        inbox_maxsize: int = 65536,
        inbox_max_bytes: int = 256 << 20,
        queue_max_bytes: int = 256 << 20,
        close_timeout: float = 30.0,
        hang_timeout: float | None = 60.0,
        handle_signals: bool = True,
        max_consecutive_failures: int | None = 100,
        rank: int | None = None,
        world_size: int | None = None,
        name: str = "eventbus",
        stop_check_every: int = 1,
        cost_every: int | None = 1000,
        strict: bool = False,
    ) -> None:
        check_bus_args(locals())  # each numeric argument's type and range, named if refused
        info = rank_info()
        self.rank = info.rank if rank is None else rank
        self.local_rank = info.local_rank
        self.world_size = info.world_size if world_size is None else world_size
        self.name = name
        self.drain_interval = drain_interval
        self.close_timeout = close_timeout
        self.handle_signals = handle_signals
        self.max_consecutive_failures = max_consecutive_failures
        self.queue_max_bytes = queue_max_bytes
        self.control = Control(self.publish)
        if self.world_size > 1:  # should_stop agreed by all ranks (one small all_reduce)
            self.control.agree = StopAgreement(self.control, every=stop_check_every)
        self._clock = PublishClock() if cost_every is not None else None
        cpu = lambda: cpu_of(self._deliveries, self._sidecar)  # noqa: E731
        self._loop = BusLoop(
            Inbox(inbox_maxsize, inbox_max_bytes),
            self,
            name=name,
            interval=drain_interval,
            hang_timeout=hang_timeout,
            cost=None if self._clock is None else CostMeter(self._clock, cost_every, cpu),
        )
        self._inbox = self._loop.inbox
        self._seq = itertools.count()
        self._state = _NEW
        self._lifecycle = threading.RLock()
        self._deliveries: list[Delivery] = []  # every subscription made, for stats and names
        self._sidecar: Sidecar | None = None  # the child process of placement="process"
        self._names: set[str] = set()
        self._ending = RunEnding(self.control, self._loop.cost, self.stats, strict=strict)
        self._loop.router.run_ended = self._ending.fill  # RunEnded's cost and losses
        if self._ending.failures is not None:  # an instance attribute: a lax bus pays nothing
            self.publish = self._ending.failures.checked(self.publish)  # type: ignore[method-assign,assignment]
        self._loop.ending = self._ending.event
        self._signals = SignalDrain(self.close, lambda: self.close_timeout, self._ending)
        self._exit_hook = False
        call_after_fork(self._forked)
        teach_torch()  # torch imported: torch.compile traces publish without a graph break

    # -- publishing ------------------------------------------------------------------

    def publish(self, ev: Event) -> None:
        """Stamp `ev` (ts if unset, seq, rank), capture its tensors, queue it; never syncs.

        Costs about a microsecond and returns at once, except when the inbox is full and a
        lossless subscriber is attached (backpressure). Raises `TypeError` for non-events.
        """
        if not isinstance(ev, Event):
            raise not_an_event(ev)
        if compiling():  # True only while torch.compile traces this call; eagerly ~25 ns
            return traced_publish(self, ev)  # one ordered op in the graph: it publishes
        if ev.seq is not None:
            raise published_twice(ev)
        t0 = _time_ns()  # the stamp, and where the cost report's timing starts
        if ev.ts is None:
            ev.ts = t0
        ev.seq = next(self._seq)  # itertools.count: atomic under the GIL
        ev.rank = self.rank
        check = QUICK.get(type(ev)) or quick_check(type(ev))
        text = check(ev)  # -1: a tensor or a container; else the length of its texts
        inbox = self._inbox
        if text < 0 or text >= BIG:  # capture, and count it against the byte bound
            inbox.put_sized(ev)
        elif len(inbox.items) < inbox.fast_limit:  # live and far from full: a bare append
            inbox.items.append(ev)
        else:
            inbox.put(ev)
        clock = self._clock
        if clock is not None:  # the cost report: ~0.1 us
            s = ev.step
            if type(s) is int and s > clock.step:  # never compares a tensor: no sync
                clock.roll(s, t0)
            clock.ns += _time_ns() - t0

    async def apublish(self, ev: Event) -> None:
        """`publish` for async code: waits without blocking the caller's event loop."""
        await self._inbox.wait_for_room()
        self.publish(ev)

    def step(self, step: int, *, samples: Any = None, tokens: Any = None) -> StepScope:
        """`with bus.step(n, samples=, tokens=)`: StepStarted, then StepEnded with duration_s."""
        return StepScope(self, step, samples=samples, tokens=tokens)

    def phase(
        self, name: str, *, step: int | None = None, device_time: bool = False, **fields: Any
    ) -> PhaseScope:
        """`with bus.phase("forward" | "backward" | "optimizer" | "data")`: its *Ended event
        (`device_time=True`: also the CUDA time, from two events; see `PhaseScope`)."""
        return PhaseScope(self, name, step, device_time=device_time, **fields)

    # -- subscribing -----------------------------------------------------------------

    def subscribe(
        self,
        sub: Any,
        *,
        events: Iterable[type[Event]] | type[Event] | None = None,
        policy: str | None = None,
        maxsize: int | None = None,
        max_batch: int | None = None,
        key: Callable[[Event], Hashable] | None = None,
        name: str | None = None,
        ranks: Iterable[int] | None = None,
        placement: str | None = None,
    ) -> Subscription:
        """Attach a subscriber: an object with `on_events(batch)` or a function of one event.

        Defaults come from the subscriber's class attributes (`events`, `policy`, `maxsize`,
        `ranks`), else: every event, `drop_oldest`, 10,000 queued. Events published after
        this call returns reach it; earlier ones do not.
        """
        o = subscribe_options(
            sub,
            events=events,
            policy=policy,
            maxsize=maxsize,
            max_batch=max_batch,
            placement=placement,
            ranks=ranks,
        )
        if (o.ranks is not None and self.rank not in o.ranks) or self._state == _FORKED:
            return Subscription(None, self._detach)
        with self._lifecycle:
            if self._state == _CLOSED:
                raise RuntimeError("subscribe() on a closed bus: create a new EventBus")
            refuse_twice(sub, self._deliveries, self._sidecar)
            if o.placement == "process":
                from eventbus.process.sidecar import place  # loaded when asked

                return place(self, sub, o, name, key)
            d = Delivery(
                sub,
                name=name_for(sub, name, self._names),
                events=o.events,
                policy=o.policy,
                maxsize=o.maxsize,
                max_batch=o.max_batch,
                max_bytes=self.queue_max_bytes,
                key=key,
                max_consecutive_failures=self.max_consecutive_failures,
            )
            d.failures = self._ending.failures
            self._deliveries.append(d)
            self._attach(d)
        return Subscription(d, self._detach)

    def _attach(self, d: Delivery) -> None:
        self._loop.router.expect(d)
        self._inbox.put_control(Attach(d))
        if not self._exit_hook:  # events for it must not vanish, even unstarted
            atexit.register(self._at_exit)
            self._exit_hook = True

    def on(self, *events: type[Event], **options: Any) -> Callable[[F], F]:
        """Decorator form: `@bus.on(Loss)` subscribes a sync or async function of one event."""

        def register(fn: F) -> F:
            self.subscribe(fn, events=events or None, **options)
            return fn

        return register

    def _detach(self, d: Delivery) -> None:
        with self._lifecycle:
            if d.state is State.PENDING and self._state == _NEW:
                d.state = State.REMOVED  # never attached: the loop skips its Attach
                self._loop.router.forget(d)
            elif (
                d.state in (State.PENDING, State.RUNNING, State.DISABLED)
                and self._state == _RUNNING
            ):
                self._inbox.put_control(Detach(d))

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> EventBus:
        """Start the bus thread (idempotent); returns once the loop runs."""
        with self._lifecycle:
            if self._state in (_RUNNING, _FORKED):
                return self
            if self._state == _CLOSED:
                raise RuntimeError("this bus was closed; create a new EventBus to start again")
            teach_torch()  # torch imported since __init__: the same
            try:
                self._loop.start()
            except KeyboardInterrupt:  # a Ctrl-C while it started: never left running
                if self._loop.thread is not None:
                    self._inbox.mode, self._state = InboxMode.LIVE, _RUNNING
                    self.close()  # its subscribers close (their files too), then the Ctrl-C
                raise
            self._inbox.mode, self._state = InboxMode.LIVE, _RUNNING
            if self.handle_signals:
                self._signals.install()
        return self

    def __enter__(self) -> EventBus:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._ending.exited(et, e)  # the status of the RunEnded a close may publish
        self.close()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every subscriber handled what was published before and ran `on_flush`
        (files are then on disk); False after `timeout` (default `close_timeout`)."""
        with self._lifecycle:
            if self._state != _RUNNING or not self._loop.alive:
                return self._state == _CLOSED
            if self._inbox.on_bus_side():
                raise RuntimeError("flush() would deadlock when called from a subscriber")
            marker = Flush()
            self._inbox.put_control(marker)
        done = marker.done.wait(timeout_of("flush", timeout, self.close_timeout))
        return done and marker.ok

    def close(self, timeout: float | None = None) -> BusStats:
        """Drain every subscriber, call their `on_close`, stop the thread; idempotent. Each
        gets a fair share of `timeout` (default `close_timeout`); one still busy after it is
        abandoned, named in the stats (`hung`). A Ctrl-C while closing keeps draining; a
        second one gives up and counts what is lost."""
        if self._state == _FORKED:
            return self.stats()
        if self._inbox.on_bus_side():
            raise RuntimeError(
                "close() cannot be called from a subscriber; use bus.control.request_stop()"
            )
        with self._lifecycle:
            if self._state == _CLOSED:
                return self.stats()
            if self._state == _NEW:
                if not self._inbox.waiting():
                    self._finish()
                    return self.stats()
                self.start()  # events are waiting for subscribers: deliver them
            deadline = time.monotonic() + timeout_of("close", timeout, self.close_timeout)
            self._loop.close(deadline)
        interrupt = self._loop.wait_closed(deadline)
        with self._lifecycle:
            if self._state != _CLOSED:  # two threads closing at once: the first finishes it
                if self._loop.alive:  # the loop itself is blocked (sync code inside async def)
                    self._loop.abandon_blocked()
                self._finish()
        if interrupt is not None:
            raise interrupt
        return self._ending.closed(self.stats())  # strict: raises the first failure

    def _finish(self) -> None:
        self._state = _CLOSED
        self._inbox.close()
        self._loop.router.remaining()  # a publisher racing the close: counted, not stranded
        if self._exit_hook:
            atexit.unregister(self._at_exit)
        self._signals.restore()
        for d in self._deliveries:
            d.worker.stop()
        if self._sidecar is not None:
            self._sidecar.release()  # it drains what it received and exits by itself
        log_close(self.stats())

    def _at_exit(self) -> None:
        if self._state in (_NEW, _RUNNING):
            self._ending.at_exit()
            self.close()

    @property
    def should_stop(self) -> bool:
        """True once a stop (or abort) was requested through `bus.control`."""
        return self.control.should_stop

    @property
    def should_abort(self) -> bool:
        """True once an abort was requested through `bus.control`."""
        return self.control.should_abort

    @property
    def thread(self) -> threading.Thread | None:
        """The bus thread, once started (to read its CPU time when profiling)."""
        return self._loop.thread

    @property
    def running(self) -> bool:
        """True between `start()` and `close()`, while the bus thread lives."""
        return self._state == _RUNNING and self._loop.alive

    def stats(self) -> BusStats:
        """A snapshot of every counter: bus-wide and per subscriber, and what the bus cost."""
        st = self._loop.stats(self._deliveries)
        return st if self._sidecar is None else self._sidecar.merged(st)

    def state_dict(self) -> dict[str, Any]:
        """Each subscriber's `state_dict()`, by name, after a flush (for checkpoints)."""
        if self._state == _FORKED:
            raise in_a_fork("state_dict()")
        self.flush()
        return states(self._deliveries, self._sidecar)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Hand each subscriber its part of a `state_dict()` (by name)."""
        if self._state == _FORKED:
            raise in_a_fork("load_state_dict()")
        if self._state == _RUNNING:
            self.flush()
        load_states(self._deliveries, state, self._sidecar)

    def _forked(self) -> None:
        """In a forked child (DataLoader worker): no thread, no sinks; every call returns."""
        self._state = _FORKED
        self._inbox.reset_after_fork()
        self._lifecycle = threading.RLock()
        self._signals.forget()
        self._ending.forget_after_fork()  # a strict bus's failure is the parent's to raise
        if self._exit_hook:
            atexit.unregister(self._at_exit)
