"""Sink throughput: JsonlWriter and TensorBoardSink events/s on the bus side, replay events/s.

    .venv/bin/python -m benchmarks.sinks [--events N]

Publish cost is timed on the training thread; sink throughput is first publish -> close
(everything on disk). Figures land in docs/performance.md by hand.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from eventbus import EventBus, replay
from eventbus.events import Loss, OptimizerStepped, Scalars, StepEnded


def _events(n: int) -> list:  # type: ignore[type-arg]
    out = []
    for i in range(n):
        k = i % 4
        if k == 0:
            out.append(Loss(step=i, value=1.0 / (i + 1)))
        elif k == 1:
            out.append(OptimizerStepped(step=i, lr=1e-3, grad_norm=0.5))
        elif k == 2:
            out.append(StepEnded(step=i, duration_s=0.01, samples=32))
        else:
            out.append(Scalars(step=i, values={"acc": 0.5, "ppl": 3.2}))
    return out


def _through_bus(sub: object, events: list, name: str) -> tuple[float, float]:  # type: ignore[type-arg]
    bus = EventBus()
    bus.subscribe(sub)
    bus.start()
    t0 = time.perf_counter()
    for ev in events:
        bus.publish(ev)
    t_pub = time.perf_counter() - t0
    st = bus.close(timeout=600)
    total = time.perf_counter() - t0
    s = st[name]
    assert s.delivered == len(events), s
    return t_pub / len(events) * 1e6, len(events) / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=200_000)
    args = ap.parse_args()
    from eventbus.sinks import JsonlWriter, TensorBoardSink

    with tempfile.TemporaryDirectory() as d:
        evs = _events(args.events)
        w = JsonlWriter(Path(d) / "j")
        pub_us, rate = _through_bus(w, evs, "jsonl")
        mb = w.path.stat().st_size / 1e6
        print(
            f"jsonl:       {args.events:,} events, publish {pub_us:.2f} us/event, "
            f"{rate:,.0f} events/s to disk ({mb:.1f} MB)"
        )
        t0 = time.perf_counter()
        n = 0

        def count(ev: object) -> None:
            nonlocal n
            n += 1

        replay(w.path, count)
        dt = time.perf_counter() - t0
        print(f"replay:      {n:,} events, {n / dt:,.0f} events/s (read, rebuild, deliver)")
        tb_n = min(args.events, 40_000)
        pub_us, rate = _through_bus(TensorBoardSink(Path(d) / "tb"), _events(tb_n), "tensorboard")
        print(
            f"tensorboard: {tb_n:,} events, publish {pub_us:.2f} us/event, "
            f"{rate:,.0f} events/s to disk"
        )


if __name__ == "__main__":
    main()
