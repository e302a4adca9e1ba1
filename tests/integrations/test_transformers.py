"""The HF Trainer bridge with the real Trainer on a tiny CPU model (a few dozen steps)."""

from __future__ import annotations

import importlib
import os
import subprocess
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
    Scalars,
    StepEnded,
    StepStarted,
    StopRequested,
)
from tests.integrations._log import attach_log, of, run_example

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from transformers import (  # noqa: E402
    PretrainedConfig,
    PreTrainedModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from eventbus.integrations.transformers import EventBusCallback  # noqa: E402

transformers.utils.logging.set_verbosity_error()


class TinyConfig(PretrainedConfig):  # type: ignore[misc]
    model_type = "eventbus-tiny-regressor"

    def __init__(self, n_in: int = 8, **kw: Any) -> None:
        self.n_in = n_in
        super().__init__(**kw)


class TinyRegressor(PreTrainedModel):  # type: ignore[misc]
    """One linear layer: a step costs milliseconds, so the Trainer's own overhead dominates."""

    config_class = TinyConfig

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        self.net = torch.nn.Linear(config.n_in, 1)
        self.post_init()

    def forward(self, x: Any, y: Any) -> dict[str, Any]:
        return {"loss": torch.nn.functional.mse_loss(self.net(x), y)}


class Regression(torch.utils.data.Dataset):  # type: ignore[misc]
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i]}


class NaNAfter(Trainer):  # type: ignore[misc]
    """A Trainer whose loss turns NaN from update `nan_at` on (a forced divergence)."""

    nan_at = 8

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
        loss = super().compute_loss(model, inputs, *args, **kw)
        if self.state.global_step + 1 >= self.nan_at:
            loss = loss * float("nan")
        return loss


class FlushAt(TrainerCallback):  # type: ignore[misc]
    """Placed after the bridge: waits at step `at` until subscribers saw everything so far."""

    def __init__(self, bus: EventBus, at: int) -> None:
        self.bus, self.at = bus, at

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.at:
            assert self.bus.flush(10)


def make_trainer(
    tmp_path: Path, callbacks: list[Any], *, cls: type[Any] = Trainer, **overrides: Any
) -> Any:
    torch.manual_seed(0)
    opts: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "max_steps": 30,
        "per_device_train_batch_size": 8,
        "learning_rate": 0.05,
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "dataloader_num_workers": 0,
        "save_strategy": "no",
        "disable_tqdm": True,
        "log_level": "error",
        "label_names": ["y"],
    }
    opts.update(overrides)
    return cls(
        model=TinyRegressor(TinyConfig()),
        args=TrainingArguments(**opts),
        train_dataset=Regression(),
        eval_dataset=Regression(16),
        callbacks=callbacks,
    )


def new_bus() -> EventBus:
    return EventBus(drain_interval=0.002, close_timeout=10)


def test_log_holds_the_trainers_steps_losses_evals_and_checkpoints(tmp_path: Path) -> None:
    bus = new_bus()
    read = attach_log(bus, tmp_path / "log")
    trainer = make_trainer(
        tmp_path,
        [EventBusCallback(bus)],
        eval_strategy="steps",
        eval_steps=15,
        save_strategy="steps",
        save_steps=15,
    )
    with bus:
        trainer.train()
    events = read()
    history = trainer.state.log_history

    assert {type(e) for e in events} >= {
        RunStarted,
        EpochStarted,
        StepStarted,
        StepEnded,
        Loss,
        OptimizerStepped,
        Scalars,
        EvalEnded,
        CheckpointSaved,
        EpochEnded,
        RunEnded,
    }
    assert all(e.rank == 0 for e in events)
    # Step k is the k-th optimizer update: the Trainer's global_step after it.
    assert [e.step for e in of(events, StepStarted)] == list(range(1, 31))
    assert [e.step for e in of(events, StepEnded)] == list(range(1, 31))
    started = {e.step: e.seq for e in of(events, StepStarted)}
    assert all(started[e.step] < e.seq for e in of(events, StepEnded))

    train_logs = [h for h in history if "loss" in h]
    assert [(e.step, e.value) for e in of(events, Loss)] == [
        (h["step"], h["loss"]) for h in train_logs
    ]
    opt = of(events, OptimizerStepped)
    assert [(e.step, e.lr, e.grad_norm) for e in opt] == [
        (h["step"], h["learning_rate"], h["grad_norm"]) for h in train_logs
    ]
    assert all(e.duration_s is not None and e.duration_s >= 0 for e in opt)

    evals = [h for h in history if "eval_loss" in h]
    got_evals = of(events, EvalEnded)
    assert [(e.step, e.metrics["eval_loss"]) for e in got_evals] == [
        (h["step"], h["eval_loss"]) for h in evals
    ]
    assert [e.step for e in got_evals] == [15, 30]
    assert all(e.metrics["loss"] == e.metrics["eval_loss"] for e in got_evals)

    saved = of(events, CheckpointSaved)
    assert [e.step for e in saved] == [15, 30]
    for e in saved:
        assert e.path == os.path.join(str(tmp_path / "out"), f"checkpoint-{e.step}")
        assert os.path.isdir(e.path)

    (run,) = of(events, RunStarted)
    assert run.total_steps == 30
    assert run.world_size == 1
    assert run.resumed_from_step is None
    assert run.config["max_steps"] == 30
    assert run.config["learning_rate"] == 0.05
    (end,) = of(events, RunEnded)
    assert (end.step, end.status) == (30, "completed")
    assert [e.epoch for e in of(events, EpochStarted)] == [0, 1, 2, 3]
    assert [e.epoch for e in of(events, EpochEnded)] == [0, 1, 2, 3]
    # Everything else the Trainer logged (epoch, train_runtime...) arrives as Scalars.
    final = of(events, Scalars)[-1].values
    assert final["train_loss"] == history[-1]["train_loss"]


def test_stop_request_ends_training_at_the_next_step_end(tmp_path: Path) -> None:
    bus = new_bus()
    read = attach_log(bus, tmp_path / "log")

    def stop_at_5(ev: StepEnded) -> None:
        if ev.step == 5:
            bus.control.request_stop("test says stop", source="test")

    bus.subscribe(stop_at_5, events=[StepEnded], policy="block")
    # The request lands while step 6 runs (FlushAt waits for it after step 5's hooks).
    trainer = make_trainer(tmp_path, [EventBusCallback(bus), FlushAt(bus, 5)])
    with bus:
        trainer.train()
    events = read()
    assert trainer.state.global_step == 6
    assert [e.step for e in of(events, StepEnded)] == list(range(1, 7))
    (end,) = of(events, RunEnded)
    assert (end.step, end.status, end.reason) == (6, "stopped", "test says stop")


def test_divergence_detector_stops_the_trainer_within_one_step(tmp_path: Path) -> None:
    from eventbus.monitors import DivergenceDetector

    bus = new_bus()
    read = attach_log(bus, tmp_path / "log")
    bus.subscribe(DivergenceDetector(action="stop"))
    # logging_nan_inf_filter=False: the Trainer's default hides NaN losses from its logs.
    trainer = make_trainer(
        tmp_path,
        [EventBusCallback(bus)],
        cls=NaNAfter,
        logging_nan_inf_filter=False,
    )
    with bus:
        trainer.train()
    events = read()
    assert NaNAfter.nan_at <= trainer.state.global_step < 30
    (det,) = of(events, DivergenceDetected)
    assert det.step == NaNAfter.nan_at
    (req,) = of(events, StopRequested)
    # The bridge checks once per step: at most one step ends after the request.
    assert len([e for e in of(events, StepEnded) if e.ts > req.ts]) <= 1
    (end,) = of(events, RunEnded)
    assert end.status == "stopped"
    assert "diverged" in (end.reason or "")


def test_abort_skips_the_final_checkpoint_a_stop_keeps(tmp_path: Path) -> None:
    for how, path in (("stop", tmp_path / "stop"), ("abort", tmp_path / "abort")):
        bus = new_bus()
        read = attach_log(bus, path / "log")

        def ask(ev: StepEnded, how: str = how, bus: EventBus = bus) -> None:
            if ev.step == 3:
                request = bus.control.request_stop if how == "stop" else bus.control.request_abort
                request(f"test {how}")

        bus.subscribe(ask, events=[StepEnded], policy="block")
        trainer = make_trainer(
            path,
            [EventBusCallback(bus), FlushAt(bus, 3)],
            save_strategy="epoch",
        )
        with bus:
            trainer.train()
        events = read()
        assert trainer.state.global_step == 4
        (end,) = of(events, RunEnded)
        saved = of(events, CheckpointSaved)
        if how == "stop":  # the Trainer's end-of-epoch save still runs
            assert end.status == "stopped"
            assert [e.step for e in saved] == [4]
        else:
            assert end.status == "aborted"
            assert saved == []
            assert not (path / "out" / "checkpoint-4").exists()


def test_manage_bus_starts_and_closes_the_bus_with_training(tmp_path: Path) -> None:
    bus = new_bus()
    read = attach_log(bus, tmp_path / "log")
    trainer = make_trainer(tmp_path, [EventBusCallback(bus, manage_bus=True)], max_steps=3)
    assert not bus.running
    trainer.train()
    assert not bus.running  # closed, so the log is complete
    events = read()
    assert type(events[0]) is RunStarted
    assert of(events, RunEnded)[0].step == 3


def test_the_example_logs_a_whole_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = run_example("hf_trainer.py", tmp_path / "run")
    assert "wrote" in capsys.readouterr().out
    (run,) = of(events, RunStarted)
    assert run.total_steps == 30
    assert [e.step for e in of(events, StepEnded)] == list(range(1, 31))
    assert len(of(events, Loss)) == 30
    assert [e.step for e in of(events, EvalEnded)] == [10, 20, 30]
    assert of(events, RunEnded)[0].status == "completed"


def test_bad_bus_argument_is_a_clear_type_error() -> None:
    with pytest.raises(TypeError, match=r"EventBusCallback\(bus\) takes an eventbus.EventBus"):
        EventBusCallback("runs/exp1")  # type: ignore[arg-type]


def test_without_transformers_the_bridge_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # None: import raises ImportError
    monkeypatch.delitem(sys.modules, "eventbus.integrations.transformers")
    with pytest.raises(ImportError) as info:
        importlib.import_module("eventbus.integrations.transformers")
    msg = str(info.value)
    assert "pip install 'eventbus[transformers]'" in msg
    assert "\n" not in msg


def test_importing_eventbus_does_not_import_the_frameworks() -> None:
    code = (
        "import sys, eventbus, eventbus.integrations, eventbus.sinks, eventbus.monitors; "
        "bad = [m for m in ('transformers', 'pytorch_lightning', 'lightning') "
        "if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
