"""What `StragglerDetector` and `RankReducer` cost the training thread, per step (issue 23).

Two torchrun ranks on CPU (gloo is not even needed: the monitors talk through the rendezvous
store). Each rank steps a small MLP (~0.5 ms on one thread) inside `bus.step()` and
`bus.phase()` scopes and publishes `Loss`; blocks rotate, in the same order on both ranks,
between

  (a) bus     the bus alone (the same events published, nobody reading the phases);
  (b) ranks   the bus with a `StragglerDetector(every=10)` and a `RankReducer([Loss])`, each
              with its thread exchanging every 50 ms (the reducer's default) through the store.

Reported from rank 0: step p50 and p99 of each, pooled, the blockwise p50 inflation - 1, and
how many reduced events rank 0 published (every step of every "ranks" block, or it says so).

    python -m benchmarks.ranks_cost [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._util import blockwise_inflation, flatten, interleave_blocks, summarize

__all__ = ["run"]

WARMUP_STEPS = 20
ROOT = Path(__file__).resolve().parents[1]


def run(
    quick: bool = False, *, blocks: int | None = None, steps: int | None = None
) -> dict[str, Any]:
    """Flat `ranks_cost.*` keys, from a 2-rank torchrun of this module."""
    blocks = blocks if blocks is not None else (6 if quick else 12)
    steps = steps if steps is not None else (300 if quick else 500)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}",
            str(Path(__file__)),
            "--worker",
            str(out),
            "--blocks",
            str(blocks),
            "--steps",
            str(steps),
        ]
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"torchrun failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def _worker(out: Path, blocks: int, steps: int) -> None:
    """One rank: the interleaved blocks; rank 0 writes the summary to `out`."""
    import torch

    from eventbus import EventBus
    from eventbus.events import Loss
    from eventbus.monitors import RankReducer, StragglerDetector

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 128), torch.randint(0, 10, (64,))
    reducers: list[RankReducer] = []

    def block(on: bool) -> Any:
        def one(_: int) -> list[float]:
            bus = EventBus(close_timeout=60)
            if on:
                reducers.append(RankReducer([Loss], close_wait_s=30))
                bus.subscribe(StragglerDetector(every=10))
                bus.subscribe(reducers[-1])
            times = []
            with bus:
                for i in range(steps + WARMUP_STEPS):
                    t0 = time.perf_counter()
                    with bus.step(i + 1):
                        with bus.phase("forward"):
                            loss = torch.nn.functional.cross_entropy(model(x), y)
                        with bus.phase("backward"):
                            opt.zero_grad(set_to_none=True)
                            loss.backward()  # type: ignore[no-untyped-call]
                        with bus.phase("optimizer"):
                            opt.step()
                        bus.publish(Loss(step=i + 1, value=loss.detach()))
                    times.append(time.perf_counter() - t0)
            return times[WARMUP_STEPS:]

        return one

    got = interleave_blocks({"bus": block(False), "ranks": block(True)}, blocks=blocks)
    if rank != 0:
        return
    res: dict[str, Any] = {"ranks_cost.ranks": 2}
    for name, bl in got.items():
        s = summarize(v * 1e3 for v in flatten(bl))
        res[f"ranks_cost.{name}_p50_ms"] = round(s["p50"], 4)
        res[f"ranks_cost.{name}_p99_ms"] = round(s["p99"], 4)
    res["ranks_cost.inflation_p50"] = round(blockwise_inflation(got["ranks"], got["bus"]), 4)
    res["ranks_cost.reduced"] = sum(r.published for r in reducers)
    res["ranks_cost.reduced_expected"] = blocks * (steps + WARMUP_STEPS)
    res["ranks_cost.steps_per_variant"] = blocks * steps
    out.write_text(json.dumps(res))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--blocks", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    args = p.parse_args()
    if args.worker is not None:
        _worker(args.worker, args.blocks, args.steps)
    else:
        print(json.dumps(run(args.quick, blocks=args.blocks, steps=args.steps), indent=1))


if __name__ == "__main__":
    main()
