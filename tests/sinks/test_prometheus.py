"""PrometheusExporter, scraped over HTTP and read with prometheus_client's own parser; and a real
Prometheus server scraping both ranks of a torchrun run."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families

from eventbus import EventBus
from eventbus.config import subscriber_from_spec
from eventbus.events import Event, Loss, MemorySample, OptimizerStepped, RunStarted, StepEnded
from eventbus.sinks import PrometheusExporter
from eventbus.sinks.prometheus import PORT_ENV

ROOT = Path(__file__).resolve().parents[2]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _get(samples: Samples, name: str, **labels: str) -> float:
    return samples[name, frozenset(labels.items())]


def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(0.005)


def _free_ports(n: int) -> int:
    """A base port with `n` free ports in a row from it."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n > 65535:
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} free ports in a row")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def bus() -> Iterator[EventBus]:
    b = EventBus(drain_interval=0.002, close_timeout=10)
    try:
        yield b
    finally:
        b.close(timeout=5)


# -- what a scrape shows ---------------------------------------------------------------------


def test_a_scrape_during_a_live_run_shows_gauges_counters_and_labels(bus: EventBus) -> None:
    release = threading.Event()

    def failing(ev: Event) -> None:
        raise ValueError("boom")

    def stuck(ev: Event) -> None:
        release.wait(10)

    exporter = PrometheusExporter(0, run="exp1")
    bus.subscribe(exporter)
    bus.subscribe(failing, events=[Loss], name="failing")
    bus.subscribe(stuck, events=[Loss], name="stuck", policy="drop_newest", maxsize=2)
    n = 20
    try:
        with bus:
            url = exporter.wait_listening(10)
            bus.publish(RunStarted(run_id="ignored: run= was given"))
            for step in range(1, n + 1):
                bus.publish(Loss(step=step, value=1.0 / step))
                bus.publish(OptimizerStepped(step=step, lr=0.01 * step, grad_norm=float("nan")))
                bus.publish(StepEnded(step=step, duration_s=0.5, samples=8, tokens=1000))
            bus.publish(MemorySample(step=n, rss_mb=100.0, allocated_mb=2.0, reserved_mb=4.0))
            bus.publish(Loss(step=n - 2, value=0.25, split="eval"))  # a late eval
            # everything routed and handled, but for what `stuck` holds: the counters stand still
            _until(lambda: bus.stats()["failing"].failed == n + 1)
            _until(lambda: bus.stats()["stuck"].published == n + 1)
            _until(lambda: bus.stats()["prometheus"].delivered == 3 * n + 3)
            got = _scrape(url)
            st = bus.stats()
            release.set()
    finally:
        release.set()

    lab = {"run": "exp1", "rank": "0"}
    assert _get(got, "eventbus_loss", split="train", **lab) == 1.0 / n
    assert _get(got, "eventbus_loss", split="eval", **lab) == 0.25
    assert _get(got, "eventbus_learning_rate", **lab) == pytest.approx(0.01 * n)
    assert math.isnan(_get(got, "eventbus_grad_norm", **lab))
    assert _get(got, "eventbus_step", **lab) == n  # the highest, not the late eval's
    assert _get(got, "eventbus_steps_per_second", **lab) == 2.0  # 0.5 s a step
    assert _get(got, "eventbus_step_duration_seconds", **lab) == 0.5
    assert _get(got, "eventbus_samples_per_second", **lab) == 16.0
    assert _get(got, "eventbus_tokens_per_second", **lab) == 2000.0
    assert _get(got, "eventbus_memory_rss_bytes", **lab) == 100 * 2**20
    assert _get(got, "eventbus_memory_allocated_bytes", **lab) == 2 * 2**20
    assert _get(got, "eventbus_memory_reserved_bytes", **lab) == 4 * 2**20
    assert abs(_get(got, "eventbus_last_event_timestamp_seconds", **lab) - time.time()) < 60

    # the bus's own counters, read at scrape time
    assert _get(got, "eventbus_published_total", **lab) == st.published == 3 * n + 3
    for name in ("failing", "stuck", "prometheus"):
        s = st[name]
        for field in ("published", "delivered", "dropped", "failed"):
            value = _get(got, f"eventbus_subscriber_{field}_total", subscriber=name, **lab)
            assert value == getattr(s, field), (name, field)
        assert _get(got, "eventbus_subscriber_queued", subscriber=name, **lab) == s.queued
    assert _get(got, "eventbus_subscriber_failed_total", subscriber="failing", **lab) == n + 1
    assert _get(got, "eventbus_subscriber_dropped_total", subscriber="stuck", **lab) > 0
    assert ("eventbus_bus_cpu_seconds_total", frozenset(lab.items())) in got
    # every sample carries run and rank
    assert all({"run", "rank"} <= {k for k, _ in labels} for _, labels in got)


def test_run_label_from_run_started_and_rates_from_step_times(bus: EventBus) -> None:
    exporter = PrometheusExporter(0)
    bus.subscribe(exporter)
    with bus:
        url = exporter.wait_listening(10)
        assert _get(_scrape(url), "eventbus_published_total", run="default", rank="0") == 0
        bus.publish(RunStarted(run_id="gpt-7"))
        t0 = time.time_ns()
        for step in range(1, 5):  # no duration_s: the time between StepEnded events
            bus.publish(StepEnded(step=step, ts=t0 + step * 250_000_000, tokens=10))
        bus.flush()
        got = _scrape(url)
    assert _get(got, "eventbus_steps_per_second", run="gpt-7", rank="0") == pytest.approx(4.0)
    assert _get(got, "eventbus_tokens_per_second", run="gpt-7", rank="0") == pytest.approx(40.0)


# -- where and when it listens ---------------------------------------------------------------


def test_listens_only_between_start_and_close_on_loopback() -> None:
    port = _free_ports(1)
    bus = EventBus(drain_interval=0.002)
    exporter = PrometheusExporter(port)
    assert not _listening(port)  # made: nothing listens
    bus.subscribe(exporter)
    assert not _listening(port)  # subscribed to a bus not started: still nothing
    assert exporter.url is None
    with bus:
        assert exporter.wait_listening(10) == f"http://127.0.0.1:{port}/metrics"
        assert _listening(port)
        mine = [
            c.laddr
            for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        ]
        assert [a.ip for a in mine] == ["127.0.0.1"]  # loopback only, by default
    assert not _listening(port)  # closed with the bus: the port is free again
    assert exporter.url is None
    with socket.socket() as s:  # free to bind, not merely refusing connections
        s.bind(("127.0.0.1", port))


def test_port_is_base_plus_local_rank_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    base = _free_ports(2)
    monkeypatch.setenv(PORT_ENV, str(base))
    monkeypatch.setenv("LOCAL_RANK", "1")
    bus = EventBus(rank=3, world_size=1, drain_interval=0.002)
    exporter = PrometheusExporter()
    bus.subscribe(exporter)
    with bus:
        url = exporter.wait_listening(10)
        assert exporter.port == base + 1
        bus.publish(Loss(step=1, value=2.0))
        bus.flush()
        assert _get(_scrape(url), "eventbus_loss", run="default", rank="3", split="train") == 2.0


def test_port_in_use_is_a_clear_error_and_training_goes_on(
    bus: EventBus, caplog: pytest.LogCaptureFixture
) -> None:
    got: list[Event] = []

    def record(ev: Event) -> None:
        got.append(ev)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        exporter = PrometheusExporter(port)
        bus.subscribe(exporter)
        bus.subscribe(record, events=[Loss], policy="block")
        with caplog.at_level(logging.WARNING, logger="eventbus"), bus:
            with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}") as e:
                exporter.wait_listening(10)
            for step in range(1, 11):
                bus.publish(Loss(step=step, value=1.0))
            bus.flush()
            _until(lambda: bus.stats()["prometheus"].state == "disabled")
    assert e.value.errno == errno.EADDRINUSE
    assert PORT_ENV in str(e.value) and "port=0" in str(e.value)  # says what to do
    assert [ev.step for ev in got] == list(range(1, 11))  # the run went on
    assert bus.stats()["prometheus"].dropped == 10  # and what the exporter missed is counted
    assert any(f"cannot listen on 127.0.0.1:{port}" in r.getMessage() for r in caplog.records)


def test_a_forked_child_lets_go_of_the_listening_socket() -> None:
    bus = EventBus(drain_interval=0.002)
    exporter = PrometheusExporter(0)
    bus.subscribe(exporter)
    bus.start()
    exporter.wait_listening(10)
    port = exporter.port
    assert port is not None
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child (a DataLoader worker): wait until the parent has checked
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        bus.close()
        with socket.socket() as s:  # the child, still alive, does not hold the port
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)


# -- bad arguments, the extra, configuration -------------------------------------------------


def test_bad_arguments_fail_where_they_are_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PORT_ENV, raising=False)
    with pytest.raises(ValueError, match=f"needs a port: pass port=N .* or set {PORT_ENV}"):
        PrometheusExporter()
    monkeypatch.setenv(PORT_ENV, "nine")
    with pytest.raises(ValueError, match=f"{PORT_ENV}='nine' is not an integer"):
        PrometheusExporter()
    with pytest.raises(ValueError, match="port must be an int from 0 to 65535"):
        PrometheusExporter(70000)
    with pytest.raises(ValueError, match="host must be"):
        PrometheusExporter(0, host="")
    bus = EventBus()
    with pytest.raises(TypeError, match="runs in the training process"):
        bus.subscribe(PrometheusExporter(0), placement="process")
    bus.close()


def test_without_prometheus_client_an_import_error_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "prometheus_client" else real(name, *args)

    monkeypatch.setattr("importlib.util.find_spec", find_spec)
    with pytest.raises(ImportError, match=r"pip install 'eventbus\[prometheus\]'"):
        PrometheusExporter(0)


def test_importing_the_sinks_does_not_import_prometheus_client() -> None:
    code = (
        "import sys, eventbus, eventbus.sinks\n"
        "from eventbus.sinks import PrometheusExporter\n"
        "assert 'prometheus_client' not in sys.modules, 'imported'\n"
        "PrometheusExporter(0)\n"
        "assert 'prometheus_client' in sys.modules, 'not imported when made'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert proc.returncode == 0, proc.stderr


def test_short_name_in_a_spec() -> None:
    exporter = subscriber_from_spec("prometheus:port=0,run=from-config")
    assert isinstance(exporter, PrometheusExporter)
    assert (exporter.base_port, exporter.run) == (0, "from-config")


@pytest.mark.slow
def test_the_cost_benchmark_measures_a_scraped_rank() -> None:
    from benchmarks import prometheus_cost

    row = prometheus_cost._variant(1, 1, True, seconds=1.0, interval=0.05)
    assert row["scrapes"] >= 5
    assert row["series_per_rank"] == 13 + 5 * 2  # the no-op subscriber and the exporter
    assert row["scrape_cpu_ms"] > 0 and row["bus_cpu_us_per_step"] > 0
    assert row["step_p50_ms"] > 0


# -- a real Prometheus server scraping a two-rank torchrun run -------------------------------

_RANK_SCRIPT = """
import os, sys, time
import torch
import torch.distributed as dist
from eventbus import EventBus
from eventbus.events import Loss, MemorySample, OptimizerStepped
from eventbus.sinks import PrometheusExporter

stop_file, limit_s = sys.argv[1], float(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
bus = EventBus()
exporter = PrometheusExporter(run="e2e")  # port: EVENTBUS_PROMETHEUS_PORT + local rank
bus.subscribe(exporter)
deadline = time.monotonic() + limit_s
with bus:
    print(f"rank {rank} serves {exporter.wait_listening(30)}", flush=True)
    w = torch.randn(32, 32)
    step = 0
    while True:
        step += 1
        with bus.step(step, samples=32, tokens=32 * 64):
            loss = (torch.randn(32, 32) @ w).square().mean()
            bus.publish(Loss(step=step, value=rank + 1.0 / step))
            bus.publish(OptimizerStepped(step=step, lr=1e-3, grad_norm=loss))
            bus.publish(MemorySample(step=step, rss_mb=100.0, allocated_mb=1.0, reserved_mb=2.0))
        time.sleep(0.01)  # the rest of a training step: leaves the CPU to Prometheus
        # both ranks leave at the same step, once the test made the stop file (or time is up)
        done = rank == 0 and (os.path.exists(stop_file) or time.monotonic() > deadline)
        flag = torch.tensor([float(done)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            break
dist.destroy_process_group()
"""


def _query(prom: str, q: str) -> list[dict[str, Any]]:
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def _dashboard_queries(api: str) -> list[str]:
    """The example dashboard's queries (its variables filled in) that return no series."""
    dash = json.loads((ROOT / "examples" / "grafana_dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    fill = {"$run": "e2e", "$rank": ".*", "$__rate_interval": "5s"}
    empty = []
    for expr in exprs:
        q = expr
        for k, v in fill.items():
            q = q.replace(k, v)
        if not _query(api, q):
            empty.append(q)
    return empty


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    """End a process started in its own session, with whatever it started (torchrun's ranks)."""
    if proc is None or proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)  # its own group: only what this test started
        try:
            proc.wait(10)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_real_prometheus_scrapes_both_ranks_of_a_torchrun_run(tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(
            "the `prometheus` server binary is not installed (Debian: `apt-get install "
            "prometheus`; .ci/run installs it), so the real-Prometheus test cannot run"
        )
    base = _free_ports(2)  # rank r serves base + r
    prom_port, rdzv_port = _free_ports(1), _free_ports(1)
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 250ms\n  scrape_timeout: 200ms\n"
        "scrape_configs:\n  - job_name: eventbus\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{base}', '127.0.0.1:{base + 1}']\n"
    )
    script = tmp_path / "train.py"
    script.write_text(_RANK_SCRIPT)
    stop_file = tmp_path / "stop"
    env = {**os.environ, PORT_ENV: str(base), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for var in ("EVENTBUS_SUBSCRIBERS", "EVENTBUS_CONFIG"):
        env.pop(var, None)
    prom_log, run_log = tmp_path / "prometheus.log", tmp_path / "torchrun.log"
    prom = run = None
    try:
        with prom_log.open("wb") as plog, run_log.open("wb") as rlog:
            prom = subprocess.Popen(
                [
                    binary,
                    f"--config.file={tmp_path / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                ],
                stdout=plog,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            run = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc_per_node=2",
                    "--rdzv_backend=c10d",
                    f"--rdzv_endpoint=127.0.0.1:{rdzv_port}",
                    str(script),
                    str(stop_file),
                    "90",
                ],
                stdout=rlog,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
                cwd=tmp_path,
            )
        api = f"http://127.0.0.1:{prom_port}"
        series: list[dict[str, Any]] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if run.poll() is not None or prom.poll() is not None:
                break
            try:
                series = _query(api, 'eventbus_loss{run="e2e",split="train"}')
            except OSError:  # Prometheus not answering yet
                series = []
            if {s["metric"]["rank"] for s in series} == {"0", "1"}:
                break
            time.sleep(0.1)
        logs = f"\ntorchrun:\n{run_log.read_text()[-3000:]}\nprometheus:\n"
        logs += prom_log.read_text()[-3000:]
        by_rank = {s["metric"]["rank"]: s for s in series}
        assert set(by_rank) == {"0", "1"}, f"series found: {series}{logs}"
        for rank, s in by_rank.items():  # each rank's series came from its own port
            assert s["metric"]["instance"] == f"127.0.0.1:{base + int(rank)}"
            assert s["metric"]["job"] == "eventbus"
        assert 0 < float(by_rank["0"]["value"][1]) <= 1.0 < float(by_rank["1"]["value"][1]) <= 2
        counters = _query(api, 'eventbus_subscriber_published_total{subscriber="prometheus"}')
        assert {s["metric"]["rank"] for s in counters} == {"0", "1"}
        # every query of the example Grafana dashboard is valid PromQL and finds data here
        empty = _dashboard_queries(api)
        while empty and time.monotonic() < deadline + 20:
            time.sleep(0.2)  # rate() needs two scrapes inside its window
            empty = _dashboard_queries(api)
        assert not empty, f"dashboard queries without data: {empty}{logs}"
        stop_file.touch()
        assert run.wait(60) == 0, logs
    finally:
        _stop(run)
        _stop(prom)
