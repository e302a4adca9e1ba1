"""The core promises: order, counts, isolation, hung subscribers, lifecycle, bad input."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from typing import Any

import pytest
import structlog

from eventbus import Event, EventBus
from eventbus.events import Loss, Scalars, StepEnded, StopRequested
from tests.conftest import Recorder


def test_publish_stamps_seq_ts_rank(bus: EventBus, recorder: Recorder) -> None:
    bus.subscribe(recorder)
    with bus:
        before = time.time_ns()
        bus.publish(Loss(step=1, value=1.0))
        bus.publish(Loss(step=2, value=1.0, ts=42))
    ev1, ev2 = recorder.got
    assert ev1.seq is not None and ev2.seq == ev1.seq + 1
    assert ev1.ts is not None and ev1.ts >= before
    assert ev2.ts == 42  # an explicit timestamp is kept
    assert ev1.rank == ev2.rank == 0


def test_million_events_lossless_in_order_to_a_slower_subscriber() -> None:
    class Slow:
        policy = "block"
        maxsize = 1000

        def __init__(self) -> None:
            self.seqs: list[int] = []

        async def on_events(self, batch: list[Event]) -> None:
            self.seqs.extend(ev.seq for ev in batch)  # type: ignore[misc]
            await asyncio.sleep(0.0005)  # slower than the publisher

    n = 1_000_000
    slow = Slow()
    bus = EventBus(inbox_maxsize=4096, cost_every=None)
    bus.subscribe(slow, max_batch=256)
    with bus:
        for i in range(n):
            bus.publish(StepEnded(step=i))
    st = bus.stats()
    assert len(slow.seqs) == n
    assert slow.seqs == list(range(slow.seqs[0], slow.seqs[0] + n))  # contiguous, in order
    assert st["Slow"].delivered == st["Slow"].published == n
    assert st["Slow"].dropped == 0
    assert st.blocked_s > 0  # it really was slower: the publisher felt backpressure


@pytest.mark.parametrize("policy", ["drop_oldest", "drop_newest", "latest"])
def test_drop_policies_count_every_event(policy: str) -> None:
    seen: list[Event] = []
    gate = threading.Event()

    def slow(ev: Event) -> None:
        gate.wait(5)
        seen.append(ev)

    bus = EventBus(cost_every=None)
    h = bus.subscribe(slow, policy=policy, maxsize=50)
    with bus:
        for i in range(5000):
            bus.publish(Loss(step=i, value=float(i)))
        bus.flush(0.5)  # lets the router fill the queue while the subscriber is stuck
        gate.set()
    st = h.stats()
    assert st is not None
    assert st.published == 5000
    assert st.delivered + st.dropped == st.published
    assert st.dropped > 0
    assert len(seen) == st.delivered
    steps = [ev.step for ev in seen]
    assert steps == sorted(steps)  # FIFO among the survivors
    if policy == "drop_newest":
        assert 0 in steps and 4999 not in steps
    else:
        assert steps[-1] == 4999  # the newest survives


def test_latest_keeps_newest_per_key() -> None:
    seen: list[Scalars] = []
    gate = threading.Event()

    def slow(ev: Any) -> None:
        gate.wait(5)
        seen.append(ev)

    bus = EventBus()
    bus.subscribe(
        slow, policy="latest", maxsize=10, key=lambda ev: ev.values["k"], events=[Scalars]
    )
    with bus:
        bus.publish(Scalars(step=0, values={"k": "blocker"}))
        bus.flush(0.3)  # the subscriber now holds "blocker" and waits on the gate
        for i in range(1, 301):
            bus.publish(Scalars(step=i, values={"k": f"key{i % 3}", "i": i}))
        bus.flush(0.3)
        gate.set()
    rest = seen[1:]
    assert sorted(ev.values["k"] for ev in rest) == ["key0", "key1", "key2"]
    assert {ev.values["k"]: ev.values["i"] for ev in rest} == {
        "key0": 300,
        "key1": 298,
        "key2": 299,
    }


def test_raising_subscriber_is_isolated_and_counted() -> None:
    good = Recorder()

    def flaky(ev: Event) -> None:
        if ev.step is not None and ev.step % 10 == 9:
            raise ValueError(f"bad step {ev.step}")

    bus = EventBus()
    bus.subscribe(good)
    h = bus.subscribe(flaky, policy="block")
    with structlog.testing.capture_logs() as logs, bus:
        for i in range(1000):
            bus.publish(Loss(step=i, value=1.0))  # never raises
    st = h.stats()
    assert st is not None
    assert st.failed == 100 and st.delivered == 900 and st.state == "closed"
    assert len(good.got) == 1000
    failures = [e for e in logs if e["event"] == "subscriber failed"]
    assert failures and failures[0]["event_type"] == "Loss"
    assert failures[0]["subscriber"].endswith("<locals>.flaky")
    assert len(failures) < 10  # rate-limited, not one line per failure


def test_always_failing_subscriber_is_disabled_and_reported() -> None:
    class Broken:
        async def on_events(self, batch: list[Event]) -> None:
            raise RuntimeError("boom")

    bus = EventBus(max_consecutive_failures=3)
    h = bus.subscribe(Broken(), max_batch=1, policy="block")
    with structlog.testing.capture_logs() as logs, bus:
        for i in range(20):
            bus.publish(Loss(step=i, value=1.0))
            bus.flush(1)
    st = h.stats()
    assert st is not None
    assert st.state in ("disabled", "closed") and st.failed == 3
    assert st.failed + st.dropped + st.delivered == 20
    assert any(e["event"] == "subscriber disabled" for e in logs)


def test_hung_subscribers_cannot_stop_close() -> None:
    class HungAsync:
        async def on_events(self, batch: list[Event]) -> None:
            await asyncio.Event().wait()  # never returns

    def hung_sync(ev: Event) -> None:
        time.sleep(60)

    good = Recorder()
    bus = EventBus()
    bus.subscribe(good)
    bus.subscribe(HungAsync())
    bus.subscribe(hung_sync)
    bus.start()
    for i in range(10):
        bus.publish(Loss(step=i, value=1.0))
    bus.flush(0.2)
    t0 = time.monotonic()
    with structlog.testing.capture_logs() as logs:
        st = bus.close(timeout=1)
    elapsed = time.monotonic() - t0
    assert elapsed < 1.6
    assert sorted(st.hung) == ["HungAsync", hung_sync.__qualname__]
    assert len(good.got) == 10
    assert any("abandoned" in e["event"] for e in logs)


def test_close_is_idempotent_and_publish_after_close_is_counted(recorder: Recorder) -> None:
    bus = EventBus()
    bus.subscribe(recorder)
    with bus:
        bus.publish(Loss(step=1, value=1.0))
    bus.close()
    bus.publish(Loss(step=2, value=1.0))  # does not raise: training code at exit is common
    st = bus.close()
    assert st.rejected == 1 and len(recorder.got) == 1
    with pytest.raises(RuntimeError, match="closed"):
        bus.start()


def test_events_published_before_start_are_delivered(recorder: Recorder) -> None:
    bus = EventBus()
    bus.subscribe(recorder)
    bus.publish(Loss(step=0, value=1.0))
    with bus:
        bus.publish(Loss(step=1, value=1.0))
    assert [e.step for e in recorder.got] == [0, 1]


def test_subscribe_while_running_gets_what_follows(bus: EventBus) -> None:
    bus.start()
    bus.publish(Loss(step=0, value=1.0))
    late = Recorder()
    h = bus.subscribe(late)
    bus.publish(Loss(step=1, value=1.0))
    assert bus.flush(5)
    assert [e.step for e in late.got] == [1]
    h.remove()
    bus.publish(Loss(step=2, value=1.0))
    assert bus.flush(5)
    assert [e.step for e in late.got] == [1]
    assert not h.active


def test_routing_by_type_and_base_class(bus: EventBus) -> None:
    import dataclasses

    @dataclasses.dataclass(slots=True, kw_only=True)
    class MyLoss(Loss):
        extra: int = 0

    only_loss = Recorder(events=(Loss,))
    only_steps = Recorder(events=(StepEnded,))
    bus.subscribe(only_loss)
    bus.subscribe(only_steps)
    with bus:
        bus.publish(Loss(step=1, value=1.0))
        bus.publish(MyLoss(step=2, value=1.0))
        bus.publish(StepEnded(step=3))
    assert [type(e) for e in only_loss.got] == [Loss, MyLoss]
    assert [e.step for e in only_steps.got] == [3]


def test_functions_sync_and_async_and_decorator(bus: EventBus) -> None:
    got_sync: list[int | None] = []
    got_async: list[int | None] = []
    threads: set[str] = set()

    @bus.on(Loss, policy="block")
    def sync_fn(ev: Loss) -> None:
        threads.add(threading.current_thread().name)
        got_sync.append(ev.step)

    async def async_fn(ev: Event) -> None:
        got_async.append(ev.step)

    bus.subscribe(async_fn, events=[StepEnded], policy="block")
    with bus:
        bus.publish(Loss(step=1, value=1.0))
        bus.publish(StepEnded(step=2))
    assert got_sync == [1] and got_async == [2]
    assert threads and all(t.startswith("eventbus-") for t in threads)  # off the loop


def test_hooks_are_called_in_order(bus: EventBus) -> None:
    calls: list[str] = []

    class Hooked:
        policy = "block"

        def on_start(self, b: EventBus) -> None:
            calls.append(f"start:{b is bus}")

        async def on_events(self, batch: list[Event]) -> None:
            calls.append(f"events:{len(batch)}")

        async def on_close(self) -> None:
            calls.append("close")

    bus.subscribe(Hooked())
    with bus:
        bus.publish(Loss(step=1, value=1.0))
    assert calls == ["start:True", "events:1", "close"]


def test_subscribers_close_newest_first_and_see_late_events() -> None:
    writer = Recorder()

    class Summariser:
        async def on_start(self, b: EventBus) -> None:
            self.bus = b

        async def on_events(self, batch: list[Event]) -> None:
            pass

        async def on_close(self) -> None:
            self.bus.publish(Scalars(step=None, values={"summary": 1.0}))

    bus = EventBus()
    bus.subscribe(writer)
    bus.subscribe(Summariser())
    with bus:
        bus.publish(Loss(step=1, value=1.0))
    assert [type(e) for e in writer.got] == [Loss, Scalars]


def test_control_stop_and_abort(bus: EventBus, recorder: Recorder) -> None:
    bus.subscribe(recorder)
    with bus:
        assert not bus.should_stop
        bus.control.request_stop("enough")
        bus.control.request_stop("again")  # idempotent: one event
        assert bus.should_stop and not bus.should_abort
        bus.control.request_abort("now")
        assert bus.should_abort
        with pytest.raises(Exception, match="now"):
            bus.control.check()
    stops = [e for e in recorder.got if isinstance(e, StopRequested)]
    assert [(s.reason, s.abort) for s in stops] == [("enough", False), ("now", True)]


def test_stats_latency_and_high_water(bus: EventBus, recorder: Recorder) -> None:
    h = bus.subscribe(recorder)
    with bus:
        for i in range(100):
            bus.publish(Loss(step=i, value=1.0))
        bus.flush(5)
        st = h.stats()
        assert st is not None and st.latency_p50_ms is not None and st.latency_p50_ms >= 0
        assert st.queue_high_water >= 1
    assert bus.stats().published == 100
    assert bus.stats().as_dict()["subscribers"]["Recorder"]["delivered"] == 100


def test_state_dict_round_trip(bus: EventBus) -> None:
    class Counting:
        policy = "block"

        def __init__(self) -> None:
            self.n = 0

        async def on_events(self, batch: list[Event]) -> None:
            self.n += len(batch)

        def state_dict(self) -> dict[str, int]:
            return {"n": self.n}

        def load_state_dict(self, d: dict[str, int]) -> None:
            self.n = d["n"]

    c = Counting()
    bus.subscribe(c)
    with bus:
        for i in range(5):
            bus.publish(Loss(step=i, value=1.0))
        state = bus.state_dict()
    assert state == {"Counting": {"n": 5}}
    other = EventBus()
    c2 = Counting()
    other.subscribe(c2)
    other.load_state_dict(state)
    assert c2.n == 5
    with pytest.raises(KeyError, match="no subscriber named"):
        other.load_state_dict({"Nope": {}})


# -- bad input -----------------------------------------------------------------------


def test_publishing_a_non_event_is_a_clear_type_error(bus: EventBus, recorder: Recorder) -> None:
    bus.subscribe(recorder)
    with bus:
        with pytest.raises(TypeError, match=r"publish\(\) takes an eventbus Event.*dict"):
            bus.publish({"loss": 1.0})  # type: ignore[arg-type]
        bus.publish(Loss(step=1, value=1.0))  # nothing else lost
    assert len(recorder.got) == 1


class _TakesNoBatch:
    def on_events(self) -> None:  # forgot the batch
        pass


class _MaxsizeZero:
    maxsize = 0  # read as "not set" and replaced by 10,000

    def on_events(self, batch: list[Event]) -> None:
        pass


@pytest.mark.parametrize(
    ("sub", "kwargs", "err", "match"),
    [
        (42, {}, TypeError, "on_events"),
        ("text", {}, TypeError, "on_events"),
        (print, {"events": [dict]}, TypeError, "Event subclasses"),
        (print, {"events": []}, ValueError, "empty"),
        (print, {"policy": "drop_all"}, ValueError, "block, drop_oldest"),
        (print, {"maxsize": 0}, ValueError, "maxsize"),
        (print, {"placement": "gpu"}, ValueError, "placement"),
        # each of these was accepted, then every event failed, or none ever came
        (Recorder, {}, TypeError, "an instance"),  # the class, not an instance of it
        (Loss, {}, TypeError, "an instance"),
        (lambda: None, {}, TypeError, "one event"),
        (lambda a, b: None, {}, TypeError, "one event"),
        (_TakesNoBatch(), {}, TypeError, "on_events"),
        (print, {"policy": 0}, ValueError, "policy"),
        (print, {"policy": ""}, ValueError, "policy"),
        (print, {"maxsize": True}, ValueError, "maxsize"),
        (_MaxsizeZero(), {}, ValueError, "maxsize"),
        (print, {"policy": "latest", "key": "name"}, TypeError, "key"),
        (print, {"ranks": 0}, TypeError, "ranks"),
        (print, {"ranks": "0"}, TypeError, "ranks"),  # rank 0 is not "0": never subscribed
        (print, {"ranks": [None]}, TypeError, "ranks"),
        (print, {"name": 3}, TypeError, "name"),
    ],
)
def test_bad_subscriptions_are_clear_errors(
    sub: Any, kwargs: dict[str, Any], err: type[Exception], match: str
) -> None:
    bus = EventBus()
    with pytest.raises(err, match=match):
        bus.subscribe(sub, **kwargs)


def test_subscribing_the_same_object_twice_is_refused_until_removed() -> None:
    """Twice subscribed, a sink got every event twice: a JSONL file with each line twice."""
    bus = EventBus(handle_signals=False)
    rec = Recorder()
    h = bus.subscribe(rec)
    with pytest.raises(ValueError, match=r"already subscribed.*'Recorder'.*remove\(\)"):
        bus.subscribe(rec, events=[Loss])
    with bus:
        bus.publish(Loss(step=1, value=1.0))
        h.remove()
        bus.subscribe(rec)  # removed: it may come back
        bus.publish(Loss(step=2, value=1.0))
    assert [e.step for e in rec.got] == [1, 2]


def test_ranks_filter_skips_other_ranks() -> None:
    bus = EventBus(rank=1, world_size=2)
    h = bus.subscribe(Recorder(), ranks=[0])
    assert not h.active and h.name is None
    h2 = bus.subscribe(Recorder(), ranks=[1])
    assert h2.active


def test_publishing_from_other_threads_and_async(bus: EventBus, recorder: Recorder) -> None:
    bus.subscribe(recorder)

    async def apub() -> None:
        for i in range(100):
            await bus.apublish(Loss(step=i, value=1.0))

    def pub() -> None:
        for i in range(100):
            bus.publish(StepEnded(step=i))

    with bus:
        threads = [threading.Thread(target=pub) for _ in range(4)]
        for t in threads:
            t.start()
        asyncio.run(apub())
        for t in threads:
            t.join()
    assert len(recorder.got) == 500
    assert sorted(e.seq for e in recorder.got) == list(range(500))  # type: ignore[type-var]


def test_unstarted_bus_with_a_full_inbox_says_what_to_do() -> None:
    bus = EventBus(inbox_maxsize=10)
    bus.subscribe(Recorder())
    for i in range(10):
        bus.publish(Loss(step=i, value=1.0))
    with pytest.raises(RuntimeError, match="never started"):
        bus.publish(Loss(step=10, value=1.0))
    assert bus.stats().inbox_size == 10  # the refused event was not queued


def test_full_inbox_with_only_lossy_subscribers_drops_and_counts_exactly() -> None:
    seen: list[Event] = []

    def slow(ev: Event) -> None:
        time.sleep(0.0001)
        seen.append(ev)

    bus = EventBus(inbox_maxsize=4, drain_interval=0.05, cost_every=None)
    h = bus.subscribe(slow, policy="drop_oldest", maxsize=8)
    n = 20_000
    with bus:
        for i in range(n):
            bus.publish(Loss(step=i, value=1.0))
    st = h.stats()
    assert st is not None
    assert st.published == n == bus.stats().published
    assert st.delivered + st.dropped == n
    assert st.dropped > 0 and len(seen) == st.delivered
    assert bus.stats().blocked_s == 0.0  # never waited: there is no lossless subscriber


def test_subscribe_then_close_at_once_delivers_everything() -> None:
    rec = Recorder()
    with EventBus() as bus:
        bus.subscribe(rec)
        for s in range(10):
            bus.publish(Loss(step=s, value=1.0))
    assert [e.step for e in rec.got] == list(range(10))


def test_removed_subscriber_still_gets_what_was_queued_then_closes() -> None:
    gate = threading.Event()
    got: list[int | None] = []
    closed: list[bool] = []

    class Slow:
        policy = "block"

        def on_events(self, batch: list[Event]) -> None:
            gate.wait(5)
            got.extend(ev.step for ev in batch)

        def on_close(self) -> None:
            closed.append(True)

    bus = EventBus()
    h = bus.subscribe(Slow(), max_batch=1)
    with bus:
        for s in range(5):
            bus.publish(Loss(step=s, value=1.0))
        bus.flush(0.2)  # routed, mostly still queued behind the gate
        h.remove()
        bus.publish(Loss(step=99, value=1.0))  # after remove(): not for it
        gate.set()
    assert got == [0, 1, 2, 3, 4] and closed == [True]
    st = h.stats()
    assert st is not None and st.dropped == 0 and st.state == "closed"


def test_publishing_the_same_event_object_twice_is_refused(
    bus: EventBus, recorder: Recorder
) -> None:
    bus.subscribe(recorder)
    bus.start()
    ev = Loss(step=1, value=1.0)
    bus.publish(ev)
    with pytest.raises(ValueError, match="already published"):
        bus.publish(ev)  # the bus still holds the first: a change would rewrite it
    assert bus.flush(5)
    assert [e.seq for e in recorder.got] == [0]


def test_republishing_a_copy_is_fine(bus: EventBus, recorder: Recorder) -> None:
    import dataclasses

    bus.subscribe(recorder)
    bus.start()
    ev = Loss(step=1, value=1.0)
    bus.publish(ev)
    again = dataclasses.replace(ev, seq=None, value=2.0)
    bus.publish(again)
    assert bus.flush(5)
    assert [(e.seq, e.value) for e in recorder.got] == [(0, 1.0), (1, 2.0)]


def test_bad_bus_options_are_clear_errors() -> None:
    for kw in (
        {"drain_interval": 0},
        {"close_timeout": -1},
        {"inbox_max_bytes": 0},
        {"queue_max_bytes": 1.5},
        {"inbox_maxsize": "big"},
    ):
        with pytest.raises(ValueError, match=next(iter(kw))):
            EventBus(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [math.nan, "1", True])
@pytest.mark.parametrize("method", ["close", "flush"])
def test_a_bad_timeout_is_refused_and_loses_nothing(method: str, timeout: Any) -> None:
    """`close(timeout=nan)` read as 0 and abandoned a lossless subscriber's queue."""
    bus = EventBus(handle_signals=False)
    got: list[Event] = []
    gate = threading.Event()

    def slow(ev: Event) -> None:
        gate.wait(10)
        got.append(ev)

    bus.subscribe(slow, policy="block")
    with bus:
        for i in range(100):
            bus.publish(Loss(step=i, value=1.0))
        with pytest.raises((ValueError, TypeError), match="timeout"):
            getattr(bus, method)(timeout=timeout)
        assert bus.running
        gate.set()
    assert len(got) == 100


@pytest.mark.parametrize(
    "kw",
    [
        {"drain_interval": math.nan},  # the bus thread died of it at its first wait
        {"close_timeout": math.nan},
        {"hang_timeout": math.nan},
        {"max_consecutive_failures": "3"},  # the bus thread died at the first failure
        {"max_consecutive_failures": 0},
        {"rank": "0"},  # stamped on every event; ranks=[0] never matched
        {"rank": -1},
        {"world_size": 0},
        {"handle_signals": "no"},  # a truthy string installed the handler
        {"strict": "yes"},
        {"name": None},
    ],
    ids=lambda kw: "-".join(f"{k}={v!r}" for k, v in kw.items()),
)
def test_every_bad_bus_option_is_refused_naming_it(kw: dict[str, Any]) -> None:
    with pytest.raises((ValueError, TypeError), match=list(kw)[-1]):
        EventBus(**kw)


def test_two_threads_closing_at_once_finish_it_once(caplog: pytest.LogCaptureFixture) -> None:
    """Both wait for the same shutdown; only one finishes it (the close was reported twice,
    and the sidecar released twice)."""
    release = threading.Event()

    class SlowClose:
        def on_events(self, batch: list[Event]) -> None:
            raise RuntimeError("a failure: the close report is a warning, said once")

        def on_close(self) -> None:
            release.wait(10)

    bus = EventBus(drain_interval=0.002)
    bus.subscribe(SlowClose())
    bus.start()
    bus.publish(Loss(step=1, value=1.0))
    assert bus.flush(timeout=10)
    entered: list[float] = []
    both = threading.Event()
    wait_closed = bus._loop.wait_closed

    def counted(deadline: float) -> KeyboardInterrupt | None:
        entered.append(deadline)
        if len(entered) == 2:
            both.set()
        return wait_closed(deadline)

    bus._loop.wait_closed = counted  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="eventbus"):
        closers = [threading.Thread(target=bus.close) for _ in range(2)]
        for t in closers:
            t.start()
        assert both.wait(10)  # both are inside close(), waiting for the same shutdown
        release.set()
        for t in closers:
            t.join(10)
    said = [r for r in caplog.records if r.getMessage().startswith("event='eventbus closed")]
    assert len(said) == 1, [r.getMessage() for r in said]
