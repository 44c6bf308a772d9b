"""Indexing family: scatter, scatter_add, scatter_reduce, index_select, index_add,
index_copy, index_fill, take_along_dim, masked_select, nonzero, where(cond), unique.

Ops with a shape known before running are lazy: a one-hot comparison of the index with
arange(n) (`_hits`) feeds a fused reduce over the index's scattered axis, as `gather` does,
so they fuse with what surrounds them and get gradients from the primitives' rules.
Out-of-range indices raise IndexError when the result is computed (value checks, see
ARCHITECTURE.md), or at once for constant indices.

Ops whose output shape depends on values (nonzero, masked_select, unique, one-argument
where) realize their input and read it on the host; masked_select of a tensor that
requires grad stays differentiable (the selected positions index it lazily).
"""
import builtins

import numpy as np

from . import dtype as dt
from ._core import kernel as K
from .errors import DTypeError, ShapeError
from .tensor import Tensor, canonical_axis, iota, const_tensor, watch_range, INDEX_MESSAGE, \
    broadcast_shape, gather, pick_one, where as _where3

_REDUCTIONS = ("sum", "prod", "mean", "amax", "amin")


def _as_index(index, what):
    if not isinstance(index, Tensor):
        index = Tensor(np.asarray(index, dtype=np.int64), dtype=dt.int64)
    if not index.dtype.is_int:
        raise DTypeError(f"{what}(): Expected dtype int64 for index, got {index.dtype.name}")
    return index


def _hits(index: Tensor, n: int, dim: int, what: str):
    """bool [..., j (at dim), m (at dim+1), ...]: index[..., j, ...] == m, m in [0, n).
    Registers the range check [0, n) on the index (torch refuses negative indices here)."""
    shape = [1] * (index.ndim + 1)
    shape[dim + 1] = n
    hit = index.unsqueeze(dim + 1) == iota(n, index.dtype).reshape(shape)
    watch_range(hit, index, 0, n, INDEX_MESSAGE, (dim, n, what))
    return hit


def _check_scatter_shapes(input, dim, index, src, what):
    if index.ndim != input.ndim and not (index.ndim <= 1 and input.ndim <= 1):
        raise ShapeError(f"{what}(): Index tensor must have the same number of dimensions "
                         f"as self tensor ({index.ndim} != {input.ndim})")
    for d in range(index.ndim):
        if d != dim and index.shape[d] > input.shape[d]:
            raise ShapeError(f"{what}(): Expected index {index.shape} to be smaller than self "
                             f"{input.shape} apart from dimension {dim}")
        if isinstance(src, Tensor) and index.shape[d] > src.shape[d]:
            raise ShapeError(f"{what}(): Expected index {index.shape} to be smaller than src "
                             f"{src.shape}")


class _Scatter:
    """The pieces every scatter-like op combines, for input (shape S), an index and a src
    restricted to the index's shape: `hit` (S: written at least once), `reduced(op,
    identity)` (S: the sources written to each place, combined by op), `last()` (S: the
    last source written, torch's unspecified-order "replace" made deterministic)."""

    def __init__(self, input, dim, index, src, what):
        self.input, self.what = input, what
        self.dim = canonical_axis(dim, input.ndim) if input.ndim else 0
        index = _as_index(index, what)
        if input.ndim == 0:          # a 0-d scatter is a 1-element one
            input, index = input.reshape(1), index.reshape(1)
            src = src.reshape(1) if isinstance(src, Tensor) and src.ndim == 0 else src
        self.flat0 = self.input.ndim == 0
        _check_scatter_shapes(input, self.dim, index, src, what)
        self.base, self.index = input, index
        self.n = input.shape[self.dim]
        self.sel = _hits(index, self.n, self.dim, what)          # [.., j, m, ..]
        if isinstance(src, Tensor):
            src = src.cast(input.dtype)
            src = src.shrink(tuple((0, s) for s in index.shape))
            self.src = src.unsqueeze(self.dim + 1)
        else:
            self.src = const_tensor(src, input.dtype, ())
        self._pads = tuple((0, 0) if d == self.dim else (0, input.shape[d] - index.shape[d])
                           for d in range(input.ndim))

    def _fit(self, t, fill):
        """A reduced tensor (index extents, n at dim) padded to the input's shape."""
        return t._pad(self._pads, fill)

    def _out(self, t):
        return t.reshape(()) if self.flat0 else t

    def hit(self):
        return self._fit(self.sel.cast(dt.uint8)._reduce(K.R_MAX, self.dim, False).cast(dt.bool_),
                         False)

    def count(self):
        return self._fit(self.sel.cast(dt.int64)._reduce(K.R_SUM, self.dim, False), 0)

    def reduced(self, rop, identity):
        d = self.base.dtype
        vals = _where3(self.sel, self.src, const_tensor(identity, d, ()))
        if d.is_bool:
            vals = vals.cast(dt.uint8)
        r = vals._reduce(rop, self.dim, False)
        return self._fit(r.cast(d) if d.is_bool else r, identity)

    def last(self):
        j = self.index.shape[self.dim]
        shape = [1] * self.sel.ndim
        shape[self.dim] = j
        pos = iota(j, dt.int32).reshape(shape)
        latest = _where3(self.sel, pos, -1)._reduce(K.R_MAX, self.dim, True)
        only = self.sel & (pos == latest)
        d = self.base.dtype
        vals = _where3(only, self.src, const_tensor(0, d, ()))
        if d.is_bool:
            return self._fit(vals._reduce(K.R_MAX, self.dim, False), False)
        return self._fit(vals._reduce(K.R_SUM, self.dim, False), 0)


def _extreme_identity(d, largest):
    if d.is_float:
        return float("-inf") if largest else float("inf")
    if d.is_bool:
        return 0 if largest else 1
    info = np.iinfo(d.np)
    return builtins.int(info.min if largest else info.max)


def scatter(input, dim, index, src=None, value=None, *, reduce=None):
    """torch.scatter(input, dim, index, src) / scatter(input, dim, index, value): a copy of
    input with out[index[i][j][k]][j][k] = src[i][j][k] (dim=0). `src` may be a number.
    Where an index repeats, the last source along dim wins (torch leaves it unspecified).
    reduce="add"/"multiply" as torch's deprecated form (scatter_add / a product)."""
    if src is None:
        src = value
    if src is None:
        raise TypeError("scatter(): expected a src tensor or a value")
    s = _Scatter(input, dim, index, src, "scatter")
    if reduce is not None:
        if reduce not in ("add", "multiply"):
            raise ValueError(f"scatter(): reduce must be 'add' or 'multiply', got {reduce!r}")
        return scatter_reduce(input, dim, index, _full_src(src, index, input),
                              "sum" if reduce == "add" else "prod")
    return s._out(_where3(s.hit(), s.last(), s.base))


def _full_src(src, index, input):
    return src if isinstance(src, Tensor) else \
        const_tensor(src, input.dtype, ()).expand(index.shape if isinstance(index, Tensor) else
                                                  np.shape(index))


def scatter_add(input, dim, index, src):
    """torch.scatter_add: a copy of input with src[i][j][k] added at out[index[i][j][k]][j][k]
    (dim=0); repeated indices accumulate."""
    if not isinstance(src, Tensor):
        raise TypeError("scatter_add(): src must be a tensor")
    s = _Scatter(input, dim, index, src, "scatter_add")
    added = s.reduced(K.R_SUM, 0)
    return s._out(s.base | added if s.base.dtype.is_bool else s.base + added)


def scatter_reduce(input, dim, index, src, reduce, *, include_self=True):
    """torch.scatter_reduce(input, dim, index, src, reduce, include_self=True): the sources
    sent to each place combined with reduce in ("sum", "prod", "mean", "amax", "amin"),
    with the input's own value too when include_self; places no index names keep the
    input. Integer means round toward minus infinity (torch's floor division)."""
    if reduce not in _REDUCTIONS:
        raise ValueError(f"scatter_reduce(): reduce argument must be one of {_REDUCTIONS}, "
                         f"got {reduce!r}")
    if not isinstance(src, Tensor):
        raise TypeError("scatter_reduce(): src must be a tensor")
    s = _Scatter(input, dim, index, src, "scatter_reduce")
    base, hit = s.base, s.hit()
    if reduce in ("sum", "mean"):
        total = s.reduced(K.R_SUM, 0)
        if include_self:
            total = total + base
        if reduce == "sum":
            return s._out(_where3(hit, total, base))
        count = s.count() + (1 if include_self else 0)
        count = _where3(hit, count, 1).cast(base.dtype)
        mean = total // count if not base.dtype.is_float else total / count
        return s._out(_where3(hit, mean, base))
    if reduce == "prod":
        total = s.reduced(K.R_PROD, 1)
        return s._out(_where3(hit, total * base if include_self else total, base))
    largest = reduce == "amax"
    r = s.reduced(K.R_MAX if largest else K.R_MIN, _extreme_identity(base.dtype, largest))
    if include_self:
        r = r.maximum(base) if largest else r.minimum(base)
    return s._out(_where3(hit, r, base))


def _along_index(input, dim, index, what):
    """dim normalized and a 1-D int index (0-d accepted) for the index_* ops."""
    index = _as_index(index, what)
    if index.ndim > 1:
        raise IndexError(f"{what}(): Index is supposed to be a vector")
    index = index.reshape(-1)
    d = canonical_axis(dim, input.ndim) if input.ndim else 0
    return d, index


def _spread(index, shape, dim):
    """A 1-D index placed along dim and broadcast to `shape` (an index for gather/scatter)."""
    view = [1] * len(shape)
    view[dim] = index.shape[0]
    return index.reshape(view).expand(shape)


def index_select(input, dim, index):
    """torch.index_select: the entries of input at positions `index` (1-D) along dim."""
    d, index = _along_index(input, dim, index, "index_select")
    if input.ndim == 0:
        return gather(input.reshape(1), 0, index).reshape(() if index.shape[0] == 1 else (-1,))
    n = input.shape[d]
    shape = input.shape[:d] + (index.shape[0],) + input.shape[d + 1:]
    sel = _hits(_spread(index, shape, d), n, d, "index_select")     # [.., m, n, ..]
    return pick_one(input.unsqueeze(d), sel, d + 1, input)


def _source_shape_check(input, d, index, source, what):
    want = input.shape[:d] + (index.shape[0],) + input.shape[d + 1:] if input.ndim else \
        (index.shape[0],)
    got = source.shape if source.ndim else (1,)
    if tuple(got) != tuple(want):
        raise ShapeError(f"{what}(): source {source.shape} must have shape {want} (self "
                         f"{input.shape}, {index.shape[0]} indices along dim {d})")


def index_add(input, dim, index, source, *, alpha=1):
    """torch.index_add(input, dim, index, source, alpha=1): a copy of input with
    alpha * source[.., i, ..] added at position index[i] along dim (repeats accumulate)."""
    d, index = _along_index(input, dim, index, "index_add")
    _source_shape_check(input, d, index, source, "index_add")
    src = source if alpha == 1 else source * alpha
    if input.ndim == 0:
        return scatter_add(input.reshape(1), 0, index, src.reshape(1)).reshape(())
    return scatter_add(input, d, _spread(index, src.shape, d), src)


def index_copy(input, dim, index, source):
    """torch.index_copy: a copy of input with source[.., i, ..] written at position
    index[i] along dim (the last one wins where an index repeats)."""
    d, index = _along_index(input, dim, index, "index_copy")
    _source_shape_check(input, d, index, source, "index_copy")
    if input.ndim == 0:
        return scatter(input.reshape(1), 0, index, source.reshape(1)).reshape(())
    return scatter(input, d, _spread(index, source.shape, d), source)


def index_fill(input, dim, index, value):
    """torch.index_fill: a copy of input with every entry at positions `index` along dim
    set to `value` (a number or a 0-d tensor)."""
    d, index = _along_index(input, dim, index, "index_fill")
    n = input.shape[d] if input.ndim else 1
    hit = _hits(index, n, 0, "index_fill").cast(dt.uint8)._reduce(K.R_MAX, 0, False)
    view = [1] * builtins.max(input.ndim, 1)
    view[d] = n
    mask = hit.cast(dt.bool_).reshape(view if input.ndim else ())
    if isinstance(value, Tensor):
        if value.ndim:
            raise IndexError("index_fill(): only supports a 0-dimensional value tensor")
        value = value.cast(input.dtype)
    return _where3(mask, value, input).cast(input.dtype)


def take_along_dim(input, indices, dim=None):
    """torch.take_along_dim: gather along dim after broadcasting input and indices on the
    other dims; dim=None works on both flattened."""
    indices = _as_index(indices, "take_along_dim")
    if dim is None:
        return gather(input.reshape(-1), 0, indices.reshape(-1))
    if input.ndim != indices.ndim:
        raise ShapeError(f"take_along_dim(): input and indices should have the same number "
                         f"of dimensions, but got {input.ndim} and {indices.ndim}")
    d = canonical_axis(dim, input.ndim)
    rest = broadcast_shape(*[tuple(1 if i == d else s for i, s in enumerate(t.shape))
                             for t in (input, indices)])
    x = input.expand(rest[:d] + (input.shape[d],) + rest[d + 1:])
    idx = indices.expand(rest[:d] + (indices.shape[d],) + rest[d + 1:])
    return gather(x, d, idx)


# ---------------------------------------------------------------------------------------
# value-dependent shapes: realized and read on the host
def _host(t: Tensor) -> np.ndarray:
    return np.asarray(t.numpy())


def _on_device_of(arr, like: Tensor, d=None):
    return Tensor(np.ascontiguousarray(arr), dtype=d or like.dtype, device=like.device)


def nonzero(input, *, as_tuple=False):
    """torch.nonzero: the indices of nonzero entries, an int64 (count, ndim) tensor in row-
    major order (as_tuple=True: one 1-D tensor per dim). Realizes input (the count
    decides the shape)."""
    a = _host(input)
    if as_tuple:
        if a.ndim == 0:
            return (_on_device_of(np.nonzero(a.reshape(1))[0], input, dt.int64),)
        return tuple(_on_device_of(ix.astype(np.int64), input, dt.int64)
                     for ix in np.nonzero(a))
    return _on_device_of(np.argwhere(a).astype(np.int64).reshape(-1, a.ndim), input, dt.int64)


def argwhere(input):
    """torch.argwhere: nonzero(input) (realizes input)."""
    return nonzero(input)


def where(condition, input=None, other=None):
    """torch.where(condition, input, other): elementwise select; where(condition) alone is
    nonzero(condition, as_tuple=True) (realizes condition)."""
    if input is None and other is None:
        if not isinstance(condition, Tensor):
            condition = Tensor(np.asarray(condition))
        return nonzero(condition, as_tuple=True)
    if input is None or other is None:
        raise TypeError("where() takes a condition alone or a condition, input and other")
    return _where3(condition, input, other)


def masked_select(input, mask):
    """torch.masked_select: the entries of input where mask (broadcast together) is true,
    as a 1-D tensor. Realizes mask; input stays lazy and differentiable when it requires
    grad (a one-hot selection over its entries), else it is read on the host too."""
    if not isinstance(mask, Tensor):
        mask = Tensor(np.asarray(mask, dtype=bool))
    if not mask.dtype.is_bool:
        raise DTypeError(f"masked_select: expected BoolTensor for mask, got {mask.dtype.name}")
    shape = broadcast_shape(input.shape, mask.shape)
    where_true = np.flatnonzero(np.broadcast_to(_host(mask), shape))
    flat = input.expand(shape).reshape(-1)
    if not input.requires_grad:
        return _on_device_of(_host(flat)[where_true], input)
    return gather(flat, 0, _on_device_of(where_true.astype(np.int64), input, dt.int64))


def unique(input, sorted=True, return_inverse=False, return_counts=False, dim=None):   # noqa: A002
    """torch.unique: the distinct values (always sorted, as torch's CPU result), with the
    index of each input entry in them (return_inverse, input's shape) and how often each
    occurs (return_counts). dim: unique slices along that dim. Realizes input."""
    a = _host(input)
    axis = None if dim is None else canonical_axis(dim, input.ndim)
    # equal_nan=False: torch keeps every NaN as a value of its own (numpy merges them)
    vals, inverse, counts = np.unique(a, return_inverse=True, return_counts=True, axis=axis,
                                      equal_nan=False)
    out = [_on_device_of(vals, input)]
    if return_inverse:
        shape = a.shape if axis is None else (a.shape[axis],)
        out.append(_on_device_of(inverse.reshape(shape).astype(np.int64), input, dt.int64))
    if return_counts:
        out.append(_on_device_of(counts.astype(np.int64), input, dt.int64))
    return out[0] if len(out) == 1 else tuple(out)


__all__ = ["scatter", "scatter_add", "scatter_reduce", "index_select", "index_add",
           "index_copy", "index_fill", "take_along_dim", "masked_select", "nonzero",
           "argwhere", "where", "unique"]

for _name in ("scatter", "scatter_add", "scatter_reduce", "index_select", "index_add",
              "index_copy", "index_fill", "take_along_dim", "masked_select", "nonzero",
              "argwhere", "unique"):
    setattr(Tensor, _name, globals()[_name])
