"""What the tests that start processes share: a free loopback port, and a torchrun launch of
a script on N CPU ranks (gloo) with the repository importable and no user config."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(
    script: Path, *args: str, cwd: Path, nproc: int = 2, timeout: float = 200
) -> subprocess.CompletedProcess[str]:
    """`python -m torch.distributed.run --nproc_per_node=N script args...`, one torch thread a
    rank, EVENTBUS_SUBSCRIBERS / EVENTBUS_CONFIG unset; output captured."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{free_port()}",
        str(script),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("EVENTBUS_SUBSCRIBERS", None)
    env.pop("EVENTBUS_CONFIG", None)
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd, check=False
    )
