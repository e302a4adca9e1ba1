"""Step stall: what instrumentation costs a real training step, bus against inline callbacks.

A small MLP trains on random data (steps of a few ms on one CPU thread). Per-step wall time,
in blocks that rotate between the variants so drift cancels:

  (a) none      no instrumentation at all;
  (b) eventbus  3 events per step (Loss and grad norm as tensors, StepEnded) onto a bus with
                JsonlWriter, TensorBoardSink, DivergenceDetector, MemoryProfiler,
                SpeedMonitor, and a subscriber that sleeps 50 ms per batch (`latest` policy);
  (c) inline    the same work as synchronous callbacks on the training thread, as the peers
                do it: `.item()`, SummaryWriter.add_scalar + flush per step, a JSON line
                written and flushed, the divergence rule, an RSS read, the 50 ms sleep;
  (c') inline_nosleep: (c) without the sleep (what logging alone costs inline);
  (b') eventbus_drain20: (b) with `drain_interval=0.02` instead of the default 50 ms (more,
                smaller batches: more bus-side work per step, 30 ms sooner to the sinks).

With `device="cuda"` the model runs on the GPU and every variant synchronises at the end of
each step (so the step time includes the device's work); (c)'s `.item()` syncs mid-step.

    python -m benchmarks.stall [--quick] [--device cuda] [--plot step_time.png]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._util import (
    blockwise_inflation,
    flatten,
    inflation,
    interleave_blocks,
    summarize,
)

__all__ = ["measure", "plot", "run"]

SLEEP_S = 0.05
WARMUP_STEPS = 5  # dropped at the start of every block (bus start-up, cold caches)
VARIANTS = ("none", "eventbus", "inline", "inline_nosleep", "eventbus_drain20")


class _Sleeper:
    """A slow subscriber: 50 ms per batch in its worker thread; keeps only the newest."""

    policy = "latest"
    name = "sleeper"

    def on_events(self, batch: list[Any]) -> None:
        time.sleep(SLEEP_S)


class _Trainer:
    """A small MLP and its optimizer on `device`, with pre-made random batches."""

    def __init__(self, device: str, *, width: int = 384, batch: int = 64) -> None:
        import torch

        torch.manual_seed(0)
        self.torch = torch
        self.device = device
        self.batch = batch
        self.model = torch.nn.Sequential(
            torch.nn.Linear(256, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 10),
        ).to(device)
        self.params = list(self.model.parameters())
        self.lr = 0.01
        self.opt = torch.optim.SGD(self.params, lr=self.lr, momentum=0.9)
        self.xs = [torch.randn(batch, 256, device=device) for _ in range(16)]
        self.ys = [torch.randint(0, 10, (batch,), device=device) for _ in range(16)]
        self.cuda = device.startswith("cuda")

    def step(self, i: int) -> tuple[Any, Any]:
        """One optimiser step; returns (loss, grad norm) as tensors, never synchronising."""
        torch = self.torch
        x, y = self.xs[i % 16], self.ys[i % 16]
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        # Clipping as HF's Trainer does by default; the norm stays a tensor (no sync).
        gn = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        return loss, gn

    def end_step(self) -> None:
        if self.cuda:
            # The timer's own sync, in every variant alike: step time = host + device work.
            self.torch.cuda.synchronize()


def _run_none(tr: _Trainer, steps: int) -> list[float]:
    pc = time.perf_counter
    out = []
    for i in range(steps):
        t0 = pc()
        tr.step(i)
        tr.end_step()
        out.append(pc() - t0)
    return out


def _other_threads_cpu_s() -> float:
    """CPU seconds used by every thread but this one (the bus thread and its workers)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime - time.thread_time()


def _make_bus(root: Path, drain_interval: float | None) -> Any:
    from eventbus import EventBus
    from eventbus.monitors import DivergenceDetector, MemoryProfiler, SpeedMonitor
    from eventbus.sinks import JsonlWriter, TensorBoardSink

    bus = EventBus() if drain_interval is None else EventBus(drain_interval=drain_interval)
    bus.subscribe(JsonlWriter(root / "jsonl"))
    bus.subscribe(TensorBoardSink(root / "tb"))
    bus.subscribe(DivergenceDetector(action="warn"))
    bus.subscribe(MemoryProfiler(snapshot_dir=root / "snapshots"))
    bus.subscribe(SpeedMonitor(every=10))
    bus.subscribe(_Sleeper())
    return bus


def _run_eventbus(
    tr: _Trainer,
    steps: int,
    root: Path,
    totals: dict[str, int],
    drain_interval: float | None = None,
    *,
    publish_s: list[float] | None = None,
) -> list[float]:
    """(b)'s steps (s); `publish_s` gets the time of each step's three publishes, in place."""
    from eventbus.events import Loss, OptimizerStepped, StepEnded

    t_made = time.perf_counter()
    bus = _make_bus(root, drain_interval)
    pc = time.perf_counter
    out = []
    lr, bs = tr.lr, tr.batch
    prev: float | None = None
    with bus:
        # A run's set-up (model, data) overlaps the sidecar's start; here the block waits
        # for it, so each block times training alone, not a sidecar importing torch.
        bus.flush(timeout=120)
        ready_ms = round((time.perf_counter() - t_made) * 1e3)
        totals["sidecar_ready_ms_max"] = max(totals.get("sidecar_ready_ms_max", 0), ready_ms)
        publish = bus.publish
        cpu0 = _other_threads_cpu_s()
        for i in range(steps):
            t0 = pc()
            loss, gn = tr.step(i)
            t1 = pc()
            publish(Loss(step=i, value=loss))  # tensors: captured without a sync
            publish(OptimizerStepped(step=i, lr=lr, grad_norm=gn))
            publish(StepEnded(step=i, duration_s=prev, samples=bs))
            if publish_s is not None:
                publish_s.append(pc() - t1)
            tr.end_step()
            prev = pc() - t0
            out.append(prev)
        cpu_ms = (_other_threads_cpu_s() - cpu0) * 1e3
    totals["bus_side_cpu_us"] = totals.get("bus_side_cpu_us", 0) + round(cpu_ms * 1e3)
    totals["steps"] = totals.get("steps", 0) + steps
    st = bus.stats()
    for name, sub in st.subscribers.items():
        key = "sleeper" if name == "sleeper" else "others"
        totals[f"{key}_dropped"] = totals.get(f"{key}_dropped", 0) + sub.dropped
        totals[f"{key}_failed"] = totals.get(f"{key}_failed", 0) + sub.failed
    jsonl = st.subscribers["jsonl"]
    totals["jsonl_lost"] = totals.get("jsonl_lost", 0) + jsonl.published - jsonl.delivered
    totals["published"] = totals.get("published", 0) + st.published
    return out


class _Inline:
    """The peers' way: every callback on the training thread, values read with .item()."""

    def __init__(self, root: Path, sleep: bool) -> None:
        import psutil
        from torch.utils.tensorboard import SummaryWriter

        from eventbus.monitors._divergence_rule import DivergenceRule

        self.writer = SummaryWriter(str(root / "tb"))
        self.file = (root / "events.jsonl").open("w")
        self.rule = DivergenceRule()
        self.proc = psutil.Process()
        self.sleep = sleep
        self.last = time.perf_counter()

    def on_step_end(self, step: int, loss: Any, gn: Any, lr: float, samples: int) -> None:
        lv = loss.item()  # a device sync on CUDA: what HF/Lightning logging does per step
        gv = gn.item()  # another one
        now = time.perf_counter()
        dt, self.last = now - self.last, now
        rss_mb = self.proc.memory_info().rss / 2**20
        w = self.writer
        w.add_scalar("train/loss", lv, step)
        w.add_scalar("train/grad_norm", gv, step)
        w.add_scalar("train/lr", lr, step)
        w.add_scalar("perf/samples_per_s", samples / dt, step)
        w.add_scalar("memory/rss_mb", rss_mb, step)
        w.flush()
        self.file.write(
            json.dumps(
                {
                    "type": "Loss",
                    "step": step,
                    "value": lv,
                    "grad_norm": gv,
                    "lr": lr,
                    "rss_mb": rss_mb,
                }
            )
            + "\n"
        )
        self.file.flush()
        self.rule.update(step, lv)
        if self.sleep:
            time.sleep(SLEEP_S)

    def close(self) -> None:
        self.writer.close()
        self.file.close()


def _run_inline(tr: _Trainer, steps: int, root: Path, sleep: bool) -> list[float]:
    cb = _Inline(root, sleep)
    pc = time.perf_counter
    out = []
    try:
        for i in range(steps):
            t0 = pc()
            loss, gn = tr.step(i)
            cb.on_step_end(i, loss, gn, tr.lr, tr.batch)
            tr.end_step()
            out.append(pc() - t0)
    finally:
        cb.close()
    return out


def measure(
    quick: bool = False,
    device: str = "cpu",
    *,
    blocks: int | None = None,
    steps: int | None = None,
    threads: int = 1,
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """Flat `stall.*` keys (ms) and the per-step samples (s) of every variant.

    `threads`: torch's intra-op threads for the step (1 leaves the second core to the bus
    thread and its subscribers, as a GPU job leaves the host cores mostly idle).
    """
    import torch

    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _measure(quick, device, blocks, steps)
    finally:
        torch.set_num_threads(prev_threads)


def _measure(
    quick: bool, device: str, blocks: int | None, steps: int | None
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    blocks = blocks if blocks is not None else (4 if quick else 16)
    steps = steps if steps is not None else (50 if quick else 120)
    slow_steps = max(WARMUP_STEPS + 3, steps // 3)
    tr = _Trainer(device)
    totals: dict[str, int] = {}
    totals20: dict[str, int] = {}
    publish_s: list[float] = []
    with tempfile.TemporaryDirectory(prefix="eventbus-bench-stall-") as d:
        tmp = Path(d)
        counter = iter(range(1_000_000))

        def fresh() -> Path:
            p = tmp / str(next(counter))
            p.mkdir()
            return p

        def keep(samples: list[float]) -> list[float]:
            return samples[WARMUP_STEPS:]

        variants: dict[str, Callable[[int], list[float]]] = {
            "none": lambda b: keep(_run_none(tr, steps)),
            "eventbus": lambda b: keep(
                _run_eventbus(tr, steps, fresh(), totals, publish_s=publish_s)
            ),
            # 50+ ms a step: fewer steps per block keep the run short; its p50 is plain.
            "inline": lambda b: keep(_run_inline(tr, slow_steps, fresh(), sleep=True)),
            "inline_nosleep": lambda b: keep(_run_inline(tr, steps, fresh(), sleep=False)),
            "eventbus_drain20": lambda b: keep(
                _run_eventbus(tr, steps, fresh(), totals20, drain_interval=0.02)
            ),
        }
        for fn in variants.values():  # warm-up: imports, allocator, first SummaryWriter
            fn(-1)
        totals.clear()
        totals20.clear()
        publish_s.clear()
        per_block = interleave_blocks(variants, blocks=blocks)
    samples = {name: flatten(b) for name, b in per_block.items()}
    out: dict[str, Any] = {}
    stats = {name: summarize(s) for name, s in samples.items()}
    for name, s in stats.items():
        out[f"stall.{name}_p50_ms"] = round(s["p50"] * 1e3, 3)
        out[f"stall.{name}_p99_ms"] = round(s["p99"] * 1e3, 3)
        out[f"stall.{name}_mean_ms"] = round(s["mean"] * 1e3, 3)
    base = stats["none"]
    for name in VARIANTS[1:]:
        out[f"stall.{name}_p50_inflation"] = round(inflation(stats[name]["p50"], base["p50"]), 4)
        out[f"stall.{name}_p99_inflation"] = round(inflation(stats[name]["p99"], base["p99"]), 4)
        out[f"stall.{name}_p50_inflation_blockwise"] = round(
            blockwise_inflation(per_block[name], per_block["none"]), 4
        )
    # The three publishes of a (b) step, timed right after the step (the step's caches: what
    # the median step pays for the bus, before any subscriber runs).
    out["stall.eventbus_publish_us_in_place_p50"] = round(summarize(publish_s)["p50"] * 1e6, 1)
    out["stall.device"] = device
    out["stall.torch_threads"] = torch_threads()
    out["stall.steps_per_variant"] = len(samples["none"])
    out["stall.blocks"] = blocks
    for name, tot in (("eventbus", totals), ("eventbus_drain20", totals20)):
        steps_b = tot.pop("steps", 0)
        cpu_us = tot.pop("bus_side_cpu_us", 0)
        for k, v in tot.items():
            out[f"stall.{name}_{k}"] = v
        # What the bus side (bus thread, workers) ran per step, competing for the GIL.
        out[f"stall.{name}_bus_side_cpu_ms_per_step"] = round(cpu_us / 1e3 / max(steps_b, 1), 3)
    return out, samples


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _subscriber_sets(root: Path) -> dict[str, Callable[[], list[Any]]]:
    from eventbus.monitors import DivergenceDetector, MemoryProfiler, SpeedMonitor
    from eventbus.sinks import JsonlWriter, TensorBoardSink

    return {
        "bare_bus": lambda: [],
        "jsonl": lambda: [JsonlWriter(root / "jsonl")],
        "tensorboard": lambda: [TensorBoardSink(root / "tb")],
        "divergence": lambda: [DivergenceDetector(action="warn")],
        "memory": lambda: [MemoryProfiler(snapshot_dir=root / "snapshots")],
        "speed": lambda: [SpeedMonitor(every=10)],
        "sleeper_50ms": lambda: [_Sleeper()],
    }


def subscriber_costs(steps: int = 300, device: str = "cpu", threads: int = 1) -> dict[str, Any]:
    """Bus-side CPU per training step (ms) for each subscriber of (b) alone on the bus.

    Same model and events as (b); the CPU of every thread but the training thread is read
    from the start of the first step until a flush after the last (all work included).
    """
    import torch

    from eventbus import EventBus
    from eventbus.events import Loss, OptimizerStepped, StepEnded

    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    tr = _Trainer(device)
    out: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="eventbus-bench-subs-") as d:
            for i, (name, make) in enumerate(_subscriber_sets(Path(d)).items()):
                bus = EventBus()
                for sub in make():
                    bus.subscribe(sub, name=f"{name}-{i}")
                with bus:
                    time.sleep(0.2)  # on_start hooks (opening files, SummaryWriter) finish
                    c0 = _other_threads_cpu_s()
                    for s in range(steps):
                        loss, gn = tr.step(s)
                        bus.publish(Loss(step=s, value=loss))
                        bus.publish(OptimizerStepped(step=s, lr=tr.lr, grad_norm=gn))
                        bus.publish(StepEnded(step=s, samples=tr.batch))
                        tr.end_step()
                    bus.flush(timeout=60)
                    cpu = _other_threads_cpu_s() - c0
                out[f"stall.bus_side_cpu_ms_per_step.{name}"] = round(cpu / steps * 1e3, 3)
    finally:
        torch.set_num_threads(prev_threads)
    return out


def run(quick: bool = False, device: str = "cpu") -> dict[str, Any]:
    """`measure` without the samples."""
    return measure(quick, device)[0]


def plot(samples: dict[str, list[float]], path: str | os.PathLike[str], title: str = "") -> None:
    """Step-time distributions of (a), (b), (c) as a small PNG (log-x histograms)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = {
        "none": "(a) no instrumentation",
        "eventbus": "(b) eventbus, 6 subscribers",
        "inline": "(c) inline callbacks (peers)",
        "inline_nosleep": "(c') inline, without the 50 ms callback",
        "eventbus_drain20": "(b') eventbus, drain_interval 20 ms",
    }
    colors = {
        "none": "#444444",
        "eventbus": "#1f77b4",
        "inline": "#d62728",
        "inline_nosleep": "#ff9896",
        "eventbus_drain20": "#17becf",
    }
    ms = {k: np.asarray(v) * 1e3 for k, v in samples.items() if v}
    lo = min(float(v.min()) for v in ms.values())
    hi = max(float(v.max()) for v in ms.values())
    bins = np.geomspace(max(lo * 0.9, 1e-3), hi * 1.1, 120)
    fig, ax = plt.subplots(figsize=(7, 3.4), dpi=90)
    for k, v in ms.items():
        ax.hist(
            v,
            bins=list(bins),
            histtype="step",
            linewidth=1.4,
            color=colors.get(k),
            label=f"{labels.get(k, k)}: p50 {np.median(v):.2f} ms",
        )
    ax.set_xscale("log")
    ticks = [
        t
        for t in (0.5, 1, 2, 3, 5, 10, 20, 30, 50, 100, 200, 500, 1000)
        if bins[0] <= t <= bins[-1]
    ]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("step time (ms, log scale)")
    ax.set_ylabel("steps")
    ax.set_title(title or "Per-step time of a small MLP on CPU", fontsize=10)
    ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--plot", metavar="PNG")
    p.add_argument(
        "--per-subscriber",
        action="store_true",
        help="only the bus-side CPU per step of each subscriber alone",
    )
    a = p.parse_args()
    if a.per_subscriber:
        print(json.dumps(subscriber_costs(100 if a.quick else 300, a.device), indent=1))
        return
    out, samples = measure(a.quick, a.device)
    if a.plot:
        plot(samples, a.plot)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
