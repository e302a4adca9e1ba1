"""What `HangWatchdog` costs the training thread, per step (issue 23).

A small MLP steps every ~0.5 ms on one CPU thread and publishes `Loss` and, through
`bus.step()`, `StepStarted`/`StepEnded` onto a running bus. Blocks rotate between

  (a) bus        the bus alone;
  (b) watchdog   the bus with a `HangWatchdog` (its thread checking every 50 ms: twenty times
                 as often as its default, to make any cost visible).

Reported: step p50 and p99 of each, pooled, and the blockwise p50 inflation (the median over
blocks of the watchdog block's p50 against the adjacent bus block's) - 1.

    python -m benchmarks.watchdog_cost [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from benchmarks._util import blockwise_inflation, flatten, interleave_blocks, summarize

__all__ = ["run"]

WARMUP_STEPS = 20


def run(
    quick: bool = False, *, blocks: int | None = None, steps: int | None = None
) -> dict[str, Any]:
    """Flat `watchdog_cost.*` keys."""
    import torch

    from eventbus import EventBus
    from eventbus.events import Loss
    from eventbus.monitors import HangWatchdog

    blocks = blocks if blocks is not None else (6 if quick else 12)
    steps = steps if steps is not None else (300 if quick else 500)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 128), torch.randint(0, 10, (64,))
    dogs: list[HangWatchdog] = []

    def block(watched: bool) -> Any:
        def one(_: int) -> list[float]:
            bus = EventBus()
            if watched:
                dog = HangWatchdog(floor_s=60.0, check_s=0.05)
                dogs.append(dog)
                bus.subscribe(dog)
            out = []
            with bus:
                for i in range(steps + WARMUP_STEPS):
                    t0 = time.perf_counter()
                    with bus.step(i):
                        opt.zero_grad(set_to_none=True)
                        loss = torch.nn.functional.cross_entropy(model(x), y)
                        loss.backward()  # type: ignore[no-untyped-call]
                        opt.step()
                        bus.publish(Loss(step=i, value=loss.detach()))
                    out.append(time.perf_counter() - t0)
            return out[WARMUP_STEPS:]

        return one

    try:
        got = interleave_blocks({"bus": block(False), "watchdog": block(True)}, blocks=blocks)
    finally:
        torch.set_num_threads(prev_threads)
    out: dict[str, Any] = {}
    for name, bl in got.items():
        s = summarize(x * 1e3 for x in flatten(bl))
        out[f"watchdog_cost.{name}_p50_ms"] = round(s["p50"], 4)
        out[f"watchdog_cost.{name}_p99_ms"] = round(s["p99"], 4)
    out["watchdog_cost.inflation_p50"] = round(blockwise_inflation(got["watchdog"], got["bus"]), 4)
    out["watchdog_cost.stalls"] = sum(d.stalls for d in dogs)  # 0: nothing stalled
    out["watchdog_cost.steps_per_variant"] = blocks * steps
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    print(json.dumps(run(p.parse_args().quick), indent=1))


if __name__ == "__main__":
    main()
