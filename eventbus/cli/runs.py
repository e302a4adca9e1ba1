"""The runs the LOG arguments of `summary` and `plot` name (`eventbus.runs`), read, and named
by what their logs say.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from eventbus.cli._errors import no_events
from eventbus.cli.report import RunReport, collect
from eventbus.runs import Run, find_runs, unique_names

__all__ = ["Run", "find_runs", "read_runs", "run_names"]


def read_runs(logs: Sequence[str], *, merge: bool = False) -> tuple[list[Run], list[RunReport]]:
    """The runs `logs` name and their reports. Of several, a run with no events is left out
    with a warning on stderr; a single one (or all) without events is an error."""
    runs = find_runs(logs, merge=merge)
    reports = [collect(r.files) for r in runs]
    kept = [(run, r) for run, r in zip(runs, reports, strict=True) if r.events]
    if not kept:
        raise no_events([f for run in runs for f in run.files])
    if len(runs) > 1:
        for run, r in zip(runs, reports, strict=True):
            if not r.events:
                names = ", ".join(map(str, run.files))
                print(f"eventbus: warning: {names}: no events, left out", file=sys.stderr)
    return [k[0] for k in kept], [k[1] for k in kept]


def run_names(runs: Sequence[Run], reports: Sequence[RunReport]) -> list[str]:
    """Each run's name: its `RunStarted.run_id`, else its directory's (or file's) name; the
    path where two would be the same."""
    names = [
        r.run_started.run_id if r.run_started and r.run_started.run_id else run.label
        for run, r in zip(runs, reports, strict=True)
    ]
    return unique_names(names, runs)
