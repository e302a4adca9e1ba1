"""eventbus.torch: watch() statistics and instrument() phase events from hooks."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

import eventbus.torch as et
from eventbus import EventBus
from eventbus.events import (
    BackwardEnded,
    ForwardEnded,
    Loss,
    OptimizerStepped,
    StepEnded,
    StepStarted,
    TensorStats,
)
from tests.conftest import Recorder
from tests.test_capture import ReadRecorder, patched_reads


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A hand-written GPT: every named module except the ModuleList runs in forward."""

    def __init__(self, vocab: int = 32, d: int = 16, layers: int = 2, ctx: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, 2) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        out: torch.Tensor = self.head(self.ln_f(x))
        return out


def _gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT()


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(seed))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> torch.Tensor:
    idx = _batch(seed)
    logits = model(idx)
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), idx.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _stats(got: list[Any]) -> list[TensorStats]:
    return [e for e in got if isinstance(e, TensorStats)]


def _called_modules(model: nn.Module) -> tuple[set[str], list[Any]]:
    called: set[str] = set()
    handles = [
        m.register_forward_hook(lambda *a, n=n: called.add(n)) for n, m in model.named_modules()
    ]
    return called, handles


def _all_hooks(model: nn.Module) -> list[int]:
    sizes = []
    for m in model.modules():
        for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks):
            sizes.append(len(d))
    for p in model.parameters():
        sizes.append(len(p._post_accumulate_grad_hooks or {}))
        sizes.append(len(p._backward_hooks or {}))
    return sizes


# -- watch ----------------------------------------------------------------------------------


def test_watch_covers_every_module_and_parameter_at_the_interval(
    bus: EventBus, recorder: Recorder
) -> None:
    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    called, handles = _called_modules(model)
    bus.subscribe(recorder)
    with bus, et.watch(model, bus, every=2):
        for step in range(1, 6):
            _train_step(model, opt, step)
    for h in handles:
        h.remove()
    stats = _stats(recorder.got)
    assert {e.step for e in stats} == {2, 4}  # forward count 1..5, every 2nd
    params = {n for n, _ in model.named_parameters()}
    modules = {n for n, _ in model.named_modules()}
    assert modules - called == {"blocks"}  # a ModuleList is never called itself
    for step in (2, 4):
        by_kind = {k: [e.name for e in stats if e.step == step and e.kind == k] for k in et.KINDS}
        assert sorted(by_kind["weights"]) == sorted(params)
        assert sorted(by_kind["grads"]) == sorted(params)
        assert sorted(by_kind["activations"]) == sorted(called)  # root is ""


def test_watch_statistics_equal_eager_values(bus: EventBus, recorder: Recorder) -> None:
    model = _gpt()
    outputs: dict[str, torch.Tensor] = {}
    hook = model.blocks[0].mlp.register_forward_hook(
        lambda m, a, out: outputs.__setitem__("mlp", out.detach().clone())
    )
    bus.subscribe(recorder)
    with bus, et.watch(model, bus, every=1, histogram=True, bins=10):
        weight = model.head.weight.detach().clone()
        model(_batch(0)).sum().backward()
        grad = model.head.weight.grad.clone()
    hook.remove()
    stats = {(e.kind, e.name): e for e in _stats(recorder.got)}
    for key, t in (
        (("activations", "blocks.0.mlp"), outputs["mlp"]),
        (("weights", "head.weight"), weight),
        (("grads", "head.weight"), grad),
    ):
        s = stats[key]
        assert s.dtype == "torch.float32"
        assert s.shape == tuple(t.shape)
        assert s.norm == pytest.approx(t.norm().item(), rel=1e-5)
        scale = t.abs().max().item()  # float32 sums in another order: relative to the scale
        assert s.mean == pytest.approx(t.mean().item(), rel=1e-4, abs=1e-6 * scale)
        assert s.std == pytest.approx(t.std().item(), rel=1e-5)
        assert s.absmax == pytest.approx(t.abs().max().item(), rel=1e-6)
        assert (s.nan_count, s.inf_count) == (0, 0)
        assert type(s.nan_count) is int
        assert type(s.norm) is float
        h = s.histogram
        assert h["min"] == t.min().item()
        assert h["max"] == t.max().item()
        assert len(h["counts"]) == 10
        assert sum(h["counts"]) == t.numel()
        expected = torch.histc((t - t.min()) / (t.max() - t.min()), bins=10, min=0, max=1)
        assert h["counts"] == [int(c) for c in expected.tolist()]


def test_watch_reports_autocast_dtypes(bus: EventBus, recorder: Recorder) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    bus.subscribe(recorder)
    with bus, et.watch(model, bus, every=1):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(2, 5, 16))
        out.float().sum().backward()
    stats = _stats(recorder.got)
    act = {e.name: e.dtype for e in stats if e.kind == "activations"}
    assert act["layers.0.linear1"] == act["layers.1.linear2"] == "torch.bfloat16"
    assert act["layers.0.norm1"] == "torch.float32"  # autocast runs layer_norm in float32
    assert act[""] == str(out.dtype)
    assert {e.dtype for e in stats if e.kind in ("weights", "grads")} == {"torch.float32"}
    weights = {e.name for e in stats if e.kind == "weights"}
    assert weights == {n for n, _ in model.named_parameters()}
    assert all(math.isfinite(e.norm) for e in stats)


def test_watch_counts_injected_nan_and_inf(bus: EventBus, recorder: Recorder) -> None:
    model = _gpt()
    with torch.no_grad():
        model.head.weight[0, 0] = float("nan")
        model.head.weight[0, 1] = float("inf")
        model.head.weight[1, 0] = float("-inf")
    logits: list[torch.Tensor] = []
    hook = model.head.register_forward_hook(lambda m, a, out: logits.append(out.detach()))
    bus.subscribe(recorder)
    with bus, et.watch(model, bus, every=1, what=("weights", "activations"), histogram=True):
        model(_batch(0))
    hook.remove()
    stats = {(e.kind, e.name): e for e in _stats(recorder.got)}
    w = stats[("weights", "head.weight")]
    assert (w.nan_count, w.inf_count) == (1, 2)
    assert math.isnan(w.norm)
    assert math.isnan(w.absmax)
    assert sum(w.histogram["counts"]) == w.shape[0] * w.shape[1] - 3  # finite values only
    out = stats[("activations", "head")]
    assert out.nan_count == int(torch.isnan(logits[0]).sum())
    assert out.inf_count == int(torch.isinf(logits[0]).sum())
    assert out.nan_count + out.inf_count > 0
    clean = [e for (k, n), e in stats.items() if k == "weights" and n != "head.weight"]
    assert clean
    assert all(e.nan_count == 0 and e.inf_count == 0 for e in clean)


def test_remove_takes_every_hook_off(bus: EventBus, recorder: Recorder) -> None:
    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not any(_all_hooks(model))
    w = et.watch(model, bus, every=1, histogram=True)
    ins = et.instrument(model, opt, bus)
    bus.subscribe(recorder)
    with bus:
        _train_step(model, opt, 0)
        model(_batch(1))  # a watched forward without backward: its grad hooks stay on
        assert all(p._post_accumulate_grad_hooks for p in model.parameters())
        assert opt._optimizer_step_pre_hooks
        assert opt._optimizer_step_post_hooks
        w.remove()
        ins.remove()
        w.remove()  # idempotent
        assert not any(_all_hooks(model))
        assert not opt._optimizer_step_pre_hooks
        assert not opt._optimizer_step_post_hooks
        bus.flush()
        n = len(recorder.got)
        _train_step(model, opt, 1)
    assert len(recorder.got) == n  # nothing more was published


def test_between_watched_steps_no_gradient_hook_stays(bus: EventBus) -> None:
    """Forward hooks stay (torch.compile must see them); gradient hooks only while watched."""
    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    modules = sum(1 for _ in model.modules())
    with bus, et.watch(model, bus, every=2) as w:
        for step in range(1, 4):
            _train_step(model, opt, step)
            assert not any(p._post_accumulate_grad_hooks for p in model.parameters()), step
            # root pre + post hook, and a forward hook on every other module
            assert sum(_all_hooks(model)) == 2 + modules - 1, step
        assert w.current == 3


def test_watch_step_numbers_follow_watcher_then_bus_then_count(
    bus: EventBus, recorder: Recorder
) -> None:
    model = nn.Linear(2, 2)
    bus.subscribe(recorder)
    with bus:
        w = et.watch(model, bus, every=5, what="activations")
        x = torch.randn(1, 2)
        for _ in range(5):
            model(x)  # counted: 1..5, published at 5
        with bus.step(10):
            model(x)  # the bus step: published at 10
        with bus.step(11):
            model(x)  # not a multiple of 5
        w.step(20)
        with bus.step(13):
            model(x)  # the watcher's own number wins: 20
        w.remove()
    assert [e.step for e in _stats(recorder.got)] == [5, 10, 20]
    assert w.current == 20


def test_watch_publishes_nothing_while_disabled(bus: EventBus, recorder: Recorder) -> None:
    model = nn.Linear(2, 2)
    bus.subscribe(recorder)
    with bus, et.watch(model, bus, every=1) as w:
        w.enabled = False
        model(torch.randn(1, 2)).sum().backward()
        w.enabled = True
        model(torch.randn(1, 2)).sum().backward()
    assert Counter(e.kind for e in _stats(recorder.got)) == {
        "weights": 2,
        "grads": 2,
        "activations": 1,
    }


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"every": 0}, ValueError, "every must be an int >= 1"),
        ({"every": 1.5}, ValueError, "every must be"),
        ({"what": ("weights", "outputs")}, ValueError, "what= takes some of"),
        ({"what": ()}, ValueError, "what= takes some of"),
        ({"histogram": True, "bins": 0}, ValueError, "bins must be"),
    ],
)
def test_watch_rejects_bad_arguments(
    bus: EventBus, kwargs: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        et.watch(nn.Linear(2, 2), bus, **kwargs)


def test_watch_and_instrument_reject_what_they_cannot_hook(bus: EventBus) -> None:
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        et.watch(lambda x: x, bus)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a model, an optimizer"):
        et.instrument(bus=bus)
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        et.instrument(nn.Linear(1, 1), object(), bus)
    with pytest.raises(TypeError, match="bus must be an EventBus"):
        et.watch(nn.Linear(1, 1), object())


# -- instrument -----------------------------------------------------------------------------


def test_instrument_publishes_phases_with_lr_and_device_grad_norm(
    bus: EventBus, recorder: Recorder
) -> None:
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    norms: list[float] = []
    opt.register_step_pre_hook(
        lambda o, a, k: norms.append(
            torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in model.parameters()])
            ).item()
        )
    )
    bus.subscribe(recorder)
    with bus, et.instrument(model, opt, bus):
        for seed in range(3):
            _train_step(model, opt, seed)
    got = [
        e for e in recorder.got if isinstance(e, ForwardEnded | BackwardEnded | OptimizerStepped)
    ]
    assert [(type(e).__name__, e.step) for e in got] == [
        (n, s) for s in (1, 2, 3) for n in ("ForwardEnded", "BackwardEnded", "OptimizerStepped")
    ]
    steps = [e for e in got if isinstance(e, OptimizerStepped)]
    assert [e.grad_norm for e in steps] == pytest.approx(norms, rel=1e-5)
    assert all(type(e.grad_norm) is float and e.lr == 3e-4 for e in steps)
    assert all(e.duration_s is not None and e.duration_s >= 0 for e in got)


def test_instrument_publishes_a_given_grad_norm_and_follows_bus_steps(
    bus: EventBus, recorder: Recorder
) -> None:
    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    bus.subscribe(recorder)
    clipped = []
    with bus, et.instrument(model, opt, bus, grad_norm=False) as ins:
        for step in (10, 11):
            with bus.step(step):
                loss = nn.functional.cross_entropy(
                    model(_batch(step)).flatten(0, 1), _batch(step).flatten()
                )
                loss.backward()
                if step == 10:
                    norm = nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                    clipped.append(norm.item())
                    ins.record_grad_norm(norm)
                opt.step()
                opt.zero_grad()
    opts = [e for e in recorder.got if isinstance(e, OptimizerStepped)]
    assert [(e.step, e.grad_norm, e.lr) for e in opts] == [(10, clipped[0], 0.5), (11, None, 0.5)]
    kinds = [type(e) for e in recorder.got if e.step == 10]
    assert kinds == [StepStarted, ForwardEnded, BackwardEnded, OptimizerStepped, StepEnded]


def test_instrument_without_optimizer_counts_forwards(bus: EventBus, recorder: Recorder) -> None:
    model = nn.Linear(2, 1)
    bus.subscribe(recorder)
    with bus, et.instrument(model, bus=bus, first_step=0):
        for _ in range(3):
            model(torch.randn(1, 2)).sum().backward()
        with torch.no_grad():
            model(torch.randn(1, 2))  # no backward: no BackwardEnded
    assert [(type(e).__name__, e.step) for e in recorder.got] == [
        ("ForwardEnded", 0),
        ("BackwardEnded", 0),
        ("ForwardEnded", 1),
        ("BackwardEnded", 1),
        ("ForwardEnded", 2),
        ("BackwardEnded", 2),
        ("ForwardEnded", 3),
    ]


# -- no host reads on the training thread ------------------------------------------------


def test_a_watched_and_instrumented_loop_never_reads_a_tensor_on_the_training_thread(
    bus: EventBus, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The device path, as a GPU runs it (CPU tensors otherwise take a host shortcut that
    # reads their range: host memory, no sync).
    monkeypatch.setattr("eventbus._torch_reduce.on_host", lambda x: False)
    model = _gpt()
    # SGD, not Adam: Adam reads its CPU step counter with .item() (harmless, but a read).
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    bus.subscribe(recorder)
    losses = []
    with bus, et.watch(model, bus, every=1, histogram=True), et.instrument(model, opt, bus):
        with ReadRecorder() as mode, patched_reads() as reads:
            for step in range(1, 4):
                with bus.step(step, samples=4):
                    loss = _train_step(model, opt, step)
                    bus.publish(Loss(step=step, value=loss))
                losses.append(loss)
        me = threading.get_ident()
        assert len(mode.calls) > 100
        assert [r for r in mode.reads if r[1] == me] == []
        assert [r for r in reads if r[1] == me] == []  # autograd hooks (grads) included
    delivered = [e.value for e in recorder.got if isinstance(e, Loss)]
    assert delivered == [t.item() for t in losses]  # eager reads, after the loop
    assert len(_stats(recorder.got)) == 3 * (
        2 * len(list(model.parameters())) + len(list(model.modules())) - 1
    )


def test_eventbus_torch_does_not_shadow_torch() -> None:
    assert et.torch is torch
    code = (
        "import eventbus.torch, torch, eventbus; "
        "assert torch.nn.Linear and eventbus.torch.torch is torch; "
        "from eventbus.torch import watch; print('ok')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
