"""The variants the bench runs, and one run of each: what the step gets as `bus`, and the end.

    bare            the step alone; `publish` is a no-op (`NullBus`)
    inline:NAME     NAME called on the training thread inside `publish` (`InlineBus`)
    bus:NAME        NAME on an `EventBus`, placement="thread" (the bus thread / its worker)
    bus:all         every subscriber on one `EventBus`, each where it runs by default (the
                    built-in file sinks in the sidecar): the run as configured
    process:NAME    NAME on an `EventBus`, placement="process" (the bus's sidecar process)

Each subscriber keeps its own policy, queue size and event types: a lossless one slower than
the step holds the step up (backpressure, counted in its step time), a lossy one drops (counted).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from eventbus.bench.inline import InlineBus, NullBus
from eventbus.bench.sources import BenchError, Source
from eventbus.bus import EventBus

__all__ = ["ALL", "BARE", "BUS", "INLINE", "KINDS", "PROCESS", "Counts", "Session", "Variant"]

BARE, INLINE, BUS, ALL, PROCESS = "bare", "inline", "bus", "all", "process"
KINDS = (BARE, INLINE, BUS, ALL, PROCESS)
SETTLE_TIMEOUT_S = 60.0  # the longest a bus variant waits for its subscribers to catch up


@dataclass(frozen=True)
class Counts:
    """What the variant's subscribers did with the events (over a whole run, warm-up too)."""

    delivered: int = 0
    dropped: int = 0
    failed: int = 0
    errors: tuple[str, ...] = ()


class Session(Protocol):
    """One run of a variant: the bus the step publishes on, waiting for it, closing it."""

    @property
    def bus(self) -> Any:
        """What the step gets as `bus`."""

    def settle(self) -> bool:
        """Wait until every event published so far was handled; False if it gave up."""

    def sidecar_pid(self) -> int | None:
        """The live sidecar's process id (process variants), else None."""

    def close(self) -> Counts:
        """End the run (drain, `on_close`); what the subscribers did."""


@dataclass(frozen=True)
class Variant:
    """A way of running the step with the subscribers in `sources`."""

    name: str
    kind: str
    sources: tuple[Source, ...] = ()
    skipped: str | None = None  # why it cannot run (a subscriber that cannot go to a sidecar)

    def open(self) -> Session:
        """Build fresh subscribers and the bus the step will get."""
        if self.kind == BARE:
            return _Bare()
        if self.kind == INLINE:
            (src,) = self.sources
            return _Inline(src)
        return _Bus(self.sources, self.kind)


def plan(sources: Sequence[Source], only: Iterable[str] | None = None) -> list[Variant]:
    """Every variant for `sources`, in the table's order (`only`: names or kinds to keep;
    bare always runs: the others are measured against it)."""
    out = [Variant(BARE, BARE)]
    out += [Variant(f"{INLINE}:{s.name}", INLINE, (s,)) for s in sources]
    out += [Variant(f"{BUS}:{s.name}", BUS, (s,)) for s in sources]
    if len(sources) > 1:
        out.append(Variant(f"{BUS}:{ALL}", ALL, tuple(sources)))
    out += [Variant(f"{PROCESS}:{s.name}", PROCESS, (s,)) for s in sources]
    if only is not None:
        out = _keep(out, list(only))
    return [_probe(v) if v.kind == PROCESS else v for v in out]


def _keep(variants: list[Variant], only: list[str]) -> list[Variant]:
    names = {v.name for v in variants}
    kinds = {*KINDS, f"{BUS}:{ALL}"}
    unknown = [w for w in only if w not in names and w not in kinds]
    if unknown:
        raise BenchError(
            f"unknown variant(s) {', '.join(map(repr, unknown))}; choose from the kinds "
            f"{', '.join(KINDS)} or the names {', '.join(sorted(names))}"
        )
    wanted = set(only) | {BARE}
    if f"{BUS}:{ALL}" in wanted:
        wanted.add(ALL)
    return [v for v in variants if v.name in wanted or v.kind in wanted]


def _probe(v: Variant) -> Variant:
    """`v`, or `v` skipped with the reason its subscriber cannot go to the sidecar."""
    from eventbus.process import ProcessSubscriber  # the sidecar's code: loaded when asked

    (src,) = v.sources
    try:
        ProcessSubscriber(src.make())  # pickles it, as subscribe(placement="process") will
    except (TypeError, RuntimeError) as e:
        return Variant(v.name, v.kind, v.sources, skipped=str(e))
    return v


class _Bare:
    def __init__(self) -> None:
        self.bus = NullBus()

    def settle(self) -> bool:
        return True

    def sidecar_pid(self) -> int | None:
        return None

    def close(self) -> Counts:
        return Counts()


class _Inline:
    def __init__(self, src: Source) -> None:
        self.bus = InlineBus(src.make(), src.options.get("events"))
        self.bus.start()

    def settle(self) -> bool:
        return True  # everything was handled inside publish

    def sidecar_pid(self) -> int | None:
        return None

    def close(self) -> Counts:
        b = self.bus
        b.close()
        return Counts(b.delivered, b.dropped, b.failed, (b.error,) if b.error else ())


class _Bus:
    def __init__(self, sources: Sequence[Source], kind: str) -> None:
        self.bus = EventBus()
        try:
            for src in sources:
                options = dict(src.options)
                if kind != ALL:
                    options["placement"] = "process" if kind == PROCESS else "thread"
                self.bus.subscribe(src.make(), **options)
            self.bus.start()
        except BaseException:
            self.bus.close()
            raise

    def settle(self) -> bool:
        return self.bus.flush(SETTLE_TIMEOUT_S)

    def sidecar_pid(self) -> int | None:
        sc = self.bus.stats().sidecar
        return sc.pid if sc is not None and sc.alive else None

    def close(self) -> Counts:
        st = self.bus.close()
        subs = st.subscribers.values()
        errors = tuple(f"{s.name}: {s.error}" for s in subs if s.error)
        if st.sidecar is not None and st.sidecar.error:
            errors += (f"sidecar: {st.sidecar.error}",)
        return Counts(sum(s.delivered for s in subs), st.dropped, st.failed, errors)
