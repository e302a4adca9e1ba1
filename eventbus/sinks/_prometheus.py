"""The parts of PrometheusExporter that need `prometheus_client`: its collector and HTTP server.

Imported only when an exporter is made, so `import eventbus.sinks` never imports the client.
The collector builds every metric at scrape time, on the server's thread: the gauges from the
values the bus thread left in a dict, the counters from `bus.stats()` read then (no polling
thread). The server is the standard library's WSGI server on one daemon thread, serving the
client's `make_wsgi_app` over our own registry, silent (no access log, no stderr).
"""

from __future__ import annotations

import errno
import io
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TextIO
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from eventbus.log import RateLimiter, get_logger

__all__ = ["GAUGES", "MetricsCollector", "MetricsServer"]

# Gauge key -> (metric name, help, extra label or ""). Keys are what the exporter stores.
GAUGES: dict[str, tuple[str, str, str]] = {
    "loss": ("eventbus_loss", "Latest loss, per split (Loss events).", "split"),
    "lr": ("eventbus_learning_rate", "Latest learning rate (OptimizerStepped.lr).", ""),
    "grad_norm": ("eventbus_grad_norm", "Latest gradient norm (OptimizerStepped).", ""),
    "step": ("eventbus_step", "Highest training step seen.", ""),
    "steps_per_s": ("eventbus_steps_per_second", "Steps per second over recent steps.", ""),
    "samples_per_s": ("eventbus_samples_per_second", "Samples per second, recent steps.", ""),
    "tokens_per_s": ("eventbus_tokens_per_second", "Tokens per second over recent steps.", ""),
    "step_s": ("eventbus_step_duration_seconds", "Mean step time over recent steps.", ""),
    "rss": ("eventbus_memory_rss_bytes", "Process resident memory (MemorySample).", ""),
    "allocated": ("eventbus_memory_allocated_bytes", "CUDA memory allocated (MemorySample).", ""),
    "reserved": ("eventbus_memory_reserved_bytes", "CUDA memory reserved (MemorySample).", ""),
    "last_event": ("eventbus_last_event_timestamp_seconds", "Wall time of the latest event.", ""),
}
# SubscriberStats field -> (counter name, help): the bus's own, per subscriber.
_COUNTERS = {
    "published": ("eventbus_subscriber_published", "Events routed to this subscriber."),
    "delivered": ("eventbus_subscriber_delivered", "Events it handled without raising."),
    "dropped": ("eventbus_subscriber_dropped", "Events dropped (overflow, disabled, close)."),
    "failed": ("eventbus_subscriber_failed", "Events whose handling raised."),
}
Values = Mapping[tuple[str, int, str], float]  # (gauge key, rank, extra label) -> value
_log_limit = RateLimiter(60.0)


class MetricsCollector:
    """Every metric, built when Prometheus scrapes: `values()` for gauges, `stats()` counters."""

    def __init__(
        self,
        values: Callable[[], Values],
        run: Callable[[], str],
        rank: Callable[[], int],
        stats: Callable[[], Any] | None,
    ) -> None:
        self._values, self._run, self._rank, self._stats = values, run, rank, stats

    def collect(self) -> Iterator[Metric]:
        """The gauges, then the bus's counters (read from `bus.stats()` now)."""
        run = self._run()
        by_key: dict[str, list[tuple[list[str], float]]] = {}
        for (key, rank, extra), v in self._values().items():
            labels = [run, str(rank), extra] if GAUGES[key][2] else [run, str(rank)]
            by_key.setdefault(key, []).append((labels, v))
        for key, (name, doc, extra) in GAUGES.items():
            samples = by_key.get(key)
            if samples:
                names = ["run", "rank", extra] if extra else ["run", "rank"]
                g = GaugeMetricFamily(name, doc, labels=names)
                for labels, v in samples:
                    g.add_metric(labels, v)
                yield g
        yield from self._bus(run, str(self._rank()))

    def _bus(self, run: str, rank: str) -> Iterator[Metric]:
        if self._stats is None:  # a handle without stats(): gauges only
            return
        try:
            st = self._stats()
        except Exception as e:  # our own code, not a user's: a scrape must still answer
            ok, held = _log_limit.allow("stats")
            if ok:
                get_logger().warning(
                    "PrometheusExporter: bus.stats() failed; counters left out of this scrape",
                    error=f"{type(e).__name__}: {e}",
                    not_logged_since=held,
                )
            return
        total = CounterMetricFamily(
            "eventbus_published", "Events accepted by publish().", labels=["run", "rank"]
        )
        total.add_metric([run, rank], st.published)
        yield total
        for field, (name, doc) in _COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=["run", "rank", "subscriber"])
            for sub, s in st.subscribers.items():
                c.add_metric([run, rank, sub], getattr(s, field))
            yield c
        queued = GaugeMetricFamily(
            "eventbus_subscriber_queued",
            "Events waiting in this subscriber's queue.",
            labels=["run", "rank", "subscriber"],
        )
        for sub, s in st.subscribers.items():
            queued.add_metric([run, rank, sub], s.queued)
        yield queued
        if st.cost is not None:
            cpu = CounterMetricFamily(
                "eventbus_bus_cpu_seconds",
                "CPU seconds of the bus thread (routing, async subscribers).",
                labels=["run", "rank"],
            )
            cpu.add_metric([run, rank], st.cost.bus_cpu_s)
            yield cpu
            pub = CounterMetricFamily(
                "eventbus_publish_seconds",
                "Seconds the training thread spent inside publish().",
                labels=["run", "rank"],
            )
            pub.add_metric([run, rank], st.cost.publish_s)
            yield pub


class _Handler(WSGIRequestHandler):
    """No access log and nothing on stderr (library etiquette); errors go to our logger."""

    timeout = 10.0  # a client that stops sending or reading cannot hold the server longer

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def get_stderr(self) -> TextIO:
        self.errors = io.StringIO()
        return self.errors

    def handle(self) -> None:
        super().handle()
        text = getattr(self, "errors", None)
        if text is not None and text.getvalue():
            _log_error("a /metrics request failed", text.getvalue())


class _Server(WSGIServer):
    """One request at a time on the serving thread: no thread started per scrape (a scrape
    costs about 1 ms of CPU; a thread start more, on a busy VM)."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        import traceback

        _log_error("a /metrics connection failed", traceback.format_exc())


class _Server6(_Server):
    address_family = socket.AF_INET6


def _log_error(what: str, detail: str) -> None:
    ok, held = _log_limit.allow(what)
    if ok:
        get_logger().warning(
            "PrometheusExporter: " + what, detail=detail[-2000:], not_logged_since=held
        )


def _advice(code: int | None, port: int) -> str:
    if code == errno.EADDRINUSE:
        return (
            f"another process holds port {port} (an earlier run, another job, or another rank "
            "with the same local rank); pass another port= or set EVENTBUS_PROMETHEUS_PORT to "
            "a free base port (each local rank listens on base + its local rank), or port=0 "
            "for any free port"
        )
    if code == errno.EACCES:
        return "ports below 1024 need privileges; pass a port above 1023"
    if code == errno.EADDRNOTAVAIL:
        return "the host is not an address of this machine; pass host='127.0.0.1'"
    return "pass another host= or port="


class MetricsServer:
    """`/metrics` of `collector` over HTTP on `host:port`, served by a daemon thread."""

    def __init__(self, collector: MetricsCollector, host: str, port: int, poll_s: float) -> None:
        registry = CollectorRegistry()  # our own: the client's global registry stays untouched
        registry.register(collector)
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            cls = _Server6 if family == socket.AF_INET6 else _Server
            self._httpd = cls((host, port), _Handler)
        except OSError as e:
            err = OSError(
                e.errno,
                f"PrometheusExporter cannot listen on {host}:{port}: "
                f"{e.strerror or e}; {_advice(e.errno, port)}",
            )
            raise err from None
        self._httpd.set_app(make_wsgi_app(registry))
        self.host = host
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            args=(poll_s,),
            name=f"eventbus-prometheus:{self.port}",
            daemon=True,
        )
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and free the port (waits at most one poll interval, then `timeout`)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout)

    def close_after_fork(self) -> None:
        """In a forked child: let go of the listening socket (no thread serves it here)."""
        self._httpd.socket.close()
