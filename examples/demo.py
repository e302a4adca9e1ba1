"""The eventbus demo: a char-level transformer on CPU with every built-in subscriber on.

Run 1 trains a tiny GPT on Python's own standard-library source for about a minute and
logs it to JSONL and TensorBoard, with the divergence detector, memory profiler, speed
monitor, weight/gradient statistics and a progress bar, all on the bus thread. Run 2 raises
the learning rate mid-run until training diverges, and the detector stops it.

    make demo                         # or: .venv/bin/python examples/demo.py
    .venv/bin/python examples/demo.py --quick --out runs/demo
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from eventbus import EventBus
from eventbus.cli.plot import plot
from eventbus.cli.report import collect
from eventbus.cli.summary import summary_lines
from eventbus.events import (
    CheckpointSaved,
    DivergenceDetected,
    EvalEnded,
    Loss,
    RunEnded,
    RunStarted,
)
from eventbus.monitors import DivergenceDetector, MemoryProfiler, SpeedMonitor
from eventbus.sinks import ConsoleProgress, JsonlWriter, TensorBoardSink
from eventbus.torch import watch

CONTEXT, BATCH = 32, 16


def corpus() -> str:
    """Text that ships with Python: the source of a few standard-library modules."""
    import argparse as m1
    import json.decoder as m2
    import string as m3
    import textwrap as m4

    return "".join(inspect.getsource(m) for m in (m1, m2, m3, m4))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, d: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(CONTEXT, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.register_buffer("mask", torch.triu(torch.ones(CONTEXT, CONTEXT, dtype=torch.bool), 1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x, self.mask)
        return self.head(self.ln(x))


def batches(data: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(0, len(data) - CONTEXT - 1, (BATCH,), generator=gen)
    x = torch.stack([data[i : i + CONTEXT] for i in ix])
    y = torch.stack([data[i + 1 : i + CONTEXT + 1] for i in ix])
    return x, y


def train(
    out: Path,
    data: torch.Tensor,
    vocab: int,
    steps: int,
    *,
    lr: float,
    blow_up_at: int | None,
    title: str,
) -> Path:
    """One run with every built-in subscriber; returns the JSONL log's path."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = TinyGPT(vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    n_params = sum(p.numel() for p in model.parameters())
    tokens = BATCH * CONTEXT

    bus = EventBus()
    jsonl = JsonlWriter(out, overwrite=True)
    bus.subscribe(jsonl)  # lossless, batched writes
    bus.subscribe(TensorBoardSink(out / "tb"))  # its own thread, flush 5 s
    bus.subscribe(DivergenceDetector(action="stop"))  # NaN at once, a rise in ~3
    bus.subscribe(MemoryProfiler(every=25))  # RSS (+ CUDA when present)
    bus.subscribe(SpeedMonitor(every=25, flops_per_token=6 * n_params, peak_flops=2e11))
    bus.subscribe(ConsoleProgress(total=steps, desc=title))  # progress bar, latest loss
    watcher = watch(model, bus, every=50, histogram=True)  # TensorStats every 50 steps
    status = "completed"
    with bus:
        bus.publish(
            RunStarted(
                config={
                    "lr": lr,
                    "params": n_params,
                    "context": CONTEXT,
                    "batch": BATCH,
                    "blow_up_at": blow_up_at,
                },
                total_steps=steps,
            )
        )
        for step in range(1, steps + 1):
            if blow_up_at is not None and step >= blow_up_at:
                for g in opt.param_groups:
                    g["lr"] *= 1.6  # an LR schedule gone wrong: x1.6 per step
            with bus.step(step, samples=BATCH, tokens=tokens):
                x, y = batches(data, gen)
                with bus.phase("forward"):
                    logits = model(x)
                    loss = F.cross_entropy(logits.view(-1, vocab), y.view(-1))
                with bus.phase("backward"):
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                with bus.phase("optimizer") as ph:
                    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 10.0)
                    ph.set(lr=opt.param_groups[0]["lr"], grad_norm=grad_norm)  # tensors: no sync
                    opt.step()
                bus.publish(Loss(step=step, value=loss))  # never .item(): no sync
                watcher.step(step)
            if step % max(steps // 4, 1) == 0:
                bus.publish(EvalEnded(step=step, metrics={"loss": evaluate(model, data, vocab)}))
            if bus.should_stop:  # the detector asked us to stop
                status = "stopped"
                break
        ckpt = out / "model.pt"
        torch.save(model.state_dict(), ckpt)
        bus.publish(CheckpointSaved(step=step, path=str(ckpt)))
        bus.publish(RunEnded(step=step, status=status, reason=bus.control.reason))
    watcher.remove()
    return jsonl.path


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, vocab: int) -> float:
    gen = torch.Generator().manual_seed(2)
    x, y = batches(data, gen)
    return float(F.cross_entropy(model(x).view(-1, vocab), y.view(-1)))  # eval: off the step


def show(log: Path, png: Path, title: str) -> None:
    report = collect([log])
    print("\n".join(summary_lines(report)))
    try:
        plot(report, png, title=title)
        print(f"report: {png}")
    except ImportError as e:  # matplotlib is an optional extra
        print(f"(no PNG report: {e})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="eventbus demo: a healthy run, then a diverging one")
    p.add_argument("--quick", action="store_true", help="a few dozen steps (for tests)")
    p.add_argument("--steps", type=int, default=None, help="steps of the healthy run")
    p.add_argument("--out", default="runs/demo", help="where logs and reports go")
    opts = p.parse_args(argv)
    steps = opts.steps or (60 if opts.quick else 2500)
    root = Path(opts.out)

    text = corpus()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    print(f"corpus: {len(text):,} characters of Python's standard library, vocab {len(chars)}")

    t0 = time.perf_counter()
    healthy = train(
        root / "healthy", data, len(chars), steps, lr=3e-3, blow_up_at=None, title="healthy"
    )
    print(f"\n== run 1: healthy ({time.perf_counter() - t0:.0f} s) ==")
    show(healthy, root / "healthy" / "report.png", "healthy run")

    blow = max(steps // 5, 30)
    diverging = train(
        root / "diverging", data, len(chars), blow + 60, lr=3e-3, blow_up_at=blow, title="diverging"
    )
    print(f"\n== run 2: the learning rate grows x1.6 per step from step {blow} ==")
    show(diverging, root / "diverging" / "report.png", "diverging run (stopped)")
    found = [e for e in collect([diverging]).detections if isinstance(e, DivergenceDetected)]
    if found:
        d = found[0]
        value = d.value if math.isfinite(d.value) else str(d.value)
        print(
            f"detected at step {d.step}: {d.metric} {value} vs baseline {d.baseline:.3g} "
            f"({d.reason}); the loop stopped through bus.should_stop"
        )
    else:
        print("no divergence was detected (unexpected)", file=sys.stderr)

    print(
        f"\nwritten under {root}/: healthy/ and diverging/ each hold events.jsonl, tb/ "
        "(TensorBoard) and report.png"
    )
    print(f"open TensorBoard with:  .venv/bin/tensorboard --logdir {root}")
    print(f"or look from the shell: .venv/bin/eventbus summary {healthy}")
    return 0 if found else 1


if __name__ == "__main__":
    raise SystemExit(main())
