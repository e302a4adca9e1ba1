"""MLflowSink on the real MLflow client and a local sqlite tracking store, read back with
`MlflowClient` (`get_metric_history`, the run's params, tags and status)."""

from __future__ import annotations

import http.server
import logging
import math
import pickle
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")

from mlflow.entities import Run
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

from eventbus import Event, EventBus
from eventbus.events import (
    DivergenceDetected,
    EvalEnded,
    Loss,
    OptimizerStepped,
    RunEnded,
    RunStarted,
    Scalars,
    StepEnded,
    StopRequested,
)
from eventbus.sinks import MLflowSink

# MLflow's own SQL store uses a loader strategy sqlalchemy 2.1 deprecates: not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")

LOSSES = [2.5, float("nan"), float("inf"), float("-inf"), 0.0, 1.25]
T0 = 1_732_269_000_123_456_789  # the events' own ts (ns): MLflow's timestamps come from it


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite store per module: creating its tables takes MLflow seconds."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()  # creates the tables
    return uri


@pytest.fixture(autouse=True)
def _no_mlflow_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)


def _run(
    uri: str, experiment: str, events: list[Event], placement: str = "thread", **kw: Any
) -> tuple[MLflowSink, EventBus]:
    sink = MLflowSink(uri, experiment=experiment, **kw)
    bus = EventBus(drain_interval=0.002, close_timeout=60)
    bus.subscribe(sink, placement=placement)
    with bus:
        for ev in events:
            bus.publish(ev)
    return sink, bus


def _runs(uri: str, experiment: str) -> list[Run]:
    """The experiment's runs, oldest first."""
    c = MlflowClient(uri)
    exp = c.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment!r}"
    return sorted(c.search_runs([exp.experiment_id]), key=lambda r: r.info.start_time)


def _history(uri: str, run: Run, key: str) -> list[tuple[int, float, int]]:
    got = MlflowClient(uri).get_metric_history(run.info.run_id, key)
    return sorted((m.step, m.value, m.timestamp) for m in got)


def _kept(logged: float, sent: float) -> bool:
    """`logged` is what MLflow keeps of `sent`: NaN as NaN; ±Inf as ±Inf or, in the SQL
    stores, clamped to the largest finite float."""
    if math.isnan(sent):
        return math.isnan(logged)
    if math.isinf(sent):
        return logged == sent or logged == math.copysign(sys.float_info.max, sent)
    return logged == sent


def test_metrics_params_tags_and_status_read_back(
    store: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = {
        "lr": 0.1,
        "model": {"layers": 2, "name": "gpt"},
        "notes": "x" * (MAX_PARAM_VAL_LENGTH + 10),
        "data@v2": [1, 2],
        "dropout": None,
    }
    events: list[Event] = [RunStarted(config=config, run_id="exp-7", world_size=1, ts=T0)]
    for step, loss in enumerate(LOSSES, start=1):
        ts = T0 + step * 1_000_000_000
        events += [
            Loss(step=step, value=loss, ts=ts),
            OptimizerStepped(step=step, lr=0.1, grad_norm=0.5 * step, ts=ts),
            Scalars(step=step, values={"acc@1": 0.25 * step}, ts=ts),
            StepEnded(step=step, duration_s=0.5, samples=64, ts=ts),
        ]
    events += [
        EvalEnded(step=6, metrics={"acc": 0.75}),
        DivergenceDetected(step=2, metric="loss", value=math.nan, baseline=2.5, reason="nan"),
        StopRequested(step=6, reason="diverged", source="test"),
        RunEnded(step=6, status="stopped", ts=T0 + 7_000_000_000),
    ]
    with caplog.at_level(logging.WARNING, logger="eventbus"):
        sink, bus = _run(store, "catalogue", events, tags={"team": "vision"})
    st = bus.stats()["mlflow"]
    assert (st.delivered, st.failed, st.dropped) == (len(events), 0, 0)

    [run] = _runs(store, "catalogue")
    loss = _history(store, run, "train/loss")
    assert [s for s, _, _ in loss] == [1, 2, 3, 4, 5, 6]  # every step, once
    for (step, value, ms), sent in zip(loss, LOSSES, strict=True):
        assert _kept(value, sent), (step, value, sent)
        assert ms == (T0 + step * 1_000_000_000) // 1_000_000  # the event's own time
    assert [(s, v) for s, v, _ in _history(store, run, "train/grad_norm")] == [
        (s, 0.5 * s) for s in range(1, 7)
    ]
    assert [v for _, v, _ in _history(store, run, "perf/samples_per_s")] == [128.0] * 6
    assert [(s, v) for s, v, _ in _history(store, run, "acc_1")] == [
        (s, 0.25 * s) for s in range(1, 7)
    ]  # a key MLflow refuses ("@"), renamed
    assert [(s, v) for s, v, _ in _history(store, run, "eval/acc")] == [(6, 0.75)]
    assert [(s, v) for s, v, _ in _history(store, run, "divergence/marker")] == [(2, 1.0)]

    params = run.data.params
    assert params["lr"] == "0.1"
    assert (params["model.layers"], params["model.name"]) == ("2", "gpt")
    assert params["data_v2"] == "[1,2]"
    assert params["dropout"] == "None"
    assert params["notes"] == "x" * MAX_PARAM_VAL_LENGTH  # cut to MLflow's limit
    warned = [r.getMessage() for r in caplog.records if "params were changed" in r.getMessage()]
    assert len(warned) == 1
    assert "notes" in warned[0] and "data@v2 -> data_v2" in warned[0]
    assert sink.stats().params_truncated == 1

    tags = run.data.tags
    assert tags["team"] == "vision"
    assert (tags["eventbus.rank"], tags["eventbus.world_size"]) == ("0", "1")
    assert tags["eventbus.run_id"] == "exp-7"
    assert run.info.run_name == "exp-7"  # named by RunStarted.run_id
    assert "loss = nan" in tags["eventbus.divergence"]
    assert "diverged" in tags["eventbus.stop"]
    assert tags["eventbus.status"] == "stopped"
    assert run.info.status == "FINISHED"  # stopped: it finished
    assert run.info.end_time == (T0 + 7_000_000_000) // 1_000_000  # RunEnded's own time


def test_each_status_maps_to_mlflows(store: str) -> None:
    statuses = {
        "completed": "FINISHED",
        "stopped": "FINISHED",
        "failed": "FAILED",
        "aborted": "KILLED",
        "interrupted": "KILLED",
        "unknown": "FAILED",
    }
    events: list[Event] = []
    for status in statuses:  # one bus, one MLflow run per RunStarted
        events += [
            RunStarted(run_id=f"run-{status}"),
            Loss(step=1, value=1.0),
            RunEnded(step=1, status=status),
            Loss(step=2, value=2.0),  # after the end, before the next start: no run open
        ]
    sink, _ = _run(store, "statuses", events, run_name=None)
    runs = {r.info.run_name: r for r in _runs(store, "statuses")}
    assert {name: r.info.status for name, r in runs.items()} == {
        f"run-{s}": mlflow_status for s, mlflow_status in statuses.items()
    }
    assert all(runs[f"run-{s}"].data.tags["eventbus.status"] == s for s in statuses)
    assert (sink.stats().runs, sink.stats().skipped) == (len(statuses), len(statuses))


def test_one_log_batch_per_drained_batch_split_only_at_mlflows_limits(
    store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes: list[int] = []  # metrics per call of the client's own `log_batch`
    real_log_batch = MlflowClient.log_batch

    def counted(self: Any, run_id: str, metrics: Any = (), **kw: Any) -> None:
        sizes.append(len(metrics))
        real_log_batch(self, run_id, metrics=metrics, **kw)

    monkeypatch.setattr(MlflowClient, "log_batch", counted)
    sink = MLflowSink(store, experiment="batches", run_name="direct")
    sink.on_start()
    sink.on_events([Loss(step=s, value=float(s), ts=T0) for s in range(1, 301)])
    assert sizes == [300]  # one call for the batch
    wide = {f"m{i}": float(i) for i in range(1500)}
    sink.on_events([Scalars(step=1, values=wide, ts=T0)])
    assert sizes == [300, 1000, 500]  # MLflow takes 1000 metrics a request
    assert sink.stats().batches == 3
    sink.on_close()
    [run] = _runs(store, "batches")
    assert len(_history(store, run, "train/loss")) == 300
    assert _history(store, run, "m1499")[0][:2] == (1, 1499.0)
    assert run.info.status == "FINISHED"  # closed without a RunEnded


def test_a_param_logged_again_keeps_its_first_value(store: str) -> None:
    sink, bus = _run(
        store,
        "params",
        [RunStarted(config={"lr": 0.1}), RunStarted(config={"lr": 0.2, "seed": 3})],
    )
    assert bus.stats()["mlflow"].failed == 0  # MLflow refuses a changed param: not sent
    [run] = _runs(store, "params")
    assert run.data.params == {"lr": "0.1", "seed": "3"}
    assert sink.stats().params_refused == 1


def test_a_failing_store_is_counted_and_training_goes_on(
    store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: Any, run_id: str, **kw: Any) -> None:
        raise ConnectionError("tracking server gone")

    sink = MLflowSink(store, experiment="failing")
    bus = EventBus(drain_interval=0.002, close_timeout=60, max_consecutive_failures=1000)
    bus.subscribe(sink, placement="thread")
    with bus:
        monkeypatch.setattr(MlflowClient, "log_batch", broken)
        for step in range(1, 21):
            bus.publish(Loss(step=step, value=1.0 / step))
        assert bus.flush(timeout=60)
        assert not bus.should_stop
    st = bus.stats()["mlflow"]
    assert (st.published, st.failed, st.delivered) == (20, 20, 0)
    assert "tracking server gone" in (st.error or "")
    [run] = _runs(store, "failing")
    assert run.info.status == "FINISHED"  # set_terminated still reached the store


def test_in_the_sidecar_by_default(store: str) -> None:
    assert MLflowSink.placement == "process"
    sink, bus = _run(
        store,
        "sidecar",
        [RunStarted(config={"where": "sidecar"})]
        + [Loss(step=s, value=v) for s, v in enumerate(LOSSES, start=1)],
        placement="process",
    )
    assert bus.stats().sidecar is not None
    assert bus.stats()["mlflow"].delivered == len(LOSSES) + 2  # + the RunEnded close publishes
    assert sink.stats().metrics == len(LOSSES)  # as the sidecar's copy reported it
    [run] = _runs(store, "sidecar")
    got = _history(store, run, "train/loss")
    assert all(_kept(v, sent) for (_, v, _), sent in zip(got, LOSSES, strict=True))
    assert run.data.params == {"where": "sidecar"}
    assert run.info.status == "FINISHED"


# -- bad input: at construction, where it was written ----------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_server_fails_at_construction() -> None:
    with pytest.raises(ConnectionError, match="cannot reach the MLflow tracking server"):
        MLflowSink(f"http://127.0.0.1:{_closed_port()}")


@pytest.fixture
def server() -> Iterator[str]:
    """A loopback HTTP server that answers 404 to everything: reachable, not MLflow."""

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_error(404)

        def log_message(self, *args: Any) -> None:
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(timeout=10)


def test_a_reachable_server_passes_the_check(server: str) -> None:
    assert MLflowSink(server).tracking_uri == server  # any HTTP answer: it is there


def test_an_unwritable_store_fails_at_construction(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError, match="MLflowSink cannot write under"):
        MLflowSink(f"sqlite:///{blocker}/sub/mlflow.db")
    with pytest.raises(OSError, match="MLflowSink cannot write under"):
        MLflowSink(str(blocker / "mlruns"))


def test_an_unknown_scheme_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="scheme MLflow does not know"):
        MLflowSink("htp://127.0.0.1:5000")


def test_the_environments_uri_is_checked_and_travels_to_the_sidecar(
    store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    copy = pickle.loads(pickle.dumps(MLflowSink()))
    assert (copy.tracking_uri, copy.experiment) == (store, "from-env")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(ConnectionError):
        MLflowSink()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"experiment": 3}, TypeError, "experiment must be a str"),
        ({"tags": ["a"]}, TypeError, "tags must be a dict"),
        ({"ranks": ()}, ValueError, "non-empty"),
    ],
)
def test_bad_arguments_fail_at_construction(
    store: str, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        MLflowSink(store, **kwargs)


@pytest.mark.parametrize(
    ("missing", "uri", "match"),
    [
        ("mlflow", None, r"MLflowSink needs the mlflow package: pip install 'eventbus\[mlflow\]'"),
        (
            "sqlalchemy",
            "sqlite:///x.db",
            r"sqlalchemy and alembic: pip install 'eventbus\[mlflow\]'",
        ),
    ],
)
def test_without_the_extra_a_one_line_import_error_names_it(
    monkeypatch: pytest.MonkeyPatch, missing: str, uri: str | None, match: str
) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed
    with pytest.raises(ImportError, match=match) as e:
        MLflowSink(uri)
    assert "\n" not in str(e.value)


def test_ranks_default_to_rank_zero(store: str) -> None:
    assert MLflowSink.ranks == (0,)
    assert MLflowSink(store, ranks=None).ranks is None


def test_the_short_names_name_the_sinks() -> None:
    from eventbus.loader import load_object

    assert load_object("mlflow") is MLflowSink
    assert load_object("wandb").__name__ == "WandbSink"
