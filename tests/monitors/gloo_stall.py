"""A 2-rank gloo job for test_watchdog_gloo.py: at step 5, rank 1 holds back from the
collective that rank 0 is already blocked in.

    torchrun --nproc_per_node=2 tests/monitors/gloo_stall.py resume|abort OUT_DIR

resume: rank 1 joins once both ranks' watchdogs reported the stall; both resume.
abort:  rank 1 never joins; rank 0's watchdog (action="abort") ends rank 0, stuck in the C++
        collective where no signal handler runs, with status 70.
"""

from __future__ import annotations

import datetime
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from eventbus import EventBus
from eventbus.events import Loss
from eventbus.monitors import HangWatchdog
from eventbus.sinks import JsonlWriter


def hold_back(out: Path, mode: str) -> None:
    """Rank 1's stall: wait, outside any step, for the stall files (resume), or forever."""
    wake = threading.Event()
    for _ in range(2400):  # 120 s at most
        if mode == "resume" and all(list(out.glob(f"stall-rank{r}-*.txt")) for r in (0, 1)):
            return
        wake.wait(0.05)


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    bus = EventBus(cost_every=None, close_timeout=2.0)
    bus.subscribe(JsonlWriter(out / "events.jsonl"))  # events.rank<r>.jsonl: 2 ranks
    abort = mode == "abort" and rank == 0
    bus.subscribe(
        HangWatchdog(
            floor_s=1.0,
            ceiling_s=1.0,
            warmup_steps=0,
            check_s=0.05,
            dir=out,
            action="abort" if abort else "warn",
            abort_after_s=0.2,
            exit_after_s=0.2,
        )
    )
    x = torch.ones(4)
    with bus:
        bus.flush(timeout=60)  # this rank's sidecar is up (a slow start is not a stall)
        dist.barrier()  # and the other rank's: step 0 starts together
        for step in range(6):
            with bus.step(step):
                if step == 5 and rank == 1:
                    hold_back(out, mode)
                dist.all_reduce(x)  # rank 0 waits here, at step 5, for rank 1
                bus.publish(Loss(step=step, value=float(x[0])))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
