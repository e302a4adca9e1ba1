"""`RankReducer`: each step's value reduced over ranks on rank 0, off the training thread."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from eventbus import EventBus
from eventbus.codec import iter_lines
from eventbus.events import Event, Loss, RankUnresponsive, ReducedMetric, Scalars, StepEnded
from eventbus.monitors import RankReducer
from eventbus.monitors.reducer import _values


def _events(path: Path) -> list[Event]:
    with path.open("rb") as f:
        return list(iter_lines(f))


# -- torchrun, 2 ranks (the launch is shared: see conftest.py) --------------------------------


@pytest.mark.timeout(300)
def test_rank_0_publishes_the_mean_of_both_ranks_at_every_step(two_ranks: Path) -> None:
    for run, steps in (("clean", 200), ("slow", 60), ("slow_allreduce", 60)):
        evs = _events(two_ranks / run / "events.rank0.jsonl")
        reduced = [e for e in evs if isinstance(e, ReducedMetric)]
        assert [e.step for e in reduced] == list(range(1, steps + 1)), run
        for e in reduced:  # rank r published step + r / 4: exact in binary
            assert (e.name, e.op, e.ranks, e.missing) == ("Loss", "mean", 2, [])
            assert e.value == e.step + 0.125
        one = _events(two_ranks / run / "events.rank1.jsonl")
        assert not any(isinstance(e, ReducedMetric) for e in one)  # rank 0 alone publishes


@pytest.mark.timeout(300)
def test_training_on_rank_0_never_waits_for_a_stalled_rank(two_ranks: Path) -> None:
    """Rank 1 stops after step 20 until rank 0 has published all 40 steps (a file rank 0 writes
    after its loop): rank 0's training ran ahead of every reduction that needed rank 1."""
    evs = _events(two_ranks / "stalled" / "events.rank0.jsonl")
    last_step = next(e.seq for e in evs if isinstance(e, StepEnded) and e.step == 40)
    reduced = {e.step: e for e in evs if isinstance(e, ReducedMetric)}
    assert sorted(reduced) == list(range(1, 41))  # every step, once rank 1 went on
    assert all(e.ranks == 2 and e.value == e.step + 0.125 for e in reduced.values())
    late = [s for s, e in reduced.items() if e.seq is not None and e.seq > last_step]
    assert late == list(range(21, 41))  # published after rank 0 ended its last step
    assert not any(isinstance(e, RankUnresponsive) for e in evs)  # late is not dead


# -- in one process: two buses as two ranks -----------------------------------------------------


@pytest.fixture
def rendezvous(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    server = dist.TCPStore(
        "127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False
    )
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    yield
    del server


@pytest.mark.usefixtures("rendezvous")
def test_a_dead_rank_is_reported_and_the_steps_go_out_without_it() -> None:
    got: list[Event] = []
    lost = threading.Event()

    def keep(ev: Event) -> None:
        got.append(ev)
        if isinstance(ev, RankUnresponsive):
            lost.set()

    red = RankReducer([Loss], op="max", timeout_s=0.3, close_wait_s=0.1, every_s=0.01)
    with EventBus(rank=0, world_size=2) as bus:  # rank 1 never starts: as good as dead
        bus.subscribe(keep, events=[ReducedMetric, RankUnresponsive])  # before: closes after
        bus.subscribe(red)
        bus.publish(Loss(step=1, value=2.0))
        assert lost.wait(30)
        bus.publish(Loss(step=2, value=3.0))
    (gone,) = [e for e in got if isinstance(e, RankUnresponsive)]
    assert (gone.missing_rank, gone.source) == (1, "rank_reducer")
    reduced = [(e.step, e.value, e.ranks, e.missing) for e in got if isinstance(e, ReducedMetric)]
    assert reduced == [(1, 2.0, 1, [1]), (2, 3.0, 1, [1])]
    assert red.stats()["lost"] == [1]


def test_one_rank_publishes_nothing_and_bad_settings_are_refused() -> None:
    got: list[Event] = []
    with EventBus(world_size=1) as bus:
        red = RankReducer()
        bus.subscribe(red)
        bus.subscribe(got.append, events=[ReducedMetric])
        bus.publish(Loss(step=1, value=1.0))
    assert got == []
    assert red.stats()["sent"] == 0
    with pytest.raises(ValueError, match="op must be one of"):
        RankReducer(op="median")
    with pytest.raises(ValueError, match="its own ReducedMetric"):
        RankReducer([ReducedMetric])
    with pytest.raises(TypeError, match="Event subclasses"):
        RankReducer([float])  # type: ignore[list-item]


def test_the_values_an_event_carries() -> None:
    assert list(_values(Loss(step=1, value=2.5))) == [("Loss", 2.5)]
    assert list(_values(Loss(step=1, value=2.5, split="val"))) == [("Loss[val]", 2.5)]
    got = list(_values(Scalars(step=1, values={"acc": 0.5, "bad": "x"})))
    assert got == [("Scalars.acc", 0.5), ("Scalars.bad", None)]
