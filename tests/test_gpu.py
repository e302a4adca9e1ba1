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
    x = torch.zeros((), device="cuda")
    with bus:
        for i in range(200):
            x.fill_(i)
            bus.publish(Loss(step=i, value=x))
            if i % 20 == 19:
                assert bus.flush(30)  # buffers come back once read
    after = POOL.statistics()
    assert [e.value for e in keep.got] == [float(i) for i in range(200)]
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
