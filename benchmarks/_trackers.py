"""The real loop's tracker rows (issue 16): W&B and MLflow behind the bus, MLflow inline.

  mlflow_inline     `MlflowClient.log_batch` of loss, grad norm and lr on the training thread
                    each step (`.item()` first, as any inline logging must), to a local sqlite
                    store: what `mlflow.log_metrics(..., step=n)` does;
  eventbus_wandb    the `eventbus` row plus `WandbSink` (offline, in the sidecar);
  eventbus_mlflow   the `eventbus` row plus `MLflowSink` on the same kind of sqlite store.

W&B inline is the `wandb` row of `benchmarks/real_loop.py`. Each variant keeps one store
(its sqlite database, created at its first block, untimed) and opens a new run per block.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.real_loop import Bus, Model, Variant

__all__ = ["BusMlflow", "BusWandb", "MlflowInline", "build"]

PROJECT = "eventbus-real-loop"
READY_TIMEOUT_S = 120.0  # a tracker's first run: wandb-core's start, MLflow's tables


def _sqlite(root: Path) -> str:
    return f"sqlite:///{root / 'mlflow.db'}"


class MlflowInline(Variant):
    """MLflow's client on the training thread: one `log_batch` of three metrics a step."""

    client: Any = None
    run_id: str | None = None

    def open_block(self) -> None:
        from mlflow.tracking import MlflowClient

        super().open_block()
        if self.client is None:
            self.client = MlflowClient(_sqlite(self.root))  # tables created here, untimed
            exp = self.client.get_experiment_by_name(PROJECT)
            self.experiment = exp.experiment_id if exp else self.client.create_experiment(PROJECT)
            import mlflow

            self.notes["mlflow_version"] = mlflow.__version__
        self.run_id = self.client.create_run(self.experiment).info.run_id

    def step(self, n: int) -> None:
        from mlflow.entities import Metric

        loss, gn = self.model.train_step(n)
        ms = time.time_ns() // 1_000_000
        lr = self.model.opt.param_groups[0]["lr"]
        metrics = [
            Metric("train/loss", loss.item(), ms, n),  # a device sync on CUDA
            Metric("train/grad_norm", gn.item(), ms, n),
            Metric("train/lr", lr, ms, n),
        ]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close_block(self) -> None:
        self.client.set_terminated(self.run_id)


class _BusTracker(Bus):
    """The eventbus row plus one tracker sink in the sidecar, its run open before timing."""

    sink: Any = None

    def make(self, d: Path) -> Any:
        raise NotImplementedError

    def trackers(self, d: Path) -> list[Any]:
        self.sink = self.make(d)
        return [self.sink]

    def open_block(self) -> None:
        """`bus.flush()` does not always wait for a subscriber's `on_start` (a race): wait until
        the sidecar reports the tracker's run open, as the inline rows open theirs."""
        super().open_block()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while self.sink.stats().runs < 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: the tracker's run did not open in time")
            time.sleep(0.05)  # the sidecar reports every 0.25 s


class BusWandb(_BusTracker):
    """The eventbus row plus a WandbSink (offline) in the sidecar."""

    def make(self, d: Path) -> Any:
        from eventbus.sinks import WandbSink

        return WandbSink(PROJECT, mode="offline", dir=d / "wandb", settings={"silent": True})


class BusMlflow(_BusTracker):
    """The eventbus row plus an MLflowSink (local sqlite store) in the sidecar."""

    def make(self, d: Path) -> Any:
        from eventbus.sinks import MLflowSink

        return MLflowSink(_sqlite(self.root), experiment=PROJECT)


def build(base: str, name: str, model: Model, root: Path) -> Variant:
    """The tracker variant `base` (one of `real_loop.TRACKERS`)."""
    kinds: dict[str, type[Variant]] = {
        "mlflow_inline": MlflowInline,
        "eventbus_wandb": BusWandb,
        "eventbus_mlflow": BusMlflow,
    }
    return kinds[base](name, model, root)
