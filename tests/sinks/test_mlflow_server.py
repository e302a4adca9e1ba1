"""MLflowSink against a real `mlflow server` on loopback (sqlite behind it): what the sink logs
over HTTP, read back with `MlflowClient(tracking_uri).get_metric_history`.

The server needs the full MLflow server's packages (flask, flask-cors), which mlflow-skinny
does not bring: without them the test skips and says so.
"""

from __future__ import annotations

import importlib.util
import math
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
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


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`mlflow server` on 127.0.0.1 (sqlite store, local artifacts), once it answers /health."""
    missing = [m for m in SERVER_NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(
            f"mlflow server needs {', '.join(missing)} (the full mlflow package brings them; "
            "mlflow-skinny does not)"
        )
    d = tmp_path_factory.mktemp("mlflow-server")
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
        yield uri
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


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
