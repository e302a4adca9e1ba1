"""The watchdog on a 2-rank gloo job (torchrun, CPU): a rank held back from a collective stalls
every rank that waits for it (issue 23). Resumed, both ranks report the stall and its length;
with `action="abort"`, the rank stuck inside the C++ collective (where no signal handler runs)
exits 70 with its stacks and every event on disk, written by its sidecar."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from eventbus.events import Loss, StallDetected, StallEnded, StopRequested
from eventbus.logformat import read_log
from tests.core.helpers import until
from tests.torchrun import torchrun

JOB = Path(__file__).with_name("gloo_stall.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _torchrun(mode: str, out: Path) -> subprocess.CompletedProcess[str]:
    return torchrun(JOB, mode, str(out), cwd=out, timeout=150)


def _stacks(out: Path, rank: int) -> str:
    (path,) = out.glob(f"stall-rank{rank}-*.txt")
    return path.read_text()


def test_both_ranks_report_the_stall_and_its_length(tmp_path: Path) -> None:
    proc = _torchrun("resume", tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank, frame in ((0, "all_reduce"), (1, "hold_back")):
        evs = list(read_log(tmp_path / f"events.rank{rank}.jsonl"))
        (stall,) = [e for e in evs if isinstance(e, StallDetected) and e.step == 4]
        (ended,) = [e for e in evs if isinstance(e, StallEnded) and e.step == 5]
        assert stall.step == 4 and stall.bound_s == 1.0 and stall.waited_s >= 1.0
        assert frame in stall.stacks and frame in _stacks(tmp_path, rank)  # where it waits
        assert ended.step == 5 and ended.stalled_s >= 1.0
        assert [e.step for e in evs if isinstance(e, Loss)] == list(range(6))


def test_abort_ends_a_rank_stuck_in_the_collective_with_its_events_on_disk(
    tmp_path: Path,
) -> None:
    proc = _torchrun("abort", tmp_path)
    assert proc.returncode != 0
    assert "status 70" in proc.stderr  # SIGTERM could not run there: the last resort
    assert "all_reduce" in _stacks(tmp_path, 0)
    log = tmp_path / "events.rank0.jsonl"
    # Rank 0's sidecar writes what it received after its parent is gone, then closes the
    # file with its stats record: wait for that (torchrun does not wait for the sidecar).
    assert until(lambda: b'"type":"eventbus.stats"' in log.read_bytes(), timeout=60)
    evs = list(read_log(log))
    assert [e.step for e in evs if isinstance(e, Loss)] == list(range(5))  # all it published
    assert [type(e) for e in evs[-2:]] == [StallDetected, StopRequested]
    assert isinstance(evs[-1], StopRequested) and evs[-1].abort
