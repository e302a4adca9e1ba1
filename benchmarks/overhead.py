"""Dispatch overhead per event: `bus.publish` against the callback systems of the peers.

Every contender is timed per call (two `perf_counter_ns` reads around one call, minus the
median cost of timing an empty call), in rounds that alternate between contenders in one
process, so load and frequency drift hit all of them alike. Publishing goes into a
*running* bus: the bus thread routes what was published during the round and competes with
the publisher for the GIL, which is what a training loop sees. Between rounds (untimed) the
bus is flushed so its routing work never lands in a peer's round.

    python -m benchmarks.overhead [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks._util import call_overhead_ns, interleave_calls, summarize
from eventbus import EventBus
from eventbus.events import Event, Loss

__all__ = ["run"]


class _Fast:
    """A subscriber that does nothing with its batch (on the bus loop)."""

    policy = "drop_oldest"

    async def on_events(self, batch: list[Event]) -> None:
        return None


class _Slow:
    """A blocking subscriber: 5 ms of `time.sleep` per batch, in its worker thread."""

    policy = "drop_oldest"
    maxsize = 1000

    def on_events(self, batch: list[Event]) -> None:
        time.sleep(0.005)


def _noop_event(ev: Event) -> None:
    return None


def _small_events(n: int) -> list[Event]:
    return [Loss(step=i, value=0.5) for i in range(n)]


def _stepped_events(n: int) -> list[Event]:
    """Five events a step, as a loop publishes them (the cost report closes a step per five)."""
    return [Loss(step=i // 5, value=0.5) for i in range(n)]


def _tensor_events(n: int) -> list[Event]:
    import torch

    return [Loss(step=i, value=torch.tensor(0.5)) for i in range(n)]


def _steps(n: int) -> Sequence[int]:
    return range(n)


def _hf_contender() -> Callable[[Any], Any]:
    """transformers' real CallbackHandler with 4 no-op TrainerCallbacks: `on_step_end`."""
    from transformers import TrainingArguments
    from transformers.trainer_callback import (
        CallbackHandler,
        TrainerCallback,
        TrainerControl,
        TrainerState,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # no DefaultFlowCallback

    class NoopCallback(TrainerCallback):
        pass

    callbacks = [NoopCallback() for _ in range(4)]
    handler = CallbackHandler(callbacks, None, None, None, None)  # type: ignore[no-untyped-call]
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="eventbus-bench-hf-"), report_to=[], use_cpu=True
    )
    state, control = TrainerState(), TrainerControl()

    def dispatch(_: Any) -> Any:
        return handler.on_step_end(args, state, control)

    return dispatch


def _lightning_contender() -> Callable[[Any], Any]:
    """Lightning's real hook dispatch on a real Trainer with 4 no-op Callbacks."""
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.trainer.call import _call_callback_hooks

    for name in ("pytorch_lightning", "lightning", "lightning_fabric"):  # after import: it
        logging.getLogger(name).setLevel(logging.ERROR)  # sets INFO on import

    class NoopCallback(pl.Callback):
        pass

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            callbacks=[NoopCallback() for _ in range(4)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accelerator="cpu",
            devices=1,
        )
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    if len(callbacks) != 4:
        raise RuntimeError(f"expected 4 Lightning callbacks, got {callbacks}")
    trainer.strategy.connect(Module())  # as in fit(): hooks see the module
    outputs, batch = {"loss": 0.5}, None

    def dispatch(step: Any) -> None:
        _call_callback_hooks(trainer, "on_train_batch_end", outputs, batch, step)

    return dispatch


def _blinker_contender() -> Callable[[Any], Any]:
    """A blinker Signal with 4 receivers, sending the event as a keyword."""
    import blinker

    signal = blinker.Signal()
    receivers = [lambda sender, **kw: None for _ in range(4)]
    for r in receivers:
        signal.connect(r, weak=False)

    def dispatch(ev: Any) -> Any:
        return signal.send(None, event=ev)

    return dispatch


def _sync_list_contender() -> Callable[[Any], Any]:
    """What a hand-written loop does: `for cb in callbacks: cb(ev)` over 4 no-ops."""
    callbacks = [_noop_event for _ in range(4)]

    def dispatch(ev: Any) -> None:
        for cb in callbacks:
            cb(ev)

    return dispatch


def _thread_cpu_s(native_id: int | None) -> float:
    """CPU seconds used so far by one thread of this process (0.0 if unknown)."""
    import psutil

    for t in psutil.Process().threads():
        if t.id == native_id:
            return float(t.user_time + t.system_time)
    return 0.0


def _bus_thread_ns_per_event(bus: EventBus, rounds: int, calls: int) -> float:
    """CPU the bus thread spends per small event published in bursts (routing to its 4
    subscribers, their queues and tasks; the slow one's work runs in its own thread)."""
    assert bus.thread is not None  # running
    tid = bus.thread.native_id
    bus.flush(timeout=30)
    c0 = _thread_cpu_s(tid)  # psutil reads clock ticks: measure many rounds at once
    for _ in range(rounds):
        for ev in _small_events(calls):
            bus.publish(ev)
        bus.flush(timeout=30)
    return (_thread_cpu_s(tid) - c0) * 1e9 / (rounds * calls)


def run(
    quick: bool = False, *, rounds: int | None = None, calls: int | None = None
) -> dict[str, Any]:
    """Measure every contender; flat `overhead.*` keys, ns per event."""
    rounds = rounds if rounds is not None else (16 if quick else 60)
    calls = calls if calls is not None else (2000 if quick else 5000)

    bus4 = EventBus(drain_interval=0.005)
    for _ in range(3):
        bus4.subscribe(_Fast())
    bus4.subscribe(_Slow(), name="slow")
    bus1 = EventBus(drain_interval=0.005)
    bus1.subscribe(_Fast())
    cost, nocost = EventBus(drain_interval=0.005), EventBus(drain_interval=0.005, cost_every=None)
    for b in (cost, nocost):  # the cost report's own cost: the same bus with and without it
        b.subscribe(_Fast())

    def build_and_publish(i: int) -> None:
        bus4.publish(Loss(step=i, value=0.5))

    contenders: dict[str, tuple[Callable[[int], Sequence[Any]], Callable[[Any], Any]]] = {
        "eventbus_publish": (_small_events, bus4.publish),
        "eventbus_publish_1sub": (_small_events, bus1.publish),
        "eventbus_publish_cost": (_stepped_events, cost.publish),
        "eventbus_publish_nocost": (_stepped_events, nocost.publish),
        "eventbus_publish_tensor": (_tensor_events, bus4.publish),
        "eventbus_build_and_publish": (_steps, build_and_publish),
        "sync_list_4": (_small_events, _sync_list_contender()),
        "blinker_4": (_small_events, _blinker_contender()),
        "hf_callbackhandler_4": (_small_events, _hf_contender()),
        "lightning_hooks_4": (_steps, _lightning_contender()),
    }
    bus_of = {
        "eventbus_publish": bus4,
        "eventbus_publish_1sub": bus1,
        "eventbus_publish_cost": cost,
        "eventbus_publish_nocost": nocost,
        "eventbus_publish_tensor": bus4,
        "eventbus_build_and_publish": bus4,
    }

    def between(name: str) -> None:
        bus = bus_of.get(name)
        if bus is not None and not bus.flush(timeout=30):
            raise RuntimeError(f"{name}: the bus did not drain within 30 s")

    with bus4, bus1, cost, nocost:
        samples = interleave_calls(contenders, rounds=rounds, calls=calls, between=between)
        st4 = bus4.stats()
        route_ns = _bus_thread_ns_per_event(bus4, 20, calls)

    out: dict[str, Any] = {}
    for name, values in samples.items():
        s = summarize(values)
        out[f"overhead.{name}_p50_ns"] = round(s["p50"], 1)
        out[f"overhead.{name}_p99_ns"] = round(s["p99"], 1)
        out[f"overhead.{name}_mean_ns"] = round(s["mean"], 1)
    out["overhead.samples_per_contender"] = rounds * calls
    out["overhead.timer_overhead_ns"] = round(call_overhead_ns(), 1)
    out["overhead.hf_over_eventbus_p50"] = round(
        out["overhead.hf_callbackhandler_4_p50_ns"]
        / max(out["overhead.eventbus_publish_p50_ns"], 1.0),
        2,
    )
    out["overhead.cost_report_ns"] = round(
        out["overhead.eventbus_publish_cost_p50_ns"]
        - out["overhead.eventbus_publish_nocost_p50_ns"],
        1,
    )
    published4 = st4.published
    out["overhead.eventbus_bus_thread_cpu_ns_per_event"] = round(route_ns, 1)
    out["overhead.eventbus_slow_dropped"] = st4.subscribers["slow"].dropped
    out["overhead.eventbus_fast_delivered"] = sum(
        s.delivered for n, s in st4.subscribers.items() if n != "slow"
    )
    out["overhead.eventbus_published"] = published4
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    print(json.dumps(run(a.quick), indent=1))


if __name__ == "__main__":
    main()
