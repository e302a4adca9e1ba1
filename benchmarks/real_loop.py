"""A real training loop: what logging and watching cost a GPT's step, eager and compiled.

The project's own GPT (`benchmarks/_gpt.py`) trains with AdamW on random tokens made in the
process. Two configurations:

  cuda  GPT-2 124M (12 layers, 12 heads, 768 dim, block 1024, vocab 50304), batch 12,
        bf16 autocast, fused AdamW;
  cpu   2 layers, 4 heads, 128 dim, block 64, vocab 512, batch 4, float32, AdamW (foreach);
        ~15 ms a step on one torch thread (`torch.set_num_threads(1)`).

Every step: forward + loss, backward, `clip_grad_norm_(1.0)` (its norm stays a tensor),
`opt.step()`, `zero_grad(set_to_none=True)`. Variants (the loop is the same; only what is
added to it differs):

  none                      bare;
  inline                    `.item()` of loss and grad norm, `SummaryWriter.add_scalar` x3, a
                            JSON line written and flushed, on the training thread each step;
  wandb                     W&B offline (`WANDB_MODE=offline`, its dir in a temp dir),
                            `wandb.log` of the same three values each step (skipped, with a
                            note in the results, where wandb is not importable);
  eventbus                  a bus with JsonlWriter, TensorBoardSink, DivergenceDetector,
                            MemoryProfiler, SpeedMonitor; the step inside `with bus.step(n)`,
                            `Loss` (the loss tensor, no .item()) and `OptimizerStepped` (lr,
                            the grad norm tensor) published each step;
  eventbus_watch50          eventbus + `watch(model, bus, every=50, histogram=True)`;
  eventbus_watch1           eventbus + `watch(model, bus, every=1)` (no histograms);
  eventbus_drain20, eventbus_drain100
                            eventbus with `drain_interval` 20 / 100 ms instead of 50 ms (each
                            wake of the bus thread costs CPU); run only when named;
  eventbus_nocost           eventbus with `cost_every=None`: no cost report (its own cost is
                            eventbus's overhead less this one's); run only when named;
  mlflow_inline             MLflow's client on the training thread: `.item()` of loss and
                            grad norm, one `log_batch` of the three values each step, to a
                            local sqlite store (as `mlflow.log_metrics` does); run only when
                            named (`benchmarks/_trackers.py`);
  eventbus_wandb, eventbus_mlflow
                            eventbus plus `WandbSink` (offline) or `MLflowSink` (the same
                            sqlite store kind), in the sidecar; run only when named;
  compiled_none, compiled_inline, compiled_eventbus, compiled_eventbus_watch50
                            the same loops with `torch.compile(model)` (default inductor);
                            for the watched one, `watch()` hooks the eager module (not the
                            compiled wrapper) before the first compiled step, so the names
                            stay the eager names and dynamo sees the hooks when it traces.

Variants without hooks on the model share one model and optimizer (one eager, one compiled:
compiled once); each watched variant has its own. Every model is built from the same seed.
Each variant keeps its model and its step count for the whole run, and runs in blocks that
rotate their order (`interleave_blocks`), so drift in the machine's load hits all alike. Its
instrumentation (SummaryWriter and file, W&B run, bus and watcher) is opened before each of
its blocks and closed after it, untimed, so while a block is timed only that variant's
threads exist (an idle bus with the built-ins still used ~0.25 ms of CPU per 15 ms step
here, and five alive at once slowed the bare CPU step by ~10%). A block runs a few untimed
warm-up steps, then `steps` timed ones (a multiple of 50, so every block holds the same
number of `every=50` watched steps). Before the first block every variant runs warm-up steps
numbered 0, 1, 2, 50, 51 (two watched steps), so compilation, and recompilation on watched
steps, stays outside the timed region; the time of those steps is reported
(`*_first_step_s`, `*_warmup_s`), with the graphs and graph breaks dynamo counted during
them, and the graphs it compiled later, inside timed blocks (`dynamo_unique_graphs_timed`;
0 unless something recompiles mid-run).

Step time is read between two timer points; on CUDA `torch.cuda.synchronize()` runs right
before each timer read (and nowhere else: not inside any instrumentation), so a step's time
is the host and device work between two syncs. Reported per variant: mean, p50 and p99 of
the step time (ms), and the overhead against `none` (compiled rows: against
`compiled_none`) as a ratio of means computed blockwise: the median over blocks of
(mean of the variant's block / mean of the baseline's block of the same round) - 1; also
the pooled ratio of means (`*_overhead_pooled`), and the CPU time this process's other
threads (bus, writers, torch) used per timed step (`*_other_threads_cpu_ms_per_step`; W&B's
work in its own service process is not in it).

    python -m benchmarks.real_loop [--quick] [--device cpu|cuda] [--compile] [--json FILE]

`--quick` leaves the compiled rows out unless `--compile` is given (inductor compiles a
model for ~10 s on the 2-core development machine); a full run includes them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks._gpt import CPU_TINY, GPT, GPT2_SMALL, GPTConfig, random_batches
from benchmarks._util import flatten, interleave_blocks, machine, percentile, summarize, versions
from benchmarks.stall import _other_threads_cpu_s

__all__ = ["COMPILED", "EAGER", "EXTRA", "TRACKERS", "VARIANTS", "measure", "run"]

EAGER = ("none", "inline", "wandb", "eventbus", "eventbus_watch50", "eventbus_watch1")
COMPILED = (
    "compiled_none",
    "compiled_inline",
    "compiled_eventbus",
    "compiled_eventbus_watch50",
)
# Asked for by name (`--variants`): the bus waking every 20 / 100 ms instead of 50 ms.
EXTRA = ("eventbus_drain20", "eventbus_drain100", "eventbus_nocost")
# Trackers behind the bus next to the same client inline (issue 16; `benchmarks/_trackers.py`).
TRACKERS = ("mlflow_inline", "eventbus_wandb", "eventbus_mlflow")
VARIANTS = EAGER + COMPILED + EXTRA + TRACKERS
WATCH_EVERY = 50
WARMUP_NUMBERS = (0, 1, 2, WATCH_EVERY, WATCH_EVERY + 1)  # two watched steps for every=50
LR = 6e-4


@dataclass(frozen=True)
class Setup:
    """One configuration: model shape, batch, precision, and how long a run is."""

    device: str
    cfg: GPTConfig
    batch: int
    bf16: bool
    fused_adamw: bool
    blocks: int
    steps: int  # timed steps per block
    warmup: int  # untimed steps at the start of every block


def setup_for(device: str, quick: bool) -> Setup:
    """The configuration of `device` ("cpu" or "cuda"); `quick` runs fewer blocks."""
    if device == "cuda":
        return Setup(
            device="cuda",
            cfg=GPT2_SMALL,
            batch=12,
            bf16=True,
            fused_adamw=True,
            blocks=3 if quick else 6,
            steps=WATCH_EVERY,
            warmup=2,
        )
    if device != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda'; got {device!r}")
    return Setup(
        device="cpu",
        cfg=CPU_TINY,
        batch=4,
        bf16=False,
        fused_adamw=False,
        blocks=3 if quick else 10,
        steps=WATCH_EVERY if quick else 2 * WATCH_EVERY,
        warmup=2,
    )


# -- the model and its training step ---------------------------------------------------------


class Model:
    """A GPT, its AdamW and pre-made random batches; `train_step` never reads a device value."""

    def __init__(self, s: Setup, *, compiled: bool, watched: bool = False) -> None:
        torch.manual_seed(0)
        self.setup = s
        self.device = torch.device(s.device)
        # A watched model gets a class of its own: dynamo does not guard on module hooks, so a
        # graph compiled for the unwatched GPT of the other compiled rows would serve it too
        # (watch() counts that in `missed`; docs/compile.md).
        cls = type("WatchedGPT", (GPT,), {}) if watched else GPT
        self.module = cls(s.cfg).to(self.device)
        self.params = list(self.module.parameters())
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=LR,
            betas=(0.9, 0.95),
            fused=True if s.fused_adamw else None,
        )
        self.compiled = compiled
        self.forward: Callable[..., Any] = self.module
        self.batches = random_batches(s.cfg, s.batch, 16, self.device)
        self.tokens = s.batch * s.cfg.block
        self.cuda = self.device.type == "cuda"

    def compile(self) -> None:
        """Wrap the model in `torch.compile` (compilation itself happens at the first step)."""
        self.forward = torch.compile(self.module)

    def train_step(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimiser step on batch `n`; returns (loss, grad norm) as tensors."""
        x, y = self.batches[n % len(self.batches)]
        ctx = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if self.setup.bf16
            else contextlib.nullcontext()
        )
        with ctx:
            _, loss = self.forward(x, y)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss, gn

    def sync(self) -> None:
        """The timer's own sync (CUDA): a step's time includes the device's work."""
        if self.cuda:
            torch.cuda.synchronize()


# -- variants ---------------------------------------------------------------------------------


class Variant:
    """One way of instrumenting the loop. `step(n)` trains one step with the instrumentation.

    Its instrumentation (writers, bus, watcher) is opened before each block and closed after
    it, both untimed, so only the running variant's threads exist while a block is timed.
    """

    def __init__(self, name: str, model: Model, root: Path) -> None:
        self.name = name
        self.model = model
        self.root = root / name
        self.root.mkdir(parents=True)
        self.n = 0  # the next step number
        self.blocks_opened = 0
        self.timed_steps = 0
        self.other_cpu_s = 0.0  # CPU of this process's other threads during timed steps
        self.notes: dict[str, Any] = {}

    def block_dir(self) -> Path:
        d = self.root / str(self.blocks_opened)
        d.mkdir()
        return d

    def open_block(self) -> None:
        """Set up the instrumentation (untimed)."""
        self.blocks_opened += 1

    def step(self, n: int) -> None:
        self.model.train_step(n)

    def close_block(self) -> None:
        """Untimed, after each block: drain and close what `open_block` made."""

    def close(self) -> None:
        """Untimed, at the end of the run."""

    def count(self, key: str, value: int) -> None:
        self.notes[key] = self.notes.get(key, 0) + value


class Inline(Variant):
    """The peers' way, on the training thread: `.item()`, add_scalar x3, a JSON line."""

    def open_block(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        super().open_block()
        d = self.block_dir()
        self.writer = SummaryWriter(str(d / "tb"))
        self.file = (d / "metrics.jsonl").open("w")

    def step(self, n: int) -> None:
        loss, gn = self.model.train_step(n)
        lv = loss.item()  # a device sync on CUDA, as HF/Lightning-style logging does
        gv = gn.item()
        lr = self.model.opt.param_groups[0]["lr"]
        w = self.writer
        w.add_scalar("train/loss", lv, n)
        w.add_scalar("train/grad_norm", gv, n)
        w.add_scalar("train/lr", lr, n)
        self.file.write(json.dumps({"step": n, "loss": lv, "grad_norm": gv, "lr": lr}) + "\n")
        self.file.flush()

    def close_block(self) -> None:
        self.writer.close()
        self.file.close()


def mlflow_missing() -> str | None:
    """Why the MLflow rows cannot run here (None: they can): the client and a sqlite store."""
    if any(importlib.util.find_spec(m) is None for m in ("mlflow", "sqlalchemy", "alembic")):
        return "mlflow is not importable in this environment; the mlflow row was not measured"
    return None


def wandb_missing() -> str | None:
    """Why the wandb variant cannot run here (None: it can)."""
    if importlib.util.find_spec("wandb") is None:
        return "wandb is not importable in this environment; the wandb row was not measured"
    return None


class Wandb(Variant):
    """Weights & Biases offline: `wandb.log` of loss, grad norm and lr each step."""

    def open_block(self) -> None:
        import wandb

        super().open_block()
        os.environ["WANDB_MODE"] = "offline"
        os.environ.setdefault("WANDB_SILENT", "true")
        self.wb = wandb.init(
            project="eventbus-real-loop",
            dir=str(self.block_dir()),
            mode="offline",
            config={"device": self.model.setup.device, "batch": self.model.setup.batch},
        )
        self.notes["wandb_version"] = wandb.__version__

    def step(self, n: int) -> None:
        loss, gn = self.model.train_step(n)
        lr = self.model.opt.param_groups[0]["lr"]
        self.wb.log(
            {"train/loss": loss.item(), "train/grad_norm": gn.item(), "train/lr": lr}, step=n
        )

    def close_block(self) -> None:
        self.wb.finish()


class _BlockBus:
    """What a watcher kept for the whole run publishes to: the bus of the block running now.

    A user watches once; watching again per block would recompile a compiled model (and drop
    every compiled module's code: dynamo does not guard on hooks). Step scopes are opened on
    this object too, so the watcher sees them (`eventbus.steps.current_step`).
    """

    def __init__(self) -> None:
        self.bus: Any = None

    def publish(self, ev: Any) -> None:
        self.bus.publish(ev)


class Bus(Variant):
    """eventbus with the built-ins; `watch_every`: also `watch()` the model (once, kept)."""

    def __init__(
        self,
        name: str,
        model: Model,
        root: Path,
        *,
        watch_every: int | None = None,
        histogram: bool = False,
        drain_interval: float = 0.05,
        cost: bool = True,
    ) -> None:
        super().__init__(name, model, root)
        self.drain_interval = drain_interval
        self.cost_every = 1000 if cost else None
        self.watch_every = watch_every
        self.histogram = histogram
        self.bus: Any = None
        self.watcher: Any = None
        self.target = _BlockBus()

    def _open(self) -> None:
        from eventbus import EventBus
        from eventbus.monitors import DivergenceDetector, MemoryProfiler, SpeedMonitor
        from eventbus.sinks import JsonlWriter, TensorBoardSink

        d = self.block_dir()
        self.jsonl = d / "events.jsonl"
        bus = EventBus(drain_interval=self.drain_interval, cost_every=self.cost_every)
        bus.subscribe(JsonlWriter(self.jsonl))
        bus.subscribe(TensorBoardSink(d / "tb"))
        bus.subscribe(DivergenceDetector(action="warn"))
        bus.subscribe(MemoryProfiler(snapshot_dir=d / "snapshots"))
        bus.subscribe(SpeedMonitor(every=10))
        for sink in self.trackers(d):
            bus.subscribe(sink)
        self.bus = self.target.bus = bus.start()
        # The sidecar starts at the first subscribe; in a run it overlaps the set-up, here
        # the untimed open waits for it (as SummaryWriter's and W&B's set-up are untimed).
        bus.flush(timeout=120)
        if self.watch_every is not None and self.watcher is None:
            from eventbus.torch import watch

            # On the eager module, before any compile (see the module docstring); kept for
            # the whole run, publishing to each block's bus.
            self.watcher = watch(
                self.model.module, self.target, every=self.watch_every, histogram=self.histogram
            )

    def trackers(self, d: Path) -> list[Any]:
        """Sinks subscribed besides the built-ins (`benchmarks/_trackers.py`); here none."""
        return []

    def _close(self) -> None:
        st = self.bus.close()
        self.bus = None
        self.count("published", st.published)
        self.count("dropped", st.dropped)
        self.count("failed", st.failed)
        for sink in ("wandb", "mlflow"):
            if sink in st.subscribers:
                self.count(f"{sink}_dropped", st.subscribers[sink].dropped)
                self.count(f"{sink}_failed", st.subscribers[sink].failed)
        jsonl = st.subscribers.get("jsonl")
        if jsonl is not None:
            self.count("jsonl_lost", jsonl.published - jsonl.delivered)
        if self.watch_every is not None:
            self._count_tensor_stats()

    def _count_tensor_stats(self) -> None:
        """What `watch()` delivered: TensorStats per kind and watched steps, from the JSONL."""
        steps: set[int] = set()
        with self.jsonl.open() as f:
            for line in f:
                if not line.startswith('{"type":"TensorStats"'):
                    continue
                rec = json.loads(line)
                steps.add(rec["step"])
                self.count(f"tensorstats_{rec['kind']}", 1)
        self.count("watched_steps", len(steps))

    def open_block(self) -> None:
        super().open_block()
        self._open()

    def step(self, n: int) -> None:
        from eventbus.events import Loss, OptimizerStepped
        from eventbus.steps import StepScope

        bus = self.bus
        m = self.model
        with StepScope(self.target, n, samples=m.setup.batch, tokens=m.tokens):
            loss, gn = m.train_step(n)
            bus.publish(Loss(step=n, value=loss))  # a tensor: captured, never .item()
            bus.publish(OptimizerStepped(step=n, lr=m.opt.param_groups[0]["lr"], grad_norm=gn))

    def close_block(self) -> None:
        self._close()

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.remove()
            self.watcher = None
        if self.bus is not None:
            self._close()


def _build(
    names: tuple[str, ...], s: Setup, root: Path
) -> tuple[dict[str, Variant], dict[str, Model]]:
    """The variants of `names` and the models they train (shared where nothing hooks them)."""
    models: dict[str, Model] = {}

    def model(key: str, compiled: bool, watched: bool = False) -> Model:
        if key not in models:
            models[key] = Model(s, compiled=compiled, watched=watched)
        return models[key]

    out: dict[str, Variant] = {}
    hist = True  # watch(every=50) with histograms, as in issue 20's row (CPU and CUDA alike)
    for name in names:
        compiled = name.startswith("compiled_")
        base = name.removeprefix("compiled_")
        shared = model("compiled" if compiled else "eager", compiled)
        v: Variant
        if base == "none":
            v = Variant(name, shared, root)
        elif base == "inline":
            v = Inline(name, shared, root)
        elif base == "wandb":
            v = Wandb(name, shared, root)
        elif base == "eventbus":
            v = Bus(name, shared, root)
        elif base == "eventbus_nocost":
            v = Bus(name, shared, root, cost=False)
        elif base.startswith("eventbus_drain"):
            v = Bus(
                name, shared, root, drain_interval=int(base.removeprefix("eventbus_drain")) / 1e3
            )
        elif base == "eventbus_watch50":
            v = Bus(
                name, model(name, compiled, True), root, watch_every=WATCH_EVERY, histogram=hist
            )
        elif base == "eventbus_watch1":
            v = Bus(name, model(name, compiled, True), root, watch_every=1, histogram=False)
        elif base in TRACKERS:
            from benchmarks._trackers import build  # it builds on this module's classes

            v = build(base, name, shared, root)
        else:
            raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
        out[name] = v
    return out, models


# -- timing -----------------------------------------------------------------------------------


def _timed_block(v: Variant, steps: int, warmup: int) -> list[float]:
    """`warmup` untimed steps, then `steps` per-step times (s) between two syncs."""
    sync = v.model.sync
    pc = time.perf_counter
    out = [0.0] * steps
    v.open_block()
    try:
        # Each block starts at a multiple of 50: its first warm-up step is a watched one, so a
        # watcher made for the block (and any graph it needs compiled) is warm before timing.
        v.n = -(-v.n // 50) * 50
        for _ in range(warmup):
            v.step(v.n)
            v.n += 1
        sync()
        cpu0 = _other_threads_cpu_s()
        t_prev = pc()
        for i in range(steps):
            v.step(v.n)
            v.n += 1
            sync()  # the only sync: right before the timer read
            t = pc()
            out[i] = t - t_prev
            t_prev = t
        v.other_cpu_s += _other_threads_cpu_s() - cpu0
        v.timed_steps += steps
    finally:
        v.close_block()
    return out


def _say(line: str) -> None:
    """Progress on stderr as it happens: a run cut short still shows what it measured."""
    print(line, file=sys.stderr, flush=True)


def _warm_up(v: Variant) -> dict[str, float]:
    """The first steps of a variant (compilation happens here); their times."""
    times = []
    v.open_block()
    try:
        for n in WARMUP_NUMBERS:
            t0 = time.perf_counter()
            v.step(n)
            v.model.sync()
            times.append(time.perf_counter() - t0)
    finally:
        v.close_block()
    v.n = WARMUP_NUMBERS[-1] + 1
    return {"first_step_s": times[0], "warmup_s": sum(times)}


def blockwise_mean_overhead(blocks: list[list[float]], base: list[list[float]]) -> float:
    """Median over blocks of (mean of block i / mean of the baseline's block i) - 1."""
    ratios = sorted(
        (sum(b) / len(b)) / (sum(a) / len(a)) for b, a in zip(blocks, base, strict=True)
    )
    return percentile(ratios, 50) - 1.0


def _dynamo_counts() -> dict[str, int]:
    """Graphs compiled and graph breaks so far in this process (torch._dynamo counters)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - torch without dynamo
        return {}
    return {
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


def _resolve(
    quick: bool, device: str | None, compile: bool | None, variants: tuple[str, ...] | None
) -> tuple[str, tuple[str, ...], list[str]]:
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device here")
    notes = []
    if variants is None:
        with_compiled = (not quick) if compile is None else compile
        variants = EAGER + (COMPILED if with_compiled else ())
        if not with_compiled:
            notes.append(
                "compiled rows not run"
                + (" (--quick leaves them out; add --compile)" if quick else "")
            )
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ValueError(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    missing = wandb_missing()
    if missing is not None and any(v.removeprefix("compiled_") == "wandb" for v in variants):
        notes.append(missing)
        variants = tuple(v for v in variants if v.removeprefix("compiled_") != "wandb")
    for client, why in (("wandb", missing), ("mlflow", mlflow_missing())):
        if why is not None and any(v in TRACKERS and client in v for v in variants):
            notes.append(why.replace(f"the {client} row was", f"the {client} tracker rows were"))
            variants = tuple(v for v in variants if not (v in TRACKERS and client in v))
    if "none" not in variants and any(v in EAGER + TRACKERS for v in variants):
        variants = ("none", *variants)
    if "compiled_none" not in variants and any(v in COMPILED for v in variants):
        variants = (*variants, "compiled_none")
    return dev, variants, notes


def measure(
    quick: bool = False,
    device: str | None = None,
    *,
    compile: bool | None = None,
    variants: tuple[str, ...] | None = None,
    blocks: int | None = None,
    steps: int | None = None,
    warmup: int | None = None,
    threads: int = 1,
) -> tuple[dict[str, Any], dict[str, list[list[float]]]]:
    """Flat `real_loop.*` keys and each variant's per-block step times (s).

    `device`: "cpu" or "cuda" (None: cuda where torch sees one). `compile`: run the compiled
    rows (None: in a full run, not with `quick`). `variants` picks rows by name (their
    baseline is added). `blocks`, `steps` (timed, per block) and `warmup` (untimed, per
    block) override the configuration's. `threads`: torch's intra-op threads.
    """
    t_start = time.perf_counter()
    dev, names, notes = _resolve(quick, device, compile, variants)
    s = setup_for(dev, quick)
    s = Setup(
        device=s.device,
        cfg=s.cfg,
        batch=s.batch,
        bf16=s.bf16,
        fused_adamw=s.fused_adamw,
        blocks=s.blocks if blocks is None else blocks,
        steps=s.steps if steps is None else steps,
        warmup=s.warmup if warmup is None else warmup,
    )
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="eventbus-bench-real-loop-") as d:
            per_block = _run_variants(names, s, Path(d), out)
    finally:
        torch.set_num_threads(prev_threads)
    out.update(_summarise(per_block))
    cfg = s.cfg
    out.update(
        {
            "device": dev,
            "device_name": (
                torch.cuda.get_device_name(0) if dev == "cuda" else machine().get("cpu_model")
            ),
            "torch": torch.__version__,
            "torch_threads": threads,
            "model": (
                f"GPT {cfg.layers}x{cfg.dim}, {cfg.heads} heads, block {cfg.block}, "
                f"vocab {cfg.vocab}, batch {s.batch}, {'bf16 autocast' if s.bf16 else 'fp32'}, "
                f"{'fused ' if s.fused_adamw else ''}AdamW"
            ),
            "blocks": s.blocks,
            "steps_per_block": s.steps,
            "warmup_steps_per_block": s.warmup,
            "watch50_histogram": True,
            "watch_order_compiled": "watch(eager model), then torch.compile",
            "variants": list(per_block),
            "note": "; ".join(notes) or None,
            "seconds": round(time.perf_counter() - t_start, 1),
        }
    )
    return {f"real_loop.{k}": v for k, v in out.items()}, per_block


def _run_variants(
    names: tuple[str, ...], s: Setup, root: Path, out: dict[str, Any]
) -> dict[str, list[list[float]]]:
    variants, models = _build(names, s, root)
    try:
        for v in variants.values():  # first steps, compilation included, in a fixed order
            if v.model.compiled and v.model.forward is v.model.module:
                v.model.compile()
            before = _dynamo_counts() if v.model.compiled else {}
            t = _warm_up(v)
            out[f"{v.name}_first_step_s"] = round(t["first_step_s"], 3)
            out[f"{v.name}_warmup_s"] = round(t["warmup_s"], 3)
            _say(f"{v.name}: warm-up {t['warmup_s']:.1f} s (first step {t['first_step_s']:.1f} s)")
            if v.model.compiled:
                after = _dynamo_counts()
                for k, x in after.items():
                    out[f"{v.name}_warmup_dynamo_{k}"] = x - before.get(k, 0)

        def block_of(v: Variant) -> Callable[[int], list[float]]:
            def block(i: int) -> list[float]:
                times = _timed_block(v, s.steps, s.warmup)
                mean_ms = 1e3 * sum(times) / len(times)
                _say(f"{v.name}: block {i + 1}/{s.blocks}, mean {mean_ms:.2f} ms")
                return times

            return block

        fns = {name: block_of(v) for name, v in variants.items()}
        graphs0 = _dynamo_counts().get("unique_graphs", 0)
        per_block = interleave_blocks(fns, blocks=s.blocks)
        if any(m.compiled for m in models.values()):
            out["dynamo_unique_graphs_timed"] = _dynamo_counts()["unique_graphs"] - graphs0
    finally:
        for v in variants.values():
            v.close()
    for v in variants.values():
        watched = v.notes.pop("watched_steps", 0)
        for k, x in v.notes.items():
            if k.startswith("tensorstats_"):  # per watched step: names lost show here
                out[f"{v.name}_{k}_per_watched_step"] = round(x / max(watched, 1), 2)
            else:
                out[f"{v.name}_{k}"] = x
        # Bus thread, writer threads, torch's own: what competes with the step for the GIL.
        cpu_ms = v.other_cpu_s * 1e3 / max(v.timed_steps, 1)
        out[f"{v.name}_other_threads_cpu_ms_per_step"] = round(cpu_ms, 3)
    if any(m.compiled for m in models.values()):
        for k, x in _dynamo_counts().items():
            out[f"dynamo_{k}"] = x
    out["params_m"] = round(sum(p.numel() for p in next(iter(models.values())).params) / 1e6, 2)
    return per_block


def _summarise(per_block: dict[str, list[list[float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, blocks in per_block.items():
        st = summarize(flatten(blocks))
        out[f"{name}_mean_ms"] = round(st["mean"] * 1e3, 3)
        out[f"{name}_p50_ms"] = round(st["p50"] * 1e3, 3)
        out[f"{name}_p99_ms"] = round(st["p99"] * 1e3, 3)
        out[f"{name}_steps"] = int(st["n"])
        base = "compiled_none" if name.startswith("compiled_") else "none"
        if name != base and base in per_block:
            out[f"{name}_overhead"] = round(blockwise_mean_overhead(blocks, per_block[base]), 4)
            pooled = st["mean"] / summarize(flatten(per_block[base]))["mean"] - 1.0
            out[f"{name}_overhead_pooled"] = round(pooled, 4)
    if "compiled_none" in per_block and "none" in per_block:
        out["compiled_none_vs_none"] = round(
            blockwise_mean_overhead(per_block["compiled_none"], per_block["none"]), 4
        )
    return out


def run(quick: bool = False, device: str | None = None) -> dict[str, Any]:
    """`measure` without the samples: flat `real_loop.*` keys."""
    return measure(quick, device)[0]


def _rows(r: dict[str, Any]) -> Iterator[str]:
    """A Markdown table of one result (for the docs and the console)."""
    p = "real_loop."
    yield "| variant | mean ms | p50 ms | p99 ms | overhead (blockwise, ratio of means) |"
    yield "|---|---:|---:|---:|---:|"
    for name in r.get(p + "variants", []):
        ov = r.get(f"{p}{name}_overhead")
        yield (
            f"| {name} | {r[f'{p}{name}_mean_ms']:.2f} | {r[f'{p}{name}_p50_ms']:.2f} | "
            f"{r[f'{p}{name}_p99_ms']:.2f} | {'' if ov is None else f'{ov * 100:+.1f}%'} |"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.real_loop", description=__doc__.splitlines()[0]
    )
    p.add_argument("--quick", action="store_true", help="fewer blocks; no compiled rows")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the torch.compile rows (default: in a full run, not with --quick)",
    )
    p.add_argument("--variants", help=f"comma-separated subset of: {', '.join(VARIANTS)}")
    p.add_argument("--json", metavar="FILE", help="also write the results here")
    a = p.parse_args(argv)
    logging.getLogger("eventbus").setLevel(logging.ERROR)
    chosen = tuple(x.strip() for x in a.variants.split(",")) if a.variants else None
    out, _ = measure(a.quick, a.device, compile=a.compile, variants=chosen)
    out["real_loop.command"] = (
        "python -m benchmarks.real_loop"
        + (" " + " ".join(sys.argv[1:] if argv is None else argv)).rstrip()
    )
    out["machine"] = machine()
    out["versions"] = versions()
    text = json.dumps(out, indent=1)
    print(text)
    print("\n".join(_rows(out)), file=sys.stderr)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
