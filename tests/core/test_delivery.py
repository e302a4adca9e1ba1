"""core.delivery: the one place subscriber code runs; anything it raises is isolated."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from eventbus import Event, EventBus
from eventbus.core.delivery import Delivery
from eventbus.core.subscriber import State, SubscriberGone
from eventbus.events import Loss
from tests.conftest import Recorder

N = 300
KILLERS: list[type[BaseException]] = [KeyboardInterrupt, SystemExit, GeneratorExit]


def _make(kind: str, exc: type[BaseException]) -> Any:
    """A subscriber that raises `exc` from the named place (every 7th event for on_events)."""

    def boom(ev: Event | None = None) -> None:
        if ev is None or (ev.seq or 0) % 7 == 0:
            raise exc("from a subscriber")

    class SyncBatch:
        def on_events(self, batch: list[Event]) -> None:
            for ev in batch:
                boom(ev)

    class AsyncBatch:
        async def on_events(self, batch: list[Event]) -> None:
            for ev in batch:
                boom(ev)

    class BadStart:
        def on_start(self, bus: Any) -> None:
            boom()

        async def on_events(self, batch: list[Event]) -> None:
            pass

    class BadClose:
        async def on_events(self, batch: list[Event]) -> None:
            pass

        async def on_close(self) -> None:
            boom()

    return {
        "function": boom,
        "sync": SyncBatch(),
        "async": AsyncBatch(),
        "on_start": BadStart(),
        "on_close": BadClose(),
    }[kind]


@pytest.mark.parametrize("exc", KILLERS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("kind", ["function", "sync", "async", "on_start", "on_close"])
def test_a_base_exception_is_isolated_like_any_failure(kind: str, exc: type[BaseException]) -> None:
    rec = Recorder()  # lossless, subscribed beside the culprit
    bus = EventBus(drain_interval=0.002, max_consecutive_failures=None)
    bus.subscribe(rec)
    handle = bus.subscribe(_make(kind, exc), name="culprit", max_batch=5)
    with bus:
        for i in range(N):
            bus.publish(Loss(step=i, value=float(i)))
        assert bus.flush(10)
        assert bus.running  # the bus thread survived
    st = bus.stats()
    assert [e.seq for e in rec.got] == list(range(N))  # the innocent lost nothing, in order
    assert st.error is None and st["Recorder"].state == "closed"
    culprit = handle.stats()
    assert culprit is not None
    if kind in ("function", "sync", "async"):
        assert culprit.failed > 0 and culprit.error and exc.__name__ in culprit.error
        assert culprit.delivered + culprit.failed + culprit.dropped == N
    elif kind == "on_start":
        assert culprit.state == "closed" and culprit.dropped == N  # disabled: counted, not fed
    else:
        assert culprit.delivered == N and culprit.error and exc.__name__ in culprit.error


def test_a_function_returning_a_coroutine_has_it_run() -> None:
    ran: list[int] = []

    async def record(ev: Event) -> None:
        await asyncio.sleep(0)
        ran.append(ev.seq or 0)

    bus = EventBus(drain_interval=0.002)
    sub = bus.subscribe(lambda ev: record(ev), policy="block")  # noqa: PLW0108 - a sync fn
    with bus:
        for i in range(50):
            bus.publish(Loss(step=i, value=1.0))
    assert ran == list(range(50))
    st = sub.stats()
    assert st is not None and st.delivered == 50 and st.failed == 0


def test_a_coroutine_that_raises_is_a_failure_of_that_event() -> None:
    async def bad(ev: Event) -> None:
        raise ValueError("inside the coroutine")

    bus = EventBus(drain_interval=0.002, max_consecutive_failures=None)
    sub = bus.subscribe(lambda ev: bad(ev), policy="block")  # noqa: PLW0108
    with bus:
        for i in range(10):
            bus.publish(Loss(step=i, value=1.0))
    st = sub.stats()
    assert st is not None and st.failed == 10 and st.delivered == 0


def test_subscriber_gone_disables_at_once() -> None:
    calls: list[int] = []

    def gone(ev: Event) -> None:
        calls.append(1)
        raise SubscriberGone("its process died")

    bus = EventBus(drain_interval=0.002)
    sub = bus.subscribe(gone, policy="block", max_batch=1)
    with bus:
        for i in range(20):
            bus.publish(Loss(step=i, value=1.0))
    st = sub.stats()
    assert st is not None and st.failed == 1 and st.dropped == 19 and len(calls) == 1


def test_delivery_alone_counts_and_names() -> None:
    got: list[Event] = []
    d = Delivery(got.append, name="list.append")

    async def main() -> BaseException | None:
        return await d.deliver([Loss(step=1, value=1.0), Loss(step=2, value=2.0)])

    assert asyncio.run(main()) is None
    d.worker.stop()
    assert len(got) == 2 and d.delivered == 2 and d.state is State.PENDING


def test_worker_runs_sync_code_off_the_loop_thread() -> None:
    threads: list[int] = []
    d = Delivery(lambda ev: threads.append(threading.get_ident()), name="f")

    async def main() -> None:
        await d.deliver([Loss(step=1, value=1.0)])

    asyncio.run(main())
    d.worker.stop()
    assert threads and threads[0] != threading.get_ident()


class _SlowStart:
    """Opens its 'file' in on_start, which waits for the test."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.opened = False
        self.got: list[Event] = []

    def on_start(self) -> None:
        self.gate.wait(30)
        self.opened = True

    def on_events(self, batch: list[Event]) -> None:
        self.got.extend(batch)


def test_a_flush_waits_for_on_start() -> None:
    """A flush right after subscribe, routed before the subscriber's task ran on_start, used to
    complete at once (nothing routed, nothing busy): a sink had not even opened its file."""
    for _ in range(3):  # the race is at the first drain: a few fresh buses
        sub = _SlowStart()
        bus = EventBus()
        bus.subscribe(sub)  # its Attach and the Flush below: likely in the first drain
        with bus:
            assert not bus.flush(timeout=0.2)  # on_start holds: not flushed
            sub.gate.set()
            assert bus.flush()
            assert sub.opened


class _PartFailed(Exception):
    def __init__(self, k: object) -> None:
        super().__init__(f"{k!r} of the batch failed")
        self.events_failed = k


class _Lying(Exception):
    def __getattr__(self, name: str) -> Any:
        if name == "events_failed":
            raise RuntimeError("no such attribute here")
        raise AttributeError(name)


@pytest.mark.parametrize(
    ("exc", "delivered", "failed"),
    [
        (_PartFailed(1), 2, 1),  # one of three failed: two were handled
        (_PartFailed(3), 0, 3),
        (_PartFailed(0), 0, 3),  # out of range, or not an int: the whole batch
        (_PartFailed(7), 0, 3),
        (_PartFailed(True), 0, 3),
        (_PartFailed("1"), 0, 3),
        (_Lying(), 0, 3),
        (ValueError(), 0, 3),
    ],
)
def test_a_batch_may_fail_in_part(exc: BaseException, delivered: int, failed: int) -> None:
    class Sub:
        async def on_events(self, batch: list[Event]) -> None:
            raise exc

    d = Delivery(Sub(), name="part")

    async def main() -> BaseException | None:
        return await d.deliver([Loss(step=i, value=1.0) for i in range(3)])

    assert asyncio.run(main()) is exc
    d.worker.stop()
    assert (d.delivered, d.failed) == (delivered, failed)


class _FlushOverlaps:
    """Its `on_flush` (a task of its own) publishes step 2 and returns only once the batch
    of step 2 is being handled: a hook and a batch in flight at once."""

    policy = "block"
    max_batch = 1

    def __init__(self) -> None:
        self.in_second = threading.Event()
        self.release = threading.Event()
        self.bus: Any = None

    def on_start(self, bus: Any) -> None:
        self.bus = bus

    async def on_events(self, batch: list[Event]) -> None:
        if any(ev.step == 2 for ev in batch):
            self.in_second.set()
            while not self.release.is_set():
                await asyncio.sleep(0.001)

    async def on_flush(self) -> None:
        self.bus.publish(Loss(step=2, value=1.0))
        while not self.in_second.is_set():
            await asyncio.sleep(0.001)


def test_a_hook_ending_while_a_batch_is_in_flight_leaves_it_busy() -> None:
    """`call_hook` cleared the busy mark when `on_flush` returned, with a batch still inside
    the subscriber: hang detection, the close's drain and the flush saw it idle."""
    sub = _FlushOverlaps()
    bus = EventBus(drain_interval=0.002, close_timeout=10)
    bus.subscribe(sub, events=Loss)
    (d,) = bus._deliveries
    with bus:
        bus.publish(Loss(step=1, value=1.0))
        assert bus.flush(timeout=10)
        assert sub.in_second.is_set()
        assert (d.busy_with, d.idle) == ("Loss", False)  # step 2 is still being handled
        assert d.busy_since is not None
        sub.release.set()
    assert bus.stats()[d.name].delivered == 2  # type: ignore[index]
