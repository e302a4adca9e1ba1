"""Tensor capture at publish: no host reads on the training thread, snapshots, exact values."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import OrderedDict, namedtuple
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import structlog
import torch
from torch.overrides import TorchFunctionMode

from eventbus import EventBus
from eventbus.capture import (
    POOL,
    Pending,
    capture_event,
    capture_shared,
    pending_of,
    resolve,
)
from eventbus.events import Loss, OptimizerStepped, Scalars, StepEnded
from tests.conftest import Recorder

# What reads a tensor's value on the host: on a CUDA tensor each one is a device sync.
HOST_READS = frozenset(
    {
        "item",
        "tolist",
        "numpy",
        "cpu",
        "__float__",
        "__int__",
        "__bool__",
        "__index__",
        "__complex__",
        "__array__",
    }
)


def _name(func: Any) -> str:
    return getattr(func, "__name__", str(func))


class ReadRecorder(TorchFunctionMode):
    """Records every host read of a tensor made on this thread while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, int]] = []
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = _name(func)
        self.calls.append(name)
        if name in HOST_READS:
            self.reads.append((name, threading.get_ident()))
        return func(*args, **(kwargs or {}))


class Spy(torch.Tensor):
    """A tensor subclass that records host reads on any thread (the bus thread too)."""

    reads: ClassVar[list[tuple[str, int]]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _name(func) in HOST_READS:
            cls.reads.append((_name(func), threading.get_ident()))
        return super().__torch_function__(func, types, args, kwargs or {})


@contextlib.contextmanager
def patched_reads() -> Iterator[list[tuple[str, int]]]:
    """Wraps the host-read methods of torch.Tensor itself: sees reads in autograd hooks too
    (a TorchFunctionMode is per thread and off inside the backward engine)."""
    reads: list[tuple[str, int]] = []
    saved = {n: torch.Tensor.__dict__.get(n) for n in HOST_READS}

    def spy(name: str, real: Any) -> Any:
        def wrapper(self: Any, *a: Any, **k: Any) -> Any:
            reads.append((name, threading.get_ident()))
            return real(self, *a, **k)

        return wrapper

    for n in HOST_READS:
        setattr(torch.Tensor, n, spy(n, getattr(torch.Tensor, n)))
    try:
        yield reads
    finally:
        for n, v in saved.items():
            if v is None:
                delattr(torch.Tensor, n)
            else:
                setattr(torch.Tensor, n, v)


def test_patched_reads_see_reads_inside_backward_hooks() -> None:
    w = torch.ones(2, requires_grad=True)

    def reading(p: torch.Tensor) -> None:
        assert p.grad is not None
        p.grad.sum().item()

    w.register_post_accumulate_grad_hook(reading)
    with ReadRecorder() as mode:
        (w * 2).sum().backward()
    assert mode.reads == []  # the mode misses a read made inside the backward engine
    with patched_reads() as reads:
        (w * 2).sum().backward()
        float(torch.tensor(1.0))
    assert [n for n, _ in reads] == ["item", "__float__"]
    assert all(hasattr(torch.Tensor, n) for n in HOST_READS)
    assert torch.tensor(2.0).item() == 2.0


def _deliver(bus: EventBus, *events: Any) -> list[Any]:
    rec = Recorder()
    bus.subscribe(rec)
    with bus:
        for ev in events:
            bus.publish(ev)
    return rec.got


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, generator=g, requires_grad=True)
    return {
        "f32": torch.randn((), generator=g),
        "bf16": torch.randn((), generator=g).to(torch.bfloat16),
        "f64": torch.randn((), generator=g, dtype=torch.float64),
        "int": torch.tensor(7),
        "bool": torch.tensor(True),
        "one_elem": torch.randn(1, generator=g),
        "grad": (w * 2).sum(),  # requires grad, has a graph
        "noncontig": torch.randn(3, 4, generator=g).t(),
        "vector": torch.randn(5, generator=g),
    }


# -- nothing reads a tensor on the publishing thread ---------------------------------------


def test_the_recorder_sees_every_kind_of_host_read() -> None:
    t = torch.tensor(2.0)
    with ReadRecorder() as mode:
        t.item()
        float(t)
        t.tolist()
        t.numpy()
        t.cpu()
        int(t)
    assert [n for n, _ in mode.reads] == ["item", "__float__", "tolist", "numpy", "cpu", "__int__"]


def test_a_deliberate_item_at_publish_is_caught(
    bus: EventBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check can fail: a capture that read the value would be seen."""
    from eventbus import capture

    real = capture._Capture.tensor

    def reading(self: Any, t: Any) -> Any:
        t.item()  # what a naive implementation does
        return real(self, t)

    monkeypatch.setattr(capture._Capture, "tensor", reading)
    with ReadRecorder() as mode:
        bus.publish(Loss(step=1, value=torch.tensor(1.5)))
    assert ("item", threading.get_ident()) in mode.reads


def test_publishing_tensors_never_reads_them_on_the_publishing_thread(bus: EventBus) -> None:
    ts = _tensors()
    events = [
        Loss(step=1, value=ts["f32"]),
        Scalars(step=1, values=dict(ts)),
        Scalars(step=1, values={"nested": [ts["f32"], (ts["int"], {"x": ts["vector"]})]}),
        OptimizerStepped(step=1, lr=torch.tensor(1e-3), grad_norm=ts["grad"]),
        StepEnded(step=1, tokens=torch.tensor(128)),
    ]
    rec = Recorder()
    bus.subscribe(rec)
    with bus:
        with ReadRecorder() as mode:
            for ev in events:
                bus.publish(ev)
        assert mode.calls, "the mode saw nothing: it is not checking anything"
        assert mode.reads == []
    assert len(rec.got) == len(events)


def test_host_reads_happen_on_the_bus_thread_only(bus: EventBus) -> None:
    Spy.reads.clear()
    spy = torch.tensor(3.25).as_subclass(Spy)
    vec = torch.arange(4.0).as_subclass(Spy)
    me = threading.get_ident()
    got = _deliver(bus, Loss(step=1, value=spy), Scalars(step=1, values={"v": vec, "s": spy}))
    assert got[0].value == 3.25
    assert Spy.reads, "the subclass recorded nothing: the check would not catch a read"
    assert all(thread != me for _, thread in Spy.reads), Spy.reads


def test_capture_cost_does_not_depend_on_the_number_of_subscribers() -> None:
    """Capture happens once per publish, before routing: same ops with 0 or 8 subscribers."""
    counts = []
    for n in (0, 1, 8):
        b = EventBus(drain_interval=0.002)
        for _ in range(n):
            b.subscribe(Recorder())
        with b, ReadRecorder() as mode:
            b.publish(Scalars(step=1, values={"a": torch.tensor(1.0), "b": torch.tensor(2.0)}))
        counts.append(sorted(mode.calls))
    assert counts[0] == counts[1] == counts[2]
    assert counts[0].count("clone") == 2


# -- snapshots and values -----------------------------------------------------------------


def test_in_place_changes_after_publish_are_not_seen(bus: EventBus) -> None:
    loss = torch.tensor(1.0)
    vec = torch.ones(3)
    norm = torch.tensor(4.0)
    events = (
        Loss(step=1, value=loss),
        Scalars(step=1, values={"vec": vec, "n": norm}),
        OptimizerStepped(step=1, grad_norm=norm),
    )
    rec = Recorder()
    bus.subscribe(rec)
    with bus:
        for ev in events:
            bus.publish(ev)
        loss.add_(10)  # before the bus thread ran: the snapshot must not move
        vec.mul_(0)
        norm.fill_(-1)
    got = rec.got
    assert got[0].value == 1.0
    assert torch.equal(got[1].values["vec"], torch.ones(3))
    assert got[1].values["n"] == 4.0
    assert got[2].grad_norm == 4.0


def test_a_container_reused_after_publish_is_not_seen(bus: EventBus) -> None:
    """A dict or list of plain numbers filled anew each step (the same object): each event
    keeps the values it was published with, as a tensor does (issue 14's class: changed
    after publish)."""
    values: dict[str, Any] = {}
    rec = Recorder()
    bus.subscribe(rec)
    with bus:
        for step in range(3):
            values["loss"] = float(step)
            values["hist"] = [step, step]
            values["pair"] = (step, [step])
            bus.publish(Scalars(step=step, values=values))
            values["hist"].append(-1)  # changed in place after publish
            values["pair"][1].append(-1)
    got = [ev.values for ev in rec.got]
    assert got == [{"loss": float(s), "hist": [s, s], "pair": (s, [s])} for s in range(3)], got


def test_delivered_values_equal_eager_item(bus: EventBus) -> None:
    ts = _tensors()
    eager = {k: t.detach().item() for k, t in ts.items() if t.numel() == 1}
    got = _deliver(
        bus,
        Loss(step=1, value=ts["f32"]),
        Scalars(step=2, values=dict(ts)),
        OptimizerStepped(step=3, lr=torch.tensor(0.5), grad_norm=ts["grad"]),
    )
    loss, scalars, opt = got
    assert type(loss.value) is float
    assert loss.value == eager["f32"]
    for k, v in eager.items():
        assert scalars.values[k] == v, k
        assert type(scalars.values[k]) is type(v), k
    assert type(scalars.values["int"]) is int
    assert type(scalars.values["bool"]) is bool
    assert opt.grad_norm == eager["grad"]
    assert opt.lr == 0.5
    for k in ("noncontig", "vector"):  # not one element: a CPU tensor, equal, no grad
        out = scalars.values[k]
        assert isinstance(out, torch.Tensor)
        assert out.device.type == "cpu"
        assert torch.equal(out, ts[k])
        assert not out.requires_grad


def test_containers_keep_their_shape_and_plain_values(bus: EventBus) -> None:
    Pair = namedtuple("Pair", "a b")
    values = {
        "list": [torch.tensor(1.0), 2.0, "x"],
        "tuple": (torch.tensor(3), None),
        "pair": Pair(torch.tensor(4.0), 5),
        "ordered": OrderedDict(k=torch.tensor(6.0)),
        "plain": 7.5,
    }
    (ev,) = _deliver(bus, Scalars(step=1, values=values))
    assert ev.values["list"] == [1.0, 2.0, "x"]
    assert ev.values["tuple"] == (3, None)
    assert ev.values["pair"] == Pair(4.0, 5)
    assert type(ev.values["pair"]) is Pair
    assert ev.values["ordered"] == {"k": 6.0}
    assert ev.values["plain"] == 7.5


def test_events_without_tensors_are_left_alone() -> None:
    values = {"a": 1.0, "b": [2, 3]}
    ev = Scalars(step=1, values=values)
    assert capture_event(ev) is False  # nothing to resolve on the bus thread
    assert ev.values == values and ev.values is not values  # a copy: values may change


def test_a_meta_tensor_is_refused_where_it_is_published(bus: EventBus) -> None:
    with bus, pytest.raises(TypeError, match="meta tensor"):
        bus.publish(Loss(step=1, value=torch.empty((), device="meta")))


def test_an_unreadable_capture_becomes_none_and_the_bus_goes_on(bus: EventBus) -> None:
    class Broken:
        device = property(lambda self: (_ for _ in ()).throw(RuntimeError("boom")))

    with structlog.testing.capture_logs() as logs:
        got = _deliver(
            bus,
            Scalars(step=1, values={"bad": Pending(Broken()), "ok": 1.0}),
            Loss(step=2, value=torch.tensor(2.0)),
        )
    assert got[0].values == {"bad": None, "ok": 1.0}
    assert got[1].value == 2.0
    assert any("could not be read" in e["event"] and e["field"] == "Scalars.values" for e in logs)


def test_shared_capture_parts_resolve_to_their_elements() -> None:
    t = torch.tensor([1.5, 2.0, 3.0, 4.0], dtype=torch.float64)
    shared = capture_shared(t)
    t.zero_()  # a snapshot
    ev = Scalars(
        step=1,
        values={"x": shared.part(0), "n": shared.part(1, kind=int), "rest": shared.part(2, 4)},
    )
    assert capture_event(ev) is True  # already-captured values still need resolving
    assert all(p.ready() for p in pending_of(ev))
    resolve(ev)
    assert ev.values == {"x": 1.5, "n": 2, "rest": [3.0, 4.0]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_without_cuda_nothing_touches_the_pinned_pool(bus: EventBus) -> None:
    before = POOL.statistics()
    got = _deliver(bus, Loss(step=1, value=torch.tensor(1.0)))
    assert got[0].value == 1.0
    assert POOL.statistics() == before


def _deep_dict(n: int, leaf: Any = None) -> dict[str, Any]:
    d: dict[str, Any] = {"leaf": leaf}
    for _ in range(n):
        d = {"a": d}
    return d


@pytest.mark.parametrize("kind", ["cyclic", "deep5000", "cyclic-list"])
def test_cyclic_or_very_deep_fields_publish_without_recursion_error(kind: str) -> None:
    if kind == "cyclic":
        v: Any = {"x": 1.0}
        v["self"] = v
    elif kind == "cyclic-list":
        v = [1.0]
        v.append(v)
    else:
        v = _deep_dict(5000)
    t = torch.tensor(2.0)
    # A class per case: the warning is rate-limited per type and field.
    cls = dataclasses.make_dataclass(
        f"Deep_{kind.replace('-', '_')}", [], bases=(Scalars,), slots=True, kw_only=True
    )
    ev = cls(step=1, values={"t": t, "v": v})
    with structlog.testing.capture_logs() as logs:
        assert capture_event(ev)  # the shallow tensor is still captured
    assert [e["field"] for e in logs if "nested deeper" in e["event"]] == ["values"]
    assert f"{cls.__name__}.values" in logs[0]["event"]
    assert len(pending_of(ev)) >= 1
    resolve(ev)
    assert ev.values["t"] == 2.0


def test_a_deep_field_without_tensors_is_delivered_unchanged(bus: EventBus) -> None:
    deep = _deep_dict(600)
    got = _deliver(bus, Scalars(step=1, values=deep), Loss(step=2, value=1.0))
    assert [type(e).__name__ for e in got] == ["Scalars", "Loss"]
    assert got[0].values == deep


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.tensor([[0.0, 1.5], [2.0, 0.0]]).to_sparse(),
        lambda: torch.tensor([[0.0, 1.5], [2.0, 0.0]]).to_sparse_csr(),
    ],
    ids=["coo", "csr"],
)
def test_sparse_tensors_reach_subscribers_and_the_encoder(make: Any, bus: EventBus) -> None:
    import warnings

    from eventbus.codec import decode, encode

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
        t = make()
    got = _deliver(bus, Scalars(step=1, values={"m": t}))
    assert len(got) == 1
    back = decode(encode(got[0]))
    assert isinstance(back, Scalars) and back.values["m"] == [[0.0, 1.5], [2.0, 0.0]]
