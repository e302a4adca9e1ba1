"""eventbus.ctl.view: step, loss, rate and ETA as `status` tells them, from events alone."""

from __future__ import annotations

from eventbus.ctl.view import CHECKPOINTS, RunView
from eventbus.events import CheckpointSaved, Loss, RunEnded, RunStarted, StepEnded

S = 1_000_000_000  # ns


def test_rate_and_eta_come_from_publish_times() -> None:
    v = RunView()
    v.update([RunStarted(total_steps=100, ts=0)])
    for step in range(1, 11):  # 4 steps per second
        v.update([Loss(step=step, value=1.0 / step, ts=step * S // 4), StepEnded(step=step)])
    snap = v.snapshot()
    assert snap["step"] == 10 and snap["total_steps"] == 100
    assert snap["loss"] == 0.1
    assert snap["steps_per_s"] == 4.0
    assert snap["eta_s"] == 22.5  # 90 steps left at 4 a second
    assert snap["run"] == "running"
    v.update([RunEnded(status="stopped", step=10, ts=11 * S // 4)])
    snap = v.snapshot()
    assert (snap["run"], snap["eta_s"]) == ("stopped", None)  # stopped at 10/100: no ETA


def test_a_nan_loss_is_said_and_eval_losses_are_not_the_training_loss() -> None:
    v = RunView()
    v.update([Loss(step=1, value=float("nan"), ts=1)])
    assert v.snapshot()["loss"] == "nan"
    v.update([Loss(step=2, value=0.5, split="eval", ts=2)])
    assert v.snapshot()["loss"] == "nan" and v.step == 2


def test_no_rate_or_eta_without_two_steps_or_a_total() -> None:
    v = RunView()
    v.update([Loss(step=5, value=1.0, ts=S)])
    assert v.snapshot()["steps_per_s"] is None
    v.update([Loss(step=6, value=1.0, ts=2 * S)])
    snap = v.snapshot()
    assert snap["steps_per_s"] == 1.0 and snap["eta_s"] is None  # no RunStarted.total_steps


def test_the_window_forgets_old_steps() -> None:
    v = RunView(window_s=10)
    v.update([StepEnded(step=1, ts=0)])
    v.update([StepEnded(step=2, ts=1 * S)])  # fast at first: 1 step/s
    for k in range(1, 11):
        v.update([StepEnded(step=2 + k, ts=(1 + 10 * k) * S)])  # then one per 10 s
    assert v.snapshot()["steps_per_s"] == 0.1


def test_checkpoints_and_the_end_are_kept() -> None:
    v = RunView()
    v.update([CheckpointSaved(step=7, path="ckpt.pt", ts=1, seq=4)])
    assert v.snapshot()["last_checkpoint"] == {"step": 7, "path": "ckpt.pt", "seq": 4}
    assert v.ended is None
    v.update([RunEnded(status="stopped", step=9, ts=2)])
    assert v.ended == "stopped" and v.snapshot()["run"] == "stopped"


def test_the_first_rate_counts_from_the_start_of_the_run() -> None:
    v = RunView()
    v.update([RunStarted(total_steps=50, resumed_from_step=20, ts=0)])
    v.update([Loss(step=30, value=1.0, ts=5 * S)])  # one batch of steps: 10 in 5 s
    snap = v.snapshot()
    assert snap["steps_per_s"] == 2.0 and snap["eta_s"] == 10.0


def test_the_checkpoint_after_an_event_is_the_first_published_after_it() -> None:
    v = RunView()
    v.update([CheckpointSaved(step=5, path="a", seq=10), CheckpointSaved(step=5, path="b", seq=12)])
    v.update([CheckpointSaved(step=9, path="c", seq=20)])
    assert v.checkpoint_after(9) == {"step": 5, "path": "a", "seq": 10}
    assert v.checkpoint_after(10) == {"step": 5, "path": "b", "seq": 12}
    assert v.checkpoint_after(15) == {"step": 9, "path": "c", "seq": 20}
    assert v.checkpoint_after(20) is None
    for k in range(CHECKPOINTS):  # only the newest are kept
        v.update([CheckpointSaved(step=10 + k, path=str(k), seq=30 + k)])
    assert v.checkpoint_after(0) == {"step": 10, "path": "0", "seq": 30}


def test_a_placeholder_total_is_no_total_and_a_new_run_counts_from_its_steps() -> None:
    v = RunView()
    v.update([RunStarted(total_steps=-1, ts=0)])  # unknown, as SpeedMonitor reads it
    v.update([StepEnded(step=s, ts=s * S) for s in (1, 2)])
    assert (v.snapshot()["total_steps"], v.snapshot()["eta_s"]) == (None, None)  # not 0 s
    v.update([StepEnded(step=s, ts=s * S) for s in range(3, 50)])
    v.update([RunStarted(total_steps=10, ts=50 * S)])  # the next run on the same bus
    v.update([StepEnded(step=s, ts=(50 + s) * S) for s in (1, 2)])
    snap = v.snapshot()
    assert (snap["step"], snap["steps_per_s"], snap["eta_s"]) == (2, 1.0, 8.0)
