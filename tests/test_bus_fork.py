"""Guarantee 5 (issue 14 item 4): after `os.fork` every bus call in the child returns at once.

In a forked child (a DataLoader worker is one) `flush()` returns False at once, `state_dict()`
and `load_state_dict()` raise a clear RuntimeError, `publish()` returns at once and reaches
nothing of the parent's, `close()` returns, `subscribe()` returns an inactive handle; and the
parent's JSONL file holds exactly the parent's events. Each child runs under `signal.alarm`
(or the DataLoader's own timeout), so a hang fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FORK_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    from eventbus import EventBus
    from eventbus.events import Loss
    from eventbus.sinks import JsonlWriter

    out_dir, report_path = sys.argv[1:3]
    CHILD_STEP = 10**9  # the child's events carry steps from here: none may reach the file

    bus = EventBus(cost_every=None)
    bus.subscribe(JsonlWriter(out_dir))
    seen = []
    bus.subscribe(lambda ev: seen.append(ev.seq), policy="block")
    bus.start()

    published = 0
    for i in range(2000):
        bus.publish(Loss(step=i, value=float(i)))
        published += 1
    bus.flush()  # the writer's worker has run: its thread and locks exist when we fork

    # Another thread keeps publishing while we fork: the inbox, the bus thread and the
    # writer are mid-flight in the parent at the moment of the fork.
    stop, going = threading.Event(), threading.Event()
    counted = []

    def keep_publishing():
        n = 0
        while not stop.is_set():
            bus.publish(Loss(step=2000 + n, value=0.0))
            n += 1
            if n == 100:
                going.set()
        counted.append(n)

    t = threading.Thread(target=keep_publishing)
    t.start()
    going.wait(30)

    def timed(fn):
        t0 = time.monotonic()
        try:
            value = fn()
        except BaseException as e:
            value = f"raised {type(e).__name__}: {e}"
        return value, time.monotonic() - t0

    pid = os.fork()
    if pid == 0:  # the child: every call returns at once; a hang dies of SIGALRM
        signal.alarm(20)
        r = {}
        r["flush"], r["flush_s"] = timed(bus.flush)
        r["flush_timeout_none"], r["flush_timeout_none_s"] = timed(lambda: bus.flush(None))
        r["state_dict"], r["state_dict_s"] = timed(bus.state_dict)
        r["load_state_dict"], _ = timed(lambda: bus.load_state_dict({}))

        def publish_many():
            for i in range(5000):
                bus.publish(Loss(step=CHILD_STEP + i, value=float(i)))
        _, r["publish_s"] = timed(publish_many)
        sub, r["subscribe_s"] = timed(lambda: bus.subscribe(print, policy="block"))
        r["subscribe_active"] = sub.active
        r["running"] = bus.running
        st, r["close_s"] = timed(bus.close)
        r["close_type"] = type(st).__name__
        r["close_again"], _ = timed(lambda: type(bus.close()).__name__)
        with open(report_path, "w") as f:
            json.dump(r, f)
        sys.exit(0)  # a normal interpreter exit: atexit and finalisation run in the child

    _, status = os.waitpid(pid, 0)
    stop.set()
    t.join()
    published += counted[0]
    for i in range(2000):  # the parent goes on after its child ended
        bus.publish(Loss(step=5_000_000 + i, value=float(i)))
        published += 1
    st = bus.close()
    print(json.dumps({"child_status": status, "published": published,
                      "seen": len(seen), "stats": st.as_dict()}))
    """
)


@pytest.mark.timeout(90)
def test_every_call_in_a_forked_child_returns_at_once(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    report = tmp_path / "child.json"
    script = tmp_path / "fork.py"
    script.write_text(FORK_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(out), str(report)],
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    parent = json.loads(proc.stdout)
    assert parent["child_status"] == 0, (parent["child_status"], proc.stderr[-3000:])
    child = json.loads(report.read_text())

    assert child["flush"] is False and child["flush_timeout_none"] is False, child
    assert child["state_dict"].startswith("raised RuntimeError"), child
    assert "fork" in child["state_dict"], child  # says why
    assert child["load_state_dict"].startswith("raised RuntimeError"), child
    assert child["subscribe_active"] is False and child["running"] is False, child
    assert child["close_type"] == "BusStats" and child["close_again"] == "BusStats", child
    for k in (
        "flush_s",
        "flush_timeout_none_s",
        "state_dict_s",
        "publish_s",
        "subscribe_s",
        "close_s",
    ):
        assert child[k] < 2.0, (k, child)  # at once (5,000 publishes included)

    # The parent's file: exactly the parent's events, each once, no gap, none of the child's.
    n = parent["published"]
    lines = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    losses = [x for x in lines if x["type"] == "Loss"]
    assert sorted(x["seq"] for x in losses) == list(range(n))
    assert all(x["step"] < 10**9 for x in losses)
    assert [x["type"] for x in lines].count("eventbus.stats") == 1
    st = parent["stats"]
    assert st["published"] == n and st["rejected"] == 0, st
    assert parent["seen"] == n
    assert st["subscribers"]["jsonl"]["delivered"] == n


LOADER_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from torch.utils.data import DataLoader, Dataset
    from eventbus import EventBus
    from eventbus.events import Loss
    from eventbus.sinks import JsonlWriter

    bus = EventBus()
    bus.subscribe(JsonlWriter(sys.argv[1]))

    class Calls(Dataset):  # every item calls the bus from a forked worker
        def __len__(self):
            return 8

        def __getitem__(self, i):
            flushed = bus.flush()
            try:
                bus.state_dict()
                raised = 0
            except RuntimeError:
                raised = 1
            bus.publish(Loss(step=10**9 + i, value=0.0))
            active = bus.subscribe(print).active
            bus.close()
            return torch.tensor([float(flushed), float(raised), float(active)])

    with bus:
        loader = DataLoader(Calls(), batch_size=4, num_workers=2,
                            multiprocessing_context="fork", timeout=30)  # a hang: an error
        rows = torch.cat(list(loader)).tolist()
        for step in range(10):
            bus.publish(Loss(step=step, value=1.0))
    print(json.dumps({"rows": rows, "published": bus.stats().published}))
    """
)


@pytest.mark.timeout(120)
def test_bus_calls_in_a_fork_dataloader_worker_return_at_once(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    script = tmp_path / "loader.py"
    script.write_text(LOADER_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(out)],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    # flush() False, state_dict() raised, subscribe() inactive: in every worker, for every item
    assert result["rows"] == [[0.0, 1.0, 0.0]] * 8, result
    assert result["published"] == 10
    lines = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["type"] == "Loss"] == list(range(10))
