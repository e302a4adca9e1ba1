"""One torchrun launch shared by the cross-rank monitors' tests (see ranks_job.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.torchrun import torchrun

JOB = Path(__file__).with_name("ranks_job.py")


def launch(out: Path, ranks: int, only: str) -> subprocess.CompletedProcess[str]:
    """`ranks_job.py` under torchrun on CPU; the runs named in `only` write under `out`."""
    done = torchrun(JOB, str(out), "--only", only, cwd=out, nproc=ranks, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every run of ranks_job.py on 2 ranks (about 15 s on 2 idle cores): its output folder."""
    out = tmp_path_factory.mktemp("ranks2")
    launch(out, 2, "clean,stalled,slow,slow_allreduce")
    return out
