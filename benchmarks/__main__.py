"""Run every benchmark: `python -m benchmarks [--quick] [--json FILE] [--plot PNG] [--doc MD]`.

Results are flat dotted keys (`overhead.eventbus_publish_p50_ns`, `stall.none_p50_ms`, ...)
plus `machine` and `versions`. `--doc` rewrites the table between the markers
`<!-- benchmarks:table:start -->` and `<!-- benchmarks:table:end -->` of a Markdown file and
leaves the rest of it alone.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._util import load_average, machine, versions

START = "<!-- benchmarks:table:start -->"
END = "<!-- benchmarks:table:end -->"

REQUIRED = (
    "overhead.eventbus_publish_p50_ns",
    "overhead.eventbus_publish_p99_ns",
    "overhead.hf_callbackhandler_4_p50_ns",
    "overhead.lightning_hooks_4_p50_ns",
    "overhead.blinker_4_p50_ns",
    "overhead.sync_list_4_p50_ns",
    "stall.none_p50_ms",
    "stall.none_p99_ms",
    "stall.eventbus_p50_ms",
    "stall.eventbus_p99_ms",
    "stall.inline_p50_ms",
    "stall.inline_p99_ms",
    "throughput.events",
    "throughput.events_per_s",
    "throughput.lost",
    "throughput.rss_peak_mb",
    "gil.none_p50_ms",
    "gil.in_thread_p50_ms",
    "gil.process_p50_ms",
)


def _optional_part(module: str, prefix: str, quick: bool) -> dict[str, Any]:
    """A colleague's `run(quick)` if the module exists; its keys under `prefix.`."""
    if importlib.util.find_spec(module) is None:
        return {f"{prefix}.note": f"{module} does not exist yet; not measured"}
    mod = importlib.import_module(module)
    got: dict[str, Any] = mod.run(quick)
    return {(k if k.startswith(prefix + ".") else f"{prefix}.{k}"): v for k, v in got.items()}


def _gil(quick: bool) -> dict[str, Any]:
    out = {"gil.none_p50_ms": None, "gil.in_thread_p50_ms": None, "gil.process_p50_ms": None}
    out.update(_optional_part("benchmarks.gil", "gil", quick))
    return out


def _stall(quick: bool, device: str, samples_out: dict[str, Any]) -> dict[str, Any]:
    from benchmarks import stall

    out, samples = stall.measure(quick, "cpu")
    samples_out["cpu"] = samples
    out.update(stall.subscriber_costs(100 if quick else 300))
    if device == "cuda":
        gpu, gpu_samples = stall.measure(quick, "cuda")
        samples_out["cuda"] = gpu_samples
        out.update({k.replace("stall.", "stall_cuda.", 1): v for k, v in gpu.items()})
    return out


def _real_loop(quick: bool, device: str) -> dict[str, Any]:
    """The GPT loop of `benchmarks/real_loop.py` on `device`; compiled rows in a full run only."""
    if importlib.util.find_spec("benchmarks.real_loop") is None:
        return {"real_loop.note": "benchmarks.real_loop does not exist yet; not measured"}
    mod = importlib.import_module("benchmarks.real_loop")
    got: dict[str, Any] = mod.run(quick, device)
    return got


def _derived(r: dict[str, Any]) -> dict[str, Any]:
    """Ratios and target verdicts (None where an input is missing)."""

    def get(k: str) -> float | None:
        v = r.get(k)
        return float(v) if isinstance(v, int | float) else None

    def ratio(a: str, b: str) -> float | None:
        x, y = get(a), get(b)
        return None if x is None or y is None or y == 0 else x / y

    out: dict[str, Any] = {}
    hf = ratio("overhead.hf_callbackhandler_4_p50_ns", "overhead.eventbus_publish_p50_ns")
    infl_p50 = ratio("stall.eventbus_p50_ms", "stall.none_p50_ms")
    infl_p99 = ratio("stall.eventbus_p99_ms", "stall.none_p99_ms")
    proc = ratio("gil.process_p50_ms", "gil.none_p50_ms")
    checks: dict[str, tuple[float | None, str, Callable[[float], bool]]] = {
        "publish_p50_le_1us": (
            get("overhead.eventbus_publish_p50_ns"),
            "<= 1000 ns",
            lambda v: v <= 1000,
        ),
        "publish_p99_le_5us": (
            get("overhead.eventbus_publish_p99_ns"),
            "<= 5000 ns",
            lambda v: v <= 5000,
        ),
        "hf_over_publish_ge_7x": (hf, ">= 7x", lambda v: v >= 7),
        "stall_p50_inflation_le_2pct": (
            None if infl_p50 is None else infl_p50 - 1,
            "<= 0.02",
            lambda v: v <= 0.02,
        ),
        "stall_p99_inflation_le_5pct": (
            None if infl_p99 is None else infl_p99 - 1,
            "<= 0.05",
            lambda v: v <= 0.05,
        ),
        # Issue 13 (the sidecar): bus-side CPU and the step's inflation in (b), the real loop.
        "stall_bus_side_cpu_le_0_15ms": (
            get("stall.eventbus_bus_side_cpu_ms_per_step"),
            "<= 0.15 ms",
            lambda v: v <= 0.15,
        ),
        "stall_p50_inflation_le_3pct": (
            None if infl_p50 is None else infl_p50 - 1,
            "<= 0.03",
            lambda v: v <= 0.03,
        ),
        "stall_p99_inflation_le_10pct": (
            None if infl_p99 is None else infl_p99 - 1,
            "<= 0.10",
            lambda v: v <= 0.10,
        ),
        "real_loop_eventbus_le_3pct": (
            get("real_loop.eventbus_overhead"),
            "<= 0.03",
            lambda v: v <= 0.03,
        ),
        "real_loop_eventbus_lowest": (
            _lowest(r),
            "< inline and wandb",
            lambda v: v < 0,
        ),
        "throughput_ge_400k_per_s": (
            get("throughput.events_per_s"),
            ">= 400000",
            lambda v: v >= 400_000,
        ),
        "throughput_lost_eq_0": (get("throughput.lost"), "== 0", lambda v: v == 0),
        "wakeups_p50_inflation_le_2pct": (
            get("wakeups.p50_inflation"),
            "<= 0.02",
            lambda v: v <= 0.02,
        ),
        "process_placement_le_5pct": (
            None if proc is None else proc - 1,
            "<= 0.05",
            lambda v: v <= 0.05,
        ),
    }
    for name, (value, target, ok) in checks.items():
        out[f"targets.{name}.value"] = None if value is None else round(value, 4)
        out[f"targets.{name}.target"] = target
        out[f"targets.{name}.met"] = None if value is None else bool(ok(value))
    return out


def _lowest(r: dict[str, Any]) -> float | None:
    """eventbus's real-loop overhead less the lowest of inline's and W&B's (< 0: lowest)."""
    mine = r.get("real_loop.eventbus_overhead")
    peers = [r.get(f"real_loop.{v}_overhead") for v in ("inline", "wandb")]
    known = [float(p) for p in peers if isinstance(p, int | float)]
    if not isinstance(mine, int | float) or not known:
        return None
    return float(mine) - min(known)


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        s = f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    else:
        s = f"{v:,}" if isinstance(v, int) else str(v)
    return f"{s} {unit}".strip()


def _pct(v: Any) -> str:
    return "n/a" if not isinstance(v, int | float) else f"{v * 100:+.1f}%"


def _real_loop_rows(r: dict[str, Any]) -> list[str]:
    """The real-loop group: a GPT's step time per variant (none when it did not run)."""
    p = "real_loop."
    names = r.get(p + "variants")
    if not names:
        return []
    lines = [
        "",
        f"**A real training loop** ({r.get(p + 'model')} on {r.get(p + 'device')}, "
        f"{r.get(p + 'device_name')}; ms per step between syncs; overhead: blockwise ratio of "
        "means against `none`, compiled rows against `compiled_none`)",
        "",
        "| variant | mean | p50 | p99 | overhead |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in names:
        k = p + name
        lines.append(
            f"| {name} | {_fmt(r.get(k + '_mean_ms'))} | {_fmt(r.get(k + '_p50_ms'))} | "
            f"{_fmt(r.get(k + '_p99_ms'))} | "
            f"{_pct(r[k + '_overhead']) if k + '_overhead' in r else ''} |"
        )
    if r.get(p + "note"):
        lines += ["", f"Not measured: {r[p + 'note']}."]
    return lines


def table(r: dict[str, Any]) -> str:
    """The Markdown tables of one run (docs/performance.md shows the latest full run)."""
    o = "overhead."
    lines = [
        "**Dispatch overhead per event** (ns, per call, interleaved; lower is better)",
        "",
        "| contender | p50 | p99 | mean |",
        "|---|---:|---:|---:|",
    ]
    rows = [
        ("eventbus `publish`, small event, 4 subscribers (1 slow)", "eventbus_publish"),
        ("eventbus `publish`, small event, 1 subscriber", "eventbus_publish_1sub"),
        ("eventbus `publish`, event with a CPU tensor, 4 subscribers", "eventbus_publish_tensor"),
        ("eventbus: build the event + `publish`, 4 subscribers", "eventbus_build_and_publish"),
        ("plain list of 4 sync callbacks", "sync_list_4"),
        ("blinker `Signal.send`, 4 receivers", "blinker_4"),
        ("HF transformers `CallbackHandler.on_step_end`, 4 callbacks", "hf_callbackhandler_4"),
        ("Lightning `_call_callback_hooks`, 4 callbacks (per hook)", "lightning_hooks_4"),
    ]
    for label, key in rows:
        lines.append(
            f"| {label} | {_fmt(r.get(o + key + '_p50_ns'))} | "
            f"{_fmt(r.get(o + key + '_p99_ns'))} | {_fmt(r.get(o + key + '_mean_ns'))} |"
        )
    lines += [
        "",
        "**Step time of a small MLP on CPU** (ms per step; inflation against (a))",
        "",
        "| variant | p50 | p99 | p50 inflation | p99 inflation |",
        "|---|---:|---:|---:|---:|",
    ]
    srows = [
        ("(a) no instrumentation", "none"),
        (
            "(b) eventbus: JSONL, TensorBoard, divergence, memory, speed + a 50 ms subscriber",
            "eventbus",
        ),
        ("(c) the same inline, as the peers do it (incl. the 50 ms callback)", "inline"),
        ("(c') inline without the 50 ms callback", "inline_nosleep"),
        ("(b') eventbus as (b), `drain_interval=0.02` (default 0.05)", "eventbus_drain20"),
    ]
    for prefix in ("stall", "stall_cuda"):
        if f"{prefix}.none_p50_ms" not in r:
            continue
        if prefix == "stall_cuda":
            lines.append("| **on the GPU** | | | | |")
        for label, key in srows:
            p = f"{prefix}.{key}"
            lines.append(
                f"| {label} | {_fmt(r.get(p + '_p50_ms'))} | {_fmt(r.get(p + '_p99_ms'))} | "
                f"{'' if key == 'none' else _pct(r.get(p + '_p50_inflation'))} | "
                f"{'' if key == 'none' else _pct(r.get(p + '_p99_inflation'))} |"
            )
    lines += _real_loop_rows(r)
    lines += [
        "",
        "**Throughput, wake-ups, GIL**",
        "",
        "| measure | value |",
        "|---|---:|",
        f"| events published -> JSON lines on disk (lossless) | "
        f"{_fmt(r.get('throughput.events'))} |",
        f"| bus-side CPU per step in (b) / (b'), ms | "
        f"{_fmt(r.get('stall.eventbus_bus_side_cpu_ms_per_step'))} / "
        f"{_fmt(r.get('stall.eventbus_drain20_bus_side_cpu_ms_per_step'))} |",
        "| bus-side CPU per step, each subscriber of (b) alone, ms | "
        + ", ".join(
            f"{k.rsplit('.', 1)[1]} {_fmt(v)}"
            for k, v in r.items()
            if k.startswith("stall.bus_side_cpu_ms_per_step.")
        )
        + " |",
        f"| sustained events/s, first publish to close() returned | "
        f"{_fmt(r.get('throughput.events_per_s'))} |",
        f"| publisher alone, events/s | {_fmt(r.get('throughput.publish_events_per_s'))} |",
        f"| lines lost | {_fmt(r.get('throughput.lost'))} |",
        f"| peak RSS (MiB) | {_fmt(r.get('throughput.rss_peak_mb'))} |",
        f"| ~2 ms step, no bus: p50 (ms) | {_fmt(r.get('wakeups.none_p50_ms'))} |",
        f"| ~2 ms step, bus running + 1 event/step: p50 (ms) | "
        f"{_fmt(r.get('wakeups.bus_p50_ms'))} |",
        f"| wake-up inflation, p50 pooled / block-paired | "
        f"{_pct(r.get('wakeups.p50_inflation'))} / "
        f"{_pct(r.get('wakeups.p50_inflation_blockwise'))} |",
        f"| the same with `drain_interval=0.005`: inflation pooled / block-paired | "
        f"{_pct(r.get('wakeups.bus_drain5_p50_inflation'))} / "
        f"{_pct(r.get('wakeups.bus_drain5_p50_inflation_blockwise'))} |",
        f"| bus-thread CPU per ~2 ms step (us), drain 50 ms (default) / 5 ms | "
        f"{_fmt(r.get('wakeups.bus_side_cpu_us_per_step'))} / "
        f"{_fmt(r.get('wakeups.bus_drain5_bus_side_cpu_us_per_step'))} |",
        f"| bus-thread CPU per event published in bursts, 4 subscribers (ns) | "
        f"{_fmt(r.get('overhead.eventbus_bus_thread_cpu_ns_per_event'))} |",
        f"| GIL: step p50 (ms), no subscriber / 5 ms Python work in thread / in process | "
        f"{_fmt(r.get('gil.none_p50_ms'))} / {_fmt(r.get('gil.in_thread_p50_ms'))} / "
        f"{_fmt(r.get('gil.process_p50_ms'))} |",
        "",
        "**Targets**",
        "",
        "| target | measured | met |",
        "|---|---:|:---:|",
    ]
    for k in sorted(x for x in r if x.startswith("targets.") and x.endswith(".target")):
        name = k[len("targets.") : -len(".target")]
        met = r.get(f"targets.{name}.met")
        lines.append(
            f"| {name} ({r[k]}) | {_fmt(r.get(f'targets.{name}.value'))} | "
            f"{'n/a' if met is None else 'yes' if met else '**no**'} |"
        )
    return "\n".join(lines)


def _update_doc(path: Path, r: dict[str, Any], command: str) -> None:
    m = r["machine"]
    head = (
        f"Measured {time.strftime('%Y-%m-%d %H:%M', time.localtime(r['run.started']))} with "
        f"`{command}` ({r['run.seconds']:.0f} s) on {m.get('cpu_model', m['processor'])}, "
        f"{m['cpus']} CPUs, Python {m['python']}, torch {r['versions'].get('torch')}; "
        f"load average before/after: {r['run.load_before']} / {r['run.load_after']}."
    )
    block = f"{START}\n{head}\n\n{table(r)}\n{END}"
    text = path.read_text() if path.exists() else ""
    if START in text and END in text:
        before, rest = text.split(START, 1)
        after = rest.split(END, 1)[1]
        text = before + block + after
    else:
        text = text.rstrip() + ("\n\n" if text else "") + block + "\n"
    path.write_text(text)


PARTS = ("overhead", "wakeups", "throughput", "stall", "gil", "capture", "real_loop")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller runs (under 2 minutes)")
    p.add_argument("--json", metavar="FILE", help="write the results here")
    p.add_argument("--plot", metavar="PNG", help="step-time distributions of the stall run")
    p.add_argument("--doc", metavar="MD", help="rewrite the results table in this Markdown file")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="also run the stall benchmark on the GPU (auto: when one exists)",
    )
    p.add_argument(
        "--only",
        default=",".join(PARTS),
        help=f"comma-separated parts to run (default: {','.join(PARTS)})",
    )
    a = p.parse_args(argv)
    parts = [x.strip() for x in a.only.split(",") if x.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    device = a.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"

    # Expected losses (the 50 ms subscriber drops, by design) are in the results; keep the
    # library's close-time warnings off the console.
    logging.getLogger("eventbus").setLevel(logging.ERROR)
    command = "python -m benchmarks" + (" " + " ".join(sys.argv[1:]) if argv is None else "")
    r: dict[str, Any] = {
        "run.started": time.time(),
        "run.quick": a.quick,
        "run.command": command,
        "run.load_before": load_average(),
    }
    samples: dict[str, Any] = {}
    t_start = time.perf_counter()
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "overhead": lambda: importlib.import_module("benchmarks.overhead").run(a.quick),
        "wakeups": lambda: importlib.import_module("benchmarks.wakeups").run(a.quick),
        "throughput": lambda: importlib.import_module("benchmarks.throughput").run(a.quick),
        "stall": lambda: _stall(a.quick, device, samples),
        "gil": lambda: _gil(a.quick),
        "capture": lambda: _optional_part("benchmarks.capture", "capture", a.quick),
        "real_loop": lambda: _real_loop(a.quick, device),
    }
    failed = []
    for name in PARTS:
        if name not in parts:
            continue
        t0 = time.perf_counter()
        print(f"[benchmarks] {name} ...", file=sys.stderr, flush=True)
        try:
            r.update(runners[name]())
        except Exception as e:
            failed.append(name)
            r[f"{name}.error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        r[f"run.{name}_seconds"] = round(time.perf_counter() - t0, 1)
        print(f"[benchmarks] {name} done in {r[f'run.{name}_seconds']} s", file=sys.stderr)
    if "gil" not in parts:
        r.update(dict.fromkeys(("gil.none_p50_ms", "gil.in_thread_p50_ms", "gil.process_p50_ms")))
    r["run.seconds"] = round(time.perf_counter() - t_start, 1)
    r["run.load_after"] = load_average()
    r.update(_derived(r))
    r["machine"] = machine()
    r["versions"] = versions()
    missing = [k for k in REQUIRED if k not in r and k.split(".")[0] in parts]
    if missing:
        r["run.missing_keys"] = missing

    print(table(r))
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1, sort_keys=False) + "\n")
    if a.plot and samples.get("cpu"):
        from benchmarks.stall import plot

        plot(samples["cpu"], a.plot)
    if a.doc:
        _update_doc(Path(a.doc), r, command)
    if failed:
        print(f"[benchmarks] failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
