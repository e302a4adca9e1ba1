"""One torchrun launch shared by the cross-rank monitors' tests (see ranks_job.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("ranks_job.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(out: Path, ranks: int, only: str) -> subprocess.CompletedProcess[str]:
    """`ranks_job.py` under torchrun on CPU; the runs named in `only` write under `out`."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={ranks}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{_free_port()}",
        str(JOB),
        str(out),
        "--only",
        only,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("EVENTBUS_SUBSCRIBERS", None)
    env.pop("EVENTBUS_CONFIG", None)
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env=env, cwd=out, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every run of ranks_job.py on 2 ranks (about 15 s on 2 idle cores): its output folder."""
    out = tmp_path_factory.mktemp("ranks2")
    launch(out, 2, "clean,stalled,slow,slow_allreduce")
    return out
