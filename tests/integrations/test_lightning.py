"""The Lightning bridge with the real Trainer on a tiny CPU model (a few dozen steps)."""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from eventbus import EventBus
from eventbus.events import (
    CheckpointSaved,
    DivergenceDetected,
    EpochEnded,
    EpochStarted,
    EvalEnded,
    Loss,
    OptimizerStepped,
    RunEnded,
    RunStarted,
    StepEnded,
    StepStarted,
    StopRequested,
)
from tests.integrations._log import attach_log, of, run_example

torch = pytest.importorskip("torch")
bridge = pytest.importorskip("eventbus.integrations.lightning")
pl = importlib.import_module(bridge.FRAMEWORK)
EventBusCallback = bridge.EventBusCallback
Logger = importlib.import_module(bridge.FRAMEWORK + ".loggers").Logger


class MemoryLogger(Logger):  # type: ignore[misc]
    """Keeps what Lightning logs: [(step, metrics)]."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, *args: Any, **kw: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((-1 if step is None else step, dict(metrics)))

    def values(self, key: str) -> list[tuple[int, float]]:
        return [(s, m[key]) for s, m in self.rows if key in m]


class Regressor(pl.LightningModule):  # type: ignore[misc]
    """A linear model; `nan_at` turns the loss NaN from that update on, `fail_at` raises."""

    def __init__(self, lr: float = 0.05, nan_at: int = 0, fail_at: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(8, 1)
        self.raw_losses: list[float] = []
        self.grad_norms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        step = self.trainer.global_step + 1
        if self.hparams.fail_at and step >= self.hparams.fail_at:
            raise RuntimeError("boom in training_step")
        if self.hparams.nan_at and step >= self.hparams.nan_at:
            loss = loss * float("nan")
        self.raw_losses.append(loss.item())  # test bookkeeping, not the bridge
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        norms = [p.grad.norm() for p in self.parameters() if p.grad is not None]
        self.grad_norms.append(torch.stack(norms).norm().item())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class FlushAt(pl.Callback):  # type: ignore[misc]
    """Placed after the bridge: waits at step `at` until subscribers saw everything so far."""

    def __init__(self, bus: EventBus, at: int) -> None:
        self.bus, self.at = bus, at

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.at:
            assert self.bus.flush(10)


def loader(n: int = 128) -> Any:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    return torch.utils.data.DataLoader(ds, batch_size=8)


def fit(
    tmp_path: Path, callbacks: list[Any], module: Any = None, **overrides: Any
) -> tuple[Any, Any, MemoryLogger]:
    torch.manual_seed(0)
    logger = MemoryLogger()
    opts: dict[str, Any] = {
        "max_steps": 30,
        "logger": logger,
        "log_every_n_steps": 1,
        "accelerator": "cpu",
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(tmp_path / "pl"),
        "limit_val_batches": 2,
        "num_sanity_val_steps": 0,
        "callbacks": callbacks,
    }
    opts.update(overrides)
    trainer = pl.Trainer(**opts)
    module = module or Regressor()
    trainer.fit(module, loader(), loader(16))
    return trainer, module, logger


def new_bus() -> EventBus:
    return EventBus(drain_interval=0.002, close_timeout=10)


def test_log_holds_lightnings_steps_losses_evals_and_checkpoints(tmp_path: Path) -> None:
    bus = new_bus()
    read = attach_log(bus, tmp_path / "log")
    with bus:
        trainer, _module, logger = fit(tmp_path, [EventBusCallback(bus)], val_check_interval=10)
    events = read()

    assert {type(e) for e in events} >= {
        RunStarted,
        EpochStarted,
        StepStarted,
        StepEnded,
        Loss,
        OptimizerStepped,
        EvalEnded,
        CheckpointSaved,
        EpochEnded,
        RunEnded,
    }
    assert trainer.global_step == 30
    assert [e.step for e in of(events, StepStarted)] == list(range(1, 31))
    assert [e.step for e in of(events, StepEnded)] == list(range(1, 31))
    assert all(e.samples == 8 for e in of(events, StepEnded))
    # Lightning's logger numbers a step before its update is counted: logger step = ours - 1.
    assert [(e.step, e.value) for e in of(events, Loss)] == [
        (s + 1, v) for s, v in logger.values("train_loss")
    ]
    assert [(e.step, e.lr) for e in of(events, OptimizerStepped)] == [
        (k, 0.05) for k in range(1, 31)
    ]
    evals = of(events, EvalEnded)
    assert [e.step for e in evals] == [10, 26]  # 16 batches an epoch: batch 10 of each
    assert [e.metrics["val_loss"] for e in evals] == [v for _, v in logger.values("val_loss")]
    assert all(e.metrics["loss"] == e.metrics["val_loss"] for e in evals)

    saved = of(events, CheckpointSaved)
    assert saved
    for e in saved:
        assert int(re.search(r"step=(\d+)", e.path).group(1)) == e.step  # type: ignore[union-attr]
    assert saved[-1].path == trainer.checkpoint_callback.best_model_path
    assert os.path.isfile(saved[-1].path)

    (run,) = of(events, RunStarted)
    assert (run.total_steps, run.world_size, run.resumed_from_step) == (30, 1, None)
    assert run.config["lr"] == 0.05
    assert run.config["trainer"]["max_steps"] == 30
    (end,) = of(events, RunEnded)
    assert (end.step, end.status) == (30, "completed")
    assert [e.epoch for e in of(events, EpochStarted)] == [0, 1]
    assert [(e.epoch, e.step) for e in of(events, EpochEnded)] == [(0, 16), (1, 30)]


def test_accumulation_makes_one_step_of_several_batches(tmp_path: Path) -> None:
    bus = new_bus()
    read = attach_log(bus, tmp_path / "log")
    with bus:
        _trainer, module, _ = fit(
            tmp_path,
            [EventBusCallback(bus, grad_norm=True)],
            max_steps=6,
            accumulate_grad_batches=2,
            enable_checkpointing=False,
        )
    events = read()
    assert [e.step for e in of(events, StepStarted)] == list(range(1, 7))
    assert [(e.step, e.samples) for e in of(events, StepEnded)] == [(k, 16) for k in range(1, 7)]
    raw = module.raw_losses
    for e in of(events, Loss):  # Lightning's normalised losses summed: the step's mean
        assert math.isclose(e.value, (raw[2 * e.step - 2] + raw[2 * e.step - 1]) / 2, rel_tol=1e-5)
    norms = [e.grad_norm for e in of(events, OptimizerStepped)]
    assert len(norms) == 6
    for got, want in zip(norms, module.grad_norms, strict=True):
        assert math.isclose(got, want, rel_tol=1e-4)


def test_stop_request_ends_training_at_the_next_batch_end(tmp_path: Path) -> None:
    bus = new_bus()
    read = attach_log(bus, tmp_path / "log")

    def stop_at_5(ev: StepEnded) -> None:
        if ev.step == 5:
            bus.control.request_stop("test says stop", source="test")

    bus.subscribe(stop_at_5, events=[StepEnded], policy="block")
    with bus:
        trainer, _, _ = fit(
            tmp_path,
            [EventBusCallback(bus), FlushAt(bus, 5)],
            enable_checkpointing=False,
        )
    events = read()
    assert trainer.global_step == 6
    assert [e.step for e in of(events, StepEnded)] == list(range(1, 7))
    (end,) = of(events, RunEnded)
    assert (end.step, end.status, end.reason) == (6, "stopped", "test says stop")


def test_divergence_detector_stops_the_trainer_within_one_step(tmp_path: Path) -> None:
    from eventbus.monitors import DivergenceDetector

    bus = new_bus()
    read = attach_log(bus, tmp_path / "log")
    bus.subscribe(DivergenceDetector(action="stop"))
    with bus:
        trainer, _, _ = fit(
            tmp_path,
            [EventBusCallback(bus)],
            Regressor(nan_at=8),
            enable_checkpointing=False,
        )
    events = read()
    assert 8 <= trainer.global_step < 30
    (det,) = of(events, DivergenceDetected)
    assert det.step == 8
    (req,) = of(events, StopRequested)
    assert len([e for e in of(events, StepEnded) if e.ts > req.ts]) <= 1
    (end,) = of(events, RunEnded)
    assert end.status == "stopped"
    assert "diverged" in (end.reason or "")


def test_an_exception_ends_the_run_as_failed_and_closes_a_managed_bus(tmp_path: Path) -> None:
    bus = new_bus()
    read = attach_log(bus, tmp_path / "log")
    with pytest.raises(RuntimeError, match="boom"):
        fit(
            tmp_path,
            [EventBusCallback(bus, manage_bus=True)],
            Regressor(fail_at=3),
            enable_checkpointing=False,
        )
    assert not bus.running
    events = read()
    (end,) = of(events, RunEnded)
    assert (end.step, end.status) == (2, "failed")
    assert "boom" in (end.reason or "")


def test_the_example_logs_a_whole_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = run_example("lightning_trainer.py", tmp_path / "run")
    assert "wrote" in capsys.readouterr().out
    (run,) = of(events, RunStarted)
    assert run.total_steps == 40
    assert run.config["lr"] == 3e-3
    assert [e.step for e in of(events, StepEnded)] == list(range(1, 41))
    assert [e.step for e in of(events, Loss)] == list(range(1, 41))
    assert [e.step for e in of(events, EvalEnded)] == [20, 40]
    assert of(events, RunEnded)[0].status == "completed"


def test_bad_bus_argument_is_a_clear_type_error() -> None:
    with pytest.raises(TypeError, match=r"EventBusCallback\(bus\) takes an eventbus.EventBus"):
        EventBusCallback(object())


def test_without_lightning_the_bridge_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)  # None: import raises ImportError
    monkeypatch.delitem(sys.modules, "eventbus.integrations.lightning")
    with pytest.raises(ImportError) as info:
        importlib.import_module("eventbus.integrations.lightning")
    msg = str(info.value)
    assert "pip install 'eventbus[lightning]'" in msg
    assert "\n" not in msg
