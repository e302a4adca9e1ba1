"""MLflowSink against a real `mlflow server` on loopback (sqlite behind it): what the sink logs
over HTTP, read back with `MlflowClient(tracking_uri).get_metric_history`.

The server needs the full MLflow server's packages (flask, flask-cors), which mlflow-skinny
does not bring: without them the test skips and says so.
"""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient

from eventbus import Event, EventBus
from eventbus.events import Loss, RunEnded, RunStarted
from eventbus.sinks import MLflowSink

ROOT = Path(__file__).resolve().parents[2]
LOSSES = [2.5, float("nan"), float("inf"), 0.0, 1.25, -0.5]
STATUSES = {"completed": "FINISHED", "failed": "FAILED", "aborted": "KILLED"}
SERVER_NEEDS = ("flask", "flask_cors")

pytestmark = [
    pytest.mark.slow,  # the server takes 10-30 s to create its tables on a busy machine
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def _serving(d: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`mlflow server` on 127.0.0.1 (sqlite store, local artifacts), once it answers /health."""
    missing = [m for m in SERVER_NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(
            f"mlflow server needs {', '.join(missing)} (the full mlflow package brings them; "
            "mlflow-skinny does not)"
        )
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    log = d / "server.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--backend-store-uri",
                f"sqlite:///{d / 'mlflow.db'}",
                "--default-artifact-root",
                str(d / "artifacts"),
                "--workers",
                "1",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=d,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        while not _healthy(uri):  # readiness: the server's own health endpoint
            if proc.poll() is not None:
                pytest.fail(f"mlflow server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server not healthy in 180 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield uri, proc
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its workers
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with _serving(tmp_path_factory.mktemp("mlflow-server")) as (uri, _):
        yield uri


def _kept(logged: float, sent: float) -> bool:
    """NaN stays NaN; ±Inf is ±Inf or, in a SQL store, the largest finite float."""
    if math.isnan(sent):
        return math.isnan(logged)
    if math.isinf(sent):
        return logged == sent or logged == math.copysign(sys.float_info.max, sent)
    return logged == sent


def test_every_step_params_and_statuses_through_a_real_server(server: str) -> None:
    events: list[Event] = []
    for status in STATUSES:  # one MLflow run per RunStarted, each ended its own way
        events.append(RunStarted(run_id=f"served-{status}", config={"lr": 0.1, "opt": {"b": 2}}))
        events += [Loss(step=s, value=v) for s, v in enumerate(LOSSES, start=1)]
        events.append(RunEnded(step=len(LOSSES), status=status))
    sink = MLflowSink(server, experiment="over-http", tags={"where": "loopback"})
    bus = EventBus(drain_interval=0.002, close_timeout=120)
    bus.subscribe(sink)  # in the sidecar, as by default: it logs over HTTP from there
    with bus:
        for ev in events:
            bus.publish(ev)
    st = bus.stats()["mlflow"]
    assert (st.delivered, st.failed, st.dropped) == (len(events), 0, 0), st.error

    client = MlflowClient(server)
    exp = client.get_experiment_by_name("over-http")
    assert exp is not None
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {f"served-{s}" for s in STATUSES}
    for status, mlflow_status in STATUSES.items():
        run = runs[f"served-{status}"]
        assert run.info.status == mlflow_status
        history = sorted(
            (m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")
        )
        assert [s for s, _ in history] == list(range(1, len(LOSSES) + 1))  # every step, once
        for (step, value), sent in zip(history, LOSSES, strict=True):
            assert _kept(value, sent), (status, step, value, sent)
        assert run.data.params == {"lr": "0.1", "opt.b": "2"}
        assert run.data.tags["where"] == "loopback"
        assert run.data.tags["eventbus.status"] == status


def test_a_server_that_goes_away_mid_run_is_counted_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail fast, not in minutes
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    with _serving(tmp_path) as (uri, proc):
        sink = MLflowSink(uri, experiment="goes-away")
        bus = EventBus(drain_interval=0.002, close_timeout=60, max_consecutive_failures=1000)
        bus.subscribe(sink, placement="thread", max_batch=1)  # one log_batch per event
        with bus:
            bus.publish(RunStarted(run_id="goes-away"))
            for step in range(1, 4):
                bus.publish(Loss(step=step, value=1.0))
            assert bus.flush(timeout=60)
            before = bus.stats()["mlflow"]
            assert (before.delivered, before.failed) == (4, 0)
            _stop(proc)  # the tracking server is gone
            for step in range(4, 7):
                bus.publish(Loss(step=step, value=1.0))
            assert bus.flush(timeout=120)
            assert not bus.should_stop
        st = bus.stats()["mlflow"]
    # After the server went: three losses and the RunEnded the bus publishes at close, each
    # counted failed (why: the connection refused), none lost silently.
    assert (st.published, st.delivered, st.failed, st.dropped) == (8, 4, 4, 0)
    assert "Connection refused" in (st.error or "")
