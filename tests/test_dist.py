"""Many processes: torchrun ranks, per-rank defaults, and a stop agreed by every rank."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch.distributed as dist

from eventbus import EventBus
from eventbus.agreement import StopAgreement
from eventbus.cli import main as cli
from eventbus.codec import iter_lines
from eventbus.dist import rank_info
from eventbus.events import Event, Loss, RunEnded, RunStarted, StopRequested
from tests.torchrun import torchrun

ROOT = Path(__file__).resolve().parents[1]


# -- rank discovery -------------------------------------------------------------------------


def test_rank_info_from_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    info = rank_info()
    assert (info.rank, info.local_rank, info.world_size) == (3, 1, 4)
    bus = EventBus(world_size=1)  # rank from the environment, no agreement in one process
    assert (bus.rank, bus.local_rank) == (3, 1)
    assert bus.control.agree is None
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        rank_info()


def test_stop_check_every_is_checked() -> None:
    with pytest.raises(ValueError, match="stop_check_every must be an int >= 1"):
        EventBus(stop_check_every=0)
    bus = EventBus(world_size=2, stop_check_every=4)
    assert isinstance(bus.control.agree, StopAgreement)
    assert bus.control.agree.every == 4


# -- the agreement in one process (a world of one over gloo) ---------------------------------


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_not_initialised_falls_back_to_local_flags(caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus(world_size=2)
    with caplog.at_level(logging.WARNING, logger="eventbus"):
        assert not bus.should_stop
        bus.control.request_stop("local")
        assert bus.should_stop
    assert sum("not agreed across ranks" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.usefixtures("world_of_one")
def test_cadence_freeze_and_other_threads() -> None:
    bus = EventBus(world_size=2)
    agree = bus.control.agree = StopAgreement(bus.control, every=3, overlap=False)
    for _ in range(6):
        assert not bus.should_stop
    assert agree.checks == 2  # calls 1 and 4 ran the collective
    bus.control.request_stop("here")
    assert bus.should_stop  # call 7: a check
    assert agree.checks == 3
    assert agree.agreed == (True, False)


@pytest.mark.usefixtures("world_of_one")
def test_agreed_value_between_checks_and_threads() -> None:
    bus = EventBus(world_size=2)
    agree = bus.control.agree = StopAgreement(bus.control, every=2, overlap=False)
    assert not bus.should_stop  # call 1: a check
    bus.control.request_stop("asked")
    assert not bus.should_stop  # call 2: the last agreed value, not the local flag
    seen: list[bool] = []
    t = threading.Thread(target=lambda: seen.append(bus.should_stop))
    t.start()
    t.join()
    assert seen == [False]  # another thread never runs a collective
    assert agree.checks == 1
    assert bus.should_stop  # call 3: a check
    assert agree.checks == 2
    assert bus.should_stop
    assert not bus.should_abort
    for _ in range(5):
        assert bus.should_stop
    assert agree.checks == 2  # frozen once agreed: no more collectives
    assert agree.decided_at == 2


@pytest.mark.usefixtures("world_of_one")
def test_overlap_sees_a_stop_one_check_later() -> None:
    bus = EventBus(world_size=2, stop_check_every=2)
    agree = bus.control.agree
    assert isinstance(agree, StopAgreement)
    assert agree.overlap  # the default
    assert not bus.should_stop  # call 1 starts check 1
    assert not bus.should_stop  # call 2: between checks
    bus.control.request_abort("now")
    assert not bus.should_stop  # call 3 reads check 1 (no stop then), starts check 2
    assert not bus.should_stop
    assert bus.should_stop  # call 5 reads check 2
    assert bus.should_abort
    assert agree.checks == 2
    assert not agree.in_flight  # nothing left in flight once a stop is agreed


@pytest.mark.usefixtures("world_of_one")
def test_a_save_rides_a_check_and_is_sent_once() -> None:
    bus = EventBus(world_size=2)
    bus.control.agree = StopAgreement(bus.control, overlap=False)
    ctl = bus.control
    assert not bus.should_stop
    ctl.request_save("now")
    assert ctl.save_pending and not ctl.save_requested  # asked, not yet agreed
    assert not bus.should_stop  # this check carries it
    assert ctl.save_requested and not ctl.save_pending
    assert not bus.should_stop
    assert ctl.save_requested  # until the loop saved
    ctl.save_done()
    assert not bus.should_stop
    assert not ctl.save_requested  # the next check did not carry it again


@pytest.mark.usefixtures("world_of_one")
def test_overlap_sees_a_save_one_check_later() -> None:
    bus = EventBus(world_size=2)
    ctl = bus.control
    assert not bus.should_stop  # starts check 1
    ctl.request_save("now")
    assert not bus.should_stop  # reads check 1 (no save then), starts check 2 with it
    assert not ctl.save_requested
    assert not bus.should_stop  # reads check 2
    assert ctl.save_requested
    ctl.save_done()
    assert not bus.should_stop
    assert not bus.should_stop
    assert not ctl.save_requested


def test_a_save_before_init_process_group_is_this_ranks_own() -> None:
    bus = EventBus(world_size=2)
    bus.control.request_save("early")
    assert not bus.control.save_requested
    assert not bus.should_stop  # no collective possible: the local request is handed over
    assert bus.control.save_requested


# -- torchrun: two ranks, gloo, CPU ------------------------------------------------------------


def _events(path: Path) -> list[Event]:
    with path.open("rb") as f:
        return list(iter_lines(f))


def _header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        return dict(orjson.loads(f.readline()))


@pytest.mark.timeout(240)  # ~12 s on 2 idle cores; never hangs: subprocess timeout below
def test_torchrun_two_ranks_stop_together(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    nan_step, every = 20, 3
    proc = torchrun(
        ROOT / "examples" / "torchrun_ddp.py",
        "--quick",
        "--out",
        str(out),
        "--nan-rank",
        "1",
        "--nan-step",
        str(nan_step),
        "--stop-check-every",
        str(every),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    stops = {}
    for rank in (0, 1):
        path = out / f"events.rank{rank}.jsonl"
        assert path.exists(), f"rank {rank} wrote no JSONL"
        header = _header(path)
        assert (header["rank"], header["world_size"]) == (rank, 2)
        evs = _events(path)
        assert all(e.rank == rank for e in evs)
        assert [e.seq for e in evs] == list(range(len(evs)))  # complete: no gap, no loss
        assert isinstance(evs[0], RunStarted)
        assert isinstance(evs[-1], RunEnded)
        assert evs[-1].status == "stopped"
        stop = evs[-1].step
        assert stop is not None
        assert [e.step for e in evs if isinstance(e, Loss)] == list(range(1, stop + 1))
        stops[rank] = (stop, header["pid"], evs)

    # The divergence was on rank 1 only; both ranks stopped at the same step, at a check.
    assert stops[0][0] == stops[1][0]
    assert nan_step <= stops[0][0] < 60
    assert (stops[0][0] - 1) % every == 0
    why0 = [e for e in stops[0][2] if isinstance(e, StopRequested)]
    why1 = [e for e in stops[1][2] if isinstance(e, StopRequested)]
    assert [(e.source, e.reason) for e in why0] == [("rank 1", "stop requested on rank 1")]
    assert why1[0].source == "DivergenceDetector"
    assert f"rank 0: stopped at step {stops[0][0]}" in proc.stdout
    assert f"rank 1: stopped at step {stops[0][0]}" in proc.stdout

    # One TensorBoard directory, written by rank 0 alone.
    tb_files = sorted(out.rglob("events.out.tfevents.*"))
    assert len(tb_files) == 1, tb_files
    assert tb_files[0].parent == out / "tb"
    assert tb_files[0].name.split(".")[-2] == str(stops[0][1])  # ...<host>.<pid>.<n>

    # The per-rank logs read as one run.
    capsys.readouterr()
    assert cli(["summary", str(out / "events.rank0.jsonl"), str(out / "events.rank1.jsonl")]) == 0
    summary = capsys.readouterr().out
    assert "ranks 0, 1" in summary
    assert "stopped: stop requested on rank 1" in summary
