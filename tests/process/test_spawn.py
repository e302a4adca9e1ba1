"""Launching and ending the child; the parent's `__main__`, imported only when needed."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from eventbus.process import spawn
from tests.process.subs import Tally, gone

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("protocol", [0, pickle.HIGHEST_PROTOCOL])
def test_only_a_pickle_naming_main_makes_the_child_import_the_script(
    protocol: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not spawn.refers_to_main(pickle.dumps(Tally("x"), protocol=protocol))
    assert spawn.main_to_import(pickle.dumps(Tally("x"), protocol=protocol)) is None
    in_main = type("InMainXyz", (), {"__module__": "__main__"})
    monkeypatch.setattr(sys.modules["__main__"], "InMainXyz", in_main, raising=False)
    assert spawn.refers_to_main(pickle.dumps(in_main(), protocol=protocol))


SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from eventbus import Event, EventBus
from eventbus.events import Loss, Scalars

class InScript:
    policy = "block"
    def __init__(self):
        self.bus = None
    def on_start(self, bus):
        self.bus = bus
    async def on_events(self, batch):
        for ev in batch:
            self.bus.publish(Scalars(step=ev.step, values={{"echo": 1.0}}))

def main():
    bus = EventBus()
    seen = []
    bus.subscribe(lambda ev: seen.append(ev.step), events=[Scalars], policy="block")
    h = bus.subscribe(InScript(), events=[Loss], placement="process")
    with bus:
        for i in range(5):
            bus.publish(Loss(step=i, value=1.0))
        bus.flush(30)
    st = h.stats()
    print("delivered", st.delivered, "echoed", len(seen), st.state)
    print("error", st.error)

{call}
"""


@pytest.mark.parametrize("guarded", [True, False])
def test_subscriber_defined_in_the_script(tmp_path: Path, guarded: bool) -> None:
    call = 'if __name__ == "__main__":\n    main()' if guarded else "main()"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(root=str(ROOT), call=call))
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=90, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if guarded:  # imported as __mp_main__ in the child: its class unpickles, main() does not run
        assert "delivered 5 echoed 5 closed" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    else:  # the child would run the training again: it refuses, and says what to do
        assert "delivered 0" in proc.stdout, proc.stdout + proc.stderr[-2000:]
        assert 'guard the script\'s training code with `if __name__ == "__main__":`' in proc.stdout


KILLED_SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
from eventbus import EventBus
from eventbus.events import Loss
from eventbus.sinks import JsonlWriter
if __name__ == "__main__":
    bus = EventBus()
    bus.subscribe(JsonlWriter({out!r}))  # in the sidecar, as by default
    with bus:
        bus.flush(60)  # the sidecar is up
        print(bus.stats().sidecar.pid, flush=True)
        for i in range(10**9):
            bus.publish(Loss(step=i, value=float(i)))
            if i % 100 == 0:
                print(i, flush=True)  # the publisher's own count
            time.sleep(0.0002)
"""


def test_a_sigkilled_publisher_loses_at_most_its_last_drain_interval(tmp_path: Path) -> None:
    """Guarantee 8: the sidecar writes everything it received, closes its files and exits."""
    script = tmp_path / "train.py"
    out = tmp_path / "log"
    script.write_text(KILLED_SCRIPT.format(root=str(ROOT), out=str(out)))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        sidecar = int(parent.stdout.readline())
        counts = []
        while len(counts) < 30:  # at least 3,000 events published
            counts.append(int(parent.stdout.readline()))
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        counts += [int(x) for x in parent.stdout.read().split()]
        assert gone(sidecar, 30), "the sidecar outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(5)
    lines = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    steps = [x["step"] for x in lines if x["type"] == "Loss"]
    assert steps == list(range(len(steps)))  # no gap, no torn line: closed properly
    assert lines[-1]["type"] == "eventbus.stats"  # the writer's closing record
    published = counts[-1]  # at least this many were published before the kill
    # Lost: what the parent held in its last drain interval (20 ms, ~0.2 ms a publish).
    assert published - 1000 <= len(steps), (published, len(steps))


def test_kill_ends_a_child_that_ignores_sigterm() -> None:
    popen = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time; signal.signal(signal.SIGTERM, "
            "signal.SIG_IGN); print(1, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    child = spawn.Child(popen)
    assert popen.stdout is not None
    popen.stdout.readline()  # SIGTERM is ignored from here on
    spawn.kill(child)
    assert not child.is_alive()
    assert child.exitcode == -signal.SIGKILL
    assert "killed by signal 9" in child.why_dead("x", "no reply")


ORPHAN_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from eventbus import EventBus
from tests.process.subs import BigBlob, Gate
if __name__ == "__main__":
    mib = 1 << 20
    bus = EventBus(close_timeout=2, hang_timeout=None, queue_max_bytes=4 * mib)
    bus.subscribe(Gate({gate!r}), placement="process", maxsize=1)  # hangs, lossless
    bus.start()
    bus.flush(60)
    print(bus.stats().sidecar.pid, flush=True)
    for i in range(12):  # its queue, then the sidecar's inbox fill: its reading waits for room
        bus.publish(BigBlob(step=i, data="x" * mib))
    import time
    seen, since = None, time.monotonic()
    while time.monotonic() - since < 1.0:  # a second with nothing taken in: it waits for room
        side = bus.stats().sidecar
        now = (side.sent_events, side.in_flight_bytes)
        if now != seen or not side.in_flight_bytes:
            seen, since = now, time.monotonic()
        time.sleep(0.05)
    print("blocked", flush=True)
    time.sleep(600)
"""


def test_a_sidecar_whose_reading_a_hung_subscriber_holds_does_not_outlive_its_parent(
    tmp_path: Path,
) -> None:
    """With no hang timeout, a hung lossless sidecar subscriber holds the sidecar's reading
    (as it holds our bus); once the parent is gone the sidecar closes anyway, within its
    close deadline, and exits: it stayed for as long as the subscriber hung (for ever)."""
    script = tmp_path / "train.py"
    script.write_text(ORPHAN_SCRIPT.format(root=str(ROOT), gate=str(tmp_path / "never")))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    sidecar = None
    try:
        assert parent.stdout is not None
        sidecar = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "blocked"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        assert gone(sidecar, 30), "the sidecar outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(5)
        (tmp_path / "never").write_text("")  # let it go, whatever happened


CLOSED_STD_SCRIPT = """
import os, sys
os.close(0)  # started with its standard input and output closed (a daemon, `<&- >&-`)
os.close(1)
sys.path.insert(0, {root!r})
from eventbus import EventBus
from eventbus.events import Loss
from tests.process.subs import Printer

bus = EventBus(drain_interval=0.002, close_timeout=10)
h = bus.subscribe(Printer(), placement="process")
with bus:
    for i in range(200):
        bus.publish(Loss(step=i, value=1.0))
    flushed = bus.flush(timeout=10)
st = h.stats()
sys.stderr.write(f"RESULT {{flushed}} {{st.delivered}} {{st.state}}\\n")
"""


def test_the_channel_is_no_standard_stream_when_those_are_closed(tmp_path: Path) -> None:
    """With stdin and stdout closed the socket pair would get their numbers: what the sidecar
    prints, or the training process reads from stdin, would be taken for its messages."""
    script = tmp_path / "train.py"
    script.write_text(CLOSED_STD_SCRIPT.format(root=str(ROOT)))
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False
    )
    result = [x for x in proc.stderr.splitlines() if x.startswith("RESULT")]
    assert result == ["RESULT True 200 closed"], proc.stderr[-3000:]
