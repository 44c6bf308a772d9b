"""Linear algebra and scans: einsum, bmm/mm/mv, outer, diag/diagonal/trace, tensordot,
kron, cross, norms (zyx.norm here; torch.linalg's spellings in zyx/linalg.py), cumprod, cummax/cummin,
logcumsumexp, diff, meshgrid.

All lazy and built from the graph primitives: einsum is a product of broadcast, permuted
operands summed over the contracted labels (the same fused reduce matmul is, so
"bij,bjk->bik" becomes matmul's kernel), contracted pairwise, left to right, for more
than two operands. A diagonal is a movement op (the flattened matrix read with a stride of
columns + 1). Scans (cumprod, cummax, logcumsumexp) reduce a window view of the row as
cumsum does: O(n^2) work per row, no sequential loop.
"""
import builtins
import math

from . import dtype as dt
from ._core import kernel as K
from .errors import ShapeError, DTypeError
from .tensor import Tensor, canonical_axis, iota, const_tensor, broadcast_shape, gather, \
    where, matmul, cat
from .sorting import return_types


# ---------------------------------------------------------------------------------------
# products
def _check_dims(t, n, what):
    if not isinstance(t, Tensor):
        raise TypeError(f"{what}: expected a zyx Tensor, got {type(t).__name__}")
    if t.ndim != n:
        raise ShapeError(f"{what}: expected a {n}-D tensor, got shape {t.shape}")


def bmm(input, mat2):
    """torch.bmm: batched (b, n, m) @ (b, m, p) -> (b, n, p); no broadcasting."""
    _check_dims(input, 3, "bmm")
    _check_dims(mat2, 3, "bmm")
    if input.shape[0] != mat2.shape[0] or input.shape[2] != mat2.shape[1]:
        raise ShapeError(f"bmm: shapes {input.shape} and {mat2.shape} do not match")
    return matmul(input, mat2)


def mm(input, mat2):
    """torch.mm: (n, m) @ (m, p) -> (n, p)."""
    _check_dims(input, 2, "mm")
    _check_dims(mat2, 2, "mm")
    return matmul(input, mat2)


def mv(input, vec):
    """torch.mv: (n, m) @ (m,) -> (n,)."""
    _check_dims(input, 2, "mv")
    _check_dims(vec, 1, "mv")
    return matmul(input, vec)


def outer(input, vec2):
    """torch.outer (alias ger): out[i, j] = input[i] * vec2[j]."""
    _check_dims(input, 1, "outer")
    _check_dims(vec2, 1, "outer")
    return input.reshape(-1, 1) * vec2.reshape(1, -1)


ger = outer


def diagonal(input, offset=0, dim1=0, dim2=1):
    """torch.diagonal: the diagonal of the (dim1, dim2) matrices (offset > 0 above the main
    one) as a new last dim, the two dims removed. A view-like movement op."""
    nd = input.ndim
    if nd < 2:
        raise ShapeError(f"diagonal: expected a tensor of 2 or more dims, got {input.shape}")
    a, b = canonical_axis(dim1, nd), canonical_axis(dim2, nd)
    if a == b:
        raise ShapeError(f"diagonal: dim1 and dim2 cannot be the same ({dim1}, {dim2})")
    rest = [d for d in range(nd) if d not in (a, b)]
    x = input.permute(rest + [a, b])
    lead = x.shape[:-2]
    n, m = x.shape[-2:]
    length = builtins.max(0, builtins.min(n, m - offset) if offset >= 0 else
                          builtins.min(n + offset, m))
    flat = x.reshape(lead + (n * m,))
    if length == 0:      # still computed from input, so a backward through it works
        return flat.shrink(tuple((0, s) for s in lead) + ((0, 0),))
    # element t of the diagonal sits at start + t * (m + 1) of the flattened matrix
    start = offset if offset >= 0 else -offset * m
    span = length * (m + 1)
    flat = flat._pad(((0, 0),) * len(lead) + ((-start, start + span - n * m),))
    rows = flat.reshape(lead + (length, m + 1))
    return rows.shrink(tuple((0, s) for s in lead) + ((0, length), (0, 1))).reshape(
        lead + (length,))


def diag(input, diagonal=0):
    """torch.diag: a 1-D input becomes a square matrix with it on the `diagonal`-th
    diagonal; a 2-D input gives that diagonal as 1-D."""
    if input.ndim == 2:
        return globals()["diagonal"](input, diagonal)
    if input.ndim != 1:
        raise ShapeError(f"diag: expected a 1-D or 2-D tensor, got shape {input.shape}")
    n, k = input.shape[0], builtins.abs(diagonal)
    size = n + k
    rows = iota(size, dt.int64).reshape(size, 1)
    cols = iota(size, dt.int64).reshape(1, size)
    on_diag = (cols - rows) == diagonal
    # the value of an entry on the diagonal is v[row] above it, v[col] below it
    v = input._pad(((0, k),))
    spread = v.reshape(size, 1).expand(size, size) if diagonal >= 0 else \
        v.reshape(1, size).expand(size, size)
    return where(on_diag, spread, const_tensor(0, input.dtype, ()))


def trace(input):
    """torch.trace: the sum of a 2-D input's main diagonal (int64 for integer input)."""
    _check_dims(input, 2, "trace")
    return diagonal(input).sum()


def tensordot(a, b, dims=2):
    """torch.tensordot: contract the last `dims` dims of a with the first `dims` of b, or
    the dims listed in dims=([a dims], [b dims])."""
    if isinstance(dims, int):
        if dims < 0:
            raise ValueError(f"tensordot expects dims >= 0, but got dims={dims}")
        da, db = list(range(a.ndim - dims, a.ndim)), list(range(dims))
    else:
        da, db = dims
        da = [da] if isinstance(da, int) else list(da)
        db = [db] if isinstance(db, int) else list(db)
    if len(da) != len(db):
        raise ShapeError(f"tensordot: both dim lists need the same length, got {da}, {db}")
    da = [canonical_axis(d, a.ndim) for d in da]
    db = [canonical_axis(d, b.ndim) for d in db]
    for x, y in zip(da, db):
        if a.shape[x] != b.shape[y]:
            raise ShapeError(f"tensordot: contracted dimension {x} of a ({a.shape[x]}) and "
                             f"{y} of b ({b.shape[y]}) differ")
    fa = [d for d in range(a.ndim) if d not in da]
    fb = [d for d in range(b.ndim) if d not in db]
    c = math.prod(a.shape[d] for d in da)
    am = a.permute(fa + da).reshape(math.prod(a.shape[d] for d in fa), c)
    bm = b.permute(db + fb).reshape(c, math.prod(b.shape[d] for d in fb))
    return matmul(am, bm).reshape(tuple(a.shape[d] for d in fa) + tuple(b.shape[d] for d in fb))


def kron(input, other):
    """torch.kron: the Kronecker product (shapes aligned on the right)."""
    nd = builtins.max(input.ndim, other.ndim)
    a = input.reshape((1,) * (nd - input.ndim) + input.shape)
    b = other.reshape((1,) * (nd - other.ndim) + other.shape)
    # a's dims interleaved with b's: a[i0, 1, i1, 1, ...] * b[1, j0, 1, j1, ...]
    ashape, bshape = [], []
    for sa, sb in zip(a.shape, b.shape):
        ashape += [sa, 1]
        bshape += [1, sb]
    prod = a.reshape(ashape) * b.reshape(bshape)
    return prod.reshape(tuple(sa * sb for sa, sb in zip(a.shape, b.shape)))


def cross(input, other, dim=None):
    """torch.cross: the 3-D cross product along dim (inputs broadcast). dim=None takes the
    first dim of size 3, as torch.cross (torch.linalg.cross defaults to -1)."""
    shape = broadcast_shape(input.shape, other.shape)
    a, b = input.expand(shape), other.expand(shape)
    if dim is None:
        sizes3 = [d for d, s in enumerate(shape) if s == 3]
        if not sizes3:
            raise ShapeError(f"cross: no dimension of size 3 in input {shape}")
        dim = sizes3[0]
    d = canonical_axis(dim, len(shape))
    if shape[d] != 3:
        raise ShapeError(f"linalg.cross: inputs dimension {d} must have length 3. Got "
                         f"{input.shape} and {other.shape}")
    # (a x b)_i = a_{i+1} b_{i+2} - a_{i+2} b_{i+1}
    return a.roll(-1, d) * b.roll(-2, d) - a.roll(-2, d) * b.roll(-1, d)


# ---------------------------------------------------------------------------------------
# einsum
def _parse_operand(term, ndim, what):
    """Labels of one einsum operand: letters, ('...', k) for the k-th ellipsis dim counted
    so that ellipsis dims of different operands align on the right."""
    if term.count("...") > 1:
        raise ValueError(f"einsum(): more than one ellipsis in '{term}'")
    for ch in term.replace("...", ""):
        if not ch.isalpha():
            raise ValueError(f"einsum(): invalid subscript '{ch}' in the equation")
    if "..." in term:
        left, right = term.split("...")
        e = ndim - len(left) - len(right)
        if e < 0:
            raise ShapeError(f"einsum(): the operand {what} has {ndim} dims, fewer than "
                             f"its subscripts '{term}'")
        return list(left) + [("...", -e + k) for k in range(e)] + list(right), e
    if len(term) != ndim:
        raise ShapeError(f"einsum(): the number of subscripts in the equation ({len(term)}) "
                         f"does not match the number of dimensions ({ndim}) for operand "
                         f"{what} and no ellipsis was given")
    return list(term), 0


def _take_diagonals(x, labels):
    """An operand with a repeated label (ii, iij) reduced to its diagonal over it."""
    while True:
        seen = {}
        pair = None
        for p, lab in enumerate(labels):
            if lab in seen:
                pair = (seen[lab], p)
                break
            seen[lab] = p
        if pair is None:
            return x, labels
        p, q = pair
        if x.shape[p] != x.shape[q]:
            raise ShapeError(f"einsum(): subscript {labels[p]} is repeated for operand "
                             f"but the sizes don't match, {x.shape[p]} != {x.shape[q]}")
        lab = labels[p]
        x = diagonal(x, 0, p, q)
        labels = [lb for k, lb in enumerate(labels) if k not in (p, q)] + [lab]


def _sum_labels(x, labels, drop):
    axes = tuple(k for k, lb in enumerate(labels) if lb in drop)
    if axes:
        x = x.sum(axes) if not x.dtype.is_bool else x.cast(dt.int64).sum(axes)
        labels = [lb for lb in labels if lb not in drop]
    return x, labels


def _contract(x, lx, y, ly, keep):
    """Product of two labelled operands, summing the labels not in `keep`; kept labels
    first (x's order, then y's new ones), summed ones last, as matmul lays out its reduce."""
    union = list(lx) + [lb for lb in ly if lb not in lx]
    kept = [lb for lb in union if lb in keep]
    summed = [lb for lb in union if lb not in keep]
    order = kept + summed

    def placed(t, lt):
        perm = [lt.index(lb) for lb in order if lb in lt]
        t = t.permute(perm) if perm != list(range(len(perm))) else t
        shape = [t.shape[perm.index(lt.index(lb))] if lb in lt else 1 for lb in order]
        return t.reshape(shape)
    px, py = placed(x, lx), placed(y, ly)
    full = broadcast_shape(px.shape, py.shape)
    prod = px.expand(full) * py.expand(full)
    if summed:
        prod = prod.sum(tuple(range(len(kept), len(order))))
    return prod, kept


def einsum(equation, *operands):
    """torch.einsum: any equation torch accepts (implicit or explicit output, repeated
    subscripts for diagonals, '...' broadcasting, size-1 dims broadcasting). Operands may
    also be passed as one list. Lowered to products of permuted/broadcast operands summed
    over the contracted subscripts, two operands at a time, left to right."""
    if not isinstance(equation, str):
        raise TypeError("einsum(): argument 'equation' (position 1) must be str, not "
                        f"{type(equation).__name__}")
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not operands:
        raise ValueError("einsum(): must provide at least one operand")
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(operands):
        raise ValueError(f"einsum(): more operands were provided than specified in the "
                         f"equation" if len(operands) > len(terms) else
                         "einsum(): fewer operands were provided than specified in the "
                         "equation")
    d = operands[0].dtype
    for t in operands[1:]:
        d = dt.promote(d, t.dtype)
    parsed, ell = [], 0
    for k, (term, t) in enumerate(zip(terms, operands)):
        labels, e = _parse_operand(term, t.ndim, k)
        ell = builtins.max(ell, e)
        parsed.append(labels)
    ell_labels = [("...", -ell + k) for k in range(ell)]
    counts = {}
    for labels in parsed:
        for lb in labels:
            counts[lb] = counts.get(lb, 0) + 1
    if arrow:
        if rhs.count("...") > 1:
            raise ValueError("einsum(): more than one ellipsis in the output")
        out = []
        for piece in rhs.split("..."):
            for ch in piece:
                if not ch.isalpha():
                    raise ValueError(f"einsum(): invalid subscript '{ch}' in the output")
                if ch in out:
                    raise ValueError(f"einsum(): output subscript {ch} appears more than "
                                     "once in the output")
                if ch not in counts:
                    raise ValueError(f"einsum(): output subscript {ch} does not appear in "
                                     "the equation for any input operand")
                out.append(ch)
            out.append("...")
        out.pop()
        if "..." in rhs:
            k = out.index("...")
            out = out[:k] + ell_labels + out[k + 1:]
        elif ell:
            out = out   # ellipsis dims not in the output are summed (torch does so too)
    else:
        letters = sorted(lb for lb, c in counts.items() if isinstance(lb, str) and c == 1)
        out = ell_labels + letters
    sizes = {}
    xs = []
    for k, (labels, t) in enumerate(zip(parsed, operands)):
        x, labels = _take_diagonals(t.cast(d), labels)
        for lb, s in zip(labels, x.shape):
            if sizes.get(lb, 1) != 1 and s != 1 and sizes[lb] != s:
                raise ShapeError(f"einsum(): operands do not broadcast with remapped shapes "
                                 f"(subscript {lb if isinstance(lb, str) else '...'}: "
                                 f"{sizes[lb]} != {s})")
            sizes[lb] = builtins.max(sizes.get(lb, 1), s)
        xs.append((x, labels))
    # labels needed later: the output's and those of operands not yet contracted
    x, lx = xs[0]
    later = [set(lb) for _, lb in xs[1:]]
    own_only = set(lx) - set(out) - set().union(*later) if later else set(lx) - set(out)
    x, lx = _sum_labels(x, lx, own_only)
    for k in range(1, len(xs)):
        y, ly = xs[k]
        keep = set(out).union(*later[k:]) if k < len(later) else set(out)
        x, lx = _contract(x, lx, y, ly, keep)
    x, lx = _sum_labels(x, lx, set(lx) - set(out))
    perm = [lx.index(lb) for lb in out]
    x = x.permute(perm) if perm != list(range(len(perm))) else x
    return x.expand(tuple(sizes[lb] for lb in out)) if x.ndim else x


# ---------------------------------------------------------------------------------------
# norms
def _float_of(x, dtype):
    if dtype is not None:
        return x.cast(dtype)
    if not x.dtype.is_float:
        raise DTypeError(f"linalg.vector_norm: Expected a floating point or complex tensor "
                         f"as input. Got {x.dtype.name}")
    return x


def vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):   # noqa: A002
    """torch.linalg.vector_norm: (sum |x|^ord)^(1/ord) over dim (all dims when None); ord
    inf/-inf: the largest/smallest |x|; ord 0: the number of nonzeros. At x == 0 the
    gradient of the 2-norm is 0, as torch's."""
    x = _float_of(x, dtype)
    a = x.abs()
    if ord == math.inf:
        return a.amax(dim, keepdim=keepdim)
    if ord == -math.inf:
        return a.amin(dim, keepdim=keepdim)
    if ord == 0:
        return (x != 0).cast(x.dtype).sum(dim, keepdim=keepdim)
    if ord == 1:
        return a.sum(dim, keepdim=keepdim)
    if ord == 2:
        return _sqrt_of_sum_of_squares((x * x).sum(dim, keepdim=keepdim))
    return (a ** ord).sum(dim, keepdim=keepdim) ** (1.0 / ord)


def _sqrt_of_sum_of_squares(s):
    """sqrt(s) of a sum of squares, with torch's zero gradient where s == 0: sqrt's
    derivative is infinite there and times the zero derivative of x * x gives NaN, so
    the square root reads 1 where s is 0 (derivative 0 through the where) and the result
    is masked back to 0."""
    zero = s == 0
    return where(zero, 0.0, where(zero, 1.0, s).sqrt())


def matrix_norm(A, ord="fro", dim=(-2, -1), keepdim=False, *, dtype=None):   # noqa: A002
    """torch.linalg.matrix_norm for ord in fro, 1, -1, inf, -inf (max/min absolute column
    or row sum), 2, -2 (largest/smallest singular value) and nuc (their sum). 2, -2 and
    nuc realize A: its singular vectors come from numpy's SVD on the host."""
    A = _float_of(A, dtype)
    r, c = (canonical_axis(d, A.ndim) for d in dim)
    if r == c:
        raise ShapeError("linalg.matrix_norm: dims must be different")
    if ord == "fro":
        return _sqrt_of_sum_of_squares((A * A).sum((r, c), keepdim=keepdim))
    if ord in ("nuc", 2, -2):
        return _singular_value_norm(A, ord, r, c, keepdim)
    if ord not in (1, -1, math.inf, -math.inf):
        raise ValueError(f"linalg.matrix_norm: Order {ord} not supported.")
    inner, outer_ = (r, c) if builtins.abs(ord) == 1 else (c, r)
    sums = A.abs().sum(inner, keepdim=True)
    red = sums.amax(outer_, keepdim=True) if ord > 0 else sums.amin(outer_, keepdim=True)
    if not keepdim:
        red = red.reshape(tuple(s for k, s in enumerate(red.shape) if k not in (r, c)))
    return red


def _singular_value_norm(A, ord, r, c, keepdim):
    """ord 2, -2 or nuc over axes (r, c): sum(A * G) where G, from the host SVD
    A = U diag(S) Vh, is u_1 v_1^T (2), u_k v_k^T (-2) or U Vh (nuc). Its value is
    sigma_1, sigma_k or sum(S) (u_i^T A v_i = sigma_i), and since G is a constant its
    gradient is G, which is the derivative of those norms wherever the singular values
    involved are distinct and nonzero (torch's too)."""
    import numpy as np
    rest = [k for k in range(A.ndim) if k not in (r, c)]
    Am = A.permute(*rest, r, c)
    host = Am.detach().numpy().astype(np.float64)
    if host.size == 0:
        raise ShapeError(f"linalg.matrix_norm: ord={ord!r} of an empty matrix")
    U, S, Vh = np.linalg.svd(host, full_matrices=False)
    if ord == "nuc":
        G = U @ Vh
    else:
        k = 0 if ord == 2 else S.shape[-1] - 1
        G = U[..., :, k:k + 1] @ Vh[..., k:k + 1, :]
    out = (Am * Tensor(G.astype(Am.dtype.np if Am.dtype is not dt.bfloat16 else np.float32),
                       dtype=Am.dtype, device=Am.device)).sum((-2, -1))
    if keepdim:
        out = out.reshape(tuple(1 if k in (r, c) else s for k, s in enumerate(A.shape)))
    return out


def linalg_norm(A, ord=None, dim=None, keepdim=False, *, dtype=None):   # noqa: A002
    """torch.linalg.norm: a vector norm over one dim (or the flattened input when ord and
    dim are None), a matrix norm over two dims (or a 2-D input with dim None)."""
    if dim is not None and not isinstance(dim, (tuple, list)):
        dim = (dim,)
    if dim is None:
        if ord is None:
            return vector_norm(A, 2, None, keepdim, dtype=dtype)
        if A.ndim == 2:
            dim = (0, 1)
        elif A.ndim == 1:
            dim = (0,)
        else:
            raise ShapeError(f"linalg.norm: input must be 1-D or 2-D when dim is None and "
                             f"ord is not None, got {A.ndim}-D")
    if len(dim) == 1:
        return vector_norm(A, 2 if ord is None else ord, dim[0], keepdim, dtype=dtype)
    if len(dim) == 2:
        return matrix_norm(A, "fro" if ord is None else ord, dim, keepdim, dtype=dtype)
    raise ShapeError(f"linalg.norm: dim must be a 1- or 2-tuple, got {dim}")


def norm(input, p="fro", dim=None, keepdim=False, dtype=None):
    """torch.norm: p "fro" (the default) is the 2-norm over dim (all dims when None); a
    number p is a vector norm over dim (the flattened input when None); p "nuc" is the
    nuclear norm over dim (the last two dims when None; see matrix_norm). Prefer
    zyx.linalg.norm / vector_norm / matrix_norm, as torch advises."""
    if p == "fro":
        if dim is not None and isinstance(dim, (tuple, list)) and len(dim) == 2:
            return matrix_norm(input, "fro", dim, keepdim, dtype=dtype)
        return vector_norm(input, 2, dim, keepdim, dtype=dtype)
    if p == "nuc":
        return matrix_norm(input, "nuc", (-2, -1) if dim is None else dim, keepdim,
                           dtype=dtype)
    if isinstance(p, str):
        raise ValueError(f"norm: p={p!r} is not supported (fro, nuc or a number)")
    return vector_norm(input, p, dim, keepdim, dtype=dtype)


# ---------------------------------------------------------------------------------------
# scans
def _windows(x, fill):
    """(..., n) -> (..., n, n): row i holds x[i-n+1 .. i] (positions before 0 are `fill`),
    so a reduce over the last axis is an inclusive scan (as cumsum builds it)."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    xp = x._pad(((0, 0),) * len(lead) + ((n - 1, 0),), fill)           # (..., 2n-1)
    w = xp.unsqueeze(-2).expand(*lead, n, 2 * n - 1)
    w = w.reshape(*lead, n * (2 * n - 1))._pad(((0, 0),) * len(lead) + ((0, n),), fill)
    return w.reshape(*lead, n, 2 * n).shrink(tuple((0, s) for s in lead) + ((0, n), (0, n)))


def _scan(input, dim, fn):
    """Apply `fn` to input with dim moved last, move it back."""
    if input.ndim == 0:
        return fn(input.reshape(1)).reshape(())
    d = canonical_axis(dim, input.ndim)
    if input.shape[d] == 0:
        return input
    x = input.transpose(d, -1) if d != input.ndim - 1 else input
    r = fn(x)
    return r.transpose(d, -1) if d != input.ndim - 1 else r


def cumprod(input, dim, *, dtype=None):
    """torch.cumprod: the inclusive running product along dim (int64 for integer and bool
    input, as torch)."""
    x = input.cast(dtype) if dtype is not None else (
        input.cast(dt.int64) if (input.dtype.is_int or input.dtype.is_bool) else input)
    return _scan(x, dim, lambda t: _windows(t, 1)._reduce(K.R_PROD, -1, False))


def logcumsumexp(input, dim):
    """torch.logcumsumexp: log(cumsum(exp(x))) along dim, each prefix shifted by its own
    maximum so that nothing overflows or underflows to -inf."""
    if not input.dtype.is_float:
        raise DTypeError(f"logcumsumexp: expected a floating point input, got "
                         f"{input.dtype.name}")

    def fn(t):
        w = _windows(t, float("-inf"))
        m = w.amax(-1, keepdim=True)
        m = where(m.isinf(), 0.0, m)
        return ((w - m).exp().sum(-1, keepdim=True).log() + m).squeeze(-1)
    return _scan(input, dim, fn)


def _cum_extreme(input, dim, largest):
    """(values, indices) of cummax/cummin: the running extreme and the index of its last
    occurrence so far (NaN counts as the extreme, as torch)."""
    what = "cummax" if largest else "cummin"
    if input.dtype.is_bool:
        x = input.cast(dt.uint8)
    else:
        x = input
    if x.ndim == 0:
        return getattr(return_types, what)(input, const_tensor(0, dt.int64, ()))
    d = canonical_axis(dim, x.ndim)
    n = x.shape[d]
    if n == 0:
        return getattr(return_types, what)(input, const_tensor(0, dt.int64, input.shape))
    xt = x.transpose(d, -1) if d != x.ndim - 1 else x
    if x.dtype.is_float:
        fill = float("-inf") if largest else float("inf")
    else:
        import numpy as np
        info = np.iinfo(x.dtype.np)
        fill = builtins.int(info.min if largest else info.max)
    w = _windows(xt, fill)
    pos = _windows(iota(n, dt.int64).reshape((1,) * (xt.ndim - 1) + (n,)), -1)
    best = w._reduce(K.R_MAX if largest else K.R_MIN, -1, True)
    hit = w == best
    if x.dtype.is_float:
        hit = hit | (w.isnan() & best.isnan())
        # torch: once a NaN is seen it stays the extreme, and its index is the NaN's
        seen_nan = w.isnan()
        hit = where(best.isnan(), seen_nan, hit)
    idx = where(hit, pos, -1)._reduce(K.R_MAX, -1, False)
    if d != x.ndim - 1:
        idx = idx.transpose(d, -1)
    # values through the indices: the gradient goes to each chosen element, as torch's
    vals = gather(input, d, idx)
    return getattr(return_types, what)(vals, idx)


def cummax(input, dim):
    """torch.cummax: (values, indices) of the running maximum along dim."""
    return _cum_extreme(input, dim, True)


def cummin(input, dim):
    """torch.cummin: (values, indices) of the running minimum along dim."""
    return _cum_extreme(input, dim, False)


def diff(input, n=1, dim=-1, prepend=None, append=None):
    """torch.diff: the n-th forward difference along dim (after concatenating prepend and
    append along it); bool input gives x[i+1] != x[i], as torch's logical xor."""
    if input.ndim == 0:
        raise ShapeError("diff expects input to be at least one-dimensional")
    d = canonical_axis(dim, input.ndim)
    parts = []
    for extra in (prepend,):
        if extra is not None:
            parts.append(_diff_extra(extra, input, d))
    parts.append(input)
    if append is not None:
        parts.append(_diff_extra(append, input, d))
    x = cat(parts, d) if len(parts) > 1 else input
    for _ in range(n):
        m = x.shape[d]
        if m == 0:
            break
        hi = tuple((1, s) if k == d else (0, s) for k, s in enumerate(x.shape))
        lo = tuple((0, s - 1) if k == d else (0, s) for k, s in enumerate(x.shape))
        x = x.shrink(hi) != x.shrink(lo) if x.dtype.is_bool else x.shrink(hi) - x.shrink(lo)
    return x


def _diff_extra(extra, input, d):
    if not isinstance(extra, Tensor):
        extra = Tensor(extra, dtype=input.dtype)
    if extra.ndim == 0:
        shape = list(input.shape)
        shape[d] = 1
        return extra.expand(tuple(shape))
    return extra


def meshgrid(*tensors, indexing="ij"):
    """torch.meshgrid: coordinate grids of 1-D tensors; indexing "ij" (matrix, torch's
    default) or "xy" (Cartesian: the first two output dims swapped)."""
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        tensors = tuple(tensors[0])
    if indexing not in ("ij", "xy"):
        raise ValueError(f"torch.meshgrid: indexing must be one of \"xy\" or \"ij\", but "
                         f"received: {indexing}")
    ts = [t.reshape(-1) if t.ndim == 0 else t for t in tensors]
    for t in ts:
        if t.ndim != 1:
            raise ShapeError(f"meshgrid expects 0-D or 1-D tensors, got shape {t.shape}")
    sizes = [t.shape[0] for t in ts]
    order = list(range(len(ts)))
    if indexing == "xy" and len(ts) >= 2:
        order[0], order[1] = 1, 0
    shape = tuple(sizes[k] for k in order)
    out = []
    for k, t in enumerate(ts):
        view = [1] * len(ts)
        view[order.index(k)] = sizes[k]
        out.append(t.reshape(view).expand(shape))
    return tuple(out)


__all__ = ["einsum", "bmm", "mm", "mv", "outer", "ger", "diag", "diagonal", "trace",
           "tensordot", "kron", "cross", "norm", "cumprod", "cummax", "cummin",
           "logcumsumexp", "diff", "meshgrid"]

for _name in ("bmm", "mm", "mv", "outer", "ger", "diag", "diagonal", "trace", "kron",
              "cross", "norm", "cumprod", "cummax", "cummin", "logcumsumexp", "diff"):
    setattr(Tensor, _name, globals()[_name])
