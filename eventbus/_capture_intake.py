"""`intake_for(cls)`: what `publish` does with an event holding tensors, containers or long
texts, as one function generated per class: each field sized and its tensors captured in one
pass, with the same results as `sizeof_event` and then `capture_event`.

Right after a training step, Python runs cold: every call costs several times what it costs
in a warm loop (docs/performance.md). The general walk made about ten calls for a `Loss`
holding a tensor; the generated function makes two (`_Capture.tensor`, then `Pending`), and
walks only containers.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

from eventbus.capture import _Capture, _capture_field, _tensor_type, capturable_fields
from eventbus.core.sizing import _BASE, NUMBERS, checked_fields, sizeof_value
from eventbus.events import Event

__all__ = ["INTAKE", "intake_for"]

Intake = Callable[[Event], tuple[int, bool]]
INTAKE: dict[type, Intake] = {}  # by class; the hot path reads it directly


def intake_for(cls: type[Event]) -> Intake:
    """The function for `cls`: `(bytes, captured)` of an event, its tensors captured in place
    (training thread; never syncs: a tensor's size is host metadata, its capture a clone or
    an asynchronous copy)."""
    fn = INTAKE.get(cls)
    if fn is not None:
        return fn
    tensor = _tensor_type()
    capturable = set(capturable_fields(cls))
    lines = ["def intake(ev):", f"    n = {_BASE}", "    cap = None", "    found = False"]
    if tensor is None:  # torch not imported yet: once it is, made again (with a tensor branch)
        lines[1:1] = ["    if tensor_type() is not None:", "        return remade(cls)(ev)"]
    for name in checked_fields(cls):
        lines += [
            f"    v = ev.{name}",
            "    t = type(v)",
            "    if t in NUMBERS:",
            "        n += 8",
            "    elif t is str:",
            "        n += 49 + len(v)",
        ]
        if name not in capturable:  # declared str/int/bool: sized, never captured
            lines += ["    else:", "        n += sizeof_value(v)"]
            continue
        if tensor is not None:  # a plain tensor (not a subclass): no walk
            lines += [
                "    elif t is TENSOR:",
                "        try:",
                "            nb = v.nbytes  # host metadata: no device sync",
                "        except Exception:  # a sparse or exotic tensor without a plain size",
                "            nb = None",
                "        n += nb if type(nb) is int else 64",
                "        if cap is None:",
                "            cap = Capture()",
                f"        ev.{name} = cap.tensor(v)  # a clone, or a copy queued: no sync",
                "        found = True",
            ]
        lines += [
            "    else:",
            "        n += sizeof_value(v)",
            "        if cap is None:",
            "            cap = Capture()",
            f"        found = general(ev, {name!r}, v, cap) or found",
        ]
    lines += ["    if cap is not None:", "        cap.fence()", "    return n, found"]
    scope: dict[str, Any] = {
        "NUMBERS": NUMBERS,
        "TENSOR": tensor,
        "Capture": _Capture,
        "general": _capture_field,
        "sizeof_value": sizeof_value,
        "tensor_type": _tensor_type,
        "cls": cls,
        "remade": _remade,
    }
    exec(compile("\n".join(lines), f"<eventbus.intake {cls.__qualname__}>", "exec"), scope)
    fn = INTAKE[cls] = typing.cast(Intake, scope["intake"])
    return fn


def _remade(cls: type[Event]) -> Intake:
    """`cls`'s function made again (torch was imported since it was made)."""
    INTAKE.pop(cls, None)
    return intake_for(cls)
