"""The scalar ring on the CPU (a host copy, no event): exact values, order, wrap-around,
fallback, threads, no waiting. On a GPU: tests/test_gpu.py."""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import eventbus._capture_pending as pending_mod
import eventbus._capture_ring as ring_mod
from eventbus import EventBus
from eventbus import capture as capture_mod
from eventbus._capture_ring import Rings, RingSlot, ScalarRing
from eventbus.capture import Shared, pending_of, resolve
from eventbus.events import Loss, Scalars
from eventbus.log import RateLimiter
from tests.conftest import Recorder

VALUES: list[tuple[torch.dtype, list[Any]]] = [
    (torch.float32, [0.1, -2.5, 1e-45, 3.4e38, math.inf, -0.0, math.nan]),
    (torch.float64, [0.1, 1 / 3, 1e-300, -math.inf, 2.0**60 + 1]),
    (torch.float16, [0.1, 65504.0, 6e-8]),
    (torch.bfloat16, [0.3, 1e30, -7.0]),
    (torch.int32, [0, -(2**31), 2**31 - 1]),
    (torch.int64, [2**53 + 1, -(2**63), 2**63 - 1]),
    (torch.bool, [True, False]),
]


def _drained(slots: list[RingSlot]) -> list[Any]:
    assert all(s.ready() for s in slots)
    return [s.value() for s in slots]


@pytest.mark.parametrize(("dtype", "values"), VALUES, ids=str)
def test_values_are_exactly_what_item_gives(dtype: torch.dtype, values: list[Any]) -> None:
    rings = Rings(size=8)
    tensors = [torch.tensor(v, dtype=dtype) for v in values]
    tensors.append(torch.tensor([[values[0]]], dtype=dtype))  # one element, two dimensions
    slots = [rings.put(t) for t in tensors]
    assert all(isinstance(s, RingSlot) for s in slots)
    got = _drained(slots)  # type: ignore[arg-type]
    want = [t.item() for t in tensors]
    assert [type(x) for x in got] == [type(x) for x in want]
    assert [repr(x) for x in got] == [repr(x) for x in want]  # -0.0 and nan too


def test_order_is_kept_across_many_copies() -> None:
    ring = ScalarRing(torch.int64, size=16)
    slots: list[RingSlot] = []
    for i in range(200):
        s = ring.put(torch.tensor(i))
        assert s is not None
        slots.append(s)
        if i % 7 == 6:  # the bus thread comes by now and then: one copy for what is written
            assert slots[-1].ready()
    assert ring.copies == 200 // 7
    assert _drained(slots) == list(range(200))
    assert ring.copies == 200 // 7 + 1  # the last four: one more copy


def test_one_copy_covers_every_slot_written_before_the_poll() -> None:
    ring = ScalarRing(torch.float32, size=16)
    slots = [ring.put(torch.tensor(float(i))) for i in range(5)]
    assert slots[3] is not None and slots[3].ready()  # any slot's first poll copies them all
    assert ring.copies == 1
    assert _drained(slots) == [0.0, 1.0, 2.0, 3.0, 4.0]  # type: ignore[arg-type]
    assert ring.copies == 1


def test_a_copy_across_the_end_of_the_buffer() -> None:
    ring = ScalarRing(torch.float64, size=8)
    first = [ring.put(torch.tensor(float(i), dtype=torch.float64)) for i in range(6)]
    assert _drained(first) == [float(i) for i in range(6)]  # type: ignore[arg-type]
    # Slots 6, 7, 0, 1, 2, 3: one copy in two pieces.
    second = [ring.put(torch.tensor(float(10 + i), dtype=torch.float64)) for i in range(6)]
    assert second[0] is not None and second[0].batch.start == 6
    assert _drained(second) == [float(10 + i) for i in range(6)]  # type: ignore[arg-type]
    assert ring.copies == 2
    assert (ring.written, ring.copied) == (12, 12)


def test_a_full_ring_falls_back_and_counts_it() -> None:
    rings = Rings(size=8)
    slots = [rings.put(torch.tensor(float(i))) for i in range(8)]
    assert all(s is not None for s in slots)
    # No bus thread has polled: the next write would overwrite slot 0 before any copy read it.
    assert rings.put(torch.tensor(99.0)) is None
    assert rings.put(torch.tensor(99.0)) is None
    st = rings.statistics()
    assert (st["written"], st["fallbacks"], st["copies"]) == (8, 2, 0)
    assert slots[0] is not None and slots[0].ready()  # one poll copies all eight, frees them
    after = [rings.put(torch.tensor(100.0 + i)) for i in range(8)]
    assert all(s is not None for s in after)
    assert _drained(slots) == [float(i) for i in range(8)]  # type: ignore[arg-type]
    assert _drained(after) == [100.0 + i for i in range(8)]  # type: ignore[arg-type]
    assert rings.statistics() == {"rings": 1, "written": 16, "fallbacks": 2, "copies": 2}


def test_a_ring_full_of_slots_nobody_polls_is_copied_by_the_bus_thread() -> None:
    rings = Rings(size=8)
    for i in range(8):  # their events were dropped before routing: no slot is ever polled
        rings.put(torch.tensor(float(i)))
    assert rings.put(torch.tensor(99.0)) is None
    assert rings.unstick() == 1
    assert rings.unstick() == 0  # not full any more: nothing to do
    later = [rings.put(torch.tensor(100.0 + i)) for i in range(8)]
    assert _drained(later) == [100.0 + i for i in range(8)]  # type: ignore[arg-type]
    assert rings.statistics() == {"rings": 1, "written": 16, "fallbacks": 1, "copies": 2}


def test_the_router_unsticks_rings_on_each_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    rings = Rings(size=4)
    for i in range(4):
        rings.put(torch.tensor(float(i)))
    monkeypatch.setattr("eventbus.core.router.RINGS", rings)
    with EventBus(drain_interval=0.002) as bus:
        bus.publish(Loss(step=1, value=1.0))
        assert bus.flush(timeout=10)
    assert rings.statistics()["copies"] == 1
    assert rings.put(torch.tensor(5.0)) is not None


def test_slots_rewritten_after_the_copy_do_not_change_what_was_copied() -> None:
    ring = ScalarRing(torch.float32, size=4)
    old = [ring.put(torch.tensor(float(i))) for i in range(4)]
    assert old[0] is not None and old[0].ready()  # copied, not read yet
    new = [ring.put(torch.tensor(-1.0)) for _ in range(4)]  # the same four slots again
    assert all(s is not None for s in new)
    assert [s.value() for s in old] == [0.0, 1.0, 2.0, 3.0]  # type: ignore[union-attr]
    assert _drained(new) == [-1.0] * 4  # type: ignore[arg-type]


def test_what_does_not_fit_a_ring_is_left_to_the_caller() -> None:
    rings = Rings(size=8)
    refused = [
        torch.tensor([1.0, 2.0]),  # two elements
        torch.tensor(1 + 2j),  # complex
        torch.tensor(3, dtype=torch.int8),
        torch.tensor(3, dtype=torch.uint8),
        torch.empty(0),
        torch.nn.Parameter(torch.tensor(1.0), requires_grad=False),  # a subclass
    ]
    assert [rings.put(t) for t in refused] == [None] * len(refused)
    assert rings.statistics() == {"rings": 0, "written": 0, "fallbacks": 0, "copies": 0}


def test_rings_are_per_dtype_and_bounded() -> None:
    rings = Rings(size=8, max_rings=2)
    assert rings.put(torch.tensor(1.0)) is not None
    assert rings.put(torch.tensor(1)) is not None
    assert rings.put(torch.tensor(True)) is None  # a third ring: none made, counted
    assert rings.statistics() == {"rings": 2, "written": 2, "fallbacks": 1, "copies": 0}
    with pytest.raises(ValueError, match="power of two"):
        ScalarRing(torch.float32, size=6)


def test_a_ring_made_in_inference_mode_takes_writes_outside_it() -> None:
    rings = Rings(size=8)
    with torch.inference_mode():
        a = rings.put(torch.tensor(1.0))
    b = rings.put(torch.tensor(2.0))
    assert a is not None and b is not None
    assert _drained([a, b]) == [1.0, 2.0]


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_put_dispatches_one_copy_and_reads_nothing() -> None:
    rings = Rings(size=4)
    t = torch.tensor(2.0)
    for _ in range(2):  # every slot's view is made on its first use
        slots = [rings.put(t) for _ in range(4)]
        assert slots[0] is not None and slots[0].ready()
    with Ops() as mode:
        s = rings.put(t)
    assert mode.ops == ["aten.copy_.default"]
    assert s is not None and _drained([s]) == [2.0]


def test_a_busy_ring_falls_back_instead_of_waiting() -> None:
    """The lock is held by another writer, by a drain, or by this thread (a torch mode that
    publishes from inside the ring's own copy_): never wait, never deadlock."""
    ring = ScalarRing(torch.float32, size=8)
    with ring.lock:
        t0 = time.perf_counter()
        assert ring.put(torch.tensor(1.0)) is None
        assert time.perf_counter() - t0 < 0.5
    assert ring.fallbacks == 1
    assert ring.put(torch.tensor(1.0)) is not None


def test_ready_never_waits_for_a_writer_or_another_bus_thread() -> None:
    ring = ScalarRing(torch.float32, size=8)
    s = ring.put(torch.tensor(4.0))
    assert s is not None
    t0 = time.perf_counter()
    with ring.lock:  # a writer is mid-write: the snapshot must not wait for it
        assert s.ready() is False
    with ring.bus_lock:  # another bus thread is copying
        assert s.ready() is False
    assert time.perf_counter() - t0 < 0.5
    assert s.ready() and s.value() == 4.0


def test_a_ring_slot_resolves_through_resolve_and_shared() -> None:
    rings = Rings(size=8)
    ev = Scalars(step=1, values={"a": rings.put(torch.tensor(0.5)), "b": 2})
    parts = Shared(rings.put(torch.tensor(7)))  # type: ignore[arg-type]
    ev2 = Scalars(step=2, values={"n": parts.part(0, kind=int)})
    assert all(p.ready() for p in pending_of(ev) + pending_of(ev2))
    resolve(ev)
    resolve(ev2)
    assert ev.values == {"a": 0.5, "b": 2}
    assert ev2.values == {"n": 7}


def test_two_writer_threads_and_a_polling_thread_lose_nothing(
    request: pytest.FixtureRequest,
) -> None:
    request.addfinalizer(functools.partial(sys.setswitchinterval, sys.getswitchinterval()))
    sys.setswitchinterval(1e-6)  # interleave the threads as much as the GIL allows
    ring = ScalarRing(torch.int64, size=256)
    n = 3000
    results: dict[int, list[tuple[int, RingSlot | None]]] = {0: [], 1: []}
    done = threading.Event()
    go = threading.Barrier(3)

    def writer(k: int) -> None:
        go.wait()
        for i in range(n):
            v = 2 * i + k
            results[k].append((v, ring.put(torch.tensor(v))))

    def bus() -> None:  # polls each slot once written, in order, as the router would
        go.wait()
        seen = [0, 0]
        while not done.is_set():
            for k in (0, 1):
                new = results[k][seen[k] :]
                seen[k] += len(new)
                for _, s in new:
                    while s is not None and not s.ready():
                        pass

    threads = [threading.Thread(target=writer, args=(k,)) for k in (0, 1)]
    poller = threading.Thread(target=bus)
    for th in (*threads, poller):
        th.start()
    for th in threads:
        th.join()
    done.set()
    poller.join()
    slots = [(v, s) for k in (0, 1) for v, s in results[k]]
    got = {v: s for v, s in slots if s is not None}
    assert all(s.ready() for s in got.values())
    assert all(s.value() == v for v, s in got.items())  # each slot holds its own value
    assert len({s.seq for s in got.values()}) == len(got)  # no slot handed out twice
    fell_back = sum(s is None for _, s in slots)
    assert ring.fallbacks == fell_back  # every write is in the ring or counted out of it
    assert ring.written == len(got) == 2 * n - fell_back
    assert ring.written > ring.size  # around the ring at least once


def _through_rings(monkeypatch: pytest.MonkeyPatch, rings: Rings) -> None:
    """Test-only: route one-element CPU tensors through a CPU ring, as CUDA scalars are."""
    real = capture_mod._Capture.tensor

    def tensor(self: Any, t: Any) -> Any:
        if t.is_cpu:
            slot = rings.put(t.detach())
            if slot is not None:
                return slot
        return real(self, t)

    monkeypatch.setattr(capture_mod._Capture, "tensor", tensor)


def test_published_scalars_reach_subscribers_through_a_ring(
    monkeypatch: pytest.MonkeyPatch, bus: EventBus
) -> None:
    rings = Rings(size=16)
    _through_rings(monkeypatch, rings)
    rec = Recorder()
    bus.subscribe(rec)
    losses = [torch.tensor(0.25 * i) for i in range(100)]
    t = torch.tensor(5.0)
    with bus:
        for i, x in enumerate(losses):
            bus.publish(Loss(step=i, value=x))
            values = {"i": torch.tensor(i), "ok": torch.tensor(i % 2 == 0), "v": torch.ones(3)}
            bus.publish(Scalars(step=i, values=values))
        bus.publish(Loss(step=100, value=t))
        t.add_(1)  # after publish: not seen
        assert bus.flush(10)
    got = rec.got
    assert [e.value for e in got if isinstance(e, Loss)] == [*(x.item() for x in losses), 5.0]
    sc = [e.values for e in got if isinstance(e, Scalars)]
    assert [v["i"] for v in sc] == list(range(100))
    assert all(type(v["i"]) is int and type(v["ok"]) is bool for v in sc)
    assert [v["ok"] for v in sc] == [i % 2 == 0 for i in range(100)]
    assert all(torch.equal(v["v"], torch.ones(3)) for v in sc)  # three elements: no ring
    st = rings.statistics()
    assert st["written"] + st["fallbacks"] == 301
    assert st["written"] > 0 and st["copies"] > 0


def test_a_failed_ring_copy_is_delivered_as_none_and_logged_and_the_ring_goes_on(
    monkeypatch: pytest.MonkeyPatch, bus: EventBus
) -> None:
    rings = Rings(size=8)
    _through_rings(monkeypatch, rings)
    rec = Recorder()
    bus.subscribe(rec)
    fail = [True]
    real = ScalarRing._new_host

    def new_host(self: ScalarRing) -> Any:
        if fail[0]:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(self)

    monkeypatch.setattr(ScalarRing, "_new_host", new_host)
    # A fresh limiter: the message is logged at most once per 10 s (other tests log it too).
    monkeypatch.setattr(pending_mod, "_failures", RateLimiter(10.0))
    with structlog.testing.capture_logs() as logs, bus:
        bus.publish(Loss(step=1, value=torch.tensor(1.0)))
        assert bus.flush(10)
        fail[0] = False
        bus.publish(Loss(step=2, value=torch.tensor(2.0)))
        assert bus.flush(10)
    assert [e.value for e in rec.got] == [None, 2.0]  # type: ignore[attr-defined]
    assert any(
        "could not be read" in e["event"]
        and e["field"] == "Loss.value"
        and "illegal memory access" in e["error"]
        for e in logs
    )
    assert rings.statistics()["written"] == 2


class FakeEvent:
    """Stands in for a CUDA event: query() tells, never waits."""

    def __init__(self) -> None:
        self.finished = False
        self.queries = 0
        self.recorded_on: Any = None

    def record(self, stream: Any) -> None:
        self.recorded_on = stream

    def query(self) -> bool:
        self.queries += 1
        return self.finished


class FakeEvents:
    def __init__(self) -> None:
        self.made: list[FakeEvent] = []
        self.back: list[FakeEvent] = []

    def get(self, device: Any) -> FakeEvent:
        self.made.append(FakeEvent())
        return self.made[-1]

    def put(self, device: Any, ev: FakeEvent) -> None:
        self.back.append(ev)


def test_the_cuda_steps_of_a_drain_with_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA-only lines of a drain, on the CPU: the copy goes on the ring's stream, waits
    while that stream captures a graph, and is followed by one event, polled and given back
    once."""
    streams: list[Any] = []
    capturing = [True]

    @contextlib.contextmanager
    def stream(s: Any) -> Iterator[None]:
        streams.append(s)
        yield

    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    events = FakeEvents()
    monkeypatch.setattr(ring_mod, "EVENTS", events)
    ring = ScalarRing(torch.float32, size=8)
    ring.cuda, ring.stream = True, "the writers' stream"  # what a CUDA ring holds
    monkeypatch.setattr(ring, "_new_host", lambda: torch.empty(8))  # pinned: not on the CPU
    slots = [ring.put(torch.tensor(float(i))) for i in range(3)]
    assert slots[0] is not None and slots[0].ready() is False  # capturing: no copy queued
    assert (ring.copies, ring.copied, events.made) == (0, 0, [])
    capturing[0] = False
    assert slots[0].ready() is False  # queued; the event has not passed
    assert streams == ["the writers' stream"] * 2
    (ev,) = events.made
    assert ev.recorded_on == "the writers' stream"
    assert (ring.copies, ring.copied) == (1, 3)
    assert slots[2] is not None and slots[2].ready() is False
    ev.finished = True
    assert all(s is not None and s.ready() for s in slots)
    assert ev.queries == 3  # dropped by the batch once seen finished
    assert events.back == [ev]
    assert [s.value() for s in slots] == [0.0, 1.0, 2.0]  # type: ignore[union-attr]
