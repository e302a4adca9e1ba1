"""`ProcessSubscriber`: what to build in the bus's sidecar process, and the options it runs with.

It is a description, not a process: `bus.subscribe(sub, placement="process")` makes one, and
the bus's `Sidecar` (one child process per bus) builds the subscriber there, from its pickle or
from an import path with arguments.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

from eventbus.core.subscriber import describe
from eventbus.events import Event
from eventbus.loader import SHORT_NAMES, load_object
from eventbus.process import spawn, wire

__all__ = ["ProcessSubscriber"]

_IMPORT_PATH_HINT = "pass an import path: ProcessSubscriber('package.module:factory', kwargs={...})"


class ProcessSubscriber:
    """A subscriber to run in the bus's sidecar process.

    `sub`: a picklable subscriber (object with `on_events`, or a function of one event), or an
    import path `"package.module:factory"` (or a built-in short name) built there with
    `args` / `kwargs`. Its class attributes (`events`, `policy`, `maxsize`, `max_batch`,
    `ranks`, `name`) are read here, as for an in-thread subscriber.
    """

    placement = "process"

    def __init__(
        self,
        sub: Any,
        *,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        events: Sequence[type[Event]] | None = None,
        name: str | None = None,
    ) -> None:
        kwargs = dict(kwargs or {})
        self.main: tuple[str, str] | None = None  # the parent's script, if the sidecar needs it
        if isinstance(sub, str):
            spec = SHORT_NAMES.get(sub, sub)
            template = load_object(spec, where="ProcessSubscriber")
            self.target: wire.Target = ("factory", (spec, tuple(args), kwargs))
        else:
            if args or kwargs:
                raise TypeError(
                    "args/kwargs are for an import path 'module:factory', not an "
                    "already built subscriber"
                )
            template = sub
            data = _pickled(sub)
            self.main = _main_for(sub, data)
            self.target = ("pickled", data)
        for attr in ("events", "policy", "maxsize", "max_batch", "ranks"):
            v = getattr(template, attr, None)  # class attributes, as bus.subscribe reads them
            if v is not None and not callable(v):
                setattr(self, attr, v)
        if events is not None:
            self.events = tuple(events)
        self.name = name or (
            describe(template) if not isinstance(template, type) else template.__name__
        )
        self.batched = hasattr(template, "on_events")

    def __call__(self, ev: Event) -> None:
        raise RuntimeError("a ProcessSubscriber runs in the sidecar; subscribe it to a bus")

    def __repr__(self) -> str:
        return f"ProcessSubscriber({self.name!r})"


def _pickled(sub: Any) -> bytes:
    try:
        data = pickle.dumps(sub, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise TypeError(
            f"placement='process' needs a picklable subscriber; {describe(sub)!r} is not "
            f"({type(e).__name__}: {e}). Define it at module level, or {_IMPORT_PATH_HINT}"
        ) from e
    if spawn.importing_main():
        raise RuntimeError(
            "a process-placed subscriber was created while its child imported your script: "
            'guard the script\'s training code with `if __name__ == "__main__":` (as for '
            "multiprocessing), or define the subscriber in a module of its own"
        )
    return data


def _main_for(sub: Any, data: bytes) -> tuple[str, str] | None:
    try:
        return spawn.main_to_import(data)
    except ValueError:
        raise TypeError(
            f"placement='process': {describe(sub)!r} is defined interactively (a notebook or "
            f"REPL), so a child process cannot import it; define it in a module, or "
            f"{_IMPORT_PATH_HINT}"
        ) from None
