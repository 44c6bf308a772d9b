"""Small PyTorch habits: comparisons (allclose, isclose, equal, logical_*), new_* and *_like
factories, random sampling (multinomial, bernoulli, randperm, randint's two-argument
form), size queries (numel, element_size, nbytes, itemsize), .t(), .is_contiguous(),
zyx.Size, set_num_threads/get_num_threads, and `requires_grad=` on every factory.

Random numbers come from zyx's counter-based device generator (zyx/random.py,
zyx.manual_seed), as zyx.rand; randperm alone draws on the host (numpy's Generator in
`RT.rng`, reseeded by manual_seed): a permutation is a sort or a shuffle, not elementwise.
"""
import builtins
import os
import sys

import numpy as np

from . import dtype as dt
from ._core import graph as G
from .errors import InvalidArgumentError, ShapeError
from . import random as _random
from . import sorting as _sorting
from .runtime import RT
from .tensor import Tensor, watch_range

_tensor_module = sys.modules["zyx.tensor"]     # `zyx.tensor` is the function (see ARCHITECTURE.md)


class Size(tuple):
    """torch.Size: a tuple of dims with numel(). zyx's `x.shape` and `x.size()` stay plain
    tuples (they are read in hot paths and compare equal to Size anyway)."""

    def numel(self):
        n = 1
        for s in self:
            n *= s
        return n

    def __repr__(self):
        return f"zyx.Size({list(self)})"


# ---------------------------------------------------------------------------------------
# comparisons
def isclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    """torch.isclose: |input - other| <= atol + rtol * |other| elementwise (infinities equal
    only to themselves; NaN equal to NaN when equal_nan)."""
    if not isinstance(other, Tensor):
        other = Tensor(other, dtype=input.dtype)
    if input.dtype.is_bool or not input.dtype.is_float:
        a, b = input.cast(dt.float64), other.cast(dt.float64)
    else:
        d = dt.promote(input.dtype, other.dtype)
        a, b = input.cast(d), other.cast(d)
    same = a == b
    near = (a - b).abs() <= (b.abs() * rtol + atol)
    close = same | (near & a.isfinite() & b.isfinite())
    if equal_nan:
        close = close | (a.isnan() & b.isnan())
    return close


def allclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    """torch.allclose: True when every element isclose (a Python bool; realizes)."""
    return builtins.bool(isclose(input, other, rtol, atol, equal_nan).all().item())


def equal(input, other):
    """torch.equal: True when both have the same shape and the same values (a Python bool;
    realizes). NaN is not equal to itself, as in torch."""
    if tuple(input.shape) != tuple(other.shape):
        return False
    return builtins.bool((input == other).all().item())


def logical_and(input, other):
    """torch.logical_and: elementwise, nonzero is true; a bool tensor."""
    return _truth(input) & _truth(other)


def logical_or(input, other):
    """torch.logical_or (see logical_and)."""
    return _truth(input) | _truth(other)


def logical_xor(input, other):
    """torch.logical_xor (see logical_and)."""
    return _truth(input) ^ _truth(other)


def logical_not(input):
    """torch.logical_not: a bool tensor, true where input is zero."""
    return ~_truth(input)


def _truth(x):
    if not isinstance(x, Tensor):
        x = Tensor(x)
    return x if x.dtype.is_bool else x != 0


# ---------------------------------------------------------------------------------------
# methods
def type_as(self, other):
    """torch.Tensor.type_as: self cast to other's dtype."""
    return self.cast(other.dtype)


def _new(self, shape, fill, dtype, device, requires_grad):
    d = dt.to_dtype(dtype) if dtype is not None else self.dtype
    return _tensor_module.full(_tensor_module.shape_args(shape), fill, d,
                               device if device is not None else self.device, requires_grad)


def new_zeros(self, *size, dtype=None, device=None, requires_grad=False):
    """torch.Tensor.new_zeros: zeros with self's dtype and device unless given."""
    return _new(self, size, 0, dtype, device, requires_grad)


def new_ones(self, *size, dtype=None, device=None, requires_grad=False):
    """torch.Tensor.new_ones: ones with self's dtype and device unless given."""
    return _new(self, size, 1, dtype, device, requires_grad)


def new_empty(self, *size, dtype=None, device=None, requires_grad=False):
    """torch.Tensor.new_empty: zyx fills it with zeros (no uninitialized memory)."""
    return _new(self, size, 0, dtype, device, requires_grad)


def new_full(self, size, fill_value, *, dtype=None, device=None, requires_grad=False):
    """torch.Tensor.new_full: `fill_value` everywhere, self's dtype and device unless given."""
    return _new(self, size, fill_value, dtype, device, requires_grad)


def new_tensor(self, data, dtype=None, device=None, requires_grad=False):
    """torch.Tensor.new_tensor: a tensor of `data` with self's dtype and device unless
    given."""
    if isinstance(data, Tensor):
        data = data.numpy()
    return Tensor(data, dtype=dtype if dtype is not None else self.dtype,
                  device=device if device is not None else self.device,
                  requires_grad=requires_grad)


def element_size(self):
    """Bytes per element (torch.Tensor.element_size)."""
    return self.dtype.itemsize


def clone(input, *, memory_format=None):
    """torch.clone: a copy of `input` that later in-place writes to either do not
    affect the other (gradients flow through it); `memory_format` is accepted and ignored
    (zyx tensors are always contiguous)."""
    return input.clone()


def numel(input):
    """torch.numel: the number of elements of `input` (its shape's product; no
    realization)."""
    return input.numel()


def _t(self):
    """torch.Tensor.t: the transpose of a matrix; 0-D and 1-D tensors are returned as is."""
    if self.ndim > 2:
        raise ShapeError(f"t() expects a tensor with <= 2 dimensions, but self is "
                         f"{self.ndim}D")
    return self.transpose(0, 1) if self.ndim == 2 else self


def _row_major(shape):
    strides, acc = [0] * len(shape), 1
    for k in range(len(shape) - 1, -1, -1):
        strides[k] = acc
        acc *= shape[k]
    return strides


class _View:
    """The index map of a chain of movement ops over a row-major base, as torch would
    stride it: the base's flat position is `off + sum(coef[k] * i[k])` over the view's
    indices i, and each constraint (coefs, const, lo, hi) says where a PAD reads real data
    (lo <= const + sum(coefs[k] * i[k]) < hi); elsewhere it reads padding."""

    def __init__(self, shape):
        self.fresh(shape)

    def fresh(self, shape):
        """A new row-major tensor of `shape` (a base, or what torch would copy into)."""
        self.shape = list(shape)
        self.coef = _row_major(shape)
        self.off = 0
        self.cons = []

    def _forms(self):
        return [self.coef] + [c[0] for c in self.cons]

    def _satisfied(self, con):
        coefs, const, lo, hi = con
        low = high = const
        for c, n in zip(coefs, self.shape):
            if n == 0:
                return True
            low += builtins.min(0, c * (n - 1))
            high += builtins.max(0, c * (n - 1))
        return lo <= low and high < hi

    def drop_satisfied(self):
        self.cons = [c for c in self.cons if not self._satisfied(c)]

    def permute(self, order):
        self.shape = [self.shape[o] for o in order]
        self.coef = [self.coef[o] for o in order]
        self.cons = [([c[o] for o in order], k, lo, hi) for c, k, lo, hi in self.cons]

    def expand(self, shape):
        lead = len(shape) - len(self.shape)
        old = [1] * lead + self.shape
        keep = [o == n for o, n in zip(old, shape)]   # a size-1 dim broadcast reads index 0

        def fix(coefs):
            return [c if k else 0 for c, k in zip([0] * lead + coefs, keep)]
        self.coef = fix(self.coef)
        self.cons = [(fix(c), k, lo, hi) for c, k, lo, hi in self.cons]
        self.shape = list(shape)

    def pad(self, pads):
        # the view's index j reads the source at j - before
        for d, (before, after) in enumerate(pads):
            n = self.shape[d]
            self.off -= self.coef[d] * before
            self.cons = [(c, k - c[d] * before, lo, hi) for c, k, lo, hi in self.cons]
            if before > 0 or after > 0:
                unit = [0] * len(self.shape)
                unit[d] = 1
                self.cons.append((unit, -before, 0, n))
            self.shape[d] = n + before + after

    def reshape(self, shape):
        """Re-express every form over the new dims; False where torch could not view
        (the dims merged into one are not laid out one inside the other)."""
        self.drop_satisfied()
        old = [(n, k) for k, n in enumerate(self.shape) if n != 1]
        new = [(n, k) for k, n in enumerate(shape) if n != 1]
        forms = self._forms()
        out = [[0] * len(shape) for _ in forms]
        i = j = 0
        while i < len(old) or j < len(new):
            i2, j2 = i + 1, j + 1
            po = old[i][0] if i < len(old) else 1
            pn = new[j][0] if j < len(new) else 1
            while po != pn:
                if po < pn:
                    po *= old[i2][0]
                    i2 += 1
                else:
                    pn *= new[j2][0]
                    j2 += 1
            group = old[i:i2]
            for f, form in enumerate(forms):
                for (_, a), (nb, b) in zip(group, group[1:]):
                    if form[a] != form[b] * nb:
                        return False
                inner = form[group[-1][1]] if group else 0
                for n, k in reversed(new[j:j2]):
                    out[f][k] = inner
                    inner *= n
            i, j = i2, j2
        self.coef = out[0]
        self.cons = [(c, k, lo, hi) for c, (_, k, lo, hi) in zip(out[1:], self.cons)]
        self.shape = list(shape)
        return True

    def row_major(self):
        self.drop_satisfied()
        if self.cons:           # it still reads padding: a new tensor in torch (F.pad)
            return True
        want = _row_major(self.shape)
        return all(n == 1 or c == w for c, w, n in zip(self.coef, want, self.shape))


def is_contiguous(self, memory_format=None):
    """torch.Tensor.is_contiguous: True when the tensor's elements lie in row-major order
    in the memory they would be read from. A realized tensor, or one computed by an op,
    is a row-major buffer; a chain of movement ops over one (transpose, expand, a slice)
    is a view with the strides torch would give it: a[1:] is contiguous, a[:, 1:], a.t()
    and an expand are not. Movement ops torch makes copies for (flip, pad, a reshape of a
    non-viewable layout) count as new row-major tensors."""
    graph = RT.graph
    node = graph.get(self._id)
    chain = []
    while node.op in G.MOVEMENT:
        chain.append(node)
        node = graph.get(node.srcs[0])
    view = _View(node.shape)
    for n in reversed(chain):
        if 0 in n.shape:
            return True
        if n.op == G.PERMUTE:
            view.permute(n.arg)
        elif n.op == G.EXPAND:
            view.expand(n.shape)
        elif n.op == G.PAD:
            view.pad(n.arg[0])
        elif n.op != G.RESHAPE or not view.reshape(n.shape):
            view.fresh(n.shape)      # a flip, or a reshape torch would copy
    return view.row_major()


def contiguous(self, memory_format=None):
    """torch.Tensor.contiguous: self when already contiguous, else a row-major copy (lazy:
    an identity cast the kernel reading it fuses)."""
    if is_contiguous(self):
        return self
    return self._make(G.CAST, self.dtype, (self,), self.shape, self.dtype)


# ---------------------------------------------------------------------------------------
# random
def _rng():
    return RT.rng


# Inverse-CDF sampling sums a window per category (cumsum is O(K^2) per row) and Gumbel-max
# draws S * K numbers; the first is cheaper while K is below this many samples' worth
_CDF_PER_SAMPLE = 64


def multinomial(input, num_samples, replacement=False, *, generator=None):
    """torch.multinomial: `num_samples` category indices per row of non-negative weights
    (1-D or 2-D input), with or without replacement; int64. Sampled on the device by zyx's
    generator (zyx.manual_seed): with replacement by inverse CDF (the count of cumulative
    weights <= u * total; Gumbel-max over S x K noise when categories outnumber
    64 x num_samples), without replacement by Gumbel-top-k (the num_samples largest
    log w + Gumbel noise). The argument checks read the weights on the host. The draws
    differ from torch's."""
    w = np.asarray(input.numpy(), dtype=np.float64)
    if w.ndim not in (1, 2):
        raise ShapeError(f"multinomial: prob_dist must be 1 or 2 dim, got {w.ndim}")
    rows = w.reshape(1, -1) if w.ndim == 1 else w
    if not np.isfinite(rows).all() or (rows < 0).any():
        raise ValueError("multinomial: probability tensor contains either `inf`, `nan` or "
                         "element < 0")
    if (rows.sum(1) <= 0).any():
        raise ValueError("multinomial: invalid multinomial distribution (sum of "
                         "probabilities <= 0)")
    if not replacement and num_samples > rows.shape[1]:
        raise ValueError("multinomial: cannot sample n_sample > prob_dist.size(-1) samples "
                         "without replacement")
    if not replacement and num_samples > np.count_nonzero(rows, 1).min():
        raise ValueError("multinomial: invalid multinomial distribution (with replacement="
                         "False, not enough non-negative category to sample)")
    r, k, s = rows.shape[0], rows.shape[1], builtins.int(num_samples)
    dev = input.device
    fd = dt.float64 if input.dtype is dt.float64 else dt.float32
    p = input.cast(fd).reshape(r, k)
    if s == 0:
        out = _tensor_module.zeros((r, 0), dtype=dt.int64, device=dev)
    elif replacement and k <= _CDF_PER_SAMPLE * s:
        c = p.cumsum(1)
        u = _random.uniform((r, s), fd, dev) * c[:, k - 1:k]
        idx = (c.reshape(r, 1, k) <= u.reshape(r, s, 1)).sum(2)
        # u * total may round up to the total: fall back to the last category with weight
        pos = _tensor_module.arange(k, dtype=dt.int64, device=dev).reshape(1, k)
        last = _tensor_module.where(p > 0, pos, 0).amax(1, keepdim=True)
        out = idx.cast(dt.int64).minimum(last)
    elif replacement:
        # realized: argmax compares the values with their maximum, and two kernels that
        # each recompute a log (vectorized in one, scalar in the other) may disagree
        g = (_random.gumbel((r, s, k), dev) + p.log().cast(dt.float32).reshape(r, 1, k))
        out = g.realize().argmax(2).cast(dt.int64)
    else:
        g = _random.gumbel((r, k), dev) + p.log().cast(dt.float32)
        out = _sorting.topk(g.realize(), s, 1).indices.cast(dt.int64)
    return out.reshape(s) if w.ndim == 1 else out


def bernoulli(input, p=None, *, generator=None):
    """torch.bernoulli: 1 with probability input (or p) per element, else 0, in input's
    dtype. The uniform draws come from zyx's generator; the compare is lazy."""
    probs = input if p is None else p
    if not isinstance(probs, Tensor) and not 0 <= probs <= 1:   # NaN fails too
        raise ValueError(f"bernoulli expects p to be in [0, 1], but got p={probs}")
    u = _tensor_module.rand(*input.shape, dtype=dt.float32 if input.dtype is not dt.float64
                            else dt.float64, device=input.device)
    draw = u < probs
    if isinstance(probs, Tensor):
        # a probability tensor is checked when the draw is realized (its values are not
        # known before): a value check on "p outside [0, 1] or NaN" as a 0/1 integer. The
        # watched node reads that integer and the draw reads the watched node, so the
        # graph keeps the check's operand alive as long as the draw (an operand nothing
        # reads is freed with its Python tensor, and the check would read a dead node).
        bad = (~((probs >= 0) & (probs <= 1))).cast(dt.uint8)
        ok = bad == 0
        watch_range(ok, bad, 0, 1,
                    "bernoulli: Expected p_in >= 0 && p_in <= 1, but the probability tensor "
                    "holds a value outside [0, 1] or NaN", error=InvalidArgumentError)
        draw = draw & ok
    return draw.cast(input.dtype)


def randperm(n, *, dtype=None, device=None, requires_grad=False, generator=None):
    """torch.randperm: a random permutation of 0..n-1 (int64 by default). Shuffled on the
    host by numpy's Generator in `RT.rng` (reseeded by zyx.manual_seed) and uploaded: a
    permutation is a shuffle, which has no elementwise form."""
    d = dt.to_dtype(dtype) if dtype is not None else dt.int64
    return Tensor(_rng().permutation(builtins.int(n)).astype(d.np if not d.is_float or
                                                              d is not dt.bfloat16 else np.float32),
                  dtype=d, device=device, requires_grad=requires_grad)


def rand_like(input, *, dtype=None, device=None, requires_grad=False):
    """torch.rand_like: uniform [0, 1) with input's shape (and dtype/device unless given)."""
    return _tensor_module.rand(*input.shape, dtype=dtype or input.dtype,
                               device=device or input.device, requires_grad=requires_grad)


def randn_like(input, *, dtype=None, device=None, requires_grad=False):
    """torch.randn_like: standard normal with input's shape (and dtype/device unless given)."""
    return _tensor_module.randn(*input.shape, dtype=dtype or input.dtype,
                                device=device or input.device, requires_grad=requires_grad)


def randint_like(input, low=0, high=None, *, dtype=None, device=None, requires_grad=False):
    """torch.randint_like(input, high) / (input, low, high): integers in [low, high) with
    input's shape and dtype unless given."""
    if high is None:
        low, high = 0, low
    return randint(low, high, input.shape, dtype=dtype or input.dtype,
                   device=device or input.device, requires_grad=requires_grad)


def randint(low, high=None, size=None, *, dtype=None, device=None, requires_grad=False,
            generator=None):
    """torch.randint(high, size) or randint(low, high, size): integers in [low, high)
    (int64 by default in torch; zyx gives int32 when the range fits, as zyx.arange).
    Computed on the device (zyx/random.py): for ranges up to 2^32 the high word of a
    random 32-bit word times the range, so each value's probability is within
    range / 2^32 (relative) of uniform: 2.3e-8 for 100 values, 0.4% at 2^24; wider ranges
    take 64 bits modulo the range (within range / 2^64)."""
    if size is None and isinstance(high, (tuple, list)):
        low, high, size = 0, low, high        # torch's two-argument form
    if size is None:
        raise TypeError("randint() missing the required argument 'size'")
    t = _base_randint(low, high, size, dtype, device)
    if requires_grad:
        t.requires_grad = True
    return t


_base_randint = _tensor_module.randint


# ---------------------------------------------------------------------------------------
# factories with requires_grad=
def _with_grad(fn):
    def wrapped(*args, requires_grad=False, **kwargs):
        t = fn(*args, **kwargs)
        if requires_grad:
            if not t.dtype.is_float:
                raise RuntimeError("Only Tensors of floating point dtype can require "
                                   "gradients")
            t.requires_grad = True
        return t
    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = (fn.__doc__ or f"torch.{fn.__name__}.") + \
        " requires_grad=True makes it a leaf that records gradients."
    return wrapped


arange = _with_grad(_tensor_module.arange)
linspace = _with_grad(_tensor_module.linspace)
eye = _with_grad(_tensor_module.eye)
zeros_like = _with_grad(_tensor_module.zeros_like)
ones_like = _with_grad(_tensor_module.ones_like)
full_like = _with_grad(_tensor_module.full_like)


def empty(*size, dtype=None, device=None, requires_grad=False):
    """torch.empty: zyx fills it with zeros (no uninitialized memory)."""
    return _tensor_module.zeros(*size, dtype=dtype, device=device, requires_grad=requires_grad)


def empty_like(input, *, dtype=None, device=None, requires_grad=False):
    """torch.empty_like: zeros shaped like input (see empty)."""
    return zeros_like(input, dtype=dtype, device=device, requires_grad=requires_grad)


# ---------------------------------------------------------------------------------------
# threads
def set_num_threads(n):
    """torch.set_num_threads: OpenMP threads the C backend's plans use (plans already
    compiled follow it too: the team size is read when a plan runs)."""
    n = builtins.int(n)
    if n < 1:
        raise ValueError(f"set_num_threads expects a positive number, got {n}")
    os.environ["OMP_NUM_THREADS"] = str(n)
    for dev in _c_devices():
        dev.set_threads(n)
    _NUM_THREADS[0] = n


_NUM_THREADS = [None]


def get_num_threads():
    """torch.get_num_threads: the C backend's OpenMP thread count (all cores when unset)."""
    if _NUM_THREADS[0] is not None:
        return _NUM_THREADS[0]
    for dev in _c_devices():
        if dev.threads:
            return dev.threads
    env = os.environ.get("OMP_NUM_THREADS", "")
    return builtins.int(env) if env.isdigit() and builtins.int(env) > 0 else (os.cpu_count() or 1)


def _c_devices():
    RT._ensure()
    return [d for d in (RT.devices or ()) if type(d).__name__ == "CDevice"]


__all__ = ["Size", "isclose", "allclose", "equal", "logical_and", "logical_or", "logical_xor",
           "logical_not", "multinomial", "bernoulli", "randperm", "rand_like", "randn_like",
           "randint_like", "randint", "arange", "linspace", "eye", "zeros_like", "ones_like",
           "full_like", "empty", "empty_like", "set_num_threads", "get_num_threads", "clone",
           "numel"]

for _name, _fn in (("type_as", type_as), ("new_zeros", new_zeros), ("new_ones", new_ones),
                   ("new_empty", new_empty), ("new_full", new_full), ("new_tensor", new_tensor),
                   ("element_size", element_size), ("t", _t), ("is_contiguous", is_contiguous),
                   ("contiguous", contiguous),
                   ("isclose", isclose), ("allclose", allclose), ("equal", equal),
                   ("multinomial", multinomial), ("bernoulli", bernoulli)):
    setattr(Tensor, _name, _fn)
Tensor.nbytes = property(lambda self: self.numel() * self.dtype.itemsize,
                         doc="Bytes the tensor's values take (numel * itemsize).")
Tensor.itemsize = property(lambda self: self.dtype.itemsize, doc="Bytes per element.")
