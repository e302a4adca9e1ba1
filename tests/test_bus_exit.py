"""Guarantees 2, 3 and 5: lossless subscribers lose nothing on every way out; fork is safe.

Each exit path runs in a subprocess with a deliberately slow lossless subscriber, so a
backlog exists at the moment the process is told to go: an exception or Ctrl-C in `with bus:`,
Ctrl-C during close (once, twice, twice with a stuck writer: then the loss is counted exactly),
SIGTERM (the default bus drains, chains the script's handler, keeps SIG_IGN), atexit (started
or never started), a bus started off the main thread, and a subscriber calling sys.exit().
The calls a forked child may make are in test_bus_fork.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
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
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
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
    expected = {
        "exception": 1,
        "keyboard_interrupt": None,
        "no_close_atexit": 0,
        "sigterm": 128 + signal.SIGTERM,
    }[name]
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
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=100, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"
    assert time.monotonic() - t0 < 100


# -- Ctrl-C, SIGTERM, atexit and a dying subscriber, with the real JsonlWriter -------------------
#
# Each script below runs the real `JsonlWriter` on a "slow disk" (batches of 100 events, 10 ms
# each), so a backlog exists when the signal arrives. Signals are sent by the writer itself when
# it reaches event TRIGGER, and only once the main thread is where the test needs it: blocked in
# `threading` inside `EventBus.close` (read from the main thread's live stack), or blocked in the
# training loop's wait after publishing everything. No sleep stands in for that ordering.

SIG_N = 12_000
TRIGGER = 6_000

SIGNAL_PRELUDE = textwrap.dedent(
    f"""
    import json, os, signal, sys, threading, time
    from eventbus import EventBus
    from eventbus.events import Loss
    from eventbus.sinks import JsonlWriter

    N, TRIGGER = {SIG_N}, {TRIGGER}
    PID = os.getpid()
    MAIN = threading.main_thread()
    BUS_PY = os.path.join("eventbus", "bus.py")

    def main_blocked(*, in_close, not_in=None, timeout=20.0):
        \"\"\"The main thread's innermost frame once it waits in `threading` (inside
        EventBus.close if `in_close`), and is not the frame `not_in`; None after `timeout`.\"\"\"
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            top = sys._current_frames().get(MAIN.ident)
            f, closing = top, False
            while f is not None:
                code = f.f_code
                if code.co_name == "close" and code.co_filename.endswith(BUS_PY):
                    closing = True
                f = f.f_back
            waiting = top is not None and top.f_code.co_filename == threading.__file__
            if waiting and top is not not_in and (closing or not in_close):
                return top
            time.sleep(0.001)  # polling a real condition, not standing in for one
        return None

    def publish_all(bus):
        for i in range(N):
            bus.publish(Loss(step=i, value=float(i)))

    class SlowDisk(JsonlWriter):
        \"\"\"The real JSONL writer on a slow disk: 100 events a batch, 10 ms a batch.\"\"\"

        max_batch = 100

        def on_events(self, batch):
            if batch[0].seq <= TRIGGER <= batch[-1].seq:
                at_trigger()
            super().on_events(batch)
            time.sleep(0.01)
    """
)

INTERRUPT_SCRIPT = SIGNAL_PRELUDE + textwrap.dedent(
    """
    out_dir, stats_path, MODE = sys.argv[1:4]
    interrupts = []  # SIGINTs the main thread has taken

    def on_sigint(signum, frame):  # Python's own handler, counting
        interrupts.append(signum)
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, on_sigint)
    first_wait = None

    def at_trigger():
        global first_wait
        first_wait = main_blocked(in_close=True)
        assert first_wait is not None, "main never waited inside close()"
        os.kill(PID, signal.SIGINT)  # Ctrl-C while close() drains
        if MODE == "twice_then_hang":
            second_ctrl_c()
            threading.Event().wait()  # stuck: this batch never reaches the disk

    def second_ctrl_c():
        \"\"\"Once the first Ctrl-C was taken and close() waits again.\"\"\"
        end = time.monotonic() + 20
        while len(interrupts) < 1 and time.monotonic() < end:
            time.sleep(0.001)
        if main_blocked(in_close=True, not_in=first_wait) is not None:
            os.kill(PID, signal.SIGINT)

    class Writer(SlowDisk):
        def on_close(self):
            if MODE == "twice_at_on_close":  # every line is written; closing is not finished
                second_ctrl_c()
                threading.Event().wait()  # ... and never will be: this on_close is stuck
            super().on_close()

    bus = EventBus(cost_every=None)
    bus.subscribe(Writer(out_dir))
    try:
        if MODE == "in_with":
            with bus:
                publish_all(bus)
                os.kill(PID, signal.SIGINT)  # Ctrl-C in the training loop ...
                threading.Event().wait(30)
            # ... and the writer sends a second one while __exit__'s close drains
        else:
            bus.start()
            publish_all(bus)
            bus.close()
    finally:
        with open(stats_path, "w") as f:
            json.dump({"stats": bus.stats().as_dict(), "interrupts": len(interrupts)}, f)
    """
)


def _read_jsonl(directory: Path) -> tuple[list[dict], list[dict]]:
    """(the Loss lines, the stats records) of `directory/events.jsonl`."""
    path = directory / "events.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return (
        [r for r in rows if r.get("type") == "Loss"],
        [r for r in rows if r.get("type") == "eventbus.stats"],
    )


def _run_script(
    tmp_path: Path, source: str, *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(source)
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Interrupted]:
    """Run INTERRUPT_SCRIPT in a mode (once per module: several tests read one run)."""
    runs: dict[str, Interrupted] = {}

    def run(mode: str) -> Interrupted:
        if mode not in runs:
            tmp = tmp_path_factory.mktemp(mode)
            out = tmp / "run"
            out.mkdir()
            result_path = tmp / "result.json"
            t0 = time.monotonic()
            proc = _run_script(tmp, INTERRUPT_SCRIPT, str(out), str(result_path), mode)
            wall = time.monotonic() - t0
            losses, records = _read_jsonl(out)
            assert result_path.exists(), proc.stderr[-3000:]
            result = json.loads(result_path.read_text())
            runs[mode] = Interrupted(
                proc, wall, losses, records, result["stats"], result["interrupts"]
            )
        return runs[mode]

    return run


@dataclass
class Interrupted:
    proc: subprocess.CompletedProcess[str]
    wall_s: float
    losses: list[dict]  # the Loss lines on disk
    records: list[dict]  # the writer's stats records on disk
    stats: dict  # bus.stats() when close() ended
    taken: int  # Ctrl-Cs the main thread took

    def ended_with_keyboard_interrupt(self) -> None:
        assert self.proc.returncode != 0, self.proc.stderr[-3000:]  # Python's own exit for it
        assert "KeyboardInterrupt" in self.proc.stderr, self.proc.stderr[-3000:]


@pytest.mark.timeout(90)
def test_ctrl_c_during_close_keeps_draining(interrupted: Callable[[str], Interrupted]) -> None:
    """Issue 14 item 2: a Ctrl-C while close() drains loses nothing lossless, and the
    process still ends with the KeyboardInterrupt."""
    r = interrupted("once")
    assert [x["seq"] for x in r.losses] == list(range(SIG_N)), r.proc.stderr[-3000:]
    assert len(r.records) == 1  # on_close ran: the stats record is there
    w = r.stats["subscribers"]["jsonl"]
    assert (w["delivered"], w["dropped"], w["state"]) == (SIG_N, 0, "closed"), w
    assert r.taken == 1
    r.ended_with_keyboard_interrupt()


@pytest.mark.timeout(90)
def test_ctrl_c_in_with_then_again_during_exit_close_loses_nothing(
    interrupted: Callable[[str], Interrupted],
) -> None:
    """A Ctrl-C in the body of `with bus:`, then a second one during the close __exit__ runs:
    the first Ctrl-C *during close* keeps draining, so nothing lossless is lost."""
    r = interrupted("in_with")
    assert [x["seq"] for x in r.losses] == list(range(SIG_N)), r.proc.stderr[-3000:]
    assert len(r.records) == 1
    w = r.stats["subscribers"]["jsonl"]
    assert (w["delivered"], w["dropped"], w["state"]) == (SIG_N, 0, "closed"), w
    assert r.taken == 2  # one in the body, one during close
    r.ended_with_keyboard_interrupt()


@pytest.mark.timeout(90)
def test_second_ctrl_c_after_the_drain_loses_nothing(
    interrupted: Callable[[str], Interrupted],
) -> None:
    """Two Ctrl-Cs during close, the second once every event is written (from an on_close
    that then sticks): all published events are on disk, the report agrees (lines + dropped ==
    published), and close() gave up on the stuck on_close at once (its timeout is 30 s)."""
    r = interrupted("twice_at_on_close")
    assert [x["seq"] for x in r.losses] == list(range(SIG_N)), r.proc.stderr[-3000:]
    assert r.stats["published"] == SIG_N
    assert len(r.losses) + r.stats["subscribers"]["jsonl"]["dropped"] == SIG_N, r.stats
    assert r.taken == 2
    assert r.wall_s < 20, "the second Ctrl-C did not give up"
    r.ended_with_keyboard_interrupt()


@pytest.mark.timeout(90)
def test_second_ctrl_c_gives_up_and_counts_exactly_what_is_lost(
    interrupted: Callable[[str], Interrupted],
) -> None:
    """Two Ctrl-Cs while the writer is stuck: close() gives up at once (well before its 30 s
    close_timeout), and what it reports lost is exact: lines on disk + dropped == published."""
    r = interrupted("twice_then_hang")
    assert r.wall_s < 20, "the second Ctrl-C did not give up"
    w = r.stats["subscribers"]["jsonl"]
    assert [x["seq"] for x in r.losses] == list(range(len(r.losses)))  # a prefix, no gap
    assert len(r.losses) < SIG_N  # the stuck batch and the rest were not written ...
    assert r.stats["published"] == SIG_N
    assert len(r.losses) + w["dropped"] == SIG_N, (len(r.losses), w)  # ... and are counted
    assert w["delivered"] == len(r.losses), w
    assert w["state"] == "hung", w
    assert "eventbus closed with losses" in r.proc.stderr, r.proc.stderr[-3000:]
    assert r.taken == 2
    r.ended_with_keyboard_interrupt()


@pytest.mark.timeout(90)
def test_second_ctrl_c_names_the_stuck_subscriber_in_hung(
    interrupted: Callable[[str], Interrupted],
) -> None:
    r = interrupted("twice_then_hang")
    assert r.stats["hung"] == ["jsonl"], r.stats


@pytest.mark.timeout(90)
def test_second_ctrl_c_during_a_stuck_on_close_names_it(
    interrupted: Callable[[str], Interrupted],
) -> None:
    r = interrupted("twice_at_on_close")
    assert r.stats["subscribers"]["jsonl"]["state"] == "hung", r.stats
    assert r.stats["hung"] == ["jsonl"], r.stats
    assert "eventbus closed with losses" in r.proc.stderr, r.proc.stderr[-3000:]


SIGTERM_SCRIPT = SIGNAL_PRELUDE + textwrap.dedent(
    """
    out_dir, report_path, MODE = sys.argv[1:4]
    published, stop, sent = threading.Event(), threading.Event(), threading.Event()
    report = {}

    def at_trigger():
        # SIGTERM (as torchrun / SLURM send) once main waits in its training loop
        end = time.monotonic() + 20
        while not published.is_set() and time.monotonic() < end:
            time.sleep(0.001)
        assert main_blocked(in_close=False) is not None
        os.kill(PID, signal.SIGTERM)
        sent.set()

    def lines_on_disk():
        with open(writer.path) as f:
            return sum(1 for x in f if json.loads(x).get("type") == "Loss")

    def my_handler(signum, frame):  # the script's own handler: stop training gracefully
        report["lines_when_my_handler_ran"] = lines_on_disk()
        stop.set()

    if MODE == "chained":
        signal.signal(signal.SIGTERM, my_handler)
    elif MODE.startswith("ignored"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    bus = EventBus(handle_signals=True) if MODE == "ignored_explicit" else EventBus()
    writer = SlowDisk(out_dir)
    bus.subscribe(writer)
    try:
        with bus:
            report["ignored_while_running"] = signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
            publish_all(bus)
            published.set()
            if MODE.startswith("ignored"):
                sent.wait(30)  # SIGTERM was sent and ignored: training goes on
            else:
                stop.wait(60)  # training goes on until told to stop
        after = signal.getsignal(signal.SIGTERM)
        report["ignored_after"] = after is signal.SIG_IGN
        report["mine_after"] = after is my_handler
    finally:
        with open(report_path, "w") as f:
            json.dump(report, f)
    """
)


def _sigterm(
    tmp_path: Path, mode: str
) -> tuple[subprocess.CompletedProcess[str], list[dict], list[dict], dict]:
    out = tmp_path / "run"
    out.mkdir()
    report = tmp_path / "report.json"
    proc = _run_script(tmp_path, SIGTERM_SCRIPT, str(out), str(report), mode)
    losses, records = _read_jsonl(out)
    assert [r["seq"] for r in losses] == list(range(SIG_N)), proc.stderr[-3000:]
    assert len(records) == 1, proc.stderr[-3000:]
    return proc, losses, records, json.loads(report.read_text()) if report.exists() else {}


@pytest.mark.timeout(90)
def test_sigterm_with_the_default_bus_drains_then_exits_143(tmp_path: Path) -> None:
    """Issue 14 item 13: `EventBus()` (handle_signals defaults to on) drains lossless
    subscribers on SIGTERM, then exits as SIGTERM's default would have it: 128 + 15."""
    proc, *_ = _sigterm(tmp_path, "default")
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]


@pytest.mark.timeout(90)
def test_sigterm_chains_the_handler_already_installed_after_the_drain(tmp_path: Path) -> None:
    proc, _, _, report = _sigterm(tmp_path, "chained")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["lines_when_my_handler_ran"] == SIG_N  # it ran, and after the drain
    assert report["mine_after"]  # and it is the process's handler again


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["ignored", "ignored_explicit"])
def test_sigterm_ignored_by_the_process_stays_ignored(tmp_path: Path, mode: str) -> None:
    """SIG_IGN set before the bus starts is kept (with `handle_signals` default or True): the
    SIGTERM sent mid-run neither stops the process nor closes the bus early."""
    proc, _, _, report = _sigterm(tmp_path, mode)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report == {"ignored_while_running": True, "ignored_after": True, "mine_after": False}, (
        report
    )


OFF_MAIN_SCRIPT = textwrap.dedent(
    f"""
    import json, signal, sys, threading
    from eventbus import EventBus
    from eventbus.events import Loss
    from eventbus.sinks import JsonlWriter

    bus = EventBus(cost_every=None)  # exactly these events, seq after seq
    bus.subscribe(JsonlWriter(sys.argv[1]))
    seen = []

    def train():  # the bus starts (and is published to) off the main thread
        bus.start()
        seen.append(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
        for i in range({SIG_N}):
            bus.publish(Loss(step=i, value=float(i)))

    t = threading.Thread(target=train)
    t.start()
    t.join()
    assert seen == [True], seen
    print("ok", flush=True)
    # no close(): the atexit drain (on the main thread) delivers everything
    """
)


@pytest.mark.timeout(90)
def test_bus_started_off_the_main_thread_installs_nothing_and_still_drains(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    proc = _run_script(tmp_path, OFF_MAIN_SCRIPT, str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"
    assert proc.stderr == ""  # no crash, no warning: nothing was asked of it
    losses, records = _read_jsonl(out)
    assert [r["seq"] for r in losses] == list(range(SIG_N))
    assert len(records) == 1


NEVER_STARTED_SCRIPT = textwrap.dedent(
    f"""
    import sys
    from eventbus import EventBus
    from eventbus.events import Loss
    from eventbus.sinks import JsonlWriter

    bus = EventBus()
    bus.subscribe(JsonlWriter(sys.argv[1]))
    for i in range({SIG_N}):
        bus.publish(Loss(step=i, value=float(i)))
    if sys.argv[2] == "crash":
        raise RuntimeError("training crashed before anyone started the bus")
    # never started, never closed: the atexit hook registered at subscribe delivers them
    """
)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["clean", "crash"])
def test_never_started_bus_delivers_at_exit(tmp_path: Path, how: str) -> None:
    """Guarantee 2: events published to a bus that was never started are not lost silently."""
    out = tmp_path / "run"
    out.mkdir()
    proc = _run_script(tmp_path, NEVER_STARTED_SCRIPT, str(out), how)
    assert proc.returncode == (0 if how == "clean" else 1), proc.stderr[-3000:]
    losses, records = _read_jsonl(out)
    assert [r["seq"] for r in losses] == list(range(SIG_N)), proc.stderr[-3000:]
    assert len(records) == 1


CULPRIT_N = 100_000
CULPRIT_SCRIPT = textwrap.dedent(
    f"""
    import json, sys
    from eventbus import EventBus
    from eventbus.events import Loss
    from eventbus.sinks import JsonlWriter

    def culprit(ev):
        sys.exit()  # a plain function subscriber that raises SystemExit on every event

    bus = EventBus(inbox_maxsize=256, cost_every=None)
    bus.subscribe(JsonlWriter(sys.argv[1]))
    bus.subscribe(culprit)
    with bus:
        for i in range({CULPRIT_N}):
            bus.publish(Loss(step=i, value=float(i)))
        alive = bus.running
    st = bus.stats()
    print(json.dumps({{"alive": alive, "stats": st.as_dict()}}))
    """
)


@pytest.mark.timeout(120)
def test_sys_exit_in_a_subscriber_kills_neither_the_bus_nor_the_writer(tmp_path: Path) -> None:
    """Issue 14 item 1, end to end: a subscriber calling sys.exit() on every event, a lossless
    JsonlWriter beside it and 100,000 events through a 256-event inbox. The run finishes (the
    old bus thread died and publish then spun forever), the JSONL has every line and its stats
    record, and the culprit's failures are counted."""
    out = tmp_path / "run"
    out.mkdir()
    proc = _run_script(tmp_path, CULPRIT_SCRIPT, str(out), timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    st = result["stats"]
    assert result["alive"] and st["error"] is None, st["error"]  # the bus thread lived on
    losses, records = _read_jsonl(out)
    assert len(losses) == CULPRIT_N
    assert sorted(r["seq"] for r in losses) == list(range(CULPRIT_N))
    assert len(records) == 1
    w = st["subscribers"]["jsonl"]
    assert (w["delivered"], w["dropped"], w["failed"]) == (CULPRIT_N, 0, 0)
    c = st["subscribers"]["culprit"]
    assert c["failed"] >= 1 and "SystemExit" in (c["error"] or ""), c
    assert c["delivered"] == 0
    assert c["failed"] + c["dropped"] == CULPRIT_N, c  # every event it was sent is accounted for


def test_ctrl_c_while_the_bus_starts_closes_what_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C landing as `start()` returned from starting the thread left it running with
    the bus still "new": its subscribers were never closed (files never finished)."""
    from eventbus import EventBus
    from eventbus.core.loop import BusLoop
    from eventbus.events import Loss

    started = BusLoop.start

    def start_then_ctrl_c(self: BusLoop, timeout: float = 30.0) -> None:
        started(self, timeout)
        raise KeyboardInterrupt

    closed: list[int] = []

    class Sink:
        def on_events(self, batch: list[Loss]) -> None:
            pass

        def on_close(self) -> None:
            closed.append(1)

    bus = EventBus()
    bus.subscribe(Sink())
    monkeypatch.setattr(BusLoop, "start", start_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        bus.start()
    assert closed == [1]
    assert bus.thread is not None and not bus.thread.is_alive()
    assert not bus.running
    with pytest.raises(RuntimeError, match="closed"):
        bus.start()
