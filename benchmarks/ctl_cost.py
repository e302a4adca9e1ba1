"""What the `eventbus ctl` listener costs the training thread, per step (issue 17).

A small MLP steps every ~2 ms on one CPU thread (micro-batches calibrated at start) and
publishes Loss and StepEnded each step onto a running bus. Blocks rotate between

  (a) bus          the bus alone;
  (b) ctl          the bus with a `ControlServer` listening (nobody asking);
  (c) ctl_polled   the same while another process asks `status` every 100 ms (a watch loop).

Per step it records the wall time and the training thread's own CPU time (`thread_time`),
compared pooled (p50/p99) and pairwise by adjacent blocks. The server's own thread is timed
apart (its CPU per answered `status`): that work shares the GIL with training but runs only
when a client asks.

    python -m benchmarks.ctl_cost [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._util import blockwise_inflation, flatten, inflation, interleave_blocks, summarize

__all__ = ["run"]

WARMUP_STEPS = 20
POLL_S = 0.1

_POLLER = """
import sys, time
from eventbus.ctl import CtlError, request
run_dir, every = sys.argv[1], float(sys.argv[2])
n = 0
while True:
    try:
        request(run_dir, "status")
        n += 1
    except CtlError:
        pass
    print(n, flush=True)
    time.sleep(every)
"""


def _model(width: int, batch: int) -> tuple[Any, Any, Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, width), torch.nn.ReLU(), torch.nn.Linear(width, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt, torch.randn(batch, 128), torch.randint(0, 10, (batch,))


def _server_cpu_s() -> float:
    """CPU seconds of the listener's thread, 0 if none runs."""
    for t in threading.enumerate():
        if t.name == "eventbus-ctl-listener" and t.ident is not None:
            return time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    return 0.0


def run(
    quick: bool = False,
    *,
    blocks: int | None = None,
    steps: int | None = None,
    target_step_s: float = 0.002,
) -> dict[str, Any]:
    """Flat `ctl_cost.*` keys: step times with and without the listener, and the inflation."""
    import torch

    from eventbus import EventBus
    from eventbus.ctl import ControlServer, request
    from eventbus.events import Loss, StepEnded

    blocks = blocks if blocks is not None else (6 if quick else 12)
    steps = steps if steps is not None else (300 if quick else 500)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, opt, x, y = _model(width=512, batch=64)
    loss_fn = torch.nn.functional.cross_entropy
    micro = [1]
    cpu: dict[str, list[float]] = {"bus": [], "ctl": [], "ctl_polled": []}
    served = {"requests": 0, "server_cpu_s": 0.0}
    tmp = Path(tempfile.mkdtemp(prefix="ctl-cost-"))

    def train(n: int, bus: Any, key: str | None = None) -> list[float]:
        pc, tt = time.perf_counter, time.thread_time
        out = []
        k = micro[0]
        for i in range(n):
            t0, c0 = pc(), tt()
            opt.zero_grad(set_to_none=True)
            for _ in range(k):
                loss = loss_fn(model(x), y)
                loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            if bus is not None:
                bus.publish(Loss(step=i, value=loss.detach()))
                bus.publish(StepEnded(step=i))
                if bus.should_stop:  # what a loop reads each step
                    break
            out.append(pc() - t0)
            if key is not None and i >= WARMUP_STEPS:
                cpu[key].append(tt() - c0)
        return out[WARMUP_STEPS:]

    def variant(key: str, listen: bool, poll: bool) -> Any:
        def block(b: int) -> list[float]:
            bus = EventBus()
            bus.subscribe(lambda ev: None, events=[Loss])
            run_dir = tmp / f"{key}-{b}"
            if listen:
                bus.subscribe(ControlServer(run_dir))
            with bus:
                poller, first = None, ""
                if listen:
                    _wait_listening(run_dir, request)
                if poll:
                    poller = subprocess.Popen(
                        [sys.executable, "-c", _POLLER, str(run_dir), str(POLL_S)],
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                    assert poller.stdout is not None
                    first = poller.stdout.readline()  # its first answer: it runs
                c0 = _server_cpu_s()
                try:
                    out = train(steps, bus, key)
                finally:
                    if poller is not None:
                        poller.kill()
                        tail = (first + poller.communicate()[0]).split()  # running counts
                        served["requests"] += int(tail[-1]) if tail else 0
                        served["server_cpu_s"] += _server_cpu_s() - c0
            return out

        return block

    try:
        train(WARMUP_STEPS + 100, None)
        for _ in range(4):  # calibrate: micro-batches per step for a ~2 ms step (p50)
            p50 = sorted(train(WARMUP_STEPS + 100, None))[50]
            if p50 >= 0.9 * target_step_s:
                break
            micro[0] = max(micro[0] + 1, math.ceil(micro[0] * target_step_s / p50))
        per_block = interleave_blocks(
            {
                "bus": variant("bus", False, False),
                "ctl": variant("ctl", True, False),
                "ctl_polled": variant("ctl_polled", True, True),
            },
            blocks=blocks,
        )
    finally:
        torch.set_num_threads(prev_threads)
    out: dict[str, Any] = {
        "ctl_cost.steps_per_variant": len(flatten(per_block["bus"])),
        "ctl_cost.micro_batches_per_step": micro[0],
    }
    base = summarize(flatten(per_block["bus"]))
    base_cpu = summarize(cpu["bus"])
    for key in ("bus", "ctl", "ctl_polled"):
        s, c = summarize(flatten(per_block[key])), summarize(cpu[key])
        out[f"ctl_cost.{key}_p50_ms"] = round(s["p50"] * 1e3, 4)
        out[f"ctl_cost.{key}_p99_ms"] = round(s["p99"] * 1e3, 4)
        out[f"ctl_cost.{key}_cpu_p50_ms"] = round(c["p50"] * 1e3, 4)
        if key != "bus":
            out[f"ctl_cost.{key}_p50_inflation"] = round(inflation(s["p50"], base["p50"]), 4)
            out[f"ctl_cost.{key}_p50_inflation_blockwise"] = round(
                blockwise_inflation(per_block[key], per_block["bus"]), 4
            )
            out[f"ctl_cost.{key}_cpu_p50_inflation"] = round(
                inflation(c["p50"], base_cpu["p50"]), 4
            )
    n = served["requests"]
    out["ctl_cost.status_requests"] = n
    out["ctl_cost.server_cpu_us_per_status"] = (
        round(served["server_cpu_s"] / n * 1e6, 1) if n else None
    )
    return out


def _wait_listening(run_dir: Path, request: Any) -> None:
    """Poll until the listener answers (it starts on the bus thread)."""
    from eventbus.ctl import CtlError

    deadline = time.monotonic() + 30
    while True:
        try:
            request(run_dir, "ping")
            return
        except CtlError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    print(json.dumps(run(p.parse_args().quick), indent=1))


if __name__ == "__main__":
    main()
