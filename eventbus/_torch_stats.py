"""Tensor statistics on the device, and their publishing with one device->host copy.

`reduce_tensor` / `measure` queue one tensor's partials (`eventbus._torch_reduce`: 4 ops for a
float32 tensor, 5 for bfloat16/float16); `measure_many` measures a model's weights or
gradients with a constant number of ops for all its small tensors together (packed per device
and dtype) and per-tensor reductions for large ones. `publishable` turns any mix of entries
into `TensorStats`: per device, the partials are stacked, combined into norm, mean, std,
absmax and counts by vectorised float64 ops (a constant number, however many entries), and
captured with one non-blocking copy; each event's fields are parts of that capture.
Nothing here reads a device value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from eventbus._torch_reduce import PACK, SMALL, host_tensor, reduce_packed, reduce_tensor
from eventbus.capture import capture_shared
from eventbus.events import TensorStats

__all__ = [
    "Entry",
    "entry",
    "measure",
    "measure_many",
    "publishable",
    "reduce_tensor",
    "tensor_stats",
]

_FIELDS = 6  # norm, mean, std, absmax, nan_count, inf_count; then hist min, max, counts


@dataclass(slots=True)
class Entry:
    """One tensor's statistics, still on its device: partials (`eventbus._torch_reduce`)."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    parts: tuple[torch.Tensor, ...]  # this tensor's own (0-d), or a packed group's (k, ...)
    row: int | None = None  # the row of a packed group's partials; None: parts are its own


def entry(
    name: str, kind: str, dtype: str, shape: Sequence[int], parts: tuple[torch.Tensor, ...]
) -> Entry:
    """An `Entry` for partials computed earlier (perhaps in a compiled graph).

    `dtype` is `str(t.dtype)`, `shape` ints: metadata read when `t` was reduced, no device read.
    """
    return Entry(name, kind, dtype, tuple(int(d) for d in shape), tuple(parts))


def tensor_stats(
    t: torch.Tensor,
    *,
    name: str = "",
    kind: str = "activations",
    bins: int = 0,
    step: int | None = None,
) -> TensorStats:
    """One tensor's `TensorStats`, values still on its device (publish it: no sync)."""
    return publishable([measure(t, name, kind, bins)], step)[0]


def measure(t: torch.Tensor, name: str, kind: str, bins: int) -> Entry:
    """Queue the partial statistics of `t` on its device (none is read)."""
    return entry(name, kind, str(t.dtype), t.shape, reduce_tensor(t, bins))


def measure_many(named: Sequence[tuple[str, torch.Tensor]], kind: str, bins: int) -> list[Entry]:
    """Entries for many tensors (a model's weights or gradients), in the order given.

    Contiguous tensors of at most `SMALL` elements are packed per (device, dtype) into buffers
    of at most `PACK` elements, each reduced by a constant number of ops. Larger (or strided)
    tensors are reduced one by one (`reduce_tensor`): on a GPU a segmented reduction gives a
    large segment one thread block, far slower than a reduction of its own.
    """
    out: list[Entry | None] = [None] * len(named)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (name, t) in enumerate(named):
        n = t.numel()
        if n == 0 or n > SMALL or not t.is_contiguous():
            out[i] = measure(t, name, kind, bins)
        else:
            groups.setdefault((t.device, t.dtype), []).append(i)
    for members in groups.values():
        batch: list[int] = []
        size = 0
        for i in [*members, -1]:  # -1: the end, flushes the last batch
            n = named[i][1].numel() if i >= 0 else PACK + 1
            if batch and size + n > PACK:
                parts = reduce_packed([named[j][1] for j in batch], bins)
                for row, j in enumerate(batch):
                    name, t = named[j]
                    out[j] = Entry(name, kind, str(t.dtype), tuple(t.shape), parts, row)
                batch, size = [], 0
            batch.append(i)
            size += n
    return [e for e in out if e is not None]


def publishable(entries: list[Entry], step: int | None) -> list[TensorStats]:
    """Events for `entries` sharing one capture per device (one device->host copy)."""
    events: list[TensorStats] = []
    by_device: dict[torch.device, list[Entry]] = {}
    for e in entries:
        by_device.setdefault(e.parts[0].device, []).append(e)
    for group in by_device.values():
        events += _events(group, step)
    return events


def _events(group: list[Entry], step: int | None) -> list[TensorStats]:
    """One device's events: partials stacked, combined, captured once (constant op count)."""
    singles = [e for e in group if e.row is None]
    packs: dict[int, tuple[torch.Tensor, ...]] = {}  # each packed group's partials, once
    at: dict[int, int] = {}  # where a packed group's rows start
    rows = len(singles)
    for e in group:
        if e.row is not None and id(e.parts) not in packs:
            packs[id(e.parts)] = e.parts
            at[id(e.parts)] = rows
            rows += e.parts[0].shape[0]
    width = {e.parts[7].shape[-1] if len(e.parts) == 8 else -1 for e in group}
    nparts = 8 if len(width) == 1 and -1 not in width else 5  # histograms only if all have one
    cols: list[list[torch.Tensor]] = [[] for _ in range(nparts)]
    # float64 holds float32 statistics and counts (up to 2**53) exactly; packed partials are
    # float64 or exact in float32 (counts under 2**24), and torch.cat promotes to float64.
    if singles:
        for i, col in enumerate(cols):
            col.append(torch.stack([e.parts[i] for e in singles]).double())
    for parts in packs.values():
        for i, col in enumerate(cols):
            col.append(parts[i])
    var, mean, lo, hi, counts, *hist = [
        (torch.cat(c) if len(c) > 1 else c[0]).double() for c in cols
    ]
    single = {id(e): i for i, e in enumerate(singles)}
    pos = [single[id(e)] if e.row is None else at[id(e.parts)] + e.row for e in group]
    sizes = [1.0] * rows
    for p, e in zip(pos, group, strict=True):
        sizes[p] = float(math.prod(e.shape))  # host metadata
    n = host_tensor(sizes, torch.float64, var.device)  # no sync: see host_tensor
    stats = _combine(n, var, mean, lo, hi, counts)
    flat = stats.reshape(-1)
    if hist:
        flat = torch.cat([flat, hist[0], hist[1], hist[2].reshape(-1)])
    # One non-blocking copy of the whole group into pinned memory.
    shared = capture_shared(flat)
    events = []
    for p, e in zip(pos, group, strict=True):
        h: Any = None
        if hist:
            b = hist[2].shape[-1]
            base = (_FIELDS + 2) * rows + b * p
            h = {
                "min": shared.part(_FIELDS * rows + p),
                "max": shared.part((_FIELDS + 1) * rows + p),
                "counts": shared.part(base, base + b, int),
            }
        events.append(
            TensorStats(
                step=step,
                name=e.name,
                kind=e.kind,
                dtype=e.dtype,
                shape=e.shape,
                norm=shared.part(p),
                mean=shared.part(rows + p),
                std=shared.part(2 * rows + p),
                absmax=shared.part(3 * rows + p),
                nan_count=shared.part(4 * rows + p, kind=int),
                inf_count=shared.part(5 * rows + p, kind=int),
                histogram=h,
            )
        )
    return events


def _combine(n: torch.Tensor, *parts: torch.Tensor) -> torch.Tensor:
    """(6, rows) float64: norm, mean, std, absmax, nan and inf counts, as eager torch gives them.

    `parts`: var, mean, lo, hi, counts (float64, one row per tensor); `n`: the element counts.
    """
    var, mean, lo, hi, counts = parts
    nan = n - counts[:, 0]
    neg_inf = counts[:, 0] - counts[:, 1]
    pos_inf = counts[:, 2]
    inf = neg_inf + pos_inf
    only_inf = (inf > 0) & (nan == 0)  # NaN anywhere already makes var and mean NaN
    # sum(x**2) = n * (var + mean**2): two non-negative terms, no cancellation.
    norm = torch.where(only_inf, math.inf, (n * (var + mean * mean)).sqrt())
    signed = torch.where(neg_inf == 0, math.inf, torch.where(pos_inf == 0, -math.inf, math.nan))
    mean = torch.where(only_inf, signed, mean)  # Welford's mean of [1, inf, 2] is NaN; sum's inf
    std = torch.where(inf > 0, math.nan, (var * n / (n - 1)).sqrt())  # n == 1: 0/0, NaN
    absmax = torch.maximum(lo.abs(), hi.abs())  # NaN propagates, as in Tensor.abs().max()
    return torch.stack([norm, mean, std, absmax, nan, inf])
