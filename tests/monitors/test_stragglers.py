"""`StragglerDetector`: the slow rank named from the phases every rank publishes."""

from __future__ import annotations

from pathlib import Path

import pytest

from eventbus import EventBus
from eventbus.cli import main as cli
from eventbus.codec import iter_lines
from eventbus.events import (
    BackwardEnded,
    Event,
    ForwardEnded,
    OptimizerStepped,
    StepEnded,
    StepStarted,
    StragglerDetected,
)
from eventbus.monitors import StragglerDetector
from eventbus.monitors._rank_link import Key


def _events(path: Path) -> list[Event]:
    with path.open("rb") as f:
        return list(iter_lines(f))


# -- torchrun, 2 ranks (the launch is shared: see conftest.py) --------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("run", ["slow", "slow_allreduce"])
def test_the_rank_slowed_in_its_forward_is_named(
    two_ranks: Path, run: str, capsys: pytest.CaptureFixture[str]
) -> None:
    evs = _events(two_ranks / run / "events.rank0.jsonl")
    named = [e for e in evs if isinstance(e, StragglerDetected)]
    assert [(e.straggler, e.phase) for e in named] == [(1, "forward")]
    (s,) = named
    assert s.relative >= 2.0 and s.scores["0"] == 1.0 and s.scores["1"] == s.relative
    assert s.seconds > s.fastest_s
    assert s.step == 30  # the third window of 10 steps: patience 3
    if run == "slow_allreduce":  # every rank's step lasts as long as the slowest rank's
        steps = {}
        for r in (0, 1):
            ends = _events(two_ranks / run / f"events.rank{r}.jsonl")
            steps[r] = sum(e.duration_s or 0 for e in ends if isinstance(e, StepEnded))
        assert steps[0] > 0.8 * steps[1]  # rank 0 waited: its whole step names no one
    logs = [str(two_ranks / run / f"events.rank{r}.jsonl") for r in (0, 1)]
    capsys.readouterr()
    assert cli(["summary", *logs]) == 0
    assert "straggler @30 on rank 0: rank 1 at " in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_no_rank_is_named_in_200_steps_without_a_slow_one(two_ranks: Path) -> None:
    for r in (0, 1):
        evs = _events(two_ranks / "clean" / f"events.rank{r}.jsonl")
        assert sum(isinstance(e, StepEnded) for e in evs) == 200
        assert not any(isinstance(e, StragglerDetected) for e in evs)


# -- in one process ---------------------------------------------------------------------------


class FakeLink:
    """Stands in for the link: keeps what the detector would send to rank 0."""

    def __init__(self) -> None:
        self.sent: list[tuple[Key, dict[str, object]]] = []

    def put(self, key: Key, part: dict[str, object]) -> None:
        self.sent.append((key, part))


@pytest.mark.asyncio
async def test_each_window_sends_the_median_of_each_phase_but_the_wait_phases() -> None:
    det = StragglerDetector(every=2)
    link = FakeLink()
    det.link = link  # type: ignore[assignment]
    det._on = True
    batch: list[Event] = []
    for step, fwd in ((1, 0.1), (2, 0.3), (3, 0.5)):
        batch += [
            StepStarted(step=step, ts=0),
            ForwardEnded(step=step, ts=1_000_000, duration_s=fwd),
            BackwardEnded(step=step, ts=3_000_000, duration_s=9.0),  # the collective: left out
            OptimizerStepped(step=step, ts=5_000_000),  # no duration_s: since the last boundary
            StepEnded(step=step),
        ]
    await det.on_events(batch)
    assert link.sent == [(("w", 0), {"step": 2, "t": {"forward": 0.2, "optimizer": 0.002}})]
    det._flush()  # the window still open (at close)
    assert link.sent[1] == (("w", 1), {"step": 3, "t": {"forward": 0.5, "optimizer": 0.002}})


def test_one_rank_does_nothing_and_bad_settings_are_refused() -> None:
    det = StragglerDetector()
    with EventBus(world_size=1) as bus:
        bus.subscribe(det)
        bus.publish(StepEnded(step=10))
    assert det.stats()["windows"] == 0
    with pytest.raises(ValueError, match="unknown wait_phases"):
        StragglerDetector(wait_phases=["allreduce"])
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        StragglerDetector(every=0)


def test_a_phase_timed_on_the_device_counts_its_device_time() -> None:
    """On a GPU the host returns from a phase long before the device finishes it: a phase
    published with `device_s` (bus.phase(..., device_time=True)) is scored by that."""
    import anyio

    det = StragglerDetector(every=5)
    sent: list[dict[str, object]] = []
    det.link.put = lambda key, value: sent.append(value)  # type: ignore[method-assign]
    det._on = True  # as on a rank of two (the link itself is tested in test_rank_link.py)
    batch: list[Event] = []
    for step in range(1, 6):
        batch += [
            StepStarted(step=step, ts=step * 10**9),
            ForwardEnded(step=step, duration_s=0.001, device_s=0.25),
            BackwardEnded(step=step, duration_s=0.002),  # a wait phase: left out
            OptimizerStepped(step=step, duration_s=0.003),  # host time only: as before
            StepEnded(step=step, duration_s=0.3),
        ]
    anyio.run(det.on_events, batch)
    (window,) = sent
    assert window["t"] == {"forward": 0.25, "optimizer": 0.003}
