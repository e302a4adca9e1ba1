"""A torchrun job for the cross-rank monitors: several short runs in one launch, each with its own
bus, JSONL directory, `StragglerDetector` and `RankReducer`.

    python -m torch.distributed.run --nproc_per_node=2 tests/monitors/ranks_job.py OUT

- `clean`: 200 steps, no rank slowed.
- `stalled`: 40 steps; rank 1 stops between steps 20 and 21 until rank 0 has finished all its
  steps (the file OUT/stalled.done), so rank 0's training cannot have waited for rank 1.
- `slow`: rank `--slow-rank` does 8x the work in its forward phase; no collective.
- `slow_allreduce`: the same, with a gloo all-reduce every step inside the backward phase, so
  every rank's step lasts as long as the slowest rank's.

Every rank publishes `Loss(step=s, value=s + rank / 4)`: exact in binary, so is the mean.
"""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from eventbus import EventBus
from eventbus.events import Loss
from eventbus.monitors import RankReducer, StragglerDetector
from eventbus.sinks import JsonlWriter

A = torch.randn(192, 192) / 192**0.5  # ~0.25 ms a unit on one thread


def work(units: int) -> None:
    x = A
    for _ in range(units):
        x = torch.tanh(x @ A)


def run(name: str, out: Path, steps: int, slow_rank: int | None, allreduce: bool) -> None:
    rank = int(os.environ["RANK"])
    stall = name == "stalled" and rank == 1
    done = out / f"{name}.done"
    bus = EventBus(close_timeout=120)
    bus.subscribe(JsonlWriter(out / name), placement="thread")
    bus.subscribe(StragglerDetector(every=10, threshold=2.0, close_wait_s=60))
    bus.subscribe(RankReducer([Loss], op="mean", timeout_s=120, close_wait_s=60))
    t = torch.ones(4)
    with bus:
        for step in range(1, steps + 1):
            with bus.step(step):
                with bus.phase("data"):
                    work(2)
                with bus.phase("forward"):
                    work(96 if rank == slow_rank else 12)
                with bus.phase("backward"):
                    if allreduce:
                        dist.all_reduce(t)  # the wait for the slowest rank lands here
                    work(8)
                with bus.phase("optimizer"):
                    work(2)
            bus.publish(Loss(step=step, value=step + rank / 4))
            if stall and step == steps // 2:
                waited = 0.0
                while not done.exists() and waited < 90:  # a poll on a condition, bounded
                    threading.Event().wait(0.01)
                    waited += 0.01
        if rank == 0 and name == "stalled":
            done.write_text(str(steps))  # every step of rank 0 is published: let rank 1 go
    print(f"rank {rank}: {name} done", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--only", default="clean,stalled,slow,slow_allreduce")
    p.add_argument("--slow-rank", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    which = args.only.split(",")
    for name in which:
        if name == "clean":
            run(name, out, 200, None, allreduce=False)
        elif name == "stalled":
            run(name, out, 40, None, allreduce=False)
        elif name == "slow":
            run(name, out, 60, args.slow_rank, allreduce=False)
        elif name == "slow_allreduce":
            dist.init_process_group("gloo")
            run(name, out, 60, args.slow_rank, allreduce=True)
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
