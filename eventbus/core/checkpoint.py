"""Subscribers' state for checkpoints: each one's `state_dict()`, by its unique name."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from eventbus.core.delivery import Delivery

__all__ = ["Remotes", "in_a_fork", "load_states", "states"]


def in_a_fork(call: str) -> RuntimeError:
    """The error for a checkpoint call in a forked child, saying where to make it."""
    return RuntimeError(
        f"{call} in a forked child (a DataLoader worker?): the subscribers live in the "
        "parent process; call it there"
    )


class Remotes(Protocol):
    """Subscribers held elsewhere (the sidecar process), by name: their state and CPU."""

    def names(self) -> set[str]: ...

    def state_dicts(self) -> dict[str, Any]: ...

    def load_state_dicts(self, states: dict[str, Any]) -> None: ...

    def cpu_s(self) -> dict[str, float]: ...


def _call(d: Delivery, hook: str, *args: Any) -> Any:
    """The subscriber's `hook`, on the caller's thread. What it raises names it: an Exception
    keeps its type (with a note); any other BaseException of its own (SystemExit, ...) never
    ends the caller's process: a RuntimeError. A Ctrl-C is the user's: it passes as it is."""
    try:
        return getattr(d.sub, hook)(*args)
    except KeyboardInterrupt:
        raise
    except Exception as e:
        e.add_note(f"raised by subscriber {d.name!r}'s {hook}()")
        raise
    except BaseException as e:
        raise RuntimeError(
            f"subscriber {d.name!r}'s {hook}() raised {type(e).__name__}: {e}"
        ) from e


def states(deliveries: Iterable[Delivery], remotes: Remotes | None = None) -> dict[str, Any]:
    """Every subscriber's `state_dict()` that has one, by name."""
    out = {
        d.name: _call(d, "state_dict")
        for d in deliveries
        if callable(getattr(d.sub, "state_dict", None))
    }
    if remotes is not None:
        out.update(remotes.state_dicts())
    return out


def load_states(
    deliveries: Iterable[Delivery], state: dict[str, Any], remotes: Remotes | None = None
) -> None:
    """Hand each subscriber its part; a name this bus does not have is a clear KeyError."""
    if not isinstance(state, Mapping):
        raise TypeError(
            "load_state_dict() takes the dict bus.state_dict() returned (subscriber name -> "
            f"its state), got {type(state).__name__}: {state!r:.80}"
        )
    known = {d.name: d for d in deliveries if d.sub is not None}  # removed ones: no state
    elsewhere = remotes.names() if remotes is not None else set()
    for name in state:
        if name not in known and name not in elsewhere:
            raise KeyError(
                f"no subscriber named {name!r} on this bus; have {sorted(known.keys() | elsewhere)}"
            )
    for name, part in state.items():
        if name in known:
            _call(known[name], "load_state_dict", part)
    if remotes is not None:
        remotes.load_state_dicts({k: v for k, v in state.items() if k in elsewhere})
