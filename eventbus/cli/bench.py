"""`eventbus bench`: what each subscriber costs your step: inline, on the bus, in the sidecar."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from eventbus.bench import BenchError, BenchResult
from eventbus.bench.measure import Progress
from eventbus.bench.measure import run as run_bench
from eventbus.cli._errors import UsageError, fail

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Register `eventbus bench STEP --subscribe SPEC... [--steps N] [--json [FILE]] ...`."""
    b = sub.add_parser(
        "bench",
        help="time your step bare, with each subscriber inline, on the bus and in the sidecar",
        description="STEP is module:function or path/to/file.py:function, called as "
        "function(step, bus) and publishing on bus.",
    )
    b.add_argument("step", metavar="STEP", help="module:function or path/to/file.py:function")
    b.add_argument(
        "--subscribe",
        "-s",
        nargs="+",
        action="extend",
        required=True,
        metavar="SPEC",
        help="jsonl:DIR, tensorboard:DIR, divergence, memory, progress, or module:factory",
    )
    b.add_argument("--steps", type=int, default=200, help="timed steps per variant and round (200)")
    b.add_argument("--rounds", type=int, default=5, help="rounds of every variant, interleaved (5)")
    b.add_argument("--warmup", type=int, default=20, help="untimed steps before each run (20)")
    b.add_argument(
        "--only",
        metavar="VARIANTS",
        help="comma-separated kinds (inline, bus, all, process) or names (bus:jsonl); "
        "bare always runs",
    )
    b.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help="write the figures as JSON to FILE (no FILE, or -: to stdout instead of the table)",
    )
    b.add_argument("--plot", metavar="FILE.png", help="draw step time and CPU per variant")
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the bench; print the table (or JSON), write --json and --plot files."""
    if args.plot is not None:
        if importlib.util.find_spec("matplotlib") is None:
            return fail("--plot needs matplotlib: pip install 'eventbus[plot]'", 1)
        if Path(args.plot).suffix.lower() != ".png":
            raise UsageError(f"--plot {args.plot}: the plot is a PNG; name it *.png")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: the user's modules import by name
    only = [w.strip() for w in args.only.split(",") if w.strip()] if args.only else None
    try:
        result = run_bench(
            args.step,
            args.subscribe,
            steps=args.steps,
            rounds=args.rounds,
            warmup=args.warmup,
            only=only,
            progress=_progress(),
        )
    except BenchError as e:
        raise UsageError(str(e)) from None
    text = json.dumps(result.as_dict(), indent=2)
    notes = sys.stderr if args.json == "-" else sys.stdout  # stdout holds only the JSON then
    print(text if args.json == "-" else result.table())
    if args.json not in (None, "-"):
        Path(args.json).write_text(text + "\n", encoding="utf-8")
        print(f"wrote {args.json}", file=notes)
    if args.plot is not None:
        result.plot(args.plot)
        print(f"wrote {args.plot}", file=notes)
    return _warn_failures(result)


def _warn_failures(result: BenchResult) -> int:
    failed = [v for v in result.variants.values() if v.failed]
    for v in failed:
        why = f" ({v.errors[0]})" if v.errors else ""
        print(f"eventbus: warning: {v.name}: {v.failed} events failed{why}", file=sys.stderr)
    return 1 if failed else 0


def _progress() -> Progress | None:
    """A progress bar on stderr when it is a terminal: tqdm if installed, else one line."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    bar: Any = None

    def show(done: int, total: int, name: str) -> None:
        nonlocal bar
        if tqdm is not None:
            if bar is None:
                bar = tqdm(total=total, unit="run", file=sys.stderr, leave=False)
            bar.set_postfix_str(name, refresh=False)
            bar.update(1)
            if done >= total:
                bar.close()
            return
        end = "\n" if done >= total else ""
        print(f"\reventbus bench: {done}/{total} {name:<40.40}", end=end, file=sys.stderr)
        sys.stderr.flush()

    return show
