"""Partial statistics of tensors in a few torch ops, with bounded temporaries (issue 20).

`reduce_tensor(t, bins)` reduces one tensor (an activation, or a large weight); it is pure
torch ops without host reads or data-dependent Python control flow, so dynamo traces it with
`fullgraph=True`. `reduce_packed(tensors, bins)` reduces many small tensors together: one copy
into a buffer of at most `PACK` elements, then segment reductions, a constant number of ops
however many tensors it holds. `eventbus._torch_stats` turns partials into `TensorStats`.

The partials ("parts"), in order:

    var      population variance: Welford, float32 (a packed buffer: centred, float64)
    mean     float32 (a packed buffer: float64)
    lo, hi   min and max (NaN if the tensor holds one)
    counts   how many elements are >= -inf, >= -max(float32), >= +inf (int64 or float32):
             NaN compares false, so nan = n - c0, -inf = c0 - c1, +inf = c2
    flo, fhi min and max of the finite values            (with bins only)
    hist     counts of the finite values in `bins` equal bins over [flo, fhi]

For one tensor they are 0-d (counts (3,), hist (bins,)); for a packed buffer of k tensors they
have a leading dimension k (counts (k, 3), hist (k, bins)).

On a GPU, eagerly, a tensor of more than `SMALL` elements is reduced by `_stats` (`_whole`
less the histogram) compiled once (`fused`): inductor fuses it into one or two kernels that
read the tensor once and allocate nothing of its size; a histogram is binned chunk by chunk.
A chunked reduction costs a launch per op per chunk, ~10 us each on a GPU: thousands for
GPT-2's activations. Where compiling fails (no Triton, no compiler), it logs why once and
chunks as below.

Temporaries: eager, a tensor of more than `CHUNK` elements is reduced in chunks (views), so
no temporary exceeds a chunk: the NaN/Inf comparison (3 bytes an element), a float32 copy of
a bfloat16/float16/float64 chunk (4), for histograms the rescaled chunk (4). Under
torch.compile the whole tensor is one expression that inductor fuses; nothing is chunked.
Nothing here reads a device value; the comments mark what would sync if written otherwise.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

import torch

from eventbus.log import get_logger

__all__ = [
    "CHUNK",
    "PACK",
    "SMALL",
    "fused",
    "host_tensor",
    "on_host",
    "reduce_packed",
    "reduce_tensor",
]

CHUNK = 1 << 20
"""Elements per chunk when an eager tensor is reduced in pieces (bounds each temporary)."""
SMALL = 1 << 15
"""`measure_many` packs tensors of at most this many elements; larger ones go one by one."""
PACK = 1 << 17
"""Elements in one packed buffer (`reduce_packed`)."""

FUSE_ON = ("cuda",)
"""Devices whose eager tensors of more than `SMALL` elements are reduced by `_stats` compiled."""

_INF = math.inf
_TINY = torch.finfo(torch.float32).tiny
_BOUNDS: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}

Parts = tuple[torch.Tensor, ...]


def host_tensor(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (host numbers) as a tensor on `device`, without a sync."""
    if device.type == "cuda":
        # torch.tensor(values, device="cuda") copies from pageable memory, which may
        # synchronise; from pinned memory a non_blocking copy is only queued on the current
        # stream, and the caching host allocator keeps the buffer until that copy has run.
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


def _bounds(x: torch.Tensor) -> torch.Tensor:
    """[-inf, -max, +inf] in x's dtype, shaped (3, 1, ..., 1): `x >= bounds` gives 3 counts."""
    shape = (3,) + (1,) * x.ndim
    values = [-_INF, -torch.finfo(x.dtype).max, _INF]
    if torch.compiler.is_compiling():  # a graph constant
        return torch.tensor(values, dtype=x.dtype, device=x.device).view(shape)
    key = (x.device, x.dtype, x.ndim)
    b = _BOUNDS.get(key)
    if b is None:  # once per device, dtype and rank
        # Filled by kernels; torch.tensor([...], device="cuda") would copy pageable memory.
        b = torch.full((3,), _INF, dtype=x.dtype, device=x.device)
        b[0].fill_(values[0])
        b[1].fill_(values[1])
        b = _BOUNDS[key] = b.view(shape)
    return b


def _counts(x: torch.Tensor) -> torch.Tensor:
    """int64 (3,): elements >= -inf, >= -max, >= +inf (one compare, one sum)."""
    g = torch.ge(x, _bounds(x))  # bool (3, *x.shape): 3 bytes an element; same dtype: no cast
    return g.sum(dim=tuple(range(1, g.ndim)))


def _finite_range(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 min and max of the finite values (+inf, -inf when there are none)."""
    lo = torch.nan_to_num(x, nan=_INF, posinf=_INF, neginf=_INF).amin()
    hi = torch.nan_to_num(x, nan=-_INF, posinf=-_INF, neginf=-_INF).amax()
    return _f32(lo), _f32(hi)


def _hist(
    f: torch.Tensor, p: torch.Tensor, lo: torch.Tensor, rng: torch.Tensor, bins: int
) -> torch.Tensor:
    """float32 counts of the finite values of `p` (`f`: its float32 copy, or `p` itself)."""
    # Rescaled to [0, 1] on the device: torch.histc with min == max would read the data's range
    # back to the host (a sync); fixed bounds never do. Non-finite values land outside [0, 1]
    # and are not counted. In place on our own float32 copy; a new tensor for float32 input.
    u = torch.sub(f, lo) if f is p else f.sub_(lo)
    return torch.histc(u.div_(rng), bins=bins, min=0.0, max=1.0)


def _f32(x: torch.Tensor) -> torch.Tensor:
    # A float32 copy for other dtypes, of at most CHUNK elements eagerly (fused when compiled).
    return x if x.dtype == torch.float32 else x.float()


def reduce_tensor(t: torch.Tensor, bins: int) -> Parts:
    """The partials of `t` (see the module docstring): 4 ops for float32, 5 for others.

    bins > 0 adds the finite range and a histogram (9 ops more; 11 for other dtypes). Eager, a
    tensor of more than `CHUNK` elements is reduced chunk by chunk; traced, it is not chunked.
    """
    with torch.no_grad():
        x = t.reshape(1) if not t.ndim else t
        if not x.is_floating_point():  # integers (tensor_stats): measured as float32
            x = x.float()
        if x.numel() == 0:
            return _empty(x, bins)
        if torch.compiler.is_compiling():
            return _whole(x, bins)
        if x.numel() > SMALL and x.device.type in FUSE_ON and x.is_contiguous():
            parts = _fused_parts(x, bins)
            if parts is not None:
                return parts
        if x.numel() <= CHUNK:
            return _whole(x, bins)
        return _chunked(x, bins)


class _Fused:
    """`_stats` compiled once, or why it cannot be (one owner for that state)."""

    fn: Callable[..., Parts] | None = None
    failed: str | None = None


def fused() -> str | None:
    """Why eager CUDA tensors are reduced in chunks rather than fused; None while fusing works."""
    return _Fused.failed


def _stats(x: torch.Tensor) -> Parts:
    """var, mean, lo, hi, counts, flo, fhi: `_whole` less the histogram (traced, fused)."""
    (var, mean, counts, flo, fhi), _ = _piece(x, 1, moments=True)
    return (var, mean, *torch.aminmax(x), counts, flo, fhi)


def _fused_parts(x: torch.Tensor, bins: int) -> Parts | None:
    """`x`'s partials with the statistics fused into one compiled function; None: chunk."""
    if _Fused.failed is not None:
        return None
    if _Fused.fn is None:
        if os.environ.get("EVENTBUS_FUSED_STATS", "1") == "0":
            _Fused.failed = "EVENTBUS_FUSED_STATS=0"
            return None
        # dynamic=True: one graph per dtype, not per size. The finite range is always computed
        # (fused, it costs no extra pass) and autocast is off: neither doubles the graphs.
        _Fused.fn = torch.compile(_stats, dynamic=True, fullgraph=True)
    try:
        with torch.autocast(x.device.type, enabled=False):
            parts = _Fused.fn(x.detach().view(-1))
    except Exception as e:  # no Triton or compiler here: chunked from now on, said once
        _Fused.failed = f"{type(e).__name__}: {str(e)[:300]}"
        get_logger().warning(
            "watch(): statistics of large GPU tensors cannot be fused by torch.compile "
            "here, so they are reduced in chunks (many more kernel launches). Set "
            "EVENTBUS_FUSED_STATS=0 to skip the attempt",
            reason=_Fused.failed,
        )
        return None
    if not bins:
        return parts[:5]
    # histc has no fused kernel, and a whole-tensor float32 copy would not be bounded.
    return (*parts, _binned(_pieces(x), parts[5], parts[6], bins))


def _piece(p: torch.Tensor, bins: int, moments: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """[var, mean,] counts[, flo, fhi] of one piece, and its float32 copy (or itself)."""
    counts = _counts(p)  # first: its bool temporary is gone before the float32 copy is made
    f = _f32(p)
    out = list(torch.var_mean(f, correction=0)) if moments else []  # Welford: no cancellation
    out.append(counts)
    if bins:  # the range in the narrower dtype: a bfloat16 temporary, not a float32 one
        out += _finite_range(p if p.element_size() <= 4 else f)
    return out, f


def on_host(x: torch.Tensor) -> bool:
    """A CPU tensor, eagerly: reading a value costs no device sync, so host shortcuts apply."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def _whole_on_host(x: torch.Tensor, bins: int) -> Parts:
    """`_whole` for a CPU tensor: two-pass moments (CPU Welford is ~15x slower) and NaN/Inf
    counted only when the range shows one. The temporaries stay within one chunk."""
    f = _f32(x)
    lo, hi = torch.aminmax(x)
    mean = f.mean()
    var = torch.linalg.vector_norm(f - mean).square_().div_(f.numel())
    # Host memory: reading it is no sync. NaN propagates into min and max, as does an Inf.
    finite = math.isfinite(lo.item()) and math.isfinite(hi.item())
    n = x.numel()
    counts = torch.tensor([n, n, 0]) if finite else _counts(x)
    parts: Parts = (var, mean, lo, hi, counts)
    if bins:
        flo, fhi = (_f32(lo), _f32(hi)) if finite else _finite_range(x)
        parts += (flo, fhi, _hist(f, x, flo, (fhi - flo).clamp_min_(_TINY), bins))
    return parts


def _whole(x: torch.Tensor, bins: int) -> Parts:
    if on_host(x):
        return _whole_on_host(x, bins)
    (var, mean, counts, *rng), f = _piece(x, bins, moments=True)
    parts: Parts = (var, mean, *torch.aminmax(x), counts)
    if bins:
        flo, fhi = rng
        parts += (flo, fhi, _hist(f, x, flo, (fhi - flo).clamp_min_(_TINY), bins))
    return parts


def _chunked(x: torch.Tensor, bins: int) -> Parts:
    pieces = _pieces(x)
    f32 = x.dtype == torch.float32
    rows = []
    for p in pieces:
        vals, f = _piece(p, bins, moments=not f32)
        del f  # before the next chunk's copy: one chunk's temporaries at a time
        rows.append(vals)
    cols = [list(c) for c in zip(*rows, strict=True)]
    if f32:  # Welford over the whole tensor: no temporary
        var, mean = torch.var_mean(x, correction=0)
    else:  # the chunks' moments combined (Chan et al.), weighted by their sizes
        n = x.numel()
        w = host_tensor([p.numel() / n for p in pieces], torch.float32, x.device)
        vs, ms, *cols = cols
        means = torch.stack(ms)
        mean = torch.dot(w, means)
        var = torch.dot(w, torch.stack(vs)) + torch.dot(w, (means - mean).square_())
    counts, *rng = cols
    parts: Parts = (var, mean, *torch.aminmax(x), torch.stack(counts).sum(0))
    if bins:
        flo, fhi = torch.stack(rng[0]).amin(), torch.stack(rng[1]).amax()
        parts += (flo, fhi, _binned(pieces, flo, fhi, bins))
    return parts


def _binned(
    pieces: list[torch.Tensor], flo: torch.Tensor, fhi: torch.Tensor, bins: int
) -> torch.Tensor:
    """The histogram over [flo, fhi] of a tensor's pieces, binned a piece at a time: float32
    counts are exact up to 2**24, a chunk's are; their sum is taken in float64."""
    span = (fhi - flo).clamp_min_(_TINY)
    hists = [_hist(_f32(p), p, flo, span, bins) for p in pieces]
    return hists[0] if len(hists) == 1 else torch.stack(hists).sum(0, dtype=torch.float64)


def _pieces(x: torch.Tensor) -> list[torch.Tensor]:
    """Views of `x` of at most CHUNK elements each, covering it once (no copy)."""
    if x.numel() <= CHUNK:
        return [x]
    if x.is_contiguous():
        return list(torch.split(x.view(-1), CHUNK))
    inner = math.prod(x.shape[1:])  # strided: split the outer dimension, recurse into big rows
    if inner <= CHUNK:
        return list(torch.split(x, CHUNK // inner))
    return [p for row in x.unbind(0) for p in _pieces(row)]


def _empty(x: torch.Tensor, bins: int) -> Parts:
    nan = torch.full((), math.nan, device=x.device)
    parts: Parts = (nan, nan, nan, nan, torch.zeros(3, dtype=torch.int64, device=x.device))
    if bins:
        parts += (nan, nan, torch.zeros(bins, device=x.device))
    return parts


def _seg(v: torch.Tensor, how: str, lengths: torch.Tensor) -> torch.Tensor:
    # unsafe=True skips the argument checks, which read `lengths` on the host (a sync).
    return torch.segment_reduce(v, how, lengths=lengths, unsafe=True)


def _spread(v: torch.Tensor, lengths: torch.Tensor, m: int) -> torch.Tensor:
    # output_size given: repeat_interleave does not read the total back (a sync).
    return torch.repeat_interleave(v, lengths, output_size=m)


def reduce_packed(tensors: Sequence[torch.Tensor], bins: int) -> Parts:
    """Partials (leading dimension k) of k contiguous tensors of one device and dtype.

    One copy into a buffer (the caller keeps it to at most PACK elements), then segment
    reductions: 16 ops (42 with a histogram) whatever k is.
    """
    with torch.no_grad():
        sizes = [t.numel() for t in tensors]
        m = sum(sizes)
        f = _f32(torch.cat([t.view(-1) for t in tensors]))  # the one copy (then float32)
        lengths = host_tensor(sizes, torch.int64, f.device)
        g = torch.empty((3, m), device=f.device)  # float32 0/1: segment sums take floats
        torch.ge(f, _bounds(f), out=g)
        counts = _seg(g.view(-1), "sum", lengths.repeat(3)).view(3, -1).T  # exact: m < 2**24
        del g
        # Moments in float64, centred (two-pass): a CPU segment sum adds its elements in order.
        x = f.double()
        mean = _seg(x, "sum", lengths) / lengths
        var = _seg(x.sub_(_spread(mean, lengths, m)).square_(), "sum", lengths) / lengths
        del x
        parts: Parts = (var, mean, _seg(f, "min", lengths), _seg(f, "max", lengths), counts)
        if bins:
            parts += _packed_hist(f, lengths, m, bins)
        return parts


def _packed_hist(f: torch.Tensor, lengths: torch.Tensor, m: int, bins: int) -> Parts:
    """Each segment's finite range and histogram, binned as torch.histc bins, in one scatter."""
    k = lengths.shape[0]
    lo = _seg(torch.nan_to_num(f, nan=_INF, posinf=_INF, neginf=_INF), "min", lengths)
    hi = _seg(torch.nan_to_num(f, nan=-_INF, posinf=-_INF, neginf=-_INF), "max", lengths)
    rng = (hi - lo).clamp_min_(_TINY)
    u = f.sub_(_spread(lo, lengths, m)).div_(_spread(rng, lengths, m)).mul_(bins)  # our copy
    # histc's bin is trunc((x - min) * bins / (max - min)), the top edge going to the last bin.
    # Non-finite values go to slot 0 of their segment's bins + 1 slots, which is dropped.
    u.nan_to_num_(nan=-1.0, posinf=-1.0, neginf=-1.0).clamp_(-1.0, bins - 1).floor_()
    first = torch.arange(k, device=f.device).mul_(bins + 1).add_(1)
    slot = u.long().add_(_spread(first, lengths, m))
    hist = torch.zeros(k * (bins + 1), device=f.device)
    hist.index_add_(0, slot, torch.ones(1, device=f.device).expand(m))  # exact: m < 2**24
    return lo, hi, hist.view(k, bins + 1)[:, 1:]
