"""The sidecar's subscribers ended at close and removed mid-run: each is counted for exactly
what was published to it (before its end or removal), never for what came after."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from eventbus import Event, EventBus
from eventbus.events import Loss
from eventbus.process import wire
from eventbus.sinks import JsonlWriter
from tests.core.helpers import identity, until
from tests.process.subs import LateEnd, Tally, WhereAmI, steps_in


def test_what_an_older_one_publishes_at_close_is_not_charged_to_a_newer_one_ended_before(
    tmp_path: Path,
) -> None:
    """Newest first: the newer one is ended before the older one publishes from `on_close`.
    The sidecar's answer to END was always "not here" (the REMOVE posted just before had
    taken it), so the ended one was put back to running and charged the older one's summary
    as a loss: a healthy close logged "closed with losses"."""
    bus = EventBus(drain_interval=0.002, close_timeout=20)
    older = bus.subscribe(Tally(str(tmp_path / "t")), placement="process")  # a Scalars at close
    newer = bus.subscribe(WhereAmI(str(tmp_path / "w")), placement="process")  # every event
    with bus:
        for i in range(5):
            bus.publish(Loss(step=i, value=1.0))
    st = bus.stats()
    identity(st)
    n = st[newer.name]  # type: ignore[index]
    assert (n.state, n.published, n.delivered, n.dropped) == ("closed", 5, 5, 0)
    assert st[older.name].state == "closed"  # type: ignore[index]
    assert st.sidecar is not None and st.sidecar.lost == 0


def test_two_removals_in_one_batch_each_keep_only_what_came_before(tmp_path: Path) -> None:
    """One batch here spans both removals: it was split at the first only, so the second
    removed subscriber was sent (and counted) what was published after its removal."""
    bus = EventBus(drain_interval=0.002, close_timeout=20)
    a = bus.subscribe(Tally(str(tmp_path / "a")), placement="process")
    b = bus.subscribe(Tally(str(tmp_path / "b")), placement="process")
    for i in range(15):  # before start: routed here together, in one batch
        if i == 5:
            a.remove()
        if i == 10:
            b.remove()
        bus.publish(Loss(step=i, value=1.0))
    bus.start()
    st = bus.close()
    identity(st)
    assert steps_in(tmp_path / "a") == list(range(5))
    assert steps_in(tmp_path / "b") == list(range(10))
    sa, sb = st[a.name], st[b.name]  # type: ignore[index]
    assert (sa.published, sa.delivered, sa.dropped) == (5, 5, 0)
    assert (sb.published, sb.delivered, sb.dropped) == (10, 10, 0)


def test_a_split_batch_waiting_for_the_window_is_counted_whole_when_the_close_gives_up(
    tmp_path: Path,
) -> None:
    """A batch cut at a removal: its first part waits for room in the window when the close
    gives up on the sidecar. That part was counted (held), the rest vanished: `a` showed 5 of
    the 10 events published to it."""
    bus = EventBus(drain_interval=0.002, close_timeout=20, hang_timeout=None)
    a = bus.subscribe(Tally(str(tmp_path / "a")), placement="process")
    x = bus.subscribe(Tally(str(tmp_path / "x")), placement="process")
    side = bus._sidecar
    assert side is not None
    for i in range(10):  # before start: one batch, cut at x's removal
        if i == 5:
            x.remove()
        bus.publish(Loss(step=i, value=1.0))
    with side._cond:
        side.chan.in_flight += 1 << 40  # the window stays full: nothing more is sent
    bus.start()
    assert until(lambda: side._held is not None)  # the first part waits for room
    st = bus.close(timeout=2)
    identity(st)
    sa, sx = st[a.name], st[x.name]  # type: ignore[index]
    assert (sa.published, sa.delivered, sa.dropped, sa.queued) == (10, 0, 10, 0)
    assert (sx.published, sx.delivered, sx.dropped, sx.queued) == (5, 0, 5, 0)


def test_a_removal_made_while_a_flush_waits_keeps_what_came_before_it(tmp_path: Path) -> None:
    """The flush told the sidecar of every removal at once, even one made after the flush
    began whose earlier events still waited here: those events then reached no one (counted
    lost), breaking "what was published before the removal still reaches it". And the
    flush's `on_flush`, ending, marked the sidecar's delivery idle while a batch still waited
    for room, so the close settled (and told the removal) before that batch was sent."""
    bus = EventBus(drain_interval=0.002, close_timeout=20)
    t = bus.subscribe(Tally(str(tmp_path / "t")), placement="process")
    bus.subscribe(Tally(str(tmp_path / "other")), placement="process")
    side = bus._sidecar
    assert side is not None
    window = side.max_bytes_in_flight
    with bus:
        bus.publish(Loss(step=0, value=1.0))
        assert bus.flush(timeout=30)
        with side._cond:  # room for one small batch, then the window is full
            side.chan.in_flight += window - 600
        bus.publish(Loss(step=1, value=1.0))
        assert until(lambda: side._through >= 1)  # step 1 sent; the window now holds
        with side._cond:
            side.chan.in_flight += 1 << 40
        bus.publish(Loss(step=2, value=1.0))
        assert until(lambda: side._held is not None)  # step 2 waits for room
        flushed: list[bool] = []
        waiter = threading.Thread(target=lambda: flushed.append(bus.flush(timeout=30)))
        waiter.start()
        assert until(lambda: len(side.delivery._markers._due) > 0)  # the flush waits on us
        for i in range(3, 40):  # behind the flush marker
            bus.publish(Loss(step=i, value=1.0))
        t.remove()
        with side._cond:  # the window opens for step 2 only: the rest waits again
            side.chan.in_flight -= 1 << 40
        waiter.join(30)
        assert flushed == [True]
        assert side.delivery.busy_since is not None  # still inside the batch of steps 3-39
        with side._cond:
            side.chan.in_flight -= window - 600
    st = bus.stats()
    identity(st)
    assert steps_in(tmp_path / "t") == list(range(40))
    s = st[t.name]  # type: ignore[index]
    assert (s.published, s.delivered, s.dropped) == (40, 40, 0)


@pytest.mark.parametrize("gap", ["sidecar_started_late", "event_dropped_on_the_way"])
def test_a_removal_is_told_at_the_flush_when_seqs_never_reached_the_sidecar(
    tmp_path: Path, gap: str
) -> None:
    """A flush told the sidecar only of removals up to the last seq it sent. Seqs that never
    reach it (events published before it existed, one dropped at the inbox by a feedback
    storm) left that behind the counter: `remove(); flush()` no longer ended the removed
    subscriber, which stayed open there (and `closed` False) until the next event."""
    bus = EventBus(drain_interval=0.002, close_timeout=20)
    with bus:
        if gap == "sidecar_started_late":
            for i in range(5):
                bus.publish(Loss(step=i, value=1.0))
            assert bus.flush(timeout=20)
        t = bus.subscribe(Tally(str(tmp_path / "t")), placement="process")
        assert bus.flush(timeout=20)
        if gap == "event_dropped_on_the_way":
            bus.publish(Loss(step=0, value=1.0))
            assert bus.flush(timeout=20)
            next(bus._seq)  # what a storm drop at the inbox leaves: a seq nobody routes
        t.remove()
        assert bus.flush(timeout=20)
        assert until(lambda: t.closed), t.stats()
    identity(bus.stats())


def test_a_removed_subscriber_whose_sidecar_dies_has_ended(tmp_path: Path) -> None:
    """The restarted sidecar rebuilds only live subscribers: one removed (and not yet ended
    there) when the old one died stayed "removed", `closed` False, for ever."""
    bus = EventBus(drain_interval=0.002, close_timeout=20)
    t = bus.subscribe(Tally(str(tmp_path / "t")), placement="process")
    bus.subscribe(Tally(str(tmp_path / "other")), placement="process")
    with bus:
        for i in range(5):
            bus.publish(Loss(step=i, value=1.0))
        assert bus.flush(timeout=30)
        t.remove()
        side = bus.stats().sidecar
        assert side is not None and side.pid is not None
        os.kill(side.pid, signal.SIGKILL)
        assert until(lambda: (s := bus.stats().sidecar) is not None and s.restarts == 1, 30)
        bus.publish(Loss(step=5, value=1.0))
        assert bus.flush(timeout=30)
        assert t.closed
    st = bus.stats()
    identity(st)
    s = st[t.name]  # type: ignore[index]
    assert (s.state, s.published, s.delivered + s.dropped) == ("closed", 5, 5)
    assert steps_in(tmp_path / "other") == [5]  # rebuilt after the death: a fresh file


def test_a_sidecar_writers_last_stats_record_holds_the_training_processes_counters(
    tmp_path: Path,
) -> None:
    """The close ended a sidecar subscriber with a REMOVE, then an END carrying the parent's
    final counters; the REMOVE alone closed it there, so in about one close of four the
    writer's last record lacked every in-process subscriber (here: 3 failures unseen)."""

    def broken(ev: Event) -> None:
        raise RuntimeError("nope")

    for i in range(8):  # a race: each round lost it about one time in four
        run = tmp_path / str(i)
        bus = EventBus(drain_interval=0.002, close_timeout=20)
        bus.subscribe(JsonlWriter(run), placement="process")
        bus.subscribe(broken, events=[Loss], policy="block", name="broken")
        with bus:
            for s in range(3):
                bus.publish(Loss(step=s, value=1.0))
        last = orjson.loads((run / "events.jsonl").read_text().splitlines()[-1])
        assert last["type"] == "eventbus.stats"
        subs = last["bus"]["subscribers"]
        assert subs["broken"]["failed"] == 3, f"round {i}: {sorted(subs)}"
        assert subs["jsonl"]["delivered"] == 3


def test_a_subscriber_ended_at_close_gets_nothing_published_after_its_end(
    tmp_path: Path,
) -> None:
    """The END alone ends a subscriber there, on a thread of its own: batches the sidecar read
    after the END, before that thread ran, still reached the ended one, which was then
    counted more delivered than it was sent (the REMOVE had taken it in order, on the
    reading thread)."""
    bus = EventBus(drain_interval=0.002, close_timeout=20)
    older = bus.subscribe(Tally(str(tmp_path / "a")), placement="process")
    newer = bus.subscribe(LateEnd(str(tmp_path / "b")), placement="process")  # ended first
    bus.start()
    for i in range(5):
        bus.publish(Loss(step=i, value=1.0))
    assert bus.flush(10)

    def publish() -> None:  # another thread goes on publishing while the bus closes
        step = 100
        while bus.running:
            bus.publish(Loss(step=step, value=1.0))
            step += 1
            time.sleep(0.002)

    t = threading.Thread(target=publish)
    t.start()
    st = bus.close()
    t.join()
    identity(st)
    n = st[newer.name]  # type: ignore[index]
    assert n.state == "closed"
    assert len(steps_in(tmp_path / "b")) == n.delivered == n.published - n.dropped
    assert st[older.name].state == "closed"  # type: ignore[index]


def test_a_removal_told_while_the_close_ends_a_subscriber_sends_it_no_remove(
    tmp_path: Path,
) -> None:
    """The close marks the subscriber removed, then tells removals skipping it (its END ends
    it). A flush or a batch telling removals in between (on the bus loop) sent it a REMOVE
    anyway: it closed before the END's counters came, as before the END alone ended it."""
    bus = EventBus(drain_interval=0.002, close_timeout=20)
    t = bus.subscribe(Tally(str(tmp_path / "t")), placement="process")
    side = bus._sidecar
    assert side is not None
    removes: list[int] = []
    post, remove = side.chan.post, side._remove

    def spy(data: bytes | None) -> None:
        if data is not None and data[:1] == wire.REMOVE:
            removes.append(pickle.loads(data[1:]))
        post(data)

    def racing(r: Any) -> None:  # only the close removes here: a flush tells removals now
        remove(r)
        other = threading.Thread(target=side._removed, args=(1 << 40,))
        other.start()
        other.join(0.5)

    side.chan.post = spy  # type: ignore[method-assign]
    side._remove = racing  # type: ignore[method-assign]
    with bus:
        for i in range(5):
            bus.publish(Loss(step=i, value=1.0))
    st = bus.stats()
    identity(st)
    assert removes == []
    s = st[t.name]  # type: ignore[index]
    assert (s.state, s.published, s.delivered) == ("closed", 5, 5)


def test_closing_a_bus_never_started_names_no_sidecar_subscriber_hung(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing was asked of the sidecar, so nothing went unanswered: it ends its subscribers
    by itself (its reading ends), as an in-process one of a bus never started is left."""
    bus = EventBus(close_timeout=5)
    sub = bus.subscribe(JsonlWriter(tmp_path))  # the sidecar starts here
    with caplog.at_level(logging.ERROR, logger="eventbus"):
        st = bus.close()
    assert st.hung == ()
    assert st[sub.name].state != "hung"  # type: ignore[index]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_sidecar_that_dies_in_its_close_is_reported_dead_once_not_hung(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bus = EventBus(drain_interval=0.002, close_timeout=10)
    sub = bus.subscribe(Tally(str(tmp_path / "t")), placement="process")
    side = bus._sidecar
    assert side is not None
    ask = side.request

    def dying(op: bytes, arg: Any, *, within: float | None = None) -> Any:
        if op == wire.CLOSE:  # killed (out of memory, say) as the close reaches it
            os.kill(side.chan.proc.pid, signal.SIGKILL)
        return ask(op, arg, within=within)

    side.request = dying  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="eventbus"), bus:
        for i in range(100):
            bus.publish(Loss(step=i, value=1.0))
    st = bus.stats()
    s = st[sub.name]  # type: ignore[index]
    assert st.hung == () and s.state != "hung"
    assert s.delivered + s.dropped + s.failed == s.published == 100
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "died" in errors[0], errors  # not "did not answer in time"
