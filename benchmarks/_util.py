"""Shared benchmark helpers: percentiles, interleaved timing, machine and version info."""

from __future__ import annotations

import gc
import importlib.metadata
import os
import platform
import resource
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = [
    "blockwise_inflation",
    "call_overhead_ns",
    "flatten",
    "inflation",
    "interleave_blocks",
    "interleave_calls",
    "load_average",
    "machine",
    "peak_rss_mb",
    "percentile",
    "summarize",
    "time_calls",
    "versions",
]


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100) of already sorted values, nearest rank."""
    if not sorted_values:
        raise ValueError("percentile() of no samples: the benchmark recorded nothing")
    i = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return float(sorted_values[i])


def summarize(values: Iterable[float]) -> dict[str, float]:
    """p50 / p90 / p99 / p99.9 / mean / n of `values`."""
    s = sorted(values)
    return {
        "p50": percentile(s, 50),
        "p90": percentile(s, 90),
        "p99": percentile(s, 99),
        "p999": percentile(s, 99.9),
        "mean": sum(s) / len(s),
        "n": float(len(s)),
    }


def inflation(value: float, base: float) -> float:
    """Relative slowdown of `value` against `base`: 0.02 means 2% slower."""
    return value / base - 1.0


def _noop(ev: Any) -> None:
    return None


def call_overhead_ns(n: int = 200_000) -> float:
    """Median cost of timing one empty Python call with two perf_counter_ns reads.

    Subtracted from every per-call sample: what remains is the callee's own cost.
    """
    samples = time_calls(_noop, [None] * n)
    samples.sort()
    return percentile(samples, 50)


def time_calls(fn: Callable[[Any], Any], args: Sequence[Any]) -> list[int]:
    """Per-call wall time in ns of `fn(a)` for each `a` (timer overhead included)."""
    pc = time.perf_counter_ns
    out = [0] * len(args)
    for i, a in enumerate(args):
        t0 = pc()
        fn(a)
        out[i] = pc() - t0
    return out


def interleave_calls(
    contenders: dict[str, tuple[Callable[[int], Sequence[Any]], Callable[[Any], Any]]],
    *,
    rounds: int,
    calls: int,
    between: Callable[[str], None] | None = None,
) -> dict[str, list[float]]:
    """Time every contender per call, alternating between them round by round.

    `contenders[name] = (make_args, fn)`: `make_args(calls)` builds the round's arguments
    (untimed, e.g. fresh events), then `fn(arg)` is timed once per argument. The order of
    contenders rotates each round so drift (load, frequency, heap growth) hits all alike.
    `between(name)` runs untimed after each contender's round (e.g. let the bus drain).
    Returns per-call samples in ns with the empty-call overhead subtracted.
    """
    gc.collect()
    gc.freeze()  # the heap built so far (torch, transformers) is not rescanned each round
    overhead = call_overhead_ns()
    names = list(contenders)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            make_args, fn = contenders[name]
            args = make_args(calls)
            gc.collect()
            raw = time_calls(fn, args)
            samples[name].extend(max(0.0, x - overhead) for x in raw)
            if between is not None:
                between(name)
    return samples


def interleave_blocks(
    variants: dict[str, Callable[[int], list[float]]], *, blocks: int
) -> dict[str, list[list[float]]]:
    """Run `variants[name](block)` block after block, rotating the order each block.

    Each call returns that block's samples (e.g. per-step times); rotating a/b/c, b/c/a,
    c/a/b cancels slow drift and any advantage of going first. Returns, per variant, the
    samples of each block in order (flatten them for pooled percentiles).
    """
    names = list(variants)
    out: dict[str, list[list[float]]] = {n: [] for n in names}
    for b in range(blocks):
        k = b % len(names)
        for name in names[k:] + names[:k]:
            out[name].append(variants[name](b))
    return out


def flatten(blocks: Iterable[list[float]]) -> list[float]:
    """One list of the samples of every block."""
    return [x for block in blocks for x in block]


def blockwise_inflation(blocks: list[list[float]], base: list[list[float]]) -> float:
    """Median over blocks of (p50 of block i / p50 of the baseline's block i) - 1.

    Pairs each block with the baseline block run next to it, so slow drift in the
    machine's load cancels within the pair.
    """
    ratios = sorted(
        percentile(sorted(b), 50) / percentile(sorted(a), 50)
        for b, a in zip(blocks, base, strict=True)
    )
    return percentile(ratios, 50) - 1.0


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB.

    Linux: VmHWM of /proc/self/status (the high-water mark of this address space; ru_maxrss
    would carry over the parent's peak into a child started with fork + exec).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024 if sys.platform != "darwin" else kib / 2**20


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages (empty where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "load_average": load_average(),
        "switch_interval_s": sys.getswitchinterval(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import psutil

        info["memory_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return info


_PACKAGES = (
    "eventbus",
    "torch",
    "anyio",
    "orjson",
    "structlog",
    "numpy",
    "transformers",
    "pytorch-lightning",
    "blinker",
    "tensorboard",
    "matplotlib",
    "psutil",
    "mosaicml",
)


def versions() -> dict[str, str | None]:
    """Installed versions of what the benchmarks touch (None: not installed)."""
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out
