"""Import paths to objects: `package.module:attr`, or a built-in's short name (`jsonl`).

The lowest layer that builds subscribers by name, shared by `eventbus.config` (which wraps
`LoadError` into a `ConfigError` naming the source and entry) and process placement (whose
child builds its subscriber from a path). It imports nothing of eventbus, so both can use it
without an import cycle. A module is imported only when a caller names its path.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["SHORT_NAMES", "LoadError", "load_object", "split_path"]

# Built-ins by short name, imported only when used (the core never imports sinks/monitors).
SHORT_NAMES: dict[str, str] = {
    "jsonl": "eventbus.sinks:JsonlWriter",
    "tensorboard": "eventbus.sinks:TensorBoardSink",
    "tb": "eventbus.sinks:TensorBoardSink",
    "progress": "eventbus.sinks:ConsoleProgress",
    "console": "eventbus.sinks:ConsoleProgress",
    "wandb": "eventbus.sinks:WandbSink",
    "mlflow": "eventbus.sinks:MLflowSink",
    "prometheus": "eventbus.sinks:PrometheusExporter",
    "divergence": "eventbus.monitors:DivergenceDetector",
    "memory": "eventbus.monitors:MemoryProfiler",
    "speed": "eventbus.monitors:SpeedMonitor",
    "early_stop": "eventbus.monitors:EarlyStopper",
    "threshold_stop": "eventbus.monitors:ThresholdStopper",
    "checkpoint_jobs": "eventbus.monitors:CheckpointJobs",
    "watchdog": "eventbus.monitors:HangWatchdog",
    "stragglers": "eventbus.monitors:StragglerDetector",
    "rank_reducer": "eventbus.monitors:RankReducer",
}


class LoadError(ValueError):
    """An import path that names nothing usable; the message says what to fix."""


def split_path(path: str) -> tuple[str, str]:
    """(module, attr) of a short name or an absolute `package.module:attr`; imports nothing."""
    target = SHORT_NAMES.get(path, path)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise LoadError(
            f"{path!r} is neither a built-in ({', '.join(SHORT_NAMES)}) nor an import path "
            "'package.module:factory'"
        )
    if not all(p.isidentifier() for p in module_name.split(".")):
        hint = " (relative imports are not supported)" if module_name.startswith(".") else ""
        raise LoadError(
            f"{path!r}: {module_name!r} is not an absolute module name{hint}; "
            "write 'package.module:factory'"
        )
    if not all(p.isidentifier() for p in attr.split(".")):
        raise LoadError(f"{path!r}: {attr!r} is not an attribute name; write 'module:factory'")
    return module_name, attr


def load_object(path: str, *, where: str = "") -> Any:
    """The object `path` names, importing its module now (`where` prefixes error messages).

    Anything the module raises while importing (a syntax error, `sys.exit()` in a script
    without a main guard) becomes a `LoadError`; only KeyboardInterrupt passes through.
    """
    prefix = f"{where}: " if where else ""
    try:
        module_name, attr = split_path(path)
    except LoadError as e:
        raise LoadError(f"{prefix}{e}") from None
    try:
        module = importlib.import_module(module_name)
    except KeyboardInterrupt:
        raise
    except ModuleNotFoundError as e:
        raise LoadError(f"{prefix}cannot import {module_name!r} for {path!r}: {e}") from e
    except BaseException as e:  # user code ran: SyntaxError, SystemExit, anything
        raise LoadError(
            f"{prefix}importing {module_name!r} for {path!r} failed: {type(e).__name__}: {e}; "
            "fix the module, or move that code under `if __name__ == '__main__':`"
        ) from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise LoadError(
                f"{prefix}module {module_name!r} has no attribute {attr!r} (from {path!r})"
            ) from None
    return obj
