"""What TensorBoardSink builds beyond scalars: histograms, texts and the HParams summaries.

Histogram shapes taken from `TensorStats.histogram`:

- `{"min", "max", "counts"}`: what `watch(histogram=True)` publishes, `len(counts)` equal bins
  from min to max (torch.histc's bins);
- `{"counts", "edges"}` (or `bin_edges`, `bins`), or a `(counts, edges)` pair, with
  `len(edges) == len(counts) + 1`;
- a flat sequence or tensor of raw values (binned by TensorBoard).

Anything else is `Unusable(reason)`: the sink counts it and logs a rate-limited warning.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import orjson

from eventbus.events import (
    DivergenceDetected,
    Event,
    MemoryLeakSuspected,
    RunEnded,
    RunStarted,
    StopRequested,
)

__all__ = [
    "HParamsRun",
    "Unusable",
    "histogram",
    "hparams_summaries",
    "hparams_values",
    "texts_of",
]

_EDGE_KEYS = ("edges", "bin_edges", "bins")
_STATUS = {  # RunEnded.status -> the HParams plugin's session status
    "completed": "STATUS_SUCCESS",
    "stopped": "STATUS_SUCCESS",  # asked to stop (early stopping, a monitor): it finished
    "failed": "STATUS_FAILURE",
    "aborted": "STATUS_FAILURE",
    "interrupted": "STATUS_FAILURE",
}


class Unusable(NamedTuple):
    """A histogram shape the sink cannot draw, and why."""

    reason: str


def histogram(h: Any) -> tuple[str, Any] | Unusable | None:
    """("raw", add_histogram_raw kwargs), ("values", x), `Unusable`, or None (nothing to draw:
    no histogram, or no finite value in the tensor)."""
    if h is None:
        return None
    if isinstance(h, Mapping):
        return _from_mapping(h)
    if isinstance(h, tuple | list) and len(h) == 2 and all(_seq(x) for x in h):
        return _from_edges(*h)
    return _from_values(h)


def _from_mapping(h: Mapping[Any, Any]) -> tuple[str, Any] | Unusable | None:
    counts = h.get("counts")
    edges = next((h[k] for k in _EDGE_KEYS if h.get(k) is not None), None)
    if counts is not None and edges is None and "min" in h and "max" in h:
        return _from_range(h["min"], h["max"], counts)
    if counts is None or edges is None:
        keys = sorted(map(str, h))
        return Unusable(f"a dict needs counts with min and max, or counts with edges; got {keys}")
    return _from_edges(counts, edges)


def _from_values(h: Any) -> tuple[str, Any] | Unusable | None:
    """Raw values as a flat float64 tensor of the finite ones (TensorBoard bins them)."""
    import torch

    if not (isinstance(h, list | tuple) or hasattr(h, "tolist")):
        return Unusable(f"{type(h).__name__} is no histogram shape")
    if isinstance(h, list | tuple) and not all(_number(v) for v in h):
        return Unusable("a sequence of raw values must hold numbers only")
    try:
        t = torch.as_tensor(h, dtype=torch.float64).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as e:
        return Unusable(f"raw values that torch cannot read: {e}")
    t = t[t.isfinite()]  # NaN/Inf are counted in nan_count/inf_count; binning needs finite
    return ("values", t) if t.numel() else None


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _from_range(lo: Any, hi: Any, counts: Any) -> tuple[str, Any] | Unusable | None:
    if not _seq(counts):
        return Unusable("counts must be a sequence")
    c = _floats(counts)
    lo_f, hi_f = _float(lo), _float(hi)
    if c is None or lo_f is None or hi_f is None or not c:
        return Unusable("min, max and counts must be numbers, with at least one count")
    if sum(c) == 0:
        return None  # no finite value in the tensor: its nan/inf counts say so
    if not (math.isfinite(lo_f) and math.isfinite(hi_f)) or hi_f < lo_f:
        return Unusable(f"min {lo_f} and max {hi_f} are no finite range")
    if hi_f == lo_f:  # every value the same: one bucket (zero-width buckets draw nothing)
        return ("raw", _raw([lo_f, lo_f], [sum(c)]))
    n = len(c)
    edges = [lo_f + (hi_f - lo_f) * i / n for i in range(n)] + [hi_f]
    return ("raw", _raw(edges, c))


def _from_edges(counts: Any, edges: Any) -> tuple[str, Any] | Unusable | None:
    c = _floats(counts) if _seq(counts) else None
    e = _floats(edges) if _seq(edges) else None
    if c is None or e is None:
        return Unusable("counts and edges must be sequences of numbers")
    if len(e) != len(c) + 1 or not c:
        return Unusable(f"need len(edges) == len(counts) + 1; got {len(e)} and {len(c)}")
    if sum(c) == 0:
        return None
    if not all(math.isfinite(x) for x in e) or any(b < a for a, b in itertools.pairwise(e)):
        return Unusable("edges must be finite and increasing")
    return ("raw", _raw(e, c))


def _raw(e: list[float], c: list[float]) -> dict[str, Any]:
    centers = [(a + b) / 2 for a, b in itertools.pairwise(e)]
    return {
        "min": e[0],
        "max": e[-1],
        "num": sum(c),
        "sum": sum(n * x for n, x in zip(c, centers, strict=True)),
        "sum_squares": sum(n * x * x for n, x in zip(c, centers, strict=True)),
        "bucket_limits": e[1:],
        "bucket_counts": c,
    }


def _float(v: Any) -> float | None:
    if not isinstance(v, int | float) and hasattr(v, "numel") and v.numel() == 1:
        v = v.item()  # a one-element CPU tensor: no device sync here
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def _floats(x: Any) -> list[float] | None:
    out = [_float(v) for v in _tolist(x)]
    return None if any(v is None for v in out) else [v for v in out if v is not None]


def _seq(x: Any) -> bool:
    return isinstance(x, list | tuple) or hasattr(x, "tolist")


def _tolist(x: Any) -> list[Any]:
    return list(x.tolist()) if hasattr(x, "tolist") else list(x)


# -- text ------------------------------------------------------------------------------------


def texts_of(ev: Event, step: int) -> Iterator[tuple[str, str]]:
    """The (tag, markdown) texts of `ev`: run config and info, detections, stop and end."""
    match ev:
        case RunStarted():
            info = {
                "run_id": ev.run_id,
                "total_steps": ev.total_steps,
                "world_size": ev.world_size,
                "resumed_from_step": ev.resumed_from_step,
            }
            yield "run/config", _code(ev.config)
            yield "run/info", _code({k: v for k, v in info.items() if v is not None})
        case DivergenceDetected():
            yield (
                "divergence/detected",
                (
                    f"**step {ev.step}**: {ev.metric} = {ev.value} (baseline {ev.baseline}): "
                    f"{ev.reason}"
                ),
            )
        case MemoryLeakSuspected():
            yield (
                "memory/leak_suspected",
                (
                    f"**step {ev.step}**: {ev.metric} growing "
                    f"{ev.rate_mb_per_step:.3f} MB/step over {ev.window} steps"
                ),
            )
        case StopRequested():
            kind = "abort" if ev.abort else "stop"
            yield "run/stop", f"**{kind}** at step {step} by {ev.source}: {ev.reason}"
        case RunEnded():
            yield "run/ended", f"**{ev.status}** at step {step}: {ev.reason or ''}"


def _code(obj: Any) -> str:
    try:
        body = orjson.dumps(
            obj, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS, default=str
        ).decode()
    except TypeError:
        body = repr(obj)
    return "```\n" + body + "\n```"


# -- HParams ----------------------------------------------------------------------------------


class HParamsRun:
    """One rank's run as the HParams plugin sees it: its config and the metric tags written."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.hparams = hparams_values(config)
        self.metrics: dict[str, float] = {}  # tag -> last value (the plugin reads the tag)
        self.written = False


def hparams_values(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`config` flattened for the plugin: nested keys joined with ".", values that are not a
    bool, number or string written as JSON text, None left out."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(hparams_values(v, key + "."))
        elif isinstance(v, bool | str) or (isinstance(v, int | float) and math.isfinite(v)):
            out[key] = v
        elif v is not None:
            try:
                out[key] = orjson.dumps(v, option=orjson.OPT_NON_STR_KEYS, default=str).decode()
            except TypeError:
                out[key] = repr(v)
    return out


def hparams_summaries(run: HParamsRun, status: str | None) -> list[Any]:
    """The plugin's experiment, session start and session end summaries for `run` (its metrics
    are the scalar tags already written: the plugin shows each one's last value)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
    from torch.utils.tensorboard.summary import hparams

    exp, ssi, _ = hparams(run.hparams, dict(run.metrics))  # type: ignore[no-untyped-call]
    end = plugin_data_pb2.SessionEndInfo(
        status=api_pb2.Status.Value(_STATUS.get(status or "", "STATUS_UNKNOWN"))
    )
    content = plugin_data_pb2.HParamsPluginData(
        session_end_info=end, version=metadata.PLUGIN_DATA_VERSION
    )
    meta = SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(
            plugin_name=metadata.PLUGIN_NAME, content=content.SerializeToString()
        )
    )
    sei = Summary(value=[Summary.Value(tag=metadata.SESSION_END_INFO_TAG, metadata=meta)])
    return [exp, ssi, sei]
