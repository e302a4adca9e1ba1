"""HangWatchdog: a loop blocked in a wait or a sleep is reported with its stack, the resumed
step reports the stall's length, and a pause published as such is not a stall."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from eventbus import Event, EventBus
from eventbus.events import Loss, RunEnded, RunStarted, StallDetected, StallEnded, StepEnded
from eventbus.monitors import HangWatchdog

ROOT = Path(__file__).resolve().parents[2]
FLOOR = 0.3  # seconds without a step that make a stall here


class Seen:
    """Keeps StallDetected / StallEnded and signals each arrival."""

    events = (StallDetected, StallEnded)
    policy = "block"

    def __init__(self) -> None:
        self.got: list[Event] = []
        self.detected = threading.Event()
        self.ended = threading.Event()

    async def on_events(self, batch: list[Event]) -> None:
        for ev in batch:
            self.got.append(ev)
            (self.detected if isinstance(ev, StallDetected) else self.ended).set()


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[tuple[EventBus, HangWatchdog, Seen]]:
    bus = EventBus(drain_interval=0.005)
    dog = HangWatchdog(floor_s=FLOOR, ceiling_s=30.0, factor=5.0, dir=tmp_path, check_s=0.02)
    seen = Seen()
    bus.subscribe(dog)
    bus.subscribe(seen)
    with bus:
        yield bus, dog, seen


def _steps(bus: EventBus, first: int, n: int) -> None:
    for i in range(first, first + n):
        with bus.step(i):
            pass


def blocked_in_a_wait(release: threading.Event) -> None:
    release.wait(30)


def blocked_in_a_sleep(release: threading.Event) -> None:
    time.sleep(3 * FLOOR)  # what is being detected: a loop stuck in a sleep


@pytest.mark.parametrize("block", [blocked_in_a_wait, blocked_in_a_sleep])
def test_a_stuck_loop_is_reported_with_its_frame_and_the_resumed_step_says_how_long(
    watched: tuple[EventBus, HangWatchdog, Seen], block: Callable[[threading.Event], None]
) -> None:
    bus, dog, seen = watched
    release = threading.Event()

    def train() -> None:
        _steps(bus, 0, 20)
        block(release)
        _steps(bus, 20, 1)
        bus.publish(RunEnded(status="completed"))  # nothing after this is a stall

    t = threading.Thread(target=train, name="trainer")
    t.start()
    try:
        assert seen.detected.wait(20), "no StallDetected"
        release.set()
        assert seen.ended.wait(20), "no StallEnded"
    finally:
        release.set()
        t.join(30)
    stall = next(ev for ev in seen.got if isinstance(ev, StallDetected))
    assert stall.step == 19
    assert stall.bound_s == FLOOR  # 5 x a step of microseconds: the floor
    assert stall.waited_s >= FLOOR
    assert f"in {block.__name__}" in stall.stacks and 'Thread "trainer"' in stall.stacks
    assert stall.path is not None and block.__name__ in Path(stall.path).read_text()
    ended = next(ev for ev in seen.got if isinstance(ev, StallEnded))
    assert ended.step == 20 and ended.stalled_s >= stall.waited_s
    assert [type(ev) for ev in seen.got] == [StallDetected, StallEnded]
    assert dog.stalls == 1


def test_a_pause_is_not_a_stall(watched: tuple[EventBus, HangWatchdog, Seen]) -> None:
    bus, dog, seen = watched
    _steps(bus, 0, 10)
    with dog.pause("checkpoint"):
        time.sleep(3 * FLOOR)  # the save being simulated: longer than the bound on purpose
    _steps(bus, 10, 5)
    assert bus.flush(timeout=10)
    assert seen.got == [] and dog.stalls == 0


def test_after_run_ended_nothing_is_a_stall(watched: tuple[EventBus, HangWatchdog, Seen]) -> None:
    bus, dog, seen = watched
    _steps(bus, 0, 5)
    bus.publish(RunEnded(status="completed"))
    assert bus.flush(timeout=10)
    time.sleep(3 * FLOOR)  # the idle time being checked: no step, no run
    assert seen.got == [] and dog.stalls == 0


def test_a_new_run_starts_clean_and_a_hang_before_its_first_step_is_reported(
    watched: tuple[EventBus, HangWatchdog, Seen],
) -> None:
    bus, dog, seen = watched
    bus.publish(RunStarted())
    _steps(bus, 0, 10)
    assert seen.detected.wait(20)  # run 1 stalls after step 9...
    bus.publish(RunEnded(status="failed"))  # ... and ends while stalled
    seen.detected.clear()
    bus.publish(RunStarted())  # run 2 hangs before its first step: the ceiling, 30 s here
    assert bus.flush(timeout=10)
    dog.ceiling_s = FLOOR  # (a short ceiling, set once run 2 began)
    assert seen.detected.wait(20), "a hang before the first step went unreported"
    _steps(bus, 0, 1)
    assert seen.ended.wait(20)
    kinds = [(type(ev).__name__, ev.step) for ev in seen.got]
    assert kinds == [("StallDetected", 9), ("StallDetected", None), ("StallEnded", 0)]


def test_a_watchdog_subscribed_again_watches_again(tmp_path: Path) -> None:
    dog = HangWatchdog(floor_s=FLOOR, ceiling_s=30.0, factor=5.0, check_s=0.02)
    for _ in range(2):
        seen = Seen()
        with EventBus(drain_interval=0.005) as bus:
            bus.subscribe(dog)
            bus.subscribe(seen)
            _steps(bus, 0, 10)
            assert seen.detected.wait(20)
    assert dog.stalls == 2


def test_a_slow_lossless_subscriber_holding_the_bus_up_is_not_a_stall(tmp_path: Path) -> None:
    class Slow:
        policy = "block"
        maxsize = 1
        events = (Loss,)

        def on_events(self, batch: list[Event]) -> None:
            time.sleep(0.1)  # the slow sink being modelled: the router waits for it

    dog = HangWatchdog(floor_s=0.05, ceiling_s=30.0, factor=2.0, check_s=0.01)
    seen = Seen()
    with EventBus(drain_interval=0.005, inbox_maxsize=16, hang_timeout=None) as bus:
        bus.subscribe(dog)
        bus.subscribe(seen)
        bus.subscribe(Slow())
        for i in range(40):  # healthy, a few ms a step: only the bus is late
            with bus.step(i):
                bus.publish(Loss(step=i, value=1.0))
        bus.publish(RunEnded())
    assert seen.got == [] and dog.stalls == 0


def _dog_saw(gaps_s: list[float], stride: int = 1, **kw: Any) -> HangWatchdog:
    dog = HangWatchdog(**kw)
    ts = 0
    for i, gap in enumerate(gaps_s):
        ts += int(gap * 1e9)
        dog._step_ended(StepEnded(step=i * stride, ts=ts))
    return dog


def test_the_bound_follows_the_median_step_within_floor_and_ceiling() -> None:
    assert _dog_saw([1.0] * 3, factor=10, floor_s=5, ceiling_s=100).bound() == 10.0
    assert _dog_saw([0.1] * 3, factor=10, floor_s=5, ceiling_s=100).bound() == 5.0
    assert _dog_saw([60.0] * 3, factor=10, floor_s=5, ceiling_s=100).bound() == 100.0
    one_slow = [1.0, 1.0, 50.0, 1.0, 1.0]
    assert _dog_saw(one_slow, factor=10, floor_s=5, ceiling_s=100).bound() == 10.0
    # steps numbered in samples (stride 64): a stall is timed between two StepEnded, so is
    # the bound
    assert _dog_saw([1.0] * 3, stride=64, factor=10, floor_s=5, ceiling_s=100).bound() == 10.0
    # before `warmup_steps` steps ended (compilation, caches): the ceiling
    assert _dog_saw([1.0], factor=10, floor_s=5, ceiling_s=100, warmup_steps=2).bound() == 100.0


def test_bad_bounds_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="floor_s <= ceiling_s"):
        HangWatchdog(floor_s=10, ceiling_s=5)
    with pytest.raises(ValueError, match="factor"):
        HangWatchdog(factor=0)


def test_it_refuses_the_sidecar_and_says_why() -> None:
    with pytest.raises(TypeError, match="training process"):
        pickle.dumps(HangWatchdog())


# -- action="abort": a loop that never reads should_stop (in a child process) ----------------

_LOOP = """
import sys, threading
from eventbus import EventBus
from eventbus.events import Loss, RunStarted
from eventbus.monitors import HangWatchdog
from eventbus.sinks import JsonlWriter

out = sys.argv[1]
bus = EventBus(drain_interval=0.005)
bus.subscribe(JsonlWriter(out))
bus.subscribe(HangWatchdog(floor_s=0.2, ceiling_s=5, dir=out, check_s=0.02, action="abort",
                           abort_after_s=0.2, exit_after_s=float(sys.argv[3])))
with bus:
    bus.publish(RunStarted())
    for i in range(20):
        with bus.step(i):
            bus.publish(Loss(step=i, value=float(i)))
    if sys.argv[2] == "stuck":
        threading.Event().wait()  # never reads should_stop
    else:
        while not bus.should_stop:  # slow, but it looks
            threading.Event().wait(0.01)
print("loop left", flush=True)
"""


def _run_loop(
    tmp_path: Path, how: str, exit_after_s: float
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    script = tmp_path / "loop.py"
    script.write_text(_LOOP)
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(script), str(out), how, str(exit_after_s)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # this checkout, whatever is installed
    )
    lines = [json.loads(x) for f in sorted(out.glob("*.jsonl")) for x in f.read_text().splitlines()]
    return done, lines


def test_abort_ends_a_loop_that_never_looks_and_keeps_every_lossless_event(
    tmp_path: Path,
) -> None:
    done, lines = _run_loop(tmp_path, "stuck", exit_after_s=0.5)
    assert done.returncode == 143, done.stderr[-2000:]  # SIGTERM's drain, then 128 + 15
    assert "loop left" not in done.stdout
    types = [x.get("type") for x in lines]
    assert types.count("Loss") == 20
    assert "StallDetected" in types
    stop = next(x for x in lines if x.get("type") == "StopRequested")
    assert stop["abort"] is True and stop["source"] == "watchdog"
    (stacks,) = (tmp_path / "run").glob("stall-rank0-pid*-1.txt")
    assert "threading.Event().wait()" in stacks.read_text()


def test_a_loop_that_reads_should_stop_ends_itself_after_the_abort(tmp_path: Path) -> None:
    done, lines = _run_loop(tmp_path, "looks", exit_after_s=60.0)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loop left" in done.stdout
    (ended,) = [x for x in lines if x.get("type") == "RunEnded"]
    assert ended["status"] == "aborted"
    assert any(x.get("type") == "StopRequested" for x in lines)
