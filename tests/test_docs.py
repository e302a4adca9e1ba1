"""Every Python code block in README.md and docs/*.md runs as written (issue 15 item 8).

Each ```python block is a program of its own: it runs in a fresh interpreter, in an empty
directory, and must exit 0 with nothing on stderr but the library's own log lines. A block
that shows what not to do, or a shape to fill in, is not tagged `python`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
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


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("where", "code"), BLOCKS, ids=[w for w, _ in BLOCKS])
def test_the_block_runs_as_written(where: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "WANDB_MODE": "offline",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, f"{where} failed:\n{proc.stderr[-3000:]}"
    # The library's log lines (one line each, `event=...`) may carry a subscriber's traceback
    # by design; anything else with one is an exception the block did not expect.
    others = "\n".join(x for x in proc.stderr.splitlines() if not x.startswith("event="))
    assert "Traceback" not in others, f"{where}:\n{proc.stderr[-3000:]}"
