"""Sorting family: sort, argsort, topk, kthvalue, median, mode, max/min with a dim.

Everything stays on the lazy graph (no host round trip), built from the graph primitives,
so gradients come from autograd's per-primitive rules.

How a row is sorted (`_sort_last`), chosen by its length n:
- n <= RANK_MAX: a rank by comparison counting. rank_i = #{j: x_j before x_i}, where
  "before" is a total order (value, then position), so ranks are a permutation; then
  indices[p] = the i whose rank is p. Two O(n^2) fused reduces per row: few kernels, fine
  while n^2 is small.
- longer rows: a bitonic sorting network over the row padded to a power of two N,
  log2(N)(log2(N)+1)/2 compare-exchange stages. Each stage is one elementwise step over
  the (value, index) pairs: a reshape groups the row into blocks, a flip gives every
  element its partner, and `where` keeps the smaller or the larger of the two. Ordering by
  (value, index) makes the unstable network give exactly the stable order (torch's
  `stable=True`). Padding is a value that sorts last (NaN ascending, -inf descending,
  the integer extremes) and, having the largest positions, after real values equal to it.
  64x4096 float32: 78 stages, two kernels each (values, indices).
Values come out of the network (or a gather of the indices), so their gradient is the
gradient routed back to where each value came from, as torch's.

NaN is larger than every number (torch's order): last when ascending, first when
descending. Bool rows compare as 0/1.
"""
import builtins
from collections import namedtuple

from . import dtype as dt
from .tensor import Tensor, canonical_axis, iota, const_tensor, gather, where

RANK_MAX = 128      # rows up to this long sort by comparison counting, longer ones bitonic
EXTRACT_MAX_K = 32  # topk of k up to this over longer rows: k extraction rounds, no sort


def _return_type(name, fields):
    """A named tuple like torch.return_types.<name> (indexable, unpackable, .values)."""
    cls = namedtuple(name, fields)
    cls.__module__ = "zyx.return_types"
    return cls


class return_types:        # noqa: N801  (torch's spelling: torch.return_types.max)
    """Named tuples returned by ops that give (values, indices), as torch.return_types."""
    sort = _return_type("sort", ["values", "indices"])
    topk = _return_type("topk", ["values", "indices"])
    kthvalue = _return_type("kthvalue", ["values", "indices"])
    median = _return_type("median", ["values", "indices"])
    mode = _return_type("mode", ["values", "indices"])
    max = _return_type("max", ["values", "indices"])
    min = _return_type("min", ["values", "indices"])
    cummax = _return_type("cummax", ["values", "indices"])
    cummin = _return_type("cummin", ["values", "indices"])


# ---------------------------------------------------------------------------------------
# the order
def _key(x: Tensor) -> Tensor:
    """The tensor whose values are compared: bool as uint8 (bool has no `<`)."""
    return x.cast(dt.uint8) if x.dtype.is_bool else x


def _before(av, ai, bv, bi, descending):
    """bool: element a (value av, position ai) comes before element b in the sorted order.
    Total order: by value (NaN largest), equal values by position."""
    if descending:
        less, tie = av > bv, av == bv
    else:
        less, tie = av < bv, av == bv
    if av.dtype.is_float:
        a_nan, b_nan = av.isnan(), bv.isnan()
        # NaN first when descending, last when ascending
        less = less | ((a_nan & ~b_nan) if descending else (b_nan & ~a_nan))
        tie = tie | (a_nan & b_nan)
    return less | (tie & (ai < bi))


def _pad_value(d, descending):
    """The value the network pads rows with: it sorts after every real value that is not
    equal to it, and after the equal ones too because padding has the largest positions."""
    if d.is_float:
        return float("-inf") if descending else float("nan")
    import numpy as np
    info = np.iinfo(d.np)
    return builtins.int(info.min if descending else info.max)


def _rank_sort(x: Tensor, descending: bool):
    """(values, indices) of the rows of 2-D `x` by comparison counting (see module doc)."""
    b, n = x.shape
    k = _key(x)
    pos = iota(n, dt.int32)
    before = _before(k.reshape(b, 1, n), pos.reshape(1, 1, n),
                     k.reshape(b, n, 1), pos.reshape(1, n, 1), descending)
    rank = before.cast(dt.int32).sum(2, dtype=dt.int32)                  # (b, n): slot of x_i
    hit = rank.reshape(b, 1, n) == pos.reshape(1, n, 1)                  # [b, p, i]
    idx = where(hit, pos.cast(dt.int64).reshape(1, 1, n), 0).sum(2)      # (b, n) int64
    return gather(x, 1, idx), idx


def _next_pow2(n):
    return 1 << builtins.max(0, (n - 1).bit_length())


def _exchange(v, i, blocks, width, mirrored, descending):
    """One compare-exchange stage over rows of length N = blocks * width: within each
    block, element p pairs with p + width/2 (or with width-1-p when `mirrored`, the first
    stage of a merge), the lower one keeping the earlier element of the pair."""
    b = v.shape[0]
    half = width // 2
    if mirrored:
        v3, i3 = v.reshape(b, blocks, width), i.reshape(b, blocks, width)
        pv, pi = v3.flip(2), i3.flip(2)
        lower = (iota(width, dt.int32) < half).reshape(1, 1, width)
    else:
        v3, i3 = v.reshape(b, blocks, 2, half), i.reshape(b, blocks, 2, half)
        pv, pi = v3.flip(2), i3.flip(2)
        lower = (iota(2, dt.int32) == 0).reshape(1, 1, 2, 1)
    partner_first = _before(pv, pi, v3, i3, descending)
    take = where(lower, partner_first, ~partner_first)
    nv, ni = where(take, pv, v3), where(take, pi, i3)
    return nv.reshape(v.shape), ni.reshape(i.shape)


def _bitonic_sort(x: Tensor, descending: bool):
    """(values, indices) of the rows of 2-D `x` by a bitonic network (see module doc)."""
    b, n = x.shape
    big = _next_pow2(n)
    k = _key(x)
    v = k._pad(((0, 0), (0, big - n)), _pad_value(k.dtype, descending))
    i = iota(big, dt.int32).reshape(1, big).expand(b, big)
    width = 2
    while width <= big:
        v, i = _exchange(v, i, big // width, width, True, descending)
        half = width // 2
        while half >= 2:
            v, i = _exchange(v, i, big // half, half, False, descending)
            half //= 2
        width *= 2
    v, i = v.shrink(((0, b), (0, n))), i.shrink(((0, b), (0, n)))
    if x.dtype.is_bool:
        v = v.cast(dt.bool_)
    return v, i.cast(dt.int64)


def _sort_last(x: Tensor, descending: bool):
    """(values, indices) sorting the last axis of `x`, any rank."""
    lead, n = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, n) if n else x
    if n <= 1:
        return x, const_tensor(0, dt.int64, x.shape)
    method = _rank_sort if n <= RANK_MAX else _bitonic_sort
    v, i = method(rows, descending)
    return v.reshape(lead + (n,)), i.reshape(lead + (n,))


def _along(x: Tensor, dim, fn):
    """Apply `fn` (last-axis op returning a tuple of tensors) along `dim` of `x`."""
    if x.ndim == 0:
        out = fn(x.reshape(1))
        return tuple(o.reshape(()) for o in out)
    d = canonical_axis(dim, x.ndim)
    if d == x.ndim - 1:
        return fn(x)
    out = fn(x.transpose(d, -1))
    return tuple(o.transpose(d, -1) for o in out)


def _check_sortable(x, what):
    if not isinstance(x, Tensor):
        raise TypeError(f"{what}: expected a zyx Tensor, got {type(x).__name__}")


# ---------------------------------------------------------------------------------------
# public ops
def sort(input, dim=-1, descending=False, stable=False):
    """torch.sort(input, dim=-1, descending=False, stable=False) -> (values, indices).
    Always stable (equal values keep their order; torch's `stable=True`); NaN is the
    largest value. Lazy: no host round trip (see the module doc for the method)."""
    _check_sortable(input, "sort")
    v, i = _along(input, dim, lambda t: _sort_last(t, builtins.bool(descending)))
    return return_types.sort(v, i)


def argsort(input, dim=-1, descending=False, stable=False):
    """torch.argsort: the indices of sort (stable, NaN largest)."""
    return sort(input, dim, descending, stable).indices


def msort(input):
    """torch.msort: sort along dim 0 (values only)."""
    return sort(input, 0).values


def topk(input, k, dim=-1, largest=True, sorted=True):   # noqa: A002  (torch names)
    """torch.topk(input, k, dim=-1, largest=True, sorted=True) -> (values, indices): the k
    largest (smallest with largest=False) along dim, in sorted order (also for
    sorted=False, which torch allows to be any order). Equal values: lower index first."""
    _check_sortable(input, "topk")
    size = input.shape[canonical_axis(dim, input.ndim)] if input.ndim else 1
    if not 0 <= k <= size:
        raise IndexError(f"topk: k ({k}) is out of range for dimension of size {size}")

    def first_k(t):
        n = t.shape[-1]
        if 0 < k <= EXTRACT_MAX_K and n > RANK_MAX:
            lead = t.shape[:-1]
            v, i = _extract_first(t.reshape(-1, n), k, builtins.bool(largest))
            return v.reshape(lead + (k,)), i.reshape(lead + (k,))
        v, i = _sort_last(t, builtins.bool(largest))
        cut = tuple((0, s) for s in t.shape[:-1]) + ((0, k),)
        return v.shrink(cut), i.shrink(cut)
    v, i = _along(input, dim, first_k)
    return return_types.topk(v, i)


def _extract_first(x: Tensor, k: int, descending: bool):
    """(values, indices) of the first k elements of each row of 2-D `x` in the sort order
    (NaN largest, equal values by position), found by k rounds of "the first element not
    yet taken": each round is a few fused reduces over the row, so topk with a small k of
    a long row costs O(k n) instead of a whole bitonic sort (256x10000, k=10: ~2 s -> tens
    of ms)."""
    b, n = x.shape
    key = _key(x)
    pos = iota(n, dt.int64).reshape(1, n)
    is_float = key.dtype.is_float
    nan = key.isnan() if is_float else None
    # what a taken element reads as, so it never wins the round's max/min
    fill = _pad_value(key.dtype, descending) if not is_float else \
        (float("-inf") if descending else float("inf"))
    taken = None
    picked = []
    for _ in range(k):
        free = ~taken if taken is not None else None
        cand = key if taken is None else where(taken, fill, key)
        if descending:
            best = cand.amax(1, keepdim=True)       # NaN propagates: NaN is largest
            hit = (cand == best) | (nan & best.isnan()) if is_float else cand == best
        else:
            # smallest non-NaN first; rows whose remaining elements are all NaN take those
            real = cand if not is_float else where(nan, fill, cand)
            best = real.amin(1, keepdim=True)
            hit = (real == best) & ~nan if is_float else real == best
            if is_float:
                left = nan if free is None else nan & free
                hit = where((hit if free is None else hit & free).any(1, keepdim=True),
                            hit, left)
        if free is not None:
            hit = hit & free
        idx = hit.cast(dt.uint8).argmax(1, keepdim=True)    # first position that hits
        picked.append(idx)
        one = pos == idx
        taken = one if taken is None else taken | one
    from .tensor import cat
    indices = cat(picked, 1)
    return gather(x, 1, indices), indices


def _select_slot(v, i, slot):
    """values/indices at position `slot` (an int, or an int64 tensor of the rows' shape)
    of the sorted last axis, which is kept as size 1."""
    if isinstance(slot, Tensor):
        vals = gather(v, -1, slot.reshape(slot.shape + (1,)))
        idx = gather(i, -1, slot.reshape(slot.shape + (1,)))
    else:
        cut = tuple((0, s) for s in v.shape[:-1]) + ((slot, slot + 1),)
        vals, idx = v.shrink(cut), i.shrink(cut)
    return vals, idx


def _reduce_to_slot(input, dim, keepdim, slot_of, name):
    """Sort along dim, take the value at the slot `slot_of(sorted_values)` chooses; the
    result keeps dim as size 1 when keepdim (torch's kthvalue/median shape rules)."""
    if input.ndim == 0:
        return getattr(return_types, name)(input, const_tensor(0, dt.int64, ()))
    d = canonical_axis(dim, input.ndim)
    if input.shape[d] == 0:
        raise IndexError(f"{name}(): Expected reduction dim {d} to have non-zero size.")

    def pick(t):
        v, i = _sort_last(t, False)
        return _select_slot(v, i, slot_of(v, t))
    v, i = _along(input, d, pick)
    if not keepdim:
        v, i = v.squeeze(d), i.squeeze(d)
    return getattr(return_types, name)(v, i)


def kthvalue(input, k, dim=-1, keepdim=False):
    """torch.kthvalue: the k-th smallest value (1-based) along dim and its index. NaN
    counts as the largest value."""
    _check_sortable(input, "kthvalue")
    size = input.shape[canonical_axis(dim, input.ndim)] if input.ndim else 1
    if not 1 <= k <= size:
        raise IndexError(f"kthvalue(): selected number k out of range for dimension of "
                         f"size {size} (k = {k})")
    return _reduce_to_slot(input, dim, keepdim, lambda v, t: k - 1, "kthvalue")


def median(input, dim=None, keepdim=False):
    """torch.median. Without dim: the lower median of all values (0-d; NaN if any value is
    NaN). With dim: (values, indices), the lower median ((n-1)//2-th smallest) of each
    row; a row holding NaN gives NaN and the index of its first NaN, as torch."""
    _check_sortable(input, "median")
    if dim is None:
        flat = input.reshape(-1)
        if flat.shape[0] == 0:
            return const_tensor(float("nan"), input.dtype, ())
        return median(flat, 0).values

    def slot(v, t):
        n = t.shape[-1]
        lower = (n - 1) // 2
        if not t.dtype.is_float:
            return lower
        nans = t.isnan().sum(-1, dtype=dt.int64)
        # sorted ascending, the first NaN sits right after the n - nans numbers
        return where(nans > 0, n - nans, lower)
    return _reduce_to_slot(input, dim, keepdim, slot, "median")


def mode(input, dim=-1, keepdim=False):
    """torch.mode: the most frequent value along dim (the smallest of equally frequent
    ones) and the index of its last occurrence, as torch's CPU kernel. Counts are an
    O(n^2) fused compare-and-sum per row."""
    _check_sortable(input, "mode")
    if input.ndim == 0:
        return return_types.mode(input, const_tensor(0, dt.int64, ()))
    d = canonical_axis(dim, input.ndim)

    def most_frequent(t):
        n = t.shape[-1]
        k = _key(t)
        same = k.unsqueeze(-1) == k.unsqueeze(-2)                 # [.., i, j]
        if k.dtype.is_float:
            same = same | (k.isnan().unsqueeze(-1) & k.isnan().unsqueeze(-2))
        count = same.cast(dt.int32).sum(-1, dtype=dt.int32)    # occurrences of x_i
        best = count.amax(-1, keepdim=True)
        # among the most frequent values the smallest: its ascending-sorted first slot
        cand = where(count == best, k, _largest(k.dtype))
        v = cand.amin(-1, keepdim=True)
        if k.dtype.is_float:     # a most frequent NaN wins only when nothing else ties
            only_nan = (count == best) & ~k.isnan()
            v = where(only_nan.any(-1, keepdim=True), v, float("nan"))
            hit = (k == v) | (k.isnan() & v.isnan())
        else:
            hit = k == v
        pos = iota(n, dt.int64).reshape((1,) * (t.ndim - 1) + (n,))
        idx = where(hit, pos, -1).amax(-1, keepdim=True)
        return gather(t, -1, idx), idx
    v, i = _along(input, d, most_frequent)
    if not keepdim:
        v, i = v.squeeze(d), i.squeeze(d)
    return return_types.mode(v, i)


def _largest(d):
    if d.is_float:
        return float("inf")
    if d.is_bool:
        return 1
    import numpy as np
    return builtins.int(np.iinfo(d.np).max)


def _extreme(input, dim, keepdim, other, largest, axis):
    """max/min in torch's three forms: all values (0-d), along dim ((values, indices)),
    or elementwise against another tensor."""
    if isinstance(dim, Tensor) or isinstance(other, Tensor):
        o = dim if isinstance(dim, Tensor) else other
        return input.maximum(o) if largest else input.minimum(o)
    dim = axis if axis is not None else dim
    if dim is None:
        if keepdim:
            raise TypeError(f"{'max' if largest else 'min'}(): keepdim needs a dim")
        return input.amax() if largest else input.amin()
    if isinstance(dim, (tuple, list)):
        raise TypeError(f"{'max' if largest else 'min'}(): dim must be an int (use "
                        f"{'amax' if largest else 'amin'} for several dims)")
    idx = (input.argmax if largest else input.argmin)(dim, keepdim=True)
    d = canonical_axis(dim, input.ndim)
    # values through the indices: the gradient goes to the chosen element only, as torch's
    vals = gather(input, d, idx) if input.ndim else input
    if not keepdim and input.ndim:
        vals, idx = vals.squeeze(d), idx.squeeze(d)
    cls = return_types.max if largest else return_types.min
    return cls(vals, idx)


def max(input, dim=None, keepdim=False, *, other=None, axis=None):   # noqa: A001
    """torch.max: `max(x)` the largest value (0-d, NaN propagates); `max(x, dim,
    keepdim=False)` the named tuple (values, indices) with the first index of each row's
    maximum (a NaN counts as the maximum); `max(x, other)` elementwise maximum."""
    return _extreme(input, dim, keepdim, other, True, axis)


def min(input, dim=None, keepdim=False, *, other=None, axis=None):   # noqa: A001
    """torch.min: the counterpart of `max` (see there)."""
    return _extreme(input, dim, keepdim, other, False, axis)


__all__ = ["sort", "argsort", "msort", "topk", "kthvalue", "median", "mode", "max", "min",
           "return_types"]

for _name in ("sort", "argsort", "msort", "topk", "kthvalue", "median", "mode", "max", "min"):
    setattr(Tensor, _name, globals()[_name])
