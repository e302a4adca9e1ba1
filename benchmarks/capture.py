"""Tensor capture: what publishing tensors and watching a model costs the training thread.

publish.*   per-call cost of `bus.publish` (ns; empty-call timer overhead subtracted) for a
            plain event, a Loss holding a CPU scalar tensor (also with 8 subscribers: the
            cost must not grow), Scalars holding 8 CPU tensors, and on CUDA the same with
            device tensors (pinned non-blocking copy + one recorded event);
watch.*     extra training-thread time of one watched step (`watch(every=1)`: weights,
            grads and activations of a tiny GPT) and of a step that is not watched;
step.*      step time of the tiny GPT trained with and without the full instrumentation
            (bus.step + instrument() + Loss published + watch(every=10)), in blocks that
            rotate between variants; on CUDA each step ends with a synchronize so the time
            includes the device's work.

  python -m benchmarks.capture [--quick] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from benchmarks._util import (
    blockwise_inflation,
    flatten,
    interleave_blocks,
    interleave_calls,
    summarize,
)
from eventbus import Event, EventBus
from eventbus.capture import POOL
from eventbus.events import Loss, Scalars
from eventbus.torch import instrument, watch

__all__ = ["run"]


class _Fast:
    """A subscriber that does nothing with its batch (on the bus loop)."""

    policy = "drop_oldest"

    async def on_events(self, batch: list[Event]) -> None:
        return None


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, 4, d // 4).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """2 blocks, d=64: 24 modules, 30 parameter tensors (~110k parameters)."""

    def __init__(self, vocab: int = 64, d: int = 64, layers: int = 2, ctx: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        out: torch.Tensor = self.head(self.ln_f(x))
        return out


# -- publish ---------------------------------------------------------------------------------


def _publish_costs(quick: bool, device: str) -> dict[str, Any]:
    rounds, calls = (8, 500) if quick else (30, 2000)
    dev = torch.device(device)
    bus1 = EventBus(drain_interval=0.005)
    bus1.subscribe(_Fast())
    bus8 = EventBus(drain_interval=0.005)
    for _ in range(8):
        bus8.subscribe(_Fast())
    scalar = torch.tensor(0.5, device=dev)
    eight = [torch.randn((), device=dev) for _ in range(8)]

    def plain(n: int) -> Sequence[Any]:
        return [Loss(step=i, value=0.5) for i in range(n)]

    def tensor(n: int) -> Sequence[Any]:
        return [Loss(step=i, value=scalar) for i in range(n)]

    def scalars8(n: int) -> Sequence[Any]:
        return [Scalars(step=i, values={f"m{j}": t for j, t in enumerate(eight)}) for i in range(n)]

    def floats10(n: int) -> Sequence[Any]:  # a logger's dict of plain numbers (HF's logs)
        return [Scalars(step=i, values={f"m{j}": 0.5 * j for j in range(10)}) for i in range(n)]

    tag = "" if device == "cpu" else "cuda_"
    contenders: dict[str, tuple[Callable[[int], Sequence[Any]], Callable[[Any], Any]]] = {
        f"{tag}tensor_scalar": (tensor, bus1.publish),
        f"{tag}tensor_scalar_8subs": (tensor, bus8.publish),
        f"{tag}scalars_8_tensors": (scalars8, bus1.publish),
    }
    if device == "cpu":
        contenders["plain_event"] = (plain, bus1.publish)
        contenders["scalars_10_floats"] = (floats10, bus1.publish)
    bus_of = {name: (bus8 if "8subs" in name else bus1) for name in contenders}

    def between(name: str) -> None:
        if not bus_of[name].flush(timeout=60):
            raise RuntimeError(f"{name}: the bus did not drain within 60 s")

    pool0 = POOL.statistics()
    with bus1, bus8:
        samples = interleave_calls(contenders, rounds=rounds, calls=calls, between=between)
    out: dict[str, Any] = {}
    for name, values in samples.items():
        s = summarize(values)
        out[f"publish.{name}_p50_ns"] = round(s["p50"], 1)
        out[f"publish.{name}_p99_ns"] = round(s["p99"], 1)
    if device == "cuda":
        pool1 = POOL.statistics()
        out["publish.cuda_pinned_allocated"] = pool1["allocated"] - pool0["allocated"]
        out["publish.cuda_pinned_reused"] = pool1["reused"] - pool0["reused"]
    return out


# -- watch and step time ---------------------------------------------------------------------


class _Trainer:
    """One tiny-GPT training setup; `step()` returns its wall time in ms."""

    def __init__(
        self, device: str, bus: EventBus | None, *, every: int | None, instrumented: bool
    ) -> None:
        torch.manual_seed(0)
        self.device = torch.device(device)
        self.model = TinyGPT().to(self.device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-2, momentum=0.9)
        self.bus = bus
        self.n = 0
        self.hooks: list[Any] = []
        if bus is not None and every is not None:
            self.hooks.append(watch(self.model, bus, every=every))
        if bus is not None and instrumented:
            self.hooks.append(instrument(self.model, self.opt, bus))
        gen = torch.Generator(device=self.device).manual_seed(0)
        self.batches = [
            torch.randint(0, 64, (8, 32), device=self.device, generator=gen) for _ in range(16)
        ]

    def _train(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.model(idx)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def step(self) -> float:
        self.n += 1
        idx = self.batches[self.n % len(self.batches)]
        t0 = time.perf_counter()
        if self.bus is not None:
            with self.bus.step(self.n, samples=idx.shape[0], tokens=idx.numel()):
                loss = self._train(idx)
                self.bus.publish(Loss(step=self.n, value=loss))
        else:
            self._train(idx)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # benchmark only: the step time includes device work
        return (time.perf_counter() - t0) * 1e3

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


def _step_times(quick: bool, device: str) -> dict[str, Any]:
    blocks, steps, warm = (4, 15, 3) if quick else (12, 40, 5)
    bus = EventBus(drain_interval=0.005)
    bus.subscribe(_Fast())
    with bus:
        trainers = {
            "none": _Trainer(device, None, every=None, instrumented=False),
            "instrumented": _Trainer(device, bus, every=10, instrumented=True),
            "watch_every_step": _Trainer(device, bus, every=1, instrumented=False),
            "watch_off_steps": _Trainer(device, bus, every=10**9, instrumented=False),
        }

        def block(name: str) -> Callable[[int], list[float]]:
            def run_block(_: int) -> list[float]:
                t = trainers[name]
                times = [t.step() for _ in range(steps + warm)][warm:]
                if not bus.flush(timeout=60):
                    raise RuntimeError("the bus did not drain within 60 s")
                return times

            return run_block

        got = interleave_blocks({n: block(n) for n in trainers}, blocks=blocks)
        for t in trainers.values():
            t.close()
    tag = "step" if device == "cpu" else "step_cuda"
    out: dict[str, Any] = {}
    for name, bl in got.items():
        s = summarize(flatten(bl))
        out[f"{tag}.{name}_p50_ms"] = round(s["p50"], 3)
        out[f"{tag}.{name}_p99_ms"] = round(s["p99"], 3)
        if name != "none":
            out[f"{tag}.{name}_inflation_p50"] = round(blockwise_inflation(bl, got["none"]), 4)
    out[f"{tag}.steps_per_variant"] = blocks * steps
    watch_cost = out[f"{tag}.watch_every_step_p50_ms"] - out[f"{tag}.none_p50_ms"]
    idle_cost = out[f"{tag}.watch_off_steps_p50_ms"] - out[f"{tag}.none_p50_ms"]
    prefix = "watch" if device == "cpu" else "watch_cuda"
    out[f"{prefix}.watched_step_extra_ms"] = round(watch_cost, 3)
    out[f"{prefix}.unwatched_step_extra_ms"] = round(idle_cost, 3)
    return out


def run(quick: bool = False, device: str | None = None) -> dict[str, Any]:
    """Every measurement, as flat `capture.*` keys; CUDA too when a device is present."""
    devices = [device] if device else (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    out: dict[str, Any] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one CPU thread: steady step times on a shared machine
    try:
        for dev in devices:
            out.update(_publish_costs(quick, dev))
            out.update(_step_times(quick, dev))
    finally:
        torch.set_num_threads(threads)
    out["cuda_device"] = torch.cuda.get_device_name(0) if "cuda" in devices else None
    out["torch_threads"] = 1
    return {f"capture.{k}": v for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    a = p.parse_args()
    print(json.dumps(run(a.quick, a.device), indent=1))


if __name__ == "__main__":
    main()
