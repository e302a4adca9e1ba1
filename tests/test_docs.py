"""Every Python code block in README.md and docs/*.md runs as written (issue 15 item 8).

Each ```python block is a program of its own: it runs in a fresh interpreter, in an empty
directory, and must exit 0 with nothing on stderr but the library's own log lines. A block
that shows what not to do, or a shape to fill in, is not tagged `python`.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks() -> list[tuple[str, str]]:
    out = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for m in _BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append((f"{doc.relative_to(ROOT)}:{line}", m.group(1)))
    return out


BLOCKS = _blocks()


def test_there_are_blocks_to_run() -> None:
    assert len(BLOCKS) >= 10


_PORT = re.compile(r"port=(\d+)")
_LOCKS: dict[str, threading.Lock] = {}


def _run(code: str, where: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The block as a program of its own in `cwd`; blocks naming one port take turns."""
    script = cwd / "block.py"
    script.write_text(code)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "WANDB_MODE": "offline",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    with contextlib.ExitStack() as turns:
        for port in sorted(set(_PORT.findall(code))):
            turns.enter_context(_LOCKS.setdefault(port, threading.Lock()))
        return subprocess.run(
            [sys.executable, str(script)],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=280,
            check=False,
        )


@pytest.fixture(scope="module")
def started(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[subprocess.CompletedProcess[str]]]]:
    """Every selected block, started two at a time as soon as the first is asked for (the
    suite runs one test at a time: the second core would sit idle); each test waits for
    its own block's result."""
    wanted = {
        item.callspec.params["where"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_the_block_runs_as_written"
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {
            where: pool.submit(_run, code, where, tmp_path_factory.mktemp("block"))
            for where, code in BLOCKS
            if where in wanted
        }


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("where", "code"), BLOCKS, ids=[w for w, _ in BLOCKS])
def test_the_block_runs_as_written(
    where: str, code: str, started: dict[str, Future[subprocess.CompletedProcess[str]]]
) -> None:
    proc = started[where].result(timeout=590)
    assert proc.returncode == 0, f"{where} failed:\n{proc.stderr[-3000:]}"
    # The library's log lines (one line each, `event=...`) may carry a subscriber's traceback
    # by design; anything else with one is an exception the block did not expect.
    others = "\n".join(x for x in proc.stderr.splitlines() if not x.startswith("event="))
    assert "Traceback" not in others, f"{where}:\n{proc.stderr[-3000:]}"
