"""Every script in examples/ runs as written, in quick mode (issue: examples a user copies)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALL = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
# torchrun_ddp.py needs a launcher: tests/test_dist.py runs it under torchrun with 2 ranks.
EXAMPLES = [p for p in ALL if p.name != "torchrun_ddp.py"]
# What frameworks print on their own: start-up banners and tips for their other products.
ADVERTS = ("💡", "Tip:", "GPU available:", "TPU available:", "litlogger", "litmodels")
# The last words of a run that went to its end (quick mode): no "stopped at" for those.
COMPLETED = {  # what a script prints only when it did its job
    "hf_trainer.py": "completed 30 steps",
    "lightning_trainer.py": "completed 40 steps",
    "eval_on_checkpoint.py": "checkpoint at step 40: eval_loss",  # the last job's result came back
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs_in_quick_mode(script: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, str(script), "--quick"]
    if "--out" in script.read_text():
        cmd += ["--out", str(tmp_path / "out")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    proc = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=280, env=env, check=False
    )
    tail = f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"{script.name} failed:\n{tail}"
    out = (proc.stdout + proc.stderr).splitlines()
    noise = [line for line in out if any(a in line for a in ADVERTS)]
    assert not noise, f"{script.name} printed what the frameworks advertise:\n" + "\n".join(noise)
    if script.name in COMPLETED:
        assert COMPLETED[script.name] in proc.stdout and "stopped at" not in proc.stdout, tail


def test_every_example_has_a_quick_mode() -> None:
    for script in ALL:
        assert "--quick" in script.read_text(), f"{script.name} needs a --quick flag for tests"
