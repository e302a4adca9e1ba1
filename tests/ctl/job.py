"""A real training loop in a subprocess (one rank, or two under torchrun), steered from the test.

The loop trains a tiny model, publishes Loss and StepEnded each step to a JSONL writer and a
`ControlServer`, checks `bus.should_stop`, and saves when `bus.control.save_requested`. At the
steps in HOLD it waits (polling, with a deadline) for the file `go-STEP` in the run directory,
so the test can act while the loop stands still at a known step, between its publish and its
next check.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from eventbus.codec import iter_lines
from eventbus.ctl import CtlError, request
from eventbus.events import Event

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")

SCRIPT = """
import os, sys, time
from pathlib import Path

import torch

from eventbus import EventBus
from eventbus.ctl import ControlServer
from eventbus.events import CheckpointSaved, Loss, RunStarted, StepEnded
from eventbus.sinks import JsonlWriter

run_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
holds = {int(s) for s in sys.argv[3].split(",") if s}
tcp = sys.argv[4] or None
torch.set_num_threads(1)
world = int(os.environ.get("WORLD_SIZE", "1"))
model = torch.nn.Linear(8, 1)
if world > 1:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(model)
rank = int(os.environ.get("RANK", "0"))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
bus = EventBus(drain_interval=0.01)
bus.subscribe(JsonlWriter(run_dir / "logs"), placement="thread")  # on disk at close
bus.subscribe(ControlServer(run_dir, tcp=tcp, request_timeout=1.0))
with bus:
    bus.publish(RunStarted(total_steps=steps, world_size=world))
    for step in range(1, steps + 1):
        loss = model(torch.randn(16, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        bus.publish(Loss(step=step, value=loss.detach()))
        bus.publish(StepEnded(step=step))
        if step in holds:
            deadline = time.monotonic() + 60
            while not (run_dir / f"go-{step}").exists():
                if time.monotonic() > deadline:
                    sys.exit(f"held at step {step} for 60 s")
                time.sleep(0.005)
        if bus.should_stop:
            break
        if bus.control.save_requested:
            path = run_dir / f"ckpt-rank{rank}-step{step}.pt"
            torch.save(model.state_dict(), path)
            bus.publish(CheckpointSaved(step=step, path=str(path)))
            bus.control.save_done()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Job:
    """The running script: its process, run directory and output file."""

    proc: subprocess.Popen[bytes]
    run_dir: Path
    output: Path

    def tail(self) -> str:
        """The end of what it printed."""
        return self.output.read_text(errors="replace")[-4000:]

    def wait_for(self, what: str, fn: Callable[[], T | None], t: float = 60) -> T:
        """Poll `fn` until it returns something other than None; fail if the job exits first."""
        deadline = time.monotonic() + t
        while True:
            got = fn()
            if got is not None:
                return got
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the job exited ({self.proc.returncode}) before {what}:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n{self.tail()}")
            time.sleep(0.01)

    def ask(self, command: str, **kw: Any) -> dict[str, Any] | None:
        """The reply, or None while the job cannot answer (yet)."""
        try:
            return request(self.run_dir, command, **kw)
        except CtlError:
            return None

    def wait_step(self, step: int) -> dict[str, Any]:
        """The status once the job reports `step` (where the script holds)."""

        def at() -> dict[str, Any] | None:
            r = self.ask("status")
            if r is not None and r["step"] is not None:
                assert r["step"] <= step, r  # held there: never beyond
            return r if r is not None and r["step"] == step else None

        return self.wait_for(f"step {step}", at)

    def go(self, step: int) -> None:
        """Let the loop held at `step` go on."""
        (self.run_dir / f"go-{step}").touch()

    def finish(self, timeout: float = 60) -> None:
        """Wait for a clean exit."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job did not end in {timeout} s:\n{self.tail()}") from None
        assert code == 0, self.tail()

    def events(self, rank: int | None = None) -> list[Event]:
        """The events the run wrote (one rank's, with several)."""
        name = "events.jsonl" if rank is None else f"events.rank{rank}.jsonl"
        with (self.run_dir / "logs" / name).open("rb") as f:
            return list(iter_lines(f))


@contextmanager
def job(
    run_dir: Path, steps: int, holds: str = "", *, tcp: str = "", ranks: int = 1
) -> Iterator[Job]:
    """The script running (under torchrun when `ranks` > 1); killed, with its children, after."""
    run_dir.mkdir(parents=True, exist_ok=True)
    script = run_dir / "train.py"
    script.write_text(SCRIPT)
    args = [str(script), str(run_dir), str(steps), holds, tcp]
    if ranks > 1:
        args = [
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={ranks}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{free_port()}",
            *args,
        ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("EVENTBUS_SUBSCRIBERS", None)
    env.pop("EVENTBUS_CONFIG", None)
    output = run_dir / "output.txt"
    with output.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=run_dir,
            start_new_session=True,  # its own process group: torchrun's workers die with it
        )
    try:
        yield Job(proc, run_dir, output)
    finally:
        with suppress(ProcessLookupError):  # whatever is left of it: workers, sidecars
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
