"""WandbSink on the real wandb client, offline, read back with wandb's own reader.

Each run is written offline into `tmp_path` and read back with `wandb leet inspect --json`,
which prints the records of a run's `.wandb` transaction log as JSON lines: history rows
(one per `run.log` step), config, summary, alert and exit records.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("wandb")

import wandb

from eventbus import Event, EventBus
from eventbus.events import (
    BusCost,
    DivergenceDetected,
    EvalEnded,
    Loss,
    MemoryLeakSuspected,
    MemorySample,
    OptimizerStepped,
    RunEnded,
    RunStarted,
    Scalars,
    StepEnded,
    StopRequested,
)
from eventbus.sinks import WandbSink

LOSSES = [2.5, float("nan"), float("inf"), float("-inf"), 0.0, 1.25]


@pytest.fixture(autouse=True)
def _quiet_offline_wandb(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, silent, no console capture (pytest captures): nothing leaves the machine."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")


def _runs(d: Path) -> list[list[dict[str, Any]]]:
    """The records of every offline run under `d`, by wandb's reader, oldest first."""
    out = []
    for run_dir in sorted((d / "wandb").glob("offline-run-*")):
        text = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        out.append([json.loads(line) for line in text.splitlines() if line.strip()])
    return sorted(out, key=lambda recs: _of(recs, "run")[0]["start_time"])


def _of(records: list[dict[str, Any]], kind: str) -> list[Any]:
    return [r[kind] for r in records if r["type"] == kind]


def _exit_codes(records: list[dict[str, Any]]) -> list[int]:
    return [e["exit_code"] for e in _of(records, "exit")]


def _history(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    rows = {}
    for h in _of(records, "history"):
        step = int(h["step"]["num"])
        assert step not in rows, f"step {step} logged in two rows"
        rows[step] = h["item"]
    return rows


def _summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in _of(records, "summary"):
        out.update(s.get("update", {}))
    return out


def _config(records: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in _of(records, "run"):
        out.update(r.get("config", {}).get("update", {}))
    for c in _of(records, "config"):
        out.update(c.get("update", {}))
    out.pop("_wandb", None)
    return out


def _float(v: Any) -> float:
    """A value as wandb's reader prints it: NaN and ±Inf come as "NaN", "Infinity"."""
    return float(v)


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def _run(d: Path, events: list[Event], **kw: Any) -> tuple[WandbSink, EventBus]:
    placement = kw.pop("placement", "thread")
    sink = WandbSink("eventbus-tests", mode="offline", dir=d, **kw)
    bus = EventBus(drain_interval=0.002, close_timeout=60)
    bus.subscribe(sink, placement=placement)
    with bus:
        for ev in events:
            bus.publish(ev)
    return sink, bus


def test_every_step_nan_and_inf_config_detections_and_exit_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int | None] = []  # the steps of the client's own `Run.log` calls
    real_log = wandb.Run.log

    def counted(self: Any, data: dict[str, Any], step: int | None = None, **kw: Any) -> None:
        calls.append(step)
        real_log(self, data, step=step, **kw)

    monkeypatch.setattr(wandb.Run, "log", counted)
    events: list[Event] = [
        RunStarted(config={"lr": 0.1, "model": {"layers": 2}}, run_id="exp-1", total_steps=6)
    ]
    for step, loss in enumerate(LOSSES, start=1):
        events += [
            Loss(step=step, value=loss),
            OptimizerStepped(step=step, lr=0.1, grad_norm=0.5 * step),
            Scalars(step=step, values={"tokens_seen": 100 * step}),
            MemorySample(step=step, rss_mb=100.0 + step, allocated_mb=0.0),
            StepEnded(step=step, duration_s=0.5, samples=64),
        ]
    events += [
        EvalEnded(step=6, metrics={"acc": 0.75}),
        BusCost(step=6, steps=6, share=0.004, subscriber_cpu_s={"wandb": 0.25}),
        DivergenceDetected(step=2, metric="loss", value=math.nan, baseline=2.5, reason="nan"),
        MemoryLeakSuspected(step=6, rate_mb_per_step=1.0, window=5),
        StopRequested(step=6, reason="diverged", source="test"),
        RunEnded(step=6, status="stopped"),
    ]
    sink, bus = _run(tmp_path, events, config={"seed": 7})
    st = bus.stats()["wandb"]
    assert (st.delivered, st.failed, st.dropped) == (len(events), 0, 0)

    [records] = _runs(tmp_path)
    rows = _history(records)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]  # one row per step: one log call per step
    for step, loss in enumerate(LOSSES, start=1):
        row = rows[step]
        assert _same(_float(row["train/loss"]), loss), (step, row["train/loss"])
        assert row["train/lr"] == pytest.approx(0.1)
        assert row["train/grad_norm"] == pytest.approx(0.5 * step)
        assert row["tokens_seen"] == 100 * step
        assert row["memory/rss_mb"] == 100.0 + step
        assert row["memory/allocated_mb"] == 0  # zero is a value
        assert row["perf/step_time_s"] == 0.5
        assert row["perf/samples_per_s"] == 128.0
    assert rows[6]["eval/acc"] == 0.75
    assert rows[6]["eventbus/share"] == pytest.approx(0.004)
    assert rows[6]["eventbus/cpu_s/wandb"] == 0.25
    assert rows[2]["divergence/marker"] == 1
    assert rows[6]["memory/leak_rate_mb_per_step"] == 1.0
    assert "eventbus/publish_ms_p99" not in rows[6]  # unknown: not logged
    assert calls == [1, 2, 3, 4, 5, 6]  # one call per step, never one per scalar
    assert sink.stats().logged == 6

    assert _config(records) == {"seed": 7, "lr": 0.1, "model": {"layers": 2}}
    assert _of(records, "run")[-1].get("display_name") == "exp-1"  # named by RunStarted.run_id
    summary = _summary(records)
    assert summary["run/status"] == "stopped"
    assert summary["run/total_steps"] == 6
    assert summary["divergence/step"] == 2
    assert summary["divergence/value"] in (None, "NaN")  # W&B keeps a NaN summary as null
    assert summary["memory/leak_step"] == 6
    assert (summary["run/stop_kind"], summary["run/stop_reason"]) == ("stop", "diverged")
    titles = [a["title"] for a in _of(records, "alert")]
    assert titles == [
        "eventbus: divergence detected",
        "eventbus: memory leak suspected",
        "eventbus: stop requested",
    ]
    assert sink.stats().alerts == 3
    assert _exit_codes(records) == [0]  # stopped is a finish


def test_failed_run_exits_1_and_a_second_run_on_the_bus_gets_its_own(tmp_path: Path) -> None:
    sink, _ = _run(
        tmp_path,
        [
            RunStarted(config={"try": 1}),
            Loss(step=1, value=1.0),
            RunEnded(step=1, status="failed", reason="RuntimeError: boom"),
            Loss(step=2, value=9.0),  # between runs: no run open, counted
            RunStarted(config={"try": 2}),
            Loss(step=1, value=0.5),
            RunEnded(step=1, status="completed"),
        ],
        run_name="fixed",
    )
    first, second = _runs(tmp_path)
    assert _config(first) == {"try": 1}
    assert _exit_codes(first) == [1]
    assert _summary(first)["run/status"] == "failed"
    assert _summary(first)["run/reason"] == "RuntimeError: boom"
    assert {s: r["train/loss"] for s, r in _history(first).items()} == {1: 1}
    assert _config(second) == {"try": 2}
    assert _exit_codes(second) == [0]
    assert {s: r["train/loss"] for s, r in _history(second).items()} == {1: 0.5}
    assert _of(second, "run")[0]["display_name"] == "fixed"  # run_name wins over run_id
    assert (sink.stats().runs, sink.stats().skipped) == (2, 1)


def test_a_step_before_the_last_logged_lands_on_it_and_is_counted(tmp_path: Path) -> None:
    sink = WandbSink("eventbus-tests", mode="offline", dir=tmp_path)
    bus = EventBus(drain_interval=0.002, close_timeout=60)
    bus.subscribe(sink, placement="thread")
    with bus:
        bus.publish(Loss(step=5, value=1.0))
        assert bus.flush(timeout=60)  # step 5 logged in its own batch
        bus.publish(EvalEnded(step=3, metrics={"acc": 0.5}))  # late: W&B would drop it
        bus.publish(Loss(step=6, value=0.5))
    rows = _history(_runs(tmp_path)[0])
    assert (rows[5]["train/loss"], rows[5]["eval/acc"]) == (1, 0.5)
    assert rows[6]["train/loss"] == 0.5
    assert 3 not in rows
    assert sink.stats().late == 1


def test_a_failing_client_is_counted_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: Any, data: dict[str, Any], step: int | None = None) -> None:
        raise ConnectionError("tracker gone")

    sink = WandbSink("eventbus-tests", mode="offline", dir=tmp_path)
    bus = EventBus(drain_interval=0.002, close_timeout=60, max_consecutive_failures=1000)
    bus.subscribe(sink, placement="thread")
    with bus:
        monkeypatch.setattr(wandb.Run, "log", broken)
        for step in range(1, 21):
            bus.publish(Loss(step=step, value=1.0 / step))
        assert bus.flush(timeout=60)
        assert not bus.should_stop
    st = bus.stats()["wandb"]
    assert st.published == 20
    assert st.failed == 20  # every event of a batch whose log raised
    assert st.delivered == 0
    assert "tracker gone" in (st.error or "")


def test_a_refused_alert_leaves_the_summary_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_alerts(self: Any, **kw: Any) -> None:
        raise wandb.Error("alerts are not available offline")

    monkeypatch.setattr(wandb.Run, "alert", no_alerts)
    sink, bus = _run(
        tmp_path,
        [DivergenceDetected(step=4, metric="loss", value=9.0, baseline=1.0, reason="spike")],
    )
    assert bus.stats()["wandb"].failed == 0
    assert (sink.stats().alerts, sink.stats().alerts_refused) == (0, 1)
    [records] = _runs(tmp_path)
    assert _of(records, "alert") == []
    summary = _summary(records)
    assert (summary["divergence/step"], summary["divergence/reason"]) == (4, "spike")


def test_in_the_sidecar_by_default(tmp_path: Path) -> None:
    sink = WandbSink("eventbus-tests", mode="offline", dir=tmp_path)
    assert sink.placement == "process"
    bus = EventBus(drain_interval=0.002, close_timeout=60)
    bus.subscribe(sink)
    with bus:
        bus.publish(RunStarted(config={"where": "sidecar"}))
        for step, loss in enumerate(LOSSES, start=1):
            bus.publish(Loss(step=step, value=loss))
    assert bus.stats().sidecar is not None
    assert bus.stats()["wandb"].delivered == len(LOSSES) + 2  # + the RunEnded close publishes
    assert sink.stats().logged == len(LOSSES)  # as the sidecar's copy reported it
    [records] = _runs(tmp_path)
    got = {s: _float(r["train/loss"]) for s, r in _history(records).items()}
    assert sorted(got) == list(range(1, len(LOSSES) + 1))
    assert all(_same(got[s], v) for s, v in enumerate(LOSSES, start=1))
    assert _config(records) == {"where": "sidecar"}
    assert _exit_codes(records) == [0]


# -- bad input: at construction, where it was written ----------------------------------------


def test_an_unwritable_dir_fails_at_construction(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError, match="WandbSink cannot write under"):
        WandbSink("p", dir=blocker / "wandb")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mode": "offlin"}, ValueError, "mode must be one of"),
        ({"config": [1, 2]}, TypeError, "config must be a dict"),
        ({"name": "x"}, TypeError, "run_name="),
        ({"entitty": "me"}, TypeError, "takes no argument 'entitty'"),
        ({"ranks": 0}, TypeError, "ranks must be a tuple"),
        ({"ranks": ()}, ValueError, "non-empty"),
    ],
)
def test_bad_arguments_fail_at_construction(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        WandbSink("p", **kwargs)


def test_init_keywords_pass_through_and_rebuild_in_the_sidecar(tmp_path: Path) -> None:
    import pickle

    sink = WandbSink("p", dir=tmp_path, group="g", tags=["a"], ranks=iter([0, 1]))
    copy = pickle.loads(pickle.dumps(sink))
    assert type(copy) is WandbSink
    assert copy.init_kwargs == {"group": "g", "tags": ["a"]}
    assert copy.ranks == (0, 1)
    assert (copy.project, copy.dir) == ("p", tmp_path)


def test_ranks_default_to_rank_zero() -> None:
    assert WandbSink.ranks == (0,)
    assert WandbSink("p").ranks == (0,)
    assert WandbSink("p", ranks=None).ranks is None


def test_without_wandb_a_one_line_import_error_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails as if not installed
    with pytest.raises(ImportError, match=r"pip install 'eventbus\[wandb\]'") as e:
        WandbSink("p")
    assert "\n" not in str(e.value)


def test_importing_the_sinks_imports_neither_tracker() -> None:
    code = (
        "import sys, eventbus.sinks\n"
        "from eventbus.sinks import WandbSink, MLflowSink\n"
        "print(sorted(m for m in ('wandb', 'mlflow') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
