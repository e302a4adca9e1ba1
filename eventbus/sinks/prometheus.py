"""PrometheusExporter: each rank serves `/metrics` for Prometheus to scrape.

    training thread          bus thread (on_events)           HTTP thread (one scrape)
    bus.publish(Loss) --->   latest values into a dict  <---  collect(): those values, and the
      (nothing more)           (a few dict stores)             counters of bus.stats() read now

It runs in the training process (`placement = "thread"`): it serves that bus's own counters.
The training thread pays nothing beyond its usual publish; the bus thread stores a few floats
per event, and a scrape builds the text on the server's thread. It listens only between
`on_start` and `on_close`, on 127.0.0.1 unless told otherwise, on port base + local rank (the
base from `port=` or `EVENTBUS_PROMETHEUS_PORT`; 0 asks the OS for any free port).
Metric names, labels, ports, service discovery and costs: docs/cluster.md.
"""

from __future__ import annotations

import errno
import importlib.util
import math
import os
import threading
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

from eventbus.core import BusHandle
from eventbus.core.fork import call_after_fork
from eventbus.events import Event, Loss, MemorySample, OptimizerStepped, RunStarted, StepEnded
from eventbus.sinks._scalars import num  # a float from a number or a CPU scalar tensor

if TYPE_CHECKING:
    from eventbus.sinks._prometheus import MetricsServer

__all__ = ["PORT_ENV", "PrometheusExporter"]

PORT_ENV = "EVENTBUS_PROMETHEUS_PORT"  # the base port; each local rank adds its index
_MB = 1024.0 * 1024.0  # MemorySample's MB are MiB (eventbus.monitors)
_Values = dict[tuple[str, int, str], float]  # (gauge key, rank, extra label) -> value
_MEMORY = (("rss", "rss_mb"), ("allocated", "allocated_mb"), ("reserved", "reserved_mb"))


class PrometheusExporter:
    """Serve this rank's latest loss, lr, grad norm, step, speed and memory, and the bus's
    published/delivered/dropped/failed counters per subscriber, labelled `run` and `rank`.

    `port`: the base port (local rank added; 0: any free port), else `EVENTBUS_PROMETHEUS_PORT`.
    `run`: the `run` label (else `RunStarted.run_id`, else "default"). `window`: about how many
    steps the rates average over. `wait_listening()` returns the URL once serving.
    """

    events: ClassVar[tuple[type[Event], ...]] = (
        RunStarted,
        StepEnded,
        Loss,
        OptimizerStepped,
        MemorySample,
    )
    policy: ClassVar[str] = "drop_oldest"  # a few dict stores per event: it never backs up
    maxsize: ClassVar[int] = 10_000
    placement: ClassVar[str] = "thread"  # serves this process's bus: never in the sidecar
    name: ClassVar[str] = "prometheus"

    def __init__(
        self,
        port: int | None = None,
        *,
        host: str = "127.0.0.1",
        run: str | None = None,
        window: int = 32,
        poll_interval: float = 0.25,
    ) -> None:
        if importlib.util.find_spec("prometheus_client") is None:
            raise ImportError(
                "PrometheusExporter needs prometheus_client: pip install 'eventbus[prometheus]'"
            )
        # Imported here, on the constructing thread, not by the bus thread mid-run.
        import eventbus.sinks._prometheus  # noqa: F401

        self.base_port = _base_port(port)
        if not isinstance(host, str) or not host:
            raise ValueError(f"host must be a non-empty address string, got {host!r}")
        if run is not None and not isinstance(run, str):
            raise TypeError(f"run must be a string label or None, got {run!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1 step, got {window!r}")
        if not poll_interval > 0:
            raise ValueError(f"poll_interval must be > 0 seconds, got {poll_interval!r}")
        self.host = host
        self.run = run
        self.window = window
        self.poll_interval = poll_interval
        self.error: OSError | None = None  # why it could not listen (also logged by the bus)
        self._run_id: str | None = None  # RunStarted.run_id, when `run` was not given
        self._rank = 0
        self._server: MetricsServer | None = None
        self._started = threading.Event()  # set once on_start bound the port, or failed to
        # the latest values: written by the bus thread only, read by the HTTP thread as a copy
        self._values: _Values = {}
        self._alpha = 2.0 / (window + 1)  # the weight of the newest step in the averages
        self._avg: dict[int, dict[str, float]] = {}  # rank -> step_s, samples, tokens per s
        self._last_end: dict[int, int] = {}  # rank -> ts of its previous StepEnded

    # -- where it listens ----------------------------------------------------------------------

    @property
    def port(self) -> int | None:
        """The port it listens on (None when not listening)."""
        server = self._server
        return None if server is None else server.port

    @property
    def url(self) -> str | None:
        """`http://host:port/metrics` while listening, else None."""
        server = self._server
        if server is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{server.port}/metrics"

    def wait_listening(self, timeout: float | None = None) -> str:
        """The URL once it listens; raises the `OSError` that stopped it, or `TimeoutError`."""
        if not self._started.wait(timeout):
            raise TimeoutError(
                f"PrometheusExporter not listening after {timeout} s: is it subscribed to a "
                "started bus?"
            )
        e = self.error
        if e is not None:  # a new exception: the bus thread raised that one object already
            raise type(e)(e.errno, e.strerror)
        url = self.url
        if url is None:
            raise RuntimeError("PrometheusExporter was closed")
        return url

    # -- subscriber hooks ----------------------------------------------------------------------

    def on_start(self, bus: BusHandle | None = None) -> None:
        """Listen on base + local rank (a sync hook: binding may resolve names, off the loop)."""
        from eventbus.sinks._prometheus import MetricsCollector, MetricsServer

        self._rank = bus.rank if bus is not None else 0
        local = bus.local_rank if bus is not None else 0
        port = self.base_port + local if self.base_port else 0
        stats = getattr(bus, "stats", None)
        collector = MetricsCollector(
            lambda: dict(self._values),  # one copy, atomic under the GIL
            self._run_label,
            lambda: self._rank,
            stats if callable(stats) else None,
        )
        try:
            if port > 65535:
                raise OSError(
                    errno.EINVAL,
                    f"PrometheusExporter cannot listen on port {port} (base {self.base_port} + "
                    f"local rank {local}); pass a base port below {65536 - local}",
                )
            self._server = MetricsServer(collector, self.host, port, self.poll_interval)
        except OSError as e:
            self.error = e
            raise  # the bus logs it and disables this subscriber; training goes on
        finally:
            self._started.set()
        call_after_fork(self._forked)

    async def on_events(self, batch: list[Event]) -> None:
        """Keep the latest values (on the bus thread: a few dict stores per event)."""
        values = self._values
        for ev in batch:
            rank = self._rank if ev.rank is None else ev.rank
            if ev.step is not None and ev.step > values.get(("step", rank, ""), -math.inf):
                values["step", rank, ""] = float(ev.step)  # the highest: a late eval goes back
            if ev.ts is not None:
                values["last_event", rank, ""] = ev.ts / 1e9
            if isinstance(ev, Loss):
                _put(values, "loss", rank, ev.value, ev.split)
            elif isinstance(ev, StepEnded):
                self._step_ended(ev, rank)
            elif isinstance(ev, OptimizerStepped):
                _put(values, "lr", rank, ev.lr)
                _put(values, "grad_norm", rank, ev.grad_norm)
            elif isinstance(ev, MemorySample):
                for key, field in _MEMORY:
                    mb = num(getattr(ev, field))
                    if mb is not None:
                        values[key, rank, ""] = mb * _MB
            elif isinstance(ev, RunStarted) and ev.run_id:
                self._run_id = str(ev.run_id)

    def on_close(self) -> None:
        """Stop listening and free the port (sync: the server's shutdown waits one poll)."""
        server, self._server = self._server, None
        if server is not None:
            server.close()

    def __reduce__(self) -> NoReturn:
        raise TypeError(
            "PrometheusExporter runs in the training process: it serves that bus's counters. "
            "Subscribe it without placement='process'."
        )

    # -- internals -----------------------------------------------------------------------------

    def _run_label(self) -> str:
        return self.run or self._run_id or "default"

    def _step_ended(self, ev: StepEnded, rank: int) -> None:
        """Rates averaged over about `window` steps (exponentially weighted): their durations,
        else the time between them. O(1) a step."""
        dur = num(ev.duration_s)
        prev = self._last_end.get(rank)
        if ev.ts is not None:
            self._last_end[rank] = ev.ts
            if dur is None and prev is not None and ev.ts > prev:
                dur = (ev.ts - prev) / 1e9
        if dur is None or not (dur > 0 and math.isfinite(dur)):
            return
        avg = self._avg.get(rank)
        if avg is None:  # the first step: the average starts at its values
            avg = self._avg[rank] = {"step_s": dur}
        a = self._alpha
        avg["step_s"] += a * (dur - avg["step_s"])
        values, mean = self._values, avg["step_s"]
        values["step_s", rank, ""] = mean
        values["steps_per_s", rank, ""] = 1.0 / mean
        for name, n in (("samples", ev.samples), ("tokens", ev.tokens)):
            per_s = num(n)
            if per_s is None:
                continue
            per_s /= dur
            old = avg.setdefault(name, per_s)
            values[f"{name}_per_s", rank, ""] = avg[name] = old + a * (per_s - old)

    def _forked(self) -> None:
        """A forked child (DataLoader worker) lets go of the listening socket it inherited."""
        server, self._server = self._server, None
        if server is not None:
            server.close_after_fork()


def _base_port(port: int | None) -> int:
    """`port`, else the environment's base port; a clear error when neither is usable."""
    where = "port"
    if port is None:
        raw = os.environ.get(PORT_ENV, "").strip()
        if not raw:
            raise ValueError(
                f"PrometheusExporter needs a port: pass port=N (each local rank listens on "
                f"N + its local rank; 0 for any free port) or set {PORT_ENV}=N"
            )
        where = PORT_ENV
        try:
            port = int(raw)
        except ValueError:
            raise ValueError(f"{PORT_ENV}={raw!r} is not an integer port") from None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"{where} must be an int from 0 to 65535, got {port!r}")
    return port


def _put(values: _Values, key: str, rank: int, v: Any, x: str = "") -> None:
    f = num(v)
    if f is not None:  # NaN and Inf are kept: Prometheus shows them as they are
        values[key, rank, x] = f
