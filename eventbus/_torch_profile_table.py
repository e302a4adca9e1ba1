"""A profile window's `key_averages()` table, built from its Chrome trace in a process of its own.

    python -m eventbus._torch_profile_table TRACE.json TABLE.txt [--sort-by KEY] [--row-limit N]

Building the table parses every recorded op in pure Python (about 0.35 s for 4,000 ops here).
On a thread of the training process that holds the GIL against every torch op, which hands
the GIL back and waits for it: a 47 ms CPU step took 1.2 s (docs/monitors.md). Here it costs
a core instead. The ops are rebuilt as torch's own `FunctionEvent`s from the trace (CPU ops,
annotations and runtime calls; device kernels attached to the op that launched them, by
"External id"), so the table is torch's `key_averages().table()`; on CPU it equals the one
torch builds in process (`tests/test_torch_profile.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["main", "trace_table"]

_HOST = frozenset({"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"})
_DEVICE = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_HIDDEN = frozenset(  # what torch leaves out of its own table (profiler_util._filter_name)
    {
        "profiler::_record_function_enter",
        "profiler::_record_function_enter_new",
        "profiler::_record_function_exit",
        "aten::is_leaf",
        "aten::output_nr",
        "aten::_version",
    }
)


def trace_table(trace: dict[str, Any], *, sort_by: str, row_limit: int) -> str:
    """torch's `key_averages().table(...)` of the ops in a Chrome trace (a loaded JSON)."""
    from torch.autograd import profiler_util  # imported here: the child needs torch, callers not

    FunctionEvent: Any = profiler_util.FunctionEvent  # untyped in torch
    EventList: Any = profiler_util.EventList

    events: list[Any] = []
    launched: dict[Any, Any] = {}  # External id -> the host op
    kernels: list[dict[str, Any]] = []
    for i, e in enumerate(trace.get("traceEvents") or ()):
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        cat = e.get("cat")
        if cat in _DEVICE:
            kernels.append(e)
            continue
        name = str(e.get("name", ""))
        if cat not in _HOST or name in _HIDDEN:
            continue
        args = e.get("args") or {}
        start = float(e.get("ts", 0.0))
        fe = FunctionEvent(
            id=i,
            name="ProfilerStep*" if name.startswith("ProfilerStep#") else name,
            thread=e.get("tid", 0),
            start_us=start,
            end_us=start + float(e.get("dur", 0.0)),
            input_shapes=args.get("Input Dims") or [],
            stack=[],
        )
        events.append(fe)
        if cat == "cpu_op" and "External id" in args:
            launched[args["External id"]] = fe
    device = "cuda" if kernels else None
    for fe in events:
        fe.use_device = device
    for k in kernels:
        args = k.get("args") or {}
        op = launched.get(args.get("External id"))
        if op is not None:
            op.append_kernel(str(k.get("name", "")), args.get("device", 0), float(k.get("dur", 0)))
    found = EventList(events, use_device=device)
    found._build_tree()  # parents and children by time, per thread: self times
    return str(found.key_averages().table(sort_by=sort_by, row_limit=row_limit))


def main(argv: list[str] | None = None) -> int:
    """Write the table of TRACE to TABLE; one line on stderr and exit code 2 on bad input."""
    p = argparse.ArgumentParser(prog="python -m eventbus._torch_profile_table")
    p.add_argument("trace", type=Path)
    p.add_argument("table", type=Path)
    p.add_argument("--sort-by", default="self_cpu_time_total")
    p.add_argument("--row-limit", type=int, default=30)
    a = p.parse_args(argv)
    try:
        trace = json.loads(a.trace.read_bytes())
    except (OSError, ValueError) as e:
        print(f"cannot read the trace {str(a.trace)!r}: {e}", file=sys.stderr)
        return 2
    text = trace_table(trace, sort_by=a.sort_by, row_limit=a.row_limit)
    a.table.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
