"""A tiny DDP model on CPU (gloo) publishing onto the bus from every rank.

    python -m torch.distributed.run --nproc_per_node=2 examples/torchrun_ddp.py [--quick]

Every rank writes its own JSONL (`runs/ddp/events.rank{r}.jsonl`), rank 0 alone writes
TensorBoard (`runs/ddp/tb`), every rank runs a divergence detector, and `bus.should_stop` is
agreed across ranks: a stop asked on one rank stops all of them at the same step. More
subscribers come from the environment without code changes (EVENTBUS_SUBSCRIBERS /
EVENTBUS_CONFIG, see docs/distributed.md). Try a divergence on rank 1 only:

    python -m torch.distributed.run --nproc_per_node=2 examples/torchrun_ddp.py \
        --nan-rank 1 --nan-step 40

then read both ranks' logs together: `eventbus summary runs/ddp/events.rank*.jsonl`.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from eventbus import EventBus
from eventbus.config import subscribe_from_config
from eventbus.events import Loss, OptimizerStepped, RunEnded, RunStarted, StepEnded
from eventbus.monitors import DivergenceDetector
from eventbus.sinks import JsonlWriter, TensorBoardSink


def main() -> None:
    p = argparse.ArgumentParser(description="Tiny DDP training with eventbus on every rank.")
    p.add_argument("--out", default="runs/ddp", help="directory for logs (default runs/ddp)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--quick", action="store_true", help="60 steps, for tests")
    p.add_argument(
        "--nan-rank",
        type=int,
        default=None,
        help="report a NaN loss on this rank (its gradients stay finite)",
    )
    p.add_argument("--nan-step", type=int, default=20, help="from this step on")
    p.add_argument("--stop-check-every", type=int, default=1)
    args = p.parse_args()
    steps = 60 if args.quick else args.steps

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # CPU; with GPUs: "nccl" and a device per LOCAL_RANK
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts them)

    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own shard of data
    x = torch.randn(1024, 16, generator=gen)
    y = x.sum(dim=1, keepdim=True)

    bus = EventBus(stop_check_every=args.stop_check_every)  # rank, world size from dist
    bus.subscribe(JsonlWriter(args.out))  # every rank: events.rank{r}.jsonl
    bus.subscribe(TensorBoardSink(os.path.join(args.out, "tb")))  # rank 0 only (its default)
    bus.subscribe(DivergenceDetector(action="stop"))  # every rank
    subscribe_from_config(bus)  # anything EVENTBUS_SUBSCRIBERS / EVENTBUS_CONFIG names

    stopped_at = None
    with bus:
        bus.publish(
            RunStarted(config={"lr": 0.05, "batch": 32}, total_steps=steps, world_size=world)
        )
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            idx = torch.randint(0, len(x), (32,), generator=gen)
            loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()  # DDP all-reduces the gradients here
            opt.step()
            reported = loss.detach()
            if rank == args.nan_rank and step >= args.nan_step:
                reported = reported * math.nan  # a rank-local blow-up, seen by one rank
            bus.publish(Loss(step=step, value=reported))  # a tensor: no .item(), no sync
            bus.publish(OptimizerStepped(step=step, lr=0.05))
            bus.publish(StepEnded(step=step, duration_s=time.perf_counter() - t0, samples=32))
            if bus.should_stop:  # agreed: every rank breaks at the same step
                stopped_at = step
                break
        status = "stopped" if stopped_at is not None else "completed"
        bus.publish(RunEnded(step=stopped_at or steps, status=status, reason=bus.control.reason))
    print(f"rank {rank}: {status} at step {stopped_at or steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
