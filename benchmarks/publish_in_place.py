"""What publishing costs right after a training step, the generated intake against the walk.

Stall (b)'s training step (a small MLP on one CPU thread), then its three publishes (`Loss`
and the grad norm as tensors, `StepEnded`), timed together. Every other step sizes and
captures with the general walk (`sizeof_event`, then `capture_event`) instead of the
generated intake (`eventbus/_capture_intake.py`), so both see the same machine. Right after a
step, Python runs cold: these times are several times a warm loop's (docs/performance.md).

    python -m benchmarks.publish_in_place [--steps 8000]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from benchmarks._util import machine, summarize

__all__ = ["run"]


def run(steps: int = 8000) -> dict[str, Any]:
    """Median and mean of the three publishes (µs), each path on alternate steps."""
    import torch

    from benchmarks.stall import _Trainer
    from eventbus import EventBus
    from eventbus.capture import capture_event
    from eventbus.core.inbox import BIG, Boxed, Inbox
    from eventbus.core.sizing import checked_fields, sizeof_event
    from eventbus.events import Loss, OptimizerStepped, StepEnded

    def walked(inbox: Any, ev: Any) -> None:
        """`Inbox.put_sized` as it was before the intake: two walks over the fields."""
        nbytes = sizeof_event(ev, checked_fields(type(ev)))
        captured = capture_event(ev)
        if nbytes >= BIG:
            inbox.put_boxed(Boxed(ev, nbytes, captured))
        else:
            inbox.put(Boxed(ev, 0, True) if captured else ev)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tr = _Trainer("cpu")
    intake = Inbox.put_sized
    times: dict[str, list[float]] = {"walk": [], "intake": []}
    pc = time.perf_counter
    try:
        with EventBus(handle_signals=False) as bus:
            publish = bus.publish
            for i in range(steps):
                path = "intake" if i % 2 else "walk"
                Inbox.put_sized = intake if path == "intake" else walked  # type: ignore[method-assign]
                loss, gn = tr.step(i)
                t0 = pc()
                publish(Loss(step=i, value=loss))
                publish(OptimizerStepped(step=i, lr=tr.lr, grad_norm=gn))
                publish(StepEnded(step=i, samples=tr.batch))
                times[path].append(pc() - t0)
    finally:
        Inbox.put_sized = intake  # type: ignore[method-assign]
        torch.set_num_threads(threads)
    out: dict[str, Any] = {"steps": steps}
    for path, ts in times.items():
        s = summarize(ts)
        out[f"publish_in_place.{path}_p50_us"] = round(s["p50"] * 1e6, 1)
        out[f"publish_in_place.{path}_mean_us"] = round(s["mean"] * 1e6, 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8000)
    a = p.parse_args()
    print(json.dumps({"machine": machine(), "results": run(a.steps)}, indent=1))


if __name__ == "__main__":
    main()
