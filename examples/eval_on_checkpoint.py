"""Evaluate every saved checkpoint in a process of its own while training goes on.

Trains the demo's tiny GPT (examples/demo.py) and saves a checkpoint every few steps. For
each `CheckpointSaved`, `CheckpointJobs` runs this same script as `--eval CKPT` in a
subprocess: it loads the checkpoint, measures the loss on held-out text and prints the
metrics as its last line (JSON). They come back as `EvalEnded` events: in the JSONL log next
to the training loss, and in `eventbus summary`. The training thread never waits for them
(closing the bus does, within its deadline).

    .venv/bin/python examples/eval_on_checkpoint.py [--quick] [--out DIR]
    .venv/bin/python examples/eval_on_checkpoint.py --eval runs/eval_on_checkpoint/ckpt-40.pt
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the demo's model, next to us
from demo import BATCH, CONTEXT, TinyGPT, batches, corpus

from eventbus import EventBus
from eventbus.cli.report import collect
from eventbus.cli.summary import summary_lines
from eventbus.events import CheckpointSaved, Loss, RunStarted
from eventbus.monitors import CheckpointJobs, SpeedMonitor
from eventbus.sinks import JsonlWriter


def dataset() -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """The demo's corpus as character ids: (vocabulary, training part, held-out tail)."""
    text = corpus()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    cut = int(len(data) * 0.9)
    return chars, data[:cut], data[cut:]


@torch.no_grad()
def evaluate(path: str, n_batches: int = 8) -> dict[str, float]:
    """The held-out loss of the checkpoint at `path` (what each job computes)."""
    ckpt = torch.load(path, weights_only=True)
    chars, _, held_out = dataset()
    model = TinyGPT(len(chars))
    model.load_state_dict(ckpt["model"])
    model.eval()
    gen = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(n_batches):
        x, y = batches(held_out, gen)
        losses.append(float(F.cross_entropy(model(x).view(-1, len(chars)), y.view(-1))))
    return {"eval_loss": sum(losses) / len(losses), "eval_batches": float(n_batches)}


def train(out: Path, steps: int, every: int) -> Path:
    """Train, checkpoint every `every` steps; the jobs evaluate each checkpoint meanwhile."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    chars, data, _ = dataset()
    model = TinyGPT(len(chars))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    out.mkdir(parents=True, exist_ok=True)

    bus = EventBus()
    jsonl = JsonlWriter(out, overwrite=True)
    bus.subscribe(jsonl)
    bus.subscribe(SpeedMonitor(every=10))
    jobs = CheckpointJobs(
        command=[sys.executable, str(Path(__file__).resolve()), "--eval", "{path}"],
        max_concurrent=1,  # one evaluation at a time; more checkpoints wait (at most 16)
        timeout=300,
    )
    bus.subscribe(jobs)
    with bus:
        bus.publish(RunStarted(config={"every": every}, total_steps=steps))
        for step in range(1, steps + 1):
            with bus.step(step, samples=BATCH, tokens=BATCH * CONTEXT):
                x, y = batches(data, gen)
                loss = F.cross_entropy(model(x).view(-1, len(chars)), y.view(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                bus.publish(Loss(step=step, value=loss))  # a tensor: no sync
            if step % every == 0:
                path = out / f"ckpt-{step}.pt"
                torch.save({"model": model.state_dict()}, path)
                bus.publish(CheckpointSaved(step=step, path=str(path)))  # a job starts
    for ev in jobs.results:  # closing the bus waited for the last job
        print(f"checkpoint at step {ev.step}: eval_loss {ev.metrics['eval_loss']:.3f}")
    return jsonl.path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="40 steps, 2 checkpoints (for tests)")
    p.add_argument("--out", default="runs/eval_on_checkpoint", help="logs and checkpoints")
    p.add_argument("--eval", metavar="CKPT", help="evaluate one checkpoint (what a job runs)")
    args = p.parse_args(argv)
    if args.eval:
        print(f"evaluating {args.eval}", file=sys.stderr)
        print(json.dumps(evaluate(args.eval)))  # the last line: the job's metrics
        return 0
    steps, every = (40, 20) if args.quick else (600, 150)
    log = train(Path(args.out), steps, every)
    print("\n".join(summary_lines(collect([log]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
