"""Sync subscribers run on their own worker thread and may publish without deadlock."""

from __future__ import annotations

import threading

import pytest

from eventbus import Event, EventBus
from eventbus.core.worker import in_worker
from eventbus.events import Loss, Scalars
from tests.conftest import Recorder


@pytest.mark.timeout(30)
def test_sync_subscriber_publishing_into_a_full_inbox_never_deadlocks() -> None:
    rec = Recorder()  # lossless: a full inbox makes ordinary publishers wait for it
    flags: list[bool] = []
    bus = EventBus(inbox_maxsize=8)

    def echo(ev: Event) -> None:
        flags.append(in_worker())
        for _ in range(20):  # more than the inbox holds
            bus.publish(Scalars(step=ev.step, values={"echo": 1.0}))

    bus.subscribe(rec)
    bus.subscribe(echo, policy="block", events=[Loss], maxsize=2, max_batch=1)
    with bus:
        for i in range(50):
            bus.publish(Loss(step=i, value=1.0))
    assert len([e for e in rec.got if isinstance(e, Loss)]) == 50
    # Its own output is bounded (half the inbox): what did not fit is counted, not lost silently.
    got = len([e for e in rec.got if isinstance(e, Scalars)])
    assert got + bus.stats().feedback_dropped == 1000
    assert bus.stats().feedback_dropped > 0
    assert flags and all(flags)


def test_flush_from_a_subscriber_is_refused() -> None:
    errors: list[BaseException] = []
    bus = EventBus()

    def flusher(ev: Event) -> None:
        try:
            bus.flush(1)
        except RuntimeError as e:
            errors.append(e)

    bus.subscribe(flusher, policy="block")
    with bus:
        bus.publish(Loss(step=1, value=1.0))
    assert errors and "deadlock" in str(errors[0])


def test_worker_flag_is_thread_local() -> None:
    assert not in_worker()
    seen: list[bool] = []
    t = threading.Thread(target=lambda: seen.append(in_worker()))
    t.start()
    t.join()
    assert seen == [False]


@pytest.mark.parametrize("n", [1, 3])
def test_each_sync_subscriber_has_its_own_thread(n: int) -> None:
    names: list[set[str]] = [set() for _ in range(n)]

    def make(i: int):  # type: ignore[no-untyped-def]
        def fn(ev: Event) -> None:
            names[i].add(threading.current_thread().name)

        return fn

    bus = EventBus()
    for i in range(n):
        bus.subscribe(make(i), policy="block")
    with bus:
        for s in range(20):
            bus.publish(Loss(step=s, value=1.0))
    assert all(len(x) == 1 for x in names)
    assert len(set().union(*names)) == n
