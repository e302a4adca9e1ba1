"""On a CUDA device: publishing loss, grad norm and watch() statistics every step never syncs.

Run with `python -m pytest tests/test_gpu.py` on a machine with a GPU; skipped without one.
`torch.cuda.set_sync_debug_mode("error")` turns every synchronising call into an error.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import eventbus.torch as et
from eventbus import Event, EventBus
from eventbus.capture import POOL
from eventbus.events import Loss, OptimizerStepped, Scalars, StepEnded, TensorStats

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class Keep:
    """A lossless subscriber that keeps every event."""

    policy = "block"

    def __init__(self) -> None:
        self.got: list[Event] = []

    async def on_events(self, batch: list[Event]) -> None:
        self.got.extend(batch)


@contextlib.contextmanager
def sync_is_an_error() -> Iterator[None]:
    torch.cuda.synchronize()  # start clean: nothing of a previous test still queued
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


class Block(nn.Module):
    """Attention written out (matmul, masked_fill, softmax): no backend choice to second-guess."""

    def __init__(self, d: int, ctx: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.register_buffer("future", torch.ones(ctx, ctx, dtype=torch.bool).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, d = x.shape[1], x.shape[2]
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        att = (q @ k.transpose(1, 2)) / math.sqrt(d)
        att = att.masked_fill(self.future[:t, :t], float("-inf")).softmax(dim=-1)
        x = x + self.proj(att @ v)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Takes float features (no nn.Embedding: its CUDA backward may read a count back)."""

    def __init__(self, d: int = 64, vocab: int = 64, layers: int = 2, ctx: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d, ctx) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for blk in self.blocks:
            x = blk(x)
        out: torch.Tensor = self.head(self.ln_f(x))
        return out


def test_sync_debug_mode_catches_a_sync() -> None:
    """The check below can fail: an .item() on a CUDA tensor raises in this mode."""
    t = torch.ones((), device="cuda")
    with sync_is_an_error(), pytest.raises(RuntimeError, match="synchroniz"):
        t.item()


def test_a_loop_publishing_every_step_never_syncs() -> None:
    torch.manual_seed(0)
    model = TinyGPT().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    keep = Keep()
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(keep)
    losses: list[torch.Tensor] = []
    given: list[torch.Tensor] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtypes: dict[str, str] = {}  # what the modules really returned, seen independently
    for name in ("blocks.0.qkv", "blocks.0.ln1"):
        model.get_submodule(name).register_forward_hook(
            lambda m, a, out, name=name: dtypes.__setitem__(name, str(out.dtype))
        )
    with bus, et.watch(model, bus, every=1, histogram=True), et.instrument(model, opt, bus) as ins:
        with sync_is_an_error():
            for step in range(1, 9):
                with bus.step(step, samples=8, tokens=8 * 32):
                    # Generated on the device: torch.tensor(..., device="cuda") would copy
                    # from pageable memory, a sync.
                    x = torch.randn(8, 32, 64, device="cuda", generator=gen)
                    target = torch.randint(0, 64, (8, 32), device="cuda", generator=gen)
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        logits = model(x)
                    loss = nn.functional.cross_entropy(
                        logits.float().flatten(0, 1), target.flatten()
                    )
                    loss.backward()
                    if step % 2 == 0:  # the clip result (pre-clip norm) on even steps
                        norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                        ins.record_grad_norm(norm)
                        given.append(norm)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    bus.publish(Loss(step=step, value=loss))
                    bus.publish(Scalars(step=step, values={"ppl": loss.exp(), "lr": 1e-3}))
                    losses.append(loss.detach())
        assert bus.flush(30)
    st = bus.stats()
    assert st.failed == 0
    assert [e.value for e in keep.got if isinstance(e, Loss)] == [t.item() for t in losses]
    ppl = [e.values["ppl"] for e in keep.got if isinstance(e, Scalars)]
    assert ppl == pytest.approx([t.exp().item() for t in losses], rel=1e-6)
    opts = [e for e in keep.got if isinstance(e, OptimizerStepped)]
    assert [e.step for e in opts] == list(range(1, 9))
    assert [e.grad_norm for e in opts[1::2]] == [t.item() for t in given]
    assert all(isinstance(e.grad_norm, float) and math.isfinite(e.grad_norm) for e in opts)
    stats = [e for e in keep.got if isinstance(e, TensorStats)]
    assert {e.step for e in stats} == set(range(1, 9))
    act = {e.name: e.dtype for e in stats if e.kind == "activations"}
    assert act["blocks.0.qkv"] == dtypes["blocks.0.qkv"] == "torch.bfloat16"
    assert act["blocks.0.ln1"] == dtypes["blocks.0.ln1"]  # float32 under CUDA autocast
    assert all(type(e.norm) is float and type(e.nan_count) is int for e in stats)
    assert all(sum(e.histogram["counts"]) == math.prod(e.shape) for e in stats)
    assert [e.step for e in keep.got if isinstance(e, StepEnded)] == list(range(1, 9))


def test_watch_statistics_on_the_device_equal_eager_values() -> None:
    torch.manual_seed(0)
    model = TinyGPT().cuda()
    seen: dict[str, torch.Tensor] = {}
    model.head.register_forward_hook(lambda m, a, out: seen.__setitem__("head", out.detach()))
    keep = Keep()
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(keep)
    x = torch.randn(4, 32, 64, device="cuda")
    with bus, et.watch(model, bus, every=1, what="activations"):
        with sync_is_an_error():
            model(x)
        assert bus.flush(30)
    (s,) = [e for e in keep.got if isinstance(e, TensorStats) and e.name == "head"]
    t = seen["head"]
    assert s.norm == pytest.approx(t.norm().item(), rel=1e-5)
    assert s.std == pytest.approx(t.std().item(), rel=1e-5)
    assert s.absmax == pytest.approx(t.abs().max().item(), rel=1e-6)
    assert (s.nan_count, s.inf_count) == (0, 0)


def test_captured_values_are_snapshots_in_stream_order() -> None:
    keep = Keep()
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(keep)
    t = torch.full((), 1.5, device="cuda")
    mat = torch.arange(12.0, device="cuda").reshape(3, 4)
    # Made before the checked block: torch.tensor(x, device="cuda") copies from pageable
    # host memory, which synchronises.
    values = {
        "int": torch.tensor(7, device="cuda"),
        "bf16": torch.tensor(0.3, device="cuda", dtype=torch.bfloat16),
        "noncontig": mat.t(),
        "one": torch.ones(1, device="cuda"),
    }
    side = torch.cuda.Stream()
    with bus:
        with sync_is_an_error():
            bus.publish(Loss(step=1, value=t))
            t.add_(10)  # queued after the copy on the same stream: not seen
            bus.publish(Scalars(step=2, values=values))
            with torch.cuda.stream(side):  # produced and published on a side stream
                side.wait_stream(torch.cuda.default_stream())
                y = (mat * 2).sum()
                bus.publish(Loss(step=3, value=y))
        assert bus.flush(30)
    torch.cuda.synchronize()
    loss1, scalars, loss3 = keep.got
    assert loss1.value == 1.5
    v = scalars.values
    assert v["int"] == 7
    assert type(v["int"]) is int
    assert v["bf16"] == torch.tensor(0.3, dtype=torch.bfloat16).item()
    assert v["one"] == 1.0
    assert torch.equal(v["noncontig"], mat.t().cpu())
    assert v["noncontig"].device.type == "cpu"
    assert loss3.value == 132.0


def test_pinned_buffers_are_reused() -> None:
    bus = EventBus(drain_interval=0.002)
    keep = Keep()
    bus.subscribe(keep)
    before = POOL.statistics()
    x = torch.zeros(2, device="cuda")  # two elements: scalars go to the device ring instead
    with bus:
        for i in range(200):
            x.fill_(i)
            bus.publish(Loss(step=i, value=x))
            if i % 20 == 19:
                assert bus.flush(30)  # buffers come back once read
    after = POOL.statistics()
    assert [e.value.tolist() for e in keep.got] == [[float(i)] * 2 for i in range(200)]
    assert after["reused"] - before["reused"] >= 100
    assert after["allocated"] - before["allocated"] <= 40


def test_the_loop_makes_no_more_pinned_buffers_once_warm() -> None:
    """Steady state: each step's captures reuse the pool (no new pinned allocation)."""
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(Keep())
    vals: list[Any] = [torch.randn((), device="cuda") for _ in range(8)]
    with bus:
        for _ in range(5):  # warm up
            bus.publish(Scalars(values=dict(enumerate(vals))))
            assert bus.flush(30)
        warm = POOL.statistics()["allocated"]
        for _ in range(20):
            bus.publish(Scalars(values=dict(enumerate(vals))))
            assert bus.flush(30)
    assert POOL.statistics()["allocated"] == warm


def test_publishing_while_a_cuda_graph_is_captured_fails_loudly() -> None:
    """Issue 22: a capture would record one copy into a reused buffer; refused at capture."""
    x = torch.ones(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with EventBus(drain_interval=0.002) as bus:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            y = x * 2  # warm-up outside the capture, as torch asks
            with (  # noqa: PT012 - the capture is the statement under test
                pytest.raises(RuntimeError, match="CUDA graph is being captured"),
                torch.cuda.graph(graph),
            ):
                y = x * 2
                bus.publish(Loss(step=1, value=y.sum()))
        torch.cuda.current_stream().wait_stream(stream)
        bus.publish(Loss(step=2, value=y.sum()))  # after the capture: published as usual
        assert bus.flush(10)


def test_a_compiled_watched_step_makes_no_sync() -> None:
    """Issue 22: statistics inside the compiled graph, published after it, no sync."""
    torch.manual_seed(0)
    model = TinyGPT().cuda()
    run = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    keep = Keep()
    gen = torch.Generator(device="cuda").manual_seed(0)
    with EventBus(drain_interval=0.002) as bus, et.watch(run, bus, every=2):
        bus.subscribe(keep)
        x = torch.randn(8, 32, 64, device="cuda", generator=gen)
        for _ in range(4):  # compile both graphs (watched and not) before checking
            run(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        with sync_is_an_error():
            for _ in range(4):
                run(x).float().square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        assert bus.flush(30)
    stats = [e for e in keep.got if isinstance(e, TensorStats)]
    assert {e.step for e in stats} == {2, 4, 6, 8}
    assert all(type(e.norm) is float and math.isfinite(e.norm) for e in stats)


def test_watched_steps_do_not_grow_the_allocator() -> None:
    """Issue 20: temporaries are bounded; the caching allocator neither retries nor grows."""
    torch.manual_seed(0)
    model = TinyGPT().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 32, 64, device="cuda", generator=gen)
    with EventBus(drain_interval=0.002) as bus, et.watch(model, bus, every=1, histogram=True):
        for step in range(12):
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step == 3:  # warm: every temporary size was seen once
                torch.cuda.synchronize()
                warm = torch.cuda.memory_stats()
        torch.cuda.synchronize()
        now = torch.cuda.memory_stats()
    assert now["num_alloc_retries"] == warm["num_alloc_retries"]
    assert now["segment.all.current"] <= warm["segment.all.current"]
    assert now["reserved_bytes.all.peak"] == warm["reserved_bytes.all.peak"]


def test_cuda_scalars_go_through_the_device_ring_without_a_sync() -> None:
    """Issue 20: a CUDA scalar costs one device-side write; one copy per drain, no sync."""
    from eventbus.capture import RINGS

    dtypes = [
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int32,
        torch.int64,
        torch.bool,
    ]
    # Made before the checked block: torch.tensor(x, device="cuda") copies from pageable
    # host memory, which synchronises.
    base = torch.arange(1, 41, device="cuda", dtype=torch.float64) / 7
    keep = Keep()
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(keep)
    side = torch.cuda.Stream()
    sent: list[dict[str, torch.Tensor]] = []
    before = RINGS.statistics()
    with bus:
        with sync_is_an_error():
            for i in range(40):
                x = base[i] * 3
                values = {str(d).removeprefix("torch."): x.to(d) for d in dtypes}
                values["shaped"] = x.reshape(1, 1).float()  # one element, two dimensions
                bus.publish(Scalars(step=i, values=values))
                sent.append({k: v.clone() for k, v in values.items()})
                x.add_(100)  # after publish, on the same stream: not seen
            with torch.cuda.stream(side):  # a second stream: a ring of its own
                side.wait_stream(torch.cuda.default_stream())
                y = base.sum()
                bus.publish(Loss(step=40, value=y))
        assert bus.flush(30)
    torch.cuda.synchronize()
    after = RINGS.statistics()
    n = 40 * (len(dtypes) + 1) + 1
    written = after["written"] - before["written"]
    fallbacks = after["fallbacks"] - before["fallbacks"]
    assert written + fallbacks == n
    assert written >= 0.9 * n  # falls back only if a writer waited over 100 us for the lock
    # One copy per drain and ring (a ring per dtype and stream), however many slots it covers.
    assert 1 <= after["copies"] - before["copies"] <= 40 * len(dtypes) + 1
    assert after["rings"] >= len(dtypes) + 1  # per dtype, and the side stream's own
    got = [e.values for e in keep.got if isinstance(e, Scalars)]
    want = [{k: v.item() for k, v in d.items()} for d in sent]
    assert got == want
    assert all(type(g[k]) is type(w[k]) for g, w in zip(got, want, strict=True) for k in w)
    (loss,) = [e for e in keep.got if isinstance(e, Loss)]
    assert loss.value == y.item()


def test_a_full_cuda_ring_falls_back_to_a_pinned_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """No bus thread polls: the ring fills, and the next scalars take the pinned path."""
    import time

    from eventbus import capture
    from eventbus._capture_ring import Rings, RingSlot
    from eventbus.capture import Pending, capture_event, pending_of, resolve

    rings = Rings(size=8)
    monkeypatch.setattr(capture, "RINGS", rings)
    xs = torch.arange(10, device="cuda", dtype=torch.float32) + 0.5
    events = [Loss(step=i, value=xs[i]) for i in range(10)]
    with sync_is_an_error():
        for ev in events:
            assert capture_event(ev)
        kinds = [type(ev.value) for ev in events]
        assert kinds == [RingSlot] * 8 + [Pending] * 2
        assert rings.statistics()["fallbacks"] == 2
        pending = [p for ev in events for p in pending_of(ev)]
        deadline = time.monotonic() + 10
        while not all(p.ready() for p in pending):  # as the router polls: never waits
            assert time.monotonic() < deadline
            time.sleep(0.001)
        for ev in events:
            resolve(ev)
    assert [ev.value for ev in events] == [i + 0.5 for i in range(10)]
    assert rings.statistics() == {"rings": 1, "written": 8, "fallbacks": 2, "copies": 1}
    assert (
        torch._C._cuda_getCurrentRawStream(0) == torch.cuda.current_stream(0).cuda_stream
    )  # the key the rings use names the stream the writes go on


def test_a_phase_timed_on_the_device_never_syncs_and_reports_its_device_time() -> None:
    """`bus.phase("forward", device_time=True)`: two CUDA events, read on the bus thread once
    the device passed them; the host's duration is much shorter than the device's."""
    from eventbus.events import ForwardEnded

    keep = Keep()
    x = torch.randn(4096, 4096, device="cuda")
    with EventBus(drain_interval=0.002) as bus:
        bus.subscribe(keep)
        with sync_is_an_error():
            for step in range(3):
                with bus.phase("forward", step=step, device_time=True):
                    for _ in range(8):
                        x = torch.tanh(x @ x * 1e-4)  # queued: the host returns at once
        assert bus.flush(timeout=60)
    fwd = [e for e in keep.got if isinstance(e, ForwardEnded)]
    assert [e.step for e in fwd] == [0, 1, 2]
    for e in fwd:
        assert isinstance(e.device_s, float) and e.device_s > 0
        assert e.duration_s is not None
