"""ConsoleProgress: step, loss, steps/s and ETA; quiet off a terminal unless forced."""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

import pytest

from eventbus import EventBus
from eventbus.events import (
    DivergenceDetected,
    Loss,
    RunEnded,
    RunStarted,
    StepEnded,
    TimeEstimate,
)
from eventbus.sinks import ConsoleProgress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _feed(p: ConsoleProgress, total: int | None, steps: int = 5) -> None:
    p.on_events([RunStarted(config={}, total_steps=total)])
    for s in range(1, steps + 1):
        p.on_events([Loss(step=s, value=1.0 / s), StepEnded(step=s)])
        time.sleep(0.01)


def test_tqdm_bar_shows_step_loss_rate_and_eta() -> None:
    pytest.importorskip("tqdm")
    out = io.StringIO()
    p = ConsoleProgress(stream=out, force=True, refresh_interval=0)
    _feed(p, total=10)
    p.on_close()
    text = out.getvalue()
    assert "5/10" in text
    assert "loss=0.2" in text
    assert "step/s" in text
    assert "<" in text  # tqdm's elapsed<remaining: the ETA


def test_plain_line_without_tqdm_has_eta_when_total_known() -> None:
    out = io.StringIO()
    p = ConsoleProgress(stream=out, force=True, refresh_interval=0, use_tqdm=False)
    _feed(p, total=100)
    p.on_close()
    text = out.getvalue()
    assert "step 5/100" in text
    assert "loss=0.2" in text
    assert "steps/s" in text
    assert "ETA" in text


@pytest.mark.parametrize("total", [None, 0, -1])
def test_no_eta_when_total_unknown(total: int | None) -> None:
    out = io.StringIO()
    p = ConsoleProgress(stream=out, force=True, refresh_interval=0, use_tqdm=False)
    _feed(p, total=total)  # 0 or less is no total (as SpeedMonitor reads it): not "5/-1"
    p.on_close()
    assert "step 5" in out.getvalue()
    assert "step 5/" not in out.getvalue()
    assert "ETA" not in out.getvalue()


def test_quiet_when_not_a_terminal_unless_forced() -> None:
    out = io.StringIO()
    p = ConsoleProgress(stream=out)
    assert not p.enabled
    _feed(p, total=10)
    p.on_close()
    assert out.getvalue() == ""
    assert ConsoleProgress(stream=_Tty()).enabled
    assert not ConsoleProgress(stream=_Tty(), force=False).enabled


def test_detections_and_run_end_are_printed() -> None:
    out = io.StringIO()
    p = ConsoleProgress(stream=out, force=True, refresh_interval=0, use_tqdm=False)
    _feed(p, total=10, steps=2)
    p.on_events(
        [
            DivergenceDetected(step=2, value=9.0, baseline=1.0, reason="spike"),
            RunEnded(status="stopped", reason="diverged"),
        ]
    )
    p.on_close()
    text = out.getvalue()
    assert "DivergenceDetected at step 2" in text
    assert "run stopped" in text


@dataclass(slots=True, kw_only=True)
class ConsoleTokenLoss(Loss):
    tokens: int = 0


def test_subclass_of_loss_updates_the_bar_like_loss() -> None:
    out = io.StringIO()
    p = ConsoleProgress(stream=out, force=True, refresh_interval=0, use_tqdm=False)
    p.on_events([ConsoleTokenLoss(step=4, value=0.5, tokens=3)])
    p.on_close()
    assert "step 4  loss=0.5" in out.getvalue()
    assert "ConsoleTokenLoss" not in out.getvalue()  # not printed as a notable event


def test_on_a_bus_it_is_lossy_and_rank_zero_only() -> None:
    assert ConsoleProgress.policy == "latest"
    assert ConsoleProgress.ranks == (0,)
    out = io.StringIO()
    p = ConsoleProgress(stream=out, force=True, refresh_interval=0, use_tqdm=False)
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(p)
    with bus:
        bus.publish(RunStarted(config={}, total_steps=3))
        for s in range(1, 4):
            bus.publish(Loss(step=s, value=float(s)))
    assert "step 3/3" in out.getvalue()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="refresh_interval"):
        ConsoleProgress(refresh_interval=-1)


def test_speed_monitors_estimate_is_the_eta_shown() -> None:
    out = io.StringIO()
    p = ConsoleProgress(stream=out, force=True, refresh_interval=0, use_tqdm=False)
    _feed(p, total=100)  # ~100 steps/s here: its own estimate would be about a second
    p.on_events([TimeEstimate(step=5, eta_s=7265.0, total_steps=100)])
    p.on_close()
    assert "ETA 2:01:0" in out.getvalue()  # SpeedMonitor's, counted down since it came


def test_tqdm_postfix_carries_the_monitors_estimate() -> None:
    pytest.importorskip("tqdm")
    out = io.StringIO()
    p = ConsoleProgress(stream=out, force=True, refresh_interval=0)
    p.on_events([TimeEstimate(step=3, eta_s=125.0, total_steps=40)])  # the total comes too
    p.on_events([StepEnded(step=4)])
    p.on_close()
    text = out.getvalue()
    assert "ETA 2:0" in text
    assert "/40" in text


def test_a_new_run_on_the_same_bus_starts_the_line_afresh() -> None:
    out = _Tty()
    p = ConsoleProgress(stream=out, refresh_interval=0, use_tqdm=False)
    _feed(p, total=100, steps=5)
    p.on_events([TimeEstimate(step=5, eta_s=7265.0, total_steps=100), RunEnded(step=5)])
    _feed(p, total=20, steps=2)  # the next run: steps from 1 again
    p.on_close()
    last = out.getvalue().rsplit("\r", 1)[-1]
    assert last.startswith("step 2/20")  # not the old run's "step 5/20"
    assert "ETA 2:0" not in last  # nor its estimate, counting down
