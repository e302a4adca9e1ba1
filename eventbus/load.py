"""`load()`: recorded JSONL logs as a pandas DataFrame, one row per event.

pandas is an optional extra (`pip install 'eventbus[pandas]'`), imported when `load` is called.
Events are read as `replay` reads them (`eventbus.logformat.read_log`), so values come back as
they were published: NaN and +/-Inf are floats, nested ones included.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from eventbus.events import Event, UnknownEvent, event_fields
from eventbus.logformat import PathLike, read_log
from eventbus.runs import find_runs, unique_names

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["COLUMNS", "load"]

COLUMNS = ("type", "step", "ts", "seq", "rank", "run")
"""The columns every frame starts with; the events' own fields follow."""

_STAMPS = ("step", "ts", "seq", "rank")


def load(paths: PathLike | Iterable[PathLike]) -> pd.DataFrame:
    """One row per event of the runs `paths` name, run after run, each in replay order.

    Columns: `type`, `step`, `ts`, `seq`, `rank` (nullable integers), `run`, then each field,
    dicts flattened (`values.loss`, `metrics.acc`). A run is a directory of `*.jsonl` files (one
    per rank); a directory names every run at or under it, a file the run of its directory.
    `run` is the run directory's name, or its path where two runs share a name.
    """
    pd = _pandas()
    runs = find_runs(paths)
    names = unique_names([r.label for r in runs], runs)
    stamps: dict[str, list[Any]] = {c: [] for c in COLUMNS}
    rows: list[dict[str, Any]] = []
    own: dict[type[Event], tuple[str, ...]] = {}
    for run, name in zip(runs, names, strict=True):
        for ev in read_log(run.files):
            cls = type(ev)
            if cls is UnknownEvent:
                stamps["type"].append(ev.type_name)
                fields: Mapping[str, Any] = ev.data
            else:
                if cls not in own:
                    own[cls] = tuple(f.name for f in event_fields(cls) if f.name not in _STAMPS)
                stamps["type"].append(cls.__name__)
                fields = {k: getattr(ev, k) for k in own[cls]}
            for k in _STAMPS:
                stamps[k].append(getattr(ev, k))
            stamps["run"].append(name)
            row: dict[str, Any] = {}
            _flatten(fields, "", row)
            rows.append(row)
    head = pd.DataFrame(
        {c: pd.array(v, dtype="Int64") if c in _STAMPS else v for c, v in stamps.items()},
        columns=list(COLUMNS),
    )
    if not rows:
        return head
    return pd.concat(
        [head, pd.DataFrame(rows).drop(columns=list(COLUMNS), errors="ignore")], axis=1
    )


def _pandas() -> Any:
    try:
        import pandas
    except ImportError as e:
        raise ImportError(
            f"eventbus.load() needs pandas ({e}); install it with: pip install 'eventbus[pandas]'"
        ) from None
    return pandas


def _flatten(d: Mapping[Any, Any], prefix: str, out: dict[str, Any]) -> None:
    """`d`'s entries into `out`, nested mappings as `outer.inner` keys."""
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            _flatten(v, f"{key}.", out)
        else:
            out[key] = v
