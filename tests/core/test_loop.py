"""core.loop: shutdown with deadlines. A hung subscriber, or a blocked loop, costs the others
nothing: innocents drain and close, the culprit is named, and what is lost is counted."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from eventbus import Event, EventBus
from eventbus.core.router import Router
from eventbus.events import Loss, Scalars
from eventbus.logformat import read_log
from eventbus.sinks import JsonlWriter
from tests.conftest import Recorder
from tests.core.helpers import Hangs, identity


def _lines(path: Path) -> list[Event]:
    return [e for e in read_log(path) if isinstance(e, Loss)]


def test_a_hung_subscriber_leaves_a_buffering_writer_its_on_close(tmp_path: Path) -> None:
    writer = JsonlWriter(tmp_path, flush_interval=5)  # holds lines until on_close
    hung = Hangs()
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(writer)
    bus.subscribe(hung, name="hung")
    bus.start()
    for i in range(1000):
        bus.publish(Loss(step=i, value=float(i)))
    assert hung.entered.wait(10)
    st = bus.close(timeout=2)
    hung.release.set()
    assert len(_lines(writer.path)) == 1000  # on disk, though its neighbour never returned
    assert st.hung == ("hung",)
    w = st[next(n for n in st.subscribers if n != "hung")]
    assert w.state == "closed" and w.delivered == 1000
    assert st["hung"].state == "hung"
    identity(st)


def test_a_hung_on_close_is_named_and_the_older_ones_still_close() -> None:
    closed: list[str] = []
    release = threading.Event()

    class Quick:
        def __init__(self, name: str) -> None:
            self.name = name

        async def on_events(self, batch: list[Event]) -> None:
            pass

        def on_close(self) -> None:
            closed.append(self.name)

    class HangsInClose(Quick):
        def on_close(self) -> None:
            release.wait(60)

    bus = EventBus(drain_interval=0.002)
    bus.subscribe(Quick("a"))
    bus.subscribe(Quick("b"))
    bus.subscribe(HangsInClose("c"))  # newest: closed first
    bus.start()
    bus.publish(Loss(step=1, value=1.0))
    t0 = time.monotonic()
    st = bus.close(timeout=1.5)
    release.set()
    assert time.monotonic() - t0 < 5  # bounded by the timeout, not by the hung hook
    assert closed == ["b", "a"]
    assert st.hung == ("c",) and st["c"].state == "hung"


def test_a_blocked_loop_names_the_culprit_and_counts_the_writers_losses() -> None:
    release = threading.Event()
    rec = Recorder()

    class BlocksTheLoop:
        async def on_events(self, batch: list[Event]) -> None:
            release.wait(60)  # a sync wait inside async def: the whole loop stops

    bus = EventBus(drain_interval=0.002)
    bus.subscribe(rec)
    bus.subscribe(BlocksTheLoop(), name="culprit")
    bus.start()
    for i in range(2000):
        bus.publish(Loss(step=i, value=float(i)))
    st = bus.close(timeout=1)
    try:
        assert st.hung == ("culprit",)  # not the innocent recorder
        assert st["Recorder"].state != "hung"
        published = st["Recorder"].published
        assert published == 2000
        assert st["Recorder"].delivered + st["Recorder"].dropped == 2000  # none uncounted
        assert not bus.running
        bus.publish(Loss(step=1, value=1.0))  # never blocks: counted as rejected
        assert bus.stats().rejected == 1
    finally:
        release.set()


def test_a_dead_loop_never_blocks_publish_and_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    die = threading.Event()
    real = Router.drain

    async def dies(self: Router, *args: Any, **kwargs: Any) -> None:
        if die.is_set():
            raise RuntimeError("a bug in the router")
        await real(self, *args, **kwargs)

    monkeypatch.setattr(Router, "drain", dies)
    rec = Recorder()  # lossless: publishers would wait for it
    bus = EventBus(drain_interval=0.002, inbox_maxsize=64)
    bus.subscribe(rec)
    bus.start()
    for i in range(10):
        bus.publish(Loss(step=i, value=1.0))
    assert bus.flush(10)
    die.set()
    done = threading.Event()

    def publish_many() -> None:
        for i in range(10_000):  # far more than the inbox holds
            bus.publish(Loss(step=i, value=1.0))
        done.set()

    t = threading.Thread(target=publish_many, daemon=True)
    t.start()
    assert done.wait(30), "publish blocked on a dead bus thread"
    assert bus.thread is not None
    bus.thread.join(10)  # it ends right after refusing publishers
    assert not bus.running
    st = bus.close(timeout=1)
    assert st.error is not None and "a bug in the router" in st.error
    s = st["Recorder"]
    assert len(rec.got) == s.delivered >= 10
    assert s.delivered + s.dropped + st.rejected == 10_010  # every event accounted for
    assert st.rejected > 0


class _SaysGoodbye:
    """Publishes one event as it closes."""

    close_first = True

    def on_start(self, bus: Any) -> None:
        self.bus = bus

    def on_events(self, batch: list[Event]) -> None:
        pass

    def on_close(self) -> None:
        self.bus.publish(Scalars(step=99, values={"bye": 1.0}))


def test_close_first_closes_a_subscriber_before_those_subscribed_before_it() -> None:
    """Newest first, but `close_first` before all: what it publishes at close reaches a sink
    subscribed after it, which a plain newest-first close would have closed already."""
    early, late = Recorder(events=[Scalars]), Recorder(events=[Scalars])
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(early, name="early")
    bus.subscribe(_SaysGoodbye())
    bus.subscribe(late, name="late")
    with bus:
        pass
    assert [e.step for e in early.got] == [99]
    assert [e.step for e in late.got] == [99]  # closed after the one that said goodbye
