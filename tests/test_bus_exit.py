"""Guarantee 2 and 5: lossless subscribers lose nothing on every way out; fork is safe.

Each exit path runs in a subprocess with a deliberately slow lossless subscriber, so a
backlog exists at the moment the process is told to go.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

N = 400

PRELUDE = textwrap.dedent(
    f"""
    import os, sys, time
    from eventbus import EventBus
    from eventbus.events import Loss

    out = open(sys.argv[1], "a", buffering=1)

    def slow_writer(ev):
        time.sleep(0.002)  # ~0.8 s of backlog for {N} events
        out.write(f"{{ev.step}}\\n")

    def publish_all(bus):
        for i in range({N}):
            bus.publish(Loss(step=i, value=float(i)))
    """
)

SCRIPTS = {
    "exception": """
        bus = EventBus()
        bus.subscribe(slow_writer, policy="block")
        with bus:
            publish_all(bus)
            raise ValueError("training crashed")
    """,
    "keyboard_interrupt": """
        bus = EventBus()
        bus.subscribe(slow_writer, policy="block")
        with bus:
            publish_all(bus)
            raise KeyboardInterrupt
    """,
    "no_close_atexit": """
        bus = EventBus()
        bus.subscribe(slow_writer, policy="block")
        bus.start()
        publish_all(bus)
        # no close(): the atexit drain must deliver everything
    """,
    "sigterm": """
        bus = EventBus(handle_signals=True)
        bus.subscribe(slow_writer, policy="block")
        with bus:
            publish_all(bus)
            print("ready", flush=True)
            time.sleep(30)
    """,
}


def _run(tmp_path: Path, name: str) -> tuple[int, list[int], str]:
    script = tmp_path / f"{name}.py"
    script.write_text(PRELUDE + textwrap.dedent(SCRIPTS[name]))
    out = tmp_path / f"{name}.txt"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    if name == "sigterm":
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    steps = [int(x) for x in out.read_text().split()] if out.exists() else []
    return proc.returncode, steps, err


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_lossless_subscriber_loses_nothing_on_exit(tmp_path: Path, name: str) -> None:
    code, steps, err = _run(tmp_path, name)
    assert steps == list(range(N)), err[-2000:]
    expected = {"exception": 1, "keyboard_interrupt": None,
                "no_close_atexit": 0, "sigterm": 128 + signal.SIGTERM}[name]
    if expected is not None:
        assert code == expected, err[-2000:]
    else:
        assert code != 0  # KeyboardInterrupt: Python's own exit status


FORK_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from torch.utils.data import DataLoader, Dataset
    from eventbus import EventBus
    from eventbus.events import Scalars, Loss

    bus = EventBus()
    seen = []
    bus.subscribe(lambda ev: seen.append(ev), policy="block")

    class Publishing(Dataset):
        def __len__(self):
            return 64
        def __getitem__(self, i):
            bus.publish(Scalars(step=i, values={"item": float(i)}))  # in a forked worker
            return torch.tensor([float(i)])

    with bus:
        loader = DataLoader(Publishing(), batch_size=8, num_workers=2,
                            multiprocessing_context="fork")
        total = 0.0
        for step, batch in enumerate(loader):
            total += float(batch.sum())
            bus.publish(Loss(step=step, value=float(batch.mean())))
    st = bus.stats()
    assert total == sum(range(64)), total
    assert [type(e).__name__ for e in seen] == ["Loss"] * 8, seen
    assert st.published == 8 and st.rejected == 0, st
    print("ok")
    """
)


@pytest.mark.timeout(120)
def test_fork_workers_publishing_neither_hang_nor_touch_the_parent(tmp_path: Path) -> None:
    script = tmp_path / "fork.py"
    script.write_text(FORK_SCRIPT)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=100, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"
    assert time.monotonic() - t0 < 100
