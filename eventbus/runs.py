"""Which runs some log paths name: shared by `eventbus summary`/`plot` and `eventbus.load()`.

A run is a directory holding `*.jsonl` files (a JsonlWriter's directory: one file per rank),
save that files named `NAME.run-N.jsonl` (a later run a JsonlWriter given a file name wrote
beside the first) are run N of that directory. A directory argument is every run at or under
it, found recursively (hidden directories skipped). File arguments from one directory written
by different ranks (`events.rank*.jsonl`) are one run; any other file is a run of its own.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

from eventbus.logformat import LogReadError, PathLike, log_files, log_ranks

__all__ = ["Run", "find_runs", "unique_names"]

_LATER_RUN = re.compile(r"\.run-(\d+)\.jsonl$")  # NAME.run-2.jsonl: the directory's run 2


class Run(NamedTuple):
    """One run's files and its name (its directory's, or `run-N`)."""

    label: str
    files: list[Path]
    where: str  # the run's path as found, to tell apart runs of the same name


def find_runs(logs: PathLike | Iterable[PathLike], *, merge: bool = False) -> list[Run]:
    """The runs `logs` name, in argument order (each once); `LogReadError` if one is missing.
    `merge`: every file they name is one run."""
    items = [logs] if isinstance(logs, str | os.PathLike) else [str(x) for x in logs]
    if not items:
        raise LogReadError("no log files given")
    if merge:
        files = log_files(items)
        return [Run(_dir_label(files[0].parent), files, ", ".join(map(str, items)))]
    found: list[Run | Path] = []  # runs, and directories of named files, in argument order
    loose: dict[Path, list[Path]] = {}  # directory -> files named in it, in argument order
    for arg in items:
        p = Path(arg)
        if p.is_dir():
            under = _runs_under(p)
            if not under:
                raise LogReadError(
                    f"{p}: no *.jsonl files in or under this directory; give a directory a "
                    "JsonlWriter wrote to (or one holding such directories), or the files"
                )
            found += under
        elif p.exists():
            if p.parent not in loose:
                loose[p.parent] = []
                found.append(p.parent)
            if p not in loose[p.parent]:
                loose[p.parent].append(p)
        else:
            raise LogReadError(f"{p}: no such file or directory")
    out: list[Run] = []
    seen: set[tuple[Path, ...]] = set()
    for item in found:
        for r in _split(item, loose[item]) if isinstance(item, Path) else [item]:
            key = tuple(sorted(f.resolve() for f in r.files))
            if key not in seen:
                seen.add(key)
                out.append(r)
    return out


def unique_names(names: Sequence[str], runs: Sequence[Run]) -> list[str]:
    """`names` (one per run), each run's path instead where two would be the same."""
    dup = {n for n in names if names.count(n) > 1}
    return [run.where if n in dup else n for n, run in zip(names, runs, strict=True)]


def _runs_under(top: Path) -> list[Run]:
    runs = []
    for d, dirs, names in os.walk(top):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        files = sorted(Path(d) / n for n in names if n.endswith(".jsonl"))
        files = [f for f in files if f.is_file()]
        runs += [
            Run(
                _dir_label(Path(d)) if n == 1 else f"run-{n}", group, d if n == 1 else str(group[0])
            )
            for n, group in _by_run_number(files)
        ]
    return runs


def _by_run_number(files: list[Path]) -> list[tuple[int, list[Path]]]:
    """One directory's files grouped by the run number their names carry (none: 1)."""
    groups: dict[int, list[Path]] = {}
    for f in files:
        m = _LATER_RUN.search(f.name)
        groups.setdefault(int(m.group(1)) if m else 1, []).append(f)
    return sorted(groups.items())


def _split(directory: Path, named: list[Path]) -> list[Run]:
    """Files named in one directory: per run number, one run if each was written by another
    rank, else a run each."""
    runs = []
    for n, files in _by_run_number(named):
        ranks = [log_ranks(f)[0] for f in files]
        if len(files) == 1 or len(set(ranks)) == len(ranks):
            label = _dir_label(directory) if n == 1 else f"run-{n}"
            runs.append(Run(label, files, str(directory if n == 1 else files[0])))
        else:
            runs += [Run(f.name, [f], str(f)) for f in files]
    return runs


def _dir_label(d: Path) -> str:
    return d.resolve().name or str(d)
