"""The user-facing lazy Tensor.

Every method builds graph nodes from a dozen primitives (see `_core/graph.pyx`); nothing
runs until a value is read (numpy/item/tolist/realize/repr). Shapes and dtypes are checked
here, when the op is written, so errors point at the line that caused them.

The primitives are the only functions that create nodes; autograd hooks in there.
"""
from __future__ import annotations

import builtins
import math
import weakref
from typing import Sequence

import numpy as np

from . import dtype as dt
from ._core import graph as G
from ._core import kernel as K
from .errors import (BackendError, DimensionError, DTypeError, IndexOutOfRangeError,
                     IntegerDivisionByZeroError, ShapeError, ValueOverflowError, ZyxError)
from .device import Device
from .runtime import RT
from ._core import tensorbase as _TB
from . import random as _random

__all__ = ["Tensor", "tensor", "from_numpy", "from_dlpack", "zeros", "ones", "full", "zeros_like", "ones_like", "full_like",
           "empty", "arange", "linspace", "eye", "rand", "randn", "uniform", "normal", "randint",
           "manual_seed", "cat", "concatenate", "stack", "where", "maximum", "minimum", "matmul",
           "dot", "split", "chunk", "unbind", "tril", "triu", "gather", "masked_fill", "exp", "log",
           "sqrt", "sin", "cos", "tanh", "sigmoid", "relu", "abs", "clamp", "clip", "pow",
           "sum", "mean", "amax", "amin", "argmax", "argmin", "softmax", "log_softmax",
           "logsumexp", "cumsum", "flip", "roll", "reshape", "permute", "transpose",
           "broadcast_to", "squeeze", "unsqueeze", "flatten", "isnan", "isinf", "isfinite"]

_graph = RT.graph
_wrap = _TB.wrap
_make = _TB.make
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453



def _prod(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def canonical_axes(axis, ndim, allow_none=True):
    """`axis` (None, an int or a sequence) as a sorted tuple of axes in [0, ndim).
    Internal helper shared by zyx's op modules (not in __all__)."""
    if axis is None:
        if not allow_none:
            raise ShapeError("an axis is required")
        return tuple(range(ndim))
    if isinstance(axis, (list, tuple)):
        out = tuple(sorted({canonical_axis(a, ndim) for a in axis}))
        return out
    return (canonical_axis(axis, ndim),)


def canonical_axis(a, ndim):
    """One axis, checked and made non-negative (0 for a 0-d tensor).
    Internal helper shared by zyx's op modules (not in __all__)."""
    if not isinstance(a, (int, np.integer)):
        raise ShapeError(f"axis must be an int, got {a!r}")
    n = ndim if ndim > 0 else 1
    if not -n <= a < n:
        raise DimensionError(f"Dimension out of range (expected to be in range of [{-n}, "
                             f"{n - 1}], but got {a}): axis {a} of a tensor of {ndim} "
                             "dimension(s)")
    return int(a) % n if ndim > 0 else 0


def broadcast_shape(*shapes):
    """The shape `shapes` broadcast to (ShapeError if they do not).
    Internal helper shared by zyx's op modules (not in __all__)."""
    nd = max(len(s) for s in shapes)
    out = []
    for i in range(nd):
        d = 1
        for s in shapes:
            k = i - (nd - len(s))
            if k < 0:
                continue
            x = s[k]
            if x != 1:
                if d != 1 and d != x:
                    raise ShapeError("shapes " + ", ".join(str(tuple(s)) for s in shapes) +
                                     " cannot be broadcast together")
                d = x
        out.append(d)
    return tuple(out)


def axis_or_dim(axis, dim):
    """The axis given as axis= or (torch) dim=, not both.
    Internal helper shared by zyx's op modules (not in __all__)."""
    if dim is not None:
        if axis is not None:
            raise TypeError("give either axis= or dim=, not both")
        return dim
    return axis


def _dim0(axis, dim):
    """axis=/dim= for ops whose axis defaults to 0 (cat, stack, split, chunk)."""
    axis = axis_or_dim(axis, dim)
    return 0 if axis is None else axis


def _fits_into(small, big):
    """True when shape `small` broadcasts to shape `big` unchanged."""
    k = len(big) - len(small)
    if k < 0:
        return False
    for i in range(len(small)):
        d = small[i]
        if d != 1 and d != big[k + i]:
            return False
    return True


def _fast_binary(self, o, bop, reverse):
    """Hot path of + - * / for the common cases (float tensors of one dtype where one shape
    broadcasts into the other, or a float or int scalar on a float tensor): no promotion and no
    general broadcasting work. None means "take the general path"."""
    n = _graph.get(self._id)
    if type(o) is Tensor:
        m = _graph.get(o._id)
        if m.dtype is not n.dtype or n.dtype.kind != "f":
            return None
        if m.shape != n.shape:
            # one side broadcasts into the other (a bias, a 0-d learning rate)
            if _fits_into(m.shape, n.shape):
                o = _expand_to(o, m, n.shape)
            elif _fits_into(n.shape, m.shape):
                self = _expand_to(self, n, m.shape)
                n = m
            else:
                return None
        a, b = (o, self) if reverse else (self, o)
    elif n.dtype.kind == "f" and (type(o) is builtins.float or type(o) is builtins.int):
        # a Python int on a float tensor promotes to the tensor's dtype too (`x + 1`)
        c = _wrap(_graph.add(G.CONST, builtins.float(o), (), n.shape, n.dtype))
        a, b = (c, self) if reverse else (self, c)
    else:
        return None
    return _TB.make(G.BINARY, bop, (a, b), n.shape, n.dtype)


class Tensor(_TB.TensorBase):
    """A lazily evaluated n-dimensional array.

    `Tensor(data, dtype=None)` accepts numpy arrays, nested lists, Python scalars and other
    Tensors. Python floats become float32 and ints int32 unless `dtype` says otherwise;
    numpy arrays keep their dtype (float64 stays float64).

    The per-object fields (`_id` of its graph node, `requires_grad`, `grad`, `_ctx`), the
    node reference count, `shape`/`dtype`/`ndim` and `_make` live in the compiled base
    class (zyx/_core/tensorbase.pyx)."""
    __slots__ = ()
    __array_priority__ = 1000

    def __init__(self, data, dtype=None, requires_grad=False, device=None):
        d = dt.to_dtype(dtype) if dtype is not None else None
        if isinstance(data, Tensor):
            t = data if d is None else data.cast(d)
            if device is not None:
                t = t.to(device)
            _graph.retain(t._id)
            self._id = t._id
        else:
            arr = _to_numpy(data, d)
            d = d or dt.from_numpy(arr.dtype)
            if d is dt.bfloat16:
                arr = f32_to_bf16_bits(arr)
            self._id = RT.from_numpy(arr, d, _backend_device(device))
        self.requires_grad = requires_grad
        self.grad = None
        self._ctx = None

    _wrap = staticmethod(_TB.wrap)

    # ---- metadata ----------------------------------------------------------------------
    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return _prod(self.shape)

    def size(self, axis=None, dim=None):
        axis = axis_or_dim(axis, dim)
        s = self.shape
        return s if axis is None else s[canonical_axis(axis, len(s))]

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __iter__(self):
        # without it Python iterates by __getitem__ until IndexError: a 0-d tensor gave []
        if not self.shape:
            raise TypeError("iteration over a 0-d tensor")
        # computed once first: each element is a view, and reading the views of a lazy
        # tensor (`for i in ix: data[i:i + T]`, ix random starts) would compute the whole
        # graph again for every element
        if self.shape[0] > 1 and _graph.get(self._id).op != G.LEAF:
            RT.realize([self._id])
        return (self[i] for i in range(self.shape[0]))

    @property
    def device(self):
        """The device this tensor lives on (a lazy one: where it will be computed), as a
        `zyx.device` ("cpu", "cuda:0", "opencl:0"...)."""
        return RT.name_of(RT.device_of(self._id))

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    def to(self, *args, dtype=None, device=None, non_blocking=False, copy=False):
        """torch's `to`: `to(dtype)`, `to(device)`, `to(device, dtype)`, `to(tensor)` (its
        device and dtype), keywords too. Returns self when nothing changes (and `copy` is
        false). Moving to another device computes the tensor where it is and copies the
        result into a new tensor there; `non_blocking` is accepted (copies to a GPU are
        queued anyway)."""
        device, dtype = parse_to_args(args, device, dtype)
        out = self if dtype is None else self.cast(dtype)
        if device is not None:
            dev = RT.resolve(device)
            if RT.device_of(out._id) is not dev:
                if out.requires_grad and out._ctx is not None:
                    raise BackendError(
                        "zyx cannot yet differentiate through a copy between devices: move "
                        "the inputs (or the model, Module.to) instead, or create the tensor "
                        "there with device=")
                moved = _wrap(RT.copy_to(out._id, dev))
                moved.requires_grad = out.requires_grad
                return moved
        if copy and out is self:
            out = self.clone()
        return out

    # ---- DLPack (zyx/dlpack.py) ----------------------------------------------------------
    def __dlpack_device__(self):
        """(DLPack device type, device index) of this tensor: CPU and CUDA tensors export."""
        from . import dlpack
        name = self.device
        kind = dlpack.DEVICE_TYPE.get(name.type)
        if kind is None:
            raise BufferError(f"DLPack export of a tensor on {name} is not supported (only "
                              "cpu, cuda and hip): move it with .cpu() first")
        return kind, name.index or 0

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule sharing this tensor's memory (computed first; on a GPU, after
        the device finished what is queued, so any consumer stream sees the values).
        Later in-place writes to this tensor (`z.add_(1)`, `z[0] = 5`, through views and
        detach() too) are computed at once and written into the exported memory, so the
        consumer (`torch.from_dlpack(z)`) sees them, as torch's shared storage would."""
        from . import dlpack
        kind, index = self.__dlpack_device__()
        if copy:
            raise BufferError("zyx exports without copying; copy=True is not supported")
        if dl_device is not None and tuple(dl_device) != (kind, index):
            raise BufferError(f"cannot export a tensor on {self.device} to DLPack device "
                              f"{tuple(dl_device)}")
        RT.realize([self._id])
        dev = RT.device_of(self._id)
        if kind != dlpack.KDL_CPU:
            RT.synchronize(dev)
        cap = dlpack.export(RT, self._id, self.device.type, index)
        share_memory(self)     # later in-place writes to self go into the exported memory
        return cap

    def cuda(self, device=None, non_blocking=False):
        """This tensor on a CUDA device (`cuda:0` unless `device` says which)."""
        if device is None:
            device = "cuda"
        elif isinstance(device, builtins.int):
            device = f"cuda:{device}"
        return self.to(device)

    def cpu(self):
        """This tensor on the CPU (C backend)."""
        return self.to("cpu")

    # ---- realization -------------------------------------------------------------------
    def realize(self) -> "Tensor":
        """Compute this tensor now (and keep the result); returns self."""
        RT.realize([self._id])
        return self

    def numpy(self) -> np.ndarray:
        """The values as a new numpy array (bfloat16 comes back as float32)."""
        return RT.to_numpy(self._id)

    def item(self):
        if self.numel() != 1:
            raise ShapeError(f"item() needs exactly one element, this tensor has shape {self.shape}")
        v = RT.host_item(self._id)      # a few integer ops: no realization (host_eval.py)
        if v is not None:
            return v.reshape(()).item()
        return self.numpy().reshape(()).item()

    def tolist(self):
        return self.numpy().tolist()

    def __array__(self, dtype=None, copy=None):
        a = self.numpy()
        return a if dtype is None else a.astype(dtype)

    def __reduce_ex__(self, protocol):
        """Pickling (multiprocessing queues, copy.deepcopy), as torch pickles a tensor: its
        values (computed now), dtype (bfloat16 travels as float32, which holds every
        bfloat16 exactly), device name and requires_grad; rebuilt by `Tensor(...)` as a
        leaf (a non-leaf's graph and any .grad are not kept, as in torch). An nn.Parameter
        is a Tensor with requires_grad=True and comes back as one. Unpickled onto the same
        device name; where that device does not exist the load raises BackendError naming
        it and the devices found (torch likewise refuses to unpickle a CUDA tensor without
        CUDA rather than move it silently): move the tensor with .cpu() before pickling."""
        return (Tensor, (self.numpy(), self.dtype.name, self.requires_grad, str(self.device)))

    def __repr__(self):
        return f"Tensor({np.array2string(self.numpy(), separator=', ')}, dtype={self.dtype.name})"

    def __bool__(self):
        if self.numel() != 1:
            raise ZyxError("the truth value of a tensor with more than one element is ambiguous")
        return bool(self.item())

    def __float__(self):
        return builtins.float(self.item())

    def __int__(self):
        return builtins.int(self.item())

    def __index__(self):
        if not self.dtype.is_int:
            raise TypeError("only integer tensors can be used as an index")
        return builtins.int(self.item())

    def __hash__(self):
        return id(self)

    def contiguous(self) -> "Tensor":
        """Lazy tensors have no memory layout to fix; returns self (torch compatibility)."""
        return self

    def detach(self) -> "Tensor":
        """Same values, cut from autograd, sharing this tensor's storage as in torch: an
        in-place write to the result (or to a view of it) changes this tensor, and writes
        to this tensor show in the result (zyx.inplace keeps the two bound; this tensor
        keeps requires_grad and its recorded history). Use clone() for an independent
        copy."""
        _graph.retain(self._id)
        return link_view(_wrap(self._id), self, "data", None)

    def clone(self) -> "Tensor":
        return self + 0 if not self.dtype.is_bool else self.cast(dt.bool_)

    # ---- primitives: `_make` (compiled base class) is the only node constructor -------
    def _unary(self, uop, dtype=None):
        return self._make(G.UNARY, uop, (self,), self.shape, dtype or self.dtype)

    def cast(self, dtype) -> "Tensor":
        """Convert to `dtype` (float -> int truncates toward zero, like torch)."""
        d = dt.to_dtype(dtype)
        if d is self.dtype:
            return self
        return self._make(G.CAST, d, (self,), self.shape, d)

    type = cast

    def float(self):
        return self.cast(dt.float32)

    def half(self):
        return self.cast(dt.float16)

    def double(self):
        return self.cast(dt.float64)

    def int(self):
        return self.cast(dt.int32)

    def long(self):
        return self.cast(dt.int64)

    def bool(self):
        return self.cast(dt.bool_)

    def _binary_prim(self, other, bop, out_dtype=None):
        # inputs already have equal shape and dtype
        n = _graph.get(self._id)
        return self._make(G.BINARY, bop, (self, other), n.shape, out_dtype or n.dtype)

    def reshape(self, *shape) -> "Tensor":
        shape = shape_args(shape)
        node = _graph.get(self._id)
        if shape == node.shape:
            return self
        if all([type(s) is builtins.int and s >= 0 for s in shape]) and \
                _prod(shape) == _prod(node.shape):   # the common, fully specified case
            return self._make(G.RESHAPE, shape, (self,), shape, node.dtype)
        n = self.numel()
        if any(not isinstance(s, (int, np.integer)) for s in shape):
            raise ShapeError(f"reshape sizes must be ints, got {shape}")
        neg = [i for i, s in enumerate(shape) if s == -1]
        if len(neg) > 1:
            raise ShapeError("only one dimension can be -1 in reshape")
        if any(s < -1 for s in shape):
            raise ShapeError(f"invalid reshape size in {shape}")
        if neg:
            rest = _prod([s for s in shape if s != -1])
            if rest == 0 or n % rest:
                raise ShapeError(f"cannot reshape tensor of shape {self.shape} into {shape}")
            shape = tuple(n // rest if s == -1 else builtins.int(s) for s in shape)
        shape = tuple(builtins.int(s) for s in shape)
        if _prod(shape) != n:
            raise ShapeError(f"cannot reshape tensor of shape {self.shape} ({n} elements) into {shape}")
        if shape == self.shape:
            return self
        return self._make(G.RESHAPE, shape, (self,), shape, self.dtype)

    view = reshape

    def permute(self, *axes) -> "Tensor":
        axes = shape_args(axes)
        nd = self.ndim
        if len(axes) != nd:
            raise ShapeError(f"permute needs {nd} axes for shape {self.shape}, got {axes}")
        axes = tuple(canonical_axis(a, nd) for a in axes)
        if sorted(axes) != list(range(nd)):
            raise ShapeError(f"permute axes {axes} are not a permutation of {tuple(range(nd))}")
        if axes == tuple(range(nd)):
            return self
        return self._make(G.PERMUTE, axes, (self,), tuple(self.shape[a] for a in axes), self.dtype)

    def expand(self, *shape) -> "Tensor":
        shape = shape_args(shape)
        node = _graph.get(self._id)
        cur = node.shape
        if shape == cur:
            return self
        if len(shape) == len(cur) and all([c == s or c == 1 for c, s in zip(cur, shape)]) \
                and all([type(s) is builtins.int and s >= 0 for s in shape]):
            return self._make(G.EXPAND, shape, (self,), shape, node.dtype)   # common case
        if len(shape) < len(cur):
            raise ShapeError(f"cannot expand shape {cur} to {shape}: fewer dimensions")
        x = self
        if len(shape) > len(cur):
            x = x.reshape((1,) * (len(shape) - len(cur)) + cur)
            cur = x.shape
        new = tuple(c if s == -1 else builtins.int(s) for c, s in zip(cur, shape))
        for c, s in zip(cur, new):
            if c != s and c != 1:
                raise ShapeError(f"cannot expand shape {self.shape} to {tuple(shape)}")
        if new == cur:
            return x
        return x._make(G.EXPAND, new, (x,), new, x.dtype)

    def broadcast_to(self, *shape):
        return self.expand(*shape)

    expand_as = lambda self, other: self.expand(other.shape)  # noqa: E731

    def _pad(self, pads, value=0):
        """pads: ((before, after), ...) per dim; negative values shrink."""
        pads = tuple((builtins.int(a), builtins.int(b)) for a, b in pads)
        if all(a == 0 and b == 0 for a, b in pads):
            return self
        shape = tuple(s + a + b for s, (a, b) in zip(self.shape, pads))
        if any(s < 0 for s in shape):
            raise ShapeError(f"padding {pads} makes a negative size for shape {self.shape}")
        v = _scalar_of(value, self.dtype)
        return self._make(G.PAD, (pads, v), (self,), shape, self.dtype)

    def shrink(self, bounds):
        """bounds: ((start, end), ...) per dim."""
        return self._pad(tuple((-s, e - n) for (s, e), n in zip(bounds, self.shape)))

    def flip(self, *axes, axis=None, dim=None, dims=None) -> "Tensor":
        """Reverse the order along the given axes: flip(0, 2), flip((0, 2)), flip(dims=...)."""
        given = axis_or_dim(axis, dim if dims is None else dims)
        if axes:
            if given is not None:
                raise TypeError("flip: give the axes positionally or by keyword, not both")
            given = axes[0] if len(axes) == 1 else axes
        axis = given
        axes = canonical_axes(axis, self.ndim)
        axes = tuple(a for a in axes if self.shape[a] > 1)
        if not axes:
            return self
        return self._make(G.FLIP, axes, (self,), self.shape, self.dtype)

    def _reduce(self, rop, axis, keepdim, dtype=None):
        axes = canonical_axes(axis, self.ndim)
        x = self
        if dtype is not None:
            x = x.cast(dtype)
        if not x.shape:
            return x
        kshape = tuple(1 if i in axes else s for i, s in enumerate(x.shape))
        if not axes:
            r = x
        else:
            r = x._make(G.REDUCE, (rop, axes), (x,), kshape, x.dtype)
        if keepdim:
            return r
        return r.reshape(tuple(s for i, s in enumerate(x.shape) if i not in axes))

    # ---- elementwise helpers -----------------------------------------------------------
    def _broadcasted(self, other, reverse=False, result=None):
        """Return (a, b) of one shape and dtype; `result` forces the common dtype."""
        if isinstance(other, Tensor):
            na, nb = _graph.get(self._id), _graph.get(other._id)
            if na.dtype is nb.dtype and result in (None, na.dtype):
                if na.shape == nb.shape:
                    return (other, self) if reverse else (self, other)   # the common case
                # same dtype, broadcasting (a bias, a 0-d learning rate): no casts
                shape = broadcast_shape(na.shape, nb.shape)
                a, b = _expand_to(self, na, shape), _expand_to(other, nb, shape)
                return (b, a) if reverse else (a, b)
            d = result or dt.promote(self.dtype, other.dtype)
            shape = broadcast_shape(self.shape, other.shape)
            a = self.cast(d).expand(shape) if self.shape != shape else self.cast(d)
            b = other.cast(d).expand(shape) if other.shape != shape else other.cast(d)
        else:
            if isinstance(other, (np.ndarray, list)):
                return self._broadcasted(Tensor(other), reverse, result)
            n = _graph.get(self._id)
            if type(other) is builtins.float and n.dtype.kind == "f" and result in (None, n.dtype):
                # float scalar on a float tensor: no promotion, no cast (hot in training loops)
                b = _wrap(_graph.add(G.CONST, other, (), n.shape, n.dtype))
                return (b, self) if reverse else (self, b)
            d = result or dt.promote_scalar(n.dtype, other)
            a = self.cast(d)
            b = const_tensor(other, d, n.shape)
        return (b, a) if reverse else (a, b)

    def _bin(self, other, bop, reverse=False, out_dtype=None, result=None):
        a, b = self._broadcasted(other, reverse, result)
        return a._binary_prim(b, bop, out_dtype)

    def _float_input(self):
        return self if self.dtype.is_float else self.cast(dt.float32)

    # arithmetic
    def add(self, other, alpha=1):
        return self._bin(other * alpha if alpha != 1 else other, K.B_ADD)

    def __add__(self, o):
        r = _fast_binary(self, o, K.B_ADD, False)
        return r if r is not None else self._bin(o, K.B_ADD)

    def __radd__(self, o):
        r = _fast_binary(self, o, K.B_ADD, True)
        return r if r is not None else self._bin(o, K.B_ADD, True)

    def sub(self, other):
        return self._bin(other, K.B_SUB)

    def __sub__(self, o):
        r = _fast_binary(self, o, K.B_SUB, False)
        if r is not None:
            return r
        if self.dtype.is_bool and (isinstance(o, Tensor) and o.dtype.is_bool):
            raise DTypeError("subtraction of bool tensors is not supported; use ^ or logical_xor")
        return self._bin(o, K.B_SUB)

    def __rsub__(self, o):
        r = _fast_binary(self, o, K.B_SUB, True)
        return r if r is not None else self._bin(o, K.B_SUB, True)

    def mul(self, other):
        return self._bin(other, K.B_MUL)

    def __mul__(self, o):
        r = _fast_binary(self, o, K.B_MUL, False)
        return r if r is not None else self._bin(o, K.B_MUL)

    def __rmul__(self, o):
        r = _fast_binary(self, o, K.B_MUL, True)
        return r if r is not None else self._bin(o, K.B_MUL, True)

    def _true_div_dtype(self, o):
        d = dt.promote(self.dtype, o.dtype) if isinstance(o, Tensor) else dt.promote_scalar(self.dtype, o)
        return d if d.is_float else dt.float32

    def div(self, other, rounding_mode=None):
        if rounding_mode is None:
            return self.__truediv__(other)
        if rounding_mode == "trunc":
            a, b = self._broadcasted(other)
            q = a._binary_prim(b, K.B_DIV)
            return q.trunc() if q.dtype.is_float else _checked_divisor(q, b, "div(trunc)")
        if rounding_mode == "floor":
            return self.__floordiv__(other)
        raise ValueError(f"rounding_mode must be None, 'trunc' or 'floor', got {rounding_mode!r}")

    divide = div

    def __truediv__(self, o):
        r = _fast_binary(self, o, K.B_DIV, False)
        return r if r is not None else self._bin(o, K.B_DIV, result=self._true_div_dtype(o))

    def __rtruediv__(self, o):
        return self._bin(o, K.B_DIV, True, result=self._true_div_dtype(o))

    def __floordiv__(self, o):
        a, b = self._broadcasted(o)
        return _checked_divisor(_floordiv(a, b), b, "//")

    def __rfloordiv__(self, o):
        a, b = self._broadcasted(o, True)
        return _checked_divisor(_floordiv(a, b), b, "//")

    def __mod__(self, o):
        a, b = self._broadcasted(o)
        return _checked_divisor(_pymod(a, b), b, "%")

    def __rmod__(self, o):
        a, b = self._broadcasted(o, True)
        return _checked_divisor(_pymod(a, b), b, "%")

    remainder = __mod__

    def fmod(self, o):
        a, b = self._broadcasted(o)
        return _checked_divisor(a._binary_prim(b, K.B_MOD), b, "fmod")

    def __pow__(self, o):
        return self.pow(o)

    def __rpow__(self, o):
        a, b = self._broadcasted(o, True)
        return a._binary_prim(b, K.B_POW)

    def pow(self, o):
        if not isinstance(o, Tensor):
            if o < 0 and not self.dtype.is_float and isinstance(o, (builtins.int, np.integer)):
                # the kernels would give 0 (2 ** -1); torch refuses it
                raise DTypeError("Integers to negative integer powers are not allowed.")
            check_fits(o, dt.promote_scalar(self.dtype, o), "pow")
            if o == 2:
                return self * self
            if o == 1:
                return self
            if o == 0.5 and self.dtype.is_float:
                return self.sqrt()
            if o == -1 and self.dtype.is_float:
                return self.reciprocal()
        a, b = self._broadcasted(o)
        return a._binary_prim(b, K.B_POW)

    def __neg__(self):
        if self.dtype.is_bool:
            raise DTypeError("negation of a bool tensor is not supported; use ~ instead")
        return self._unary(K.U_NEG)

    neg = __neg__
    negative = __neg__

    def __pos__(self):
        return self

    def __abs__(self):
        return self.abs()

    # comparisons -> bool
    def _cmp(self, o, bop, reverse=False):
        if type(o) is builtins.int and self.dtype.is_int and _overflows_strict(o, self.dtype):
            # x == 2**40 on int32: compare wider (torch's answer) instead of wrapping the
            # scalar to 0
            wide = dt.int64 if -2 ** 63 <= o < 2 ** 63 and self.dtype is not dt.uint64 \
                else dt.float64
            return self.cast(wide)._bin(o, bop, reverse, out_dtype=dt.bool_)
        return self._bin(o, bop, reverse, out_dtype=dt.bool_)

    def __lt__(self, o):
        return self._cmp(o, K.B_CMPLT)

    def __gt__(self, o):
        return self._cmp(o, K.B_CMPGT)

    def __le__(self, o):
        return ~self._cmp(o, K.B_CMPGT) if not self.dtype.is_float else _le(self, o)

    def __ge__(self, o):
        return ~self._cmp(o, K.B_CMPLT) if not self.dtype.is_float else _ge(self, o)

    def __eq__(self, o):  # noqa: D105  (elementwise, like torch)
        return self._cmp(o, K.B_EQ)

    def __ne__(self, o):
        return self._cmp(o, K.B_NOTEQ)

    lt, gt, le, ge, eq, ne = __lt__, __gt__, __le__, __ge__, __eq__, __ne__

    # bitwise / logical
    def _bitwise(self, o, bop, reverse=False):
        a, b = self._broadcasted(o, reverse)
        if a.dtype.is_float:
            raise DTypeError(f"bitwise ops need int or bool tensors, got {a.dtype.name}")
        if a.dtype.is_bool:
            bop = {K.B_BITAND: K.B_AND, K.B_BITOR: K.B_OR, K.B_BITXOR: K.B_NOTEQ}.get(bop, bop)
        return a._binary_prim(b, bop)

    def __and__(self, o):
        return self._bitwise(o, K.B_BITAND)

    def __rand__(self, o):
        return self._bitwise(o, K.B_BITAND, True)

    def __or__(self, o):
        return self._bitwise(o, K.B_BITOR)

    def __ror__(self, o):
        return self._bitwise(o, K.B_BITOR, True)

    def __xor__(self, o):
        return self._bitwise(o, K.B_BITXOR)

    def __rxor__(self, o):
        return self._bitwise(o, K.B_BITXOR, True)

    def __lshift__(self, o):
        return self._shift(o, K.B_SHL)

    def __rshift__(self, o):
        return self._shift(o, K.B_SHR)

    def _shift(self, o, bop):
        if not self.dtype.is_int:
            raise DTypeError(f"shifts need integer tensors, got {self.dtype.name}")
        return self._bitwise(o, bop)

    def __invert__(self):
        if self.dtype.is_float:
            raise DTypeError(f"~ needs an int or bool tensor, got {self.dtype.name}")
        return self._unary(K.U_BITNOT)

    bitwise_not = __invert__
    bitwise_and, bitwise_or, bitwise_xor = __and__, __or__, __xor__

    def logical_not(self):
        return ~self.bool()

    def logical_and(self, o):
        return self.bool() & (o.bool() if isinstance(o, Tensor) else builtins.bool(o))

    def logical_or(self, o):
        return self.bool() | (o.bool() if isinstance(o, Tensor) else builtins.bool(o))

    def logical_xor(self, o):
        return self.bool() ^ (o.bool() if isinstance(o, Tensor) else builtins.bool(o))

    # math
    def exp(self):
        return self._float_input()._unary(K.U_EXP)

    def exp2(self):
        return self._float_input()._unary(K.U_EXP2)

    def log(self):
        return self._float_input()._unary(K.U_LOG)

    def log2(self):
        return self._float_input()._unary(K.U_LOG2)

    def log10(self):
        return self.log2() * (math.log10(2.0))

    def log1p(self):
        return (self + 1).log()

    def expm1(self):
        return self.exp() - 1

    def sqrt(self):
        return self._float_input()._unary(K.U_SQRT)

    def rsqrt(self):
        return self.sqrt().reciprocal()

    def reciprocal(self):
        return self._float_input()._unary(K.U_RECIP)

    def sin(self):
        return self._float_input()._unary(K.U_SIN)

    def cos(self):
        return self._float_input()._unary(K.U_COS)

    def tan(self):
        x = self._float_input()
        return x.sin() / x.cos()

    def sinh(self):
        x = self._float_input()
        return (x.exp() - (-x).exp()) * 0.5

    def cosh(self):
        x = self._float_input()
        return (x.exp() + (-x).exp()) * 0.5

    def tanh(self):
        return self._float_input()._unary(K.U_TANH)

    def erf(self):
        return self._float_input()._unary(K.U_ERF)

    def floor(self):
        return self._unary(K.U_FLOOR) if self.dtype.is_float else self

    def ceil(self):
        return -((-self).floor()) if self.dtype.is_float else self

    def trunc(self):
        return self._unary(K.U_TRUNC) if self.dtype.is_float else self

    def round(self, decimals=0):
        """Round half to even (torch.round semantics)."""
        if not self.dtype.is_float:
            return self
        x = self if decimals == 0 else self * (10.0 ** decimals)
        f = x.floor()
        diff = x - f
        half_up = f + 1
        is_odd = (f - (f * 0.5).floor() * 2) != 0
        r = where(diff > 0.5, half_up, where(diff < 0.5, f, where(is_odd, half_up, f)))
        return r if decimals == 0 else r / (10.0 ** decimals)

    def abs(self):
        if self.dtype.is_bool or self.dtype.kind == "u":
            return self
        return self._unary(K.U_ABS)

    def sign(self):
        if self.dtype.is_bool:
            return self
        z = const_tensor(0, self.dtype, self.shape)
        pos = (self > 0).cast(self.dtype)
        neg = (self < 0).cast(self.dtype)
        return pos - neg if self.dtype.kind != "u" else pos   # sign(nan) is 0, as in torch

    def square(self):
        return self * self

    def relu(self):
        # where, not maximum: the gradient at exactly 0 is 0 as in torch (maximum splits
        # ties); `<= 0` keeps NaN flowing through like torch.relu
        n = _graph.get(self._id)
        d, sh = n.dtype, n.shape
        if d.kind != "f":
            return where(self <= 0, const_tensor(0, d, ()), self)
        # the same nodes as the line above, without the general broadcasting machinery
        z = _wrap(_graph.add(G.CONST, 0.0, (), sh, d))
        lt = _make(G.BINARY, K.B_CMPLT, (self, z), sh, dt.bool_)
        eq = _make(G.BINARY, K.B_EQ, (self, z), sh, dt.bool_)
        le = _make(G.BINARY, K.B_OR, (lt, eq), sh, dt.bool_)
        return _make(G.WHERE, None, (le, z, self), sh, d)

    def sigmoid(self):
        x = self._float_input()
        return (1 + (-x).exp()).reciprocal()

    def maximum(self, o):
        return self._bin(o, K.B_MAX)

    def minimum(self, o):
        return self._bin(o, K.B_MIN)

    def clamp(self, min=None, max=None):  # noqa: A002  (torch names)
        if min is None and max is None:
            raise ValueError("clamp needs min or max")
        # where, not maximum/minimum: torch.clamp gives x the whole gradient on a bound
        # (maximum/minimum split ties in half) and keeps x there (-0.0 stays -0.0). A NaN
        # bound gives NaN, as torch does (x < nan alone would ignore it).
        r = clamp_float_scalars(self, min, max, True)
        if r is not None:
            return r
        x = self
        for bound in (min, max):
            if bound is not None and not isinstance(bound, Tensor):
                check_fits(bound, dt.promote_scalar(self.dtype, bound), "clamp")
        if min is not None:
            x = where(_past(x, min, K.B_CMPLT), min, x)
        if max is not None:
            x = where(_past(x, max, K.B_CMPGT), max, x)
        return x

    clip = clamp

    def isnan(self):
        if not self.dtype.is_float:
            return const_tensor(False, dt.bool_, self.shape)
        return self != self

    def isinf(self):
        if not self.dtype.is_float:
            return const_tensor(False, dt.bool_, self.shape)
        return self.abs() == float("inf")

    def isfinite(self):
        if not self.dtype.is_float:
            return const_tensor(True, dt.bool_, self.shape)
        return (self - self) == 0

    def where(self, cond, other):
        return where(cond, self, other)

    def masked_fill(self, mask, value):
        return where(mask, value, self)

    def lerp(self, end, weight):
        return self + (end - self) * weight


def clamp_float_scalars(x, lo, hi, keep_ties):
    """Hot path of clamp (keep_ties: x wins a tie, so it gets the gradient there) and of the
    hardtanh family (the bound wins: no gradient on it) for a float tensor and finite
    Python-number bounds (or None): the nodes of where(x < lo, lo, x) /
    where(x <= lo, lo, x) built directly. None means "take the general path".
    Internal helper shared by zyx's op modules (not in __all__)."""
    n = _graph.get(x._id)
    d, sh = n.dtype, n.shape
    if d.kind != "f":
        return None
    for b in (lo, hi):
        if b is not None and (type(b) is not builtins.float and type(b) is not builtins.int
                              or b != b):
            return None
    for b, bop in ((lo, K.B_CMPLT), (hi, K.B_CMPGT)):
        if b is None:
            continue
        c = _wrap(_graph.add(G.CONST, builtins.float(b), (), sh, d))
        sel = _make(G.BINARY, bop, (x, c), sh, dt.bool_)
        if not keep_ties:
            eq = _make(G.BINARY, K.B_EQ, (x, c), sh, dt.bool_)
            sel = _make(G.BINARY, K.B_OR, (sel, eq), sh, dt.bool_)
        x = _make(G.WHERE, None, (sel, c, x), sh, d)
    return x


def _past(x, bound, bop):
    """Where x is past a clamp bound (bop B_CMPLT for min, B_CMPGT for max), or the bound
    is NaN: clamp selects the bound there."""
    if isinstance(bound, Tensor):
        c = x._cmp(bound, bop)
        return c | (bound != bound) if bound.dtype.is_float else c
    if bound != bound:
        return const_tensor(True, dt.bool_, x.shape)
    return x._cmp(bound, bop)


def _le(a, o):
    return a._cmp(o, K.B_CMPLT) | a._cmp(o, K.B_EQ)


def _ge(a, o):
    return a._cmp(o, K.B_CMPGT) | a._cmp(o, K.B_EQ)


def _floordiv(a, b):
    if a.dtype.is_float:
        # Python/numpy/torch floor division: derived from fmod so that a == (a // b) * b +
        # a % b holds exactly; floor(a / b) is off by one where a / b rounds up to an
        # integer (1 // 0.1 is 9, not 10) and wrong for infinities (-5 // inf is -1).
        mod = a._binary_prim(b, K.B_MOD)                        # C fmod
        div = (a - mod)._binary_prim(b, K.B_DIV)
        div = where((mod != 0) & ((b < 0) ^ (mod < 0)), div - 1, div)
        fl = div.floor()
        fl = where(div - fl > 0.5, fl + 1, fl)
        return where(b == 0, a._binary_prim(b, K.B_DIV), fl)
    if a.dtype.is_bool:
        raise DTypeError("floor division of bool tensors is not supported")
    q = a._binary_prim(b, K.B_DIV)   # C truncation
    if a.dtype.kind == "u":
        return q
    r = a._binary_prim(b, K.B_MOD)
    fix = ((r != 0) & ((r < 0) ^ (b < 0))).cast(a.dtype)
    return q - fix


def _pymod(a, b):
    """Python/torch remainder: result has the sign of the divisor."""
    if a.dtype.is_bool:
        raise DTypeError("remainder of bool tensors is not supported")
    r = a._binary_prim(b, K.B_MOD)
    if a.dtype.kind == "u":
        return r
    fix = (r != 0) & ((r < 0) ^ (b < 0))
    return where(fix, r + b, r)


def shape_args(shape):
    """A shape given as `*sizes` or as one sequence, as a tuple.
    Internal helper shared by zyx's op modules (not in __all__)."""
    if len(shape) == 1:
        s0 = shape[0]
        if type(s0) is tuple:
            return s0
        if isinstance(s0, (tuple, list)):
            return tuple(s0)
    return tuple(shape)


def _scalar_of(v, d):
    if isinstance(v, Tensor):
        v = v.item()
    if d.is_bool:
        return builtins.bool(v)
    if d.is_float:
        return builtins.float(v)
    if isinstance(v, builtins.float) and not v.is_integer():
        raise DTypeError(f"cannot use float {v} as a constant of integer dtype {d.name}")
    v = builtins.int(v)
    bits = d.itemsize * 8
    if d.kind == "u":
        return v % (1 << bits)
    v = (v + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1))
    return v


def _overflows(v, d) -> bool:
    """torch's c10::overflows for integer dtypes: whether the Python number `v` does not
    fit `d`. Ints into unsigned dtypes may be negative down to -max (they wrap, as in
    torch); floats must be finite and in range. Float dtypes are left out: torch itself
    raises there only in some ops (full, masked_fill) and rounds to inf in others."""
    if not d.is_int or isinstance(v, (builtins.bool, np.bool_)):
        return False
    if isinstance(v, (builtins.float, np.floating)):
        v = builtins.float(v)
        if not math.isfinite(v):
            return True
        lo, hi = _int_range(d)
        return v < lo or v > hi
    if not isinstance(v, (builtins.int, np.integer)):
        return False
    v = builtins.int(v)
    lo, hi = _int_range(d)
    if d.kind == "u":
        return v > hi or -v > hi
    return v < lo or v > hi


def _overflows_strict(v, d) -> bool:
    """Whether int `v` is outside integer dtype `d`'s range (no unsigned wrap)."""
    lo, hi = _int_range(d)
    return v < lo or v > hi


def check_fits(v, d, what):
    """Raise like torch when a Python number does not fit the dtype it becomes (zyx used to
    wrap it silently: full((2,), 1e30, dtype=int32) gave zeros).
    Internal helper shared by zyx's op modules (not in __all__)."""
    if not isinstance(v, Tensor) and _overflows(v, d):
        raise ValueOverflowError(f"value cannot be converted to type {d.name} without "
                                 f"overflow: {v!r} (in {what})")


def rebind(dst: "Tensor", src: "Tensor", sync: bool = True) -> None:
    """Point tensor object `dst` at `src`'s graph node (new node retained before the old is
    released). The object keeps its identity, so user references (model parameters held by
    an optimizer, a module's buffers) see the new value: zyx's form of an in-place update.
    With `sync`, what shares dst's storage follows (its views and detached aliases, and
    numpy/DLPack memory it shares: `REBIND_HOOK`, set by zyx.inplace).
    Internal helper shared by zyx's op modules (not in __all__)."""
    if dst._id == src._id:
        return
    _graph.retain(src._id)
    old = dst._id
    dst._id = src._id
    if sync and REBIND_HOOK and (dst._views is not None or id(dst) in _SHARED):
        REBIND_HOOK[0](dst, old)       # before the release: it may still read node `old`
    _graph.release(old)


# zyx.inplace puts its view propagation here: hook(tensor, old node id) after `rebind`
# moved a tensor that has views or shares external memory. (Public so that zyx.inplace can
# set it; not part of the zyx API.)
REBIND_HOOK = []

_SHARED = {}    # id(tensor) -> (weakref, Buffer): tensors whose memory numpy/DLPack shares


def link_view(out: "Tensor", base: "Tensor", kind, arg) -> "Tensor":
    """Record `out` as a view of `base` (`out._view`, a weak reference in `base._views`):
    zyx.inplace writes a view through its base and re-derives a base's views after a
    write. Returns out.
    Internal helper shared by zyx's op modules (not in __all__)."""
    if out is base:
        return out
    out._view = (base, kind, arg)
    refs = base._views
    if refs is None:
        base._views = [weakref.ref(out)]
    else:
        refs.append(weakref.ref(out))
        if len(refs) % 64 == 0:           # drop dead views now and then
            base._views = [r for r in refs if r() is not None] or None
    return out


def new_handle(t: "Tensor") -> "Tensor":
    """A new tensor object on t's value that is not an alias of t (unlike detach()):
    nothing links the two, so writing one never changes the other (zyx values are
    immutable nodes; only the objects are rebound).
    Internal helper shared by zyx's op modules (not in __all__)."""
    _graph.retain(t._id)
    return _wrap(t._id)


def share_memory(t: "Tensor") -> "Tensor":
    """Record that t's (leaf) buffer is memory numpy or a DLPack consumer/producer shares,
    so that zyx.inplace writes t's later in-place updates into it. Returns t.
    Internal helper shared by zyx's op modules (not in __all__)."""
    buf = _graph.get(t._id).buffer
    if buf is None:
        return t
    k = id(t)
    entry = _SHARED.get(k)
    if entry is None or entry[0]() is not t:
        _SHARED[k] = (weakref.ref(t, _unshare_dead(k)), buf)
    return t


def _unshare_dead(k):
    def cb(ref):
        entry = _SHARED.get(k)
        if entry is not None and entry[0] is ref:   # not a newer object with the same id
            del _SHARED[k]
    return cb


def shared_buffer(t: "Tensor"):
    """The Buffer whose memory t shares with numpy/DLPack (share_memory), or None.
    Internal helper shared by zyx's op modules (not in __all__)."""
    entry = _SHARED.get(id(t))
    if entry is None or entry[0]() is not t:
        return None
    return entry[1]


def unshare_memory(t: "Tensor") -> None:
    """t no longer writes into the memory it shared (`t.data = other`, as torch swaps the
    storage).
    Internal helper shared by zyx's op modules (not in __all__)."""
    entry = _SHARED.get(id(t))
    if entry is not None and entry[0]() is t:
        del _SHARED[id(t)]


def expand_ellipsis(idx, ndim, used):
    """The index items with Ellipsis (or, when there is none, the end) replaced by full
    slices of the `ndim - used` dims the other items do not index.
    Internal helper shared by zyx's op modules (not in __all__)."""
    full = []
    for i in idx:
        if i is Ellipsis:
            full += [slice(None)] * (ndim - used)
        else:
            full.append(i)
    if not any(i is Ellipsis for i in idx):   # not `in`: Tensor.__eq__ is elementwise
        full += [slice(None)] * (ndim - used)
    return full


def const_tensor(value, d, shape=()):
    """A constant tensor of dtype d and any shape: one node, no memory; folded into kernels.
    Internal helper shared by zyx's op modules (not in __all__)."""
    nid = _graph.add(G.CONST, _scalar_of(value, d), (), tuple(shape), d)
    return _wrap(nid)


def f32_to_bf16_bits(arr):
    """float32 values as bfloat16 bit patterns (uint16), rounded to nearest even.
    Internal helper shared by zyx's op modules (not in __all__)."""
    a = np.ascontiguousarray(arr, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    r[nan] = ((u[nan] >> 16) | 64).astype(np.uint16)
    return r


def _to_numpy(data, d):
    """Convert user data to a numpy array of zyx dtype d (or the natural one)."""
    if isinstance(data, np.ndarray):
        arr = data
        if d is not None and d is not dt.bfloat16:
            arr = arr.astype(d.np, copy=False)
        elif d is dt.bfloat16:
            arr = arr.astype(np.float32, copy=False)
        elif arr.dtype == np.float16 or arr.dtype.kind in "biuf":
            dt.from_numpy(arr.dtype)   # raises for unsupported numpy dtypes
        else:
            raise DTypeError(f"numpy dtype {arr.dtype} has no zyx equivalent")
        return arr
    if isinstance(data, (np.generic,)):
        return _to_numpy(np.asarray(data), d)
    if isinstance(data, (builtins.bool, builtins.int, builtins.float, list, tuple)):
        if isinstance(data, (list, tuple)):
            data = [x.numpy() if isinstance(x, Tensor) else x for x in data] if any(
                isinstance(x, Tensor) for x in data) else data
        try:
            arr = np.asarray(data)
        except OverflowError:     # numpy holds ints only up to 2**64
            arr = np.asarray(data, dtype=object)
        if arr.dtype == object:
            big = [x for x in arr.reshape(-1) if isinstance(x, builtins.int)]
            if big and len(big) == arr.size:
                v = builtins.max(big, key=builtins.abs)
                raise ValueOverflowError(f"value {v} does not fit any integer dtype "
                                         f"(in tensor)")
            raise ShapeError("nested lists must be rectangular and hold numbers")
        if d is not None and d.is_int and arr.size and arr.dtype.kind in "iuf":
            for v in (arr.min(), arr.max()):
                check_fits(v.item(), d, "tensor")
        if d is None:
            if arr.dtype.kind == "f":
                d = dt.float32
            elif arr.dtype.kind in "iu":
                if arr.size == 0 or _fits_int32(arr.min(), arr.max()):
                    d = dt.int32
                elif arr.dtype == np.uint64:   # numpy picks it only for values int64 cannot hold
                    raise ValueOverflowError(
                        f"value {arr.max()} does not fit in int64, the widest integer dtype "
                        f"inferred for Python ints (torch refuses it too); pass dtype=zyx.uint64")
                else:
                    d = dt.int64
            elif arr.dtype.kind == "b":
                d = dt.bool_
            else:
                raise DTypeError(f"cannot make a tensor from {type(data).__name__} of {arr.dtype}")
        return arr.astype(np.float32 if d is dt.bfloat16 else d.np)
    raise DTypeError(f"cannot make a tensor from {type(data).__name__}")


# ---------------------------------------------------------------------------------------
# creation
def parse_to_args(args, device, dtype):
    """(device, dtype) of `to(*args, device=, dtype=)` as torch reads them: positional
    devices, dtypes, or a tensor giving both.
    Internal helper shared by zyx's op modules (not in __all__)."""
    for a in args:
        if isinstance(a, Tensor):
            device, dtype = a.device, a.dtype
        elif _names_device(a):
            device = a
        else:
            dtype = a
    return device, dtype


def _names_device(a):
    """Whether a positional argument of `to()` names a device (a Device, a device string
    such as "cuda:0", a backend device) rather than a dtype ("float64", zyx.int32...)."""
    if isinstance(a, Device):
        return True
    if isinstance(a, str):
        return not dt.is_dtype_name(a)
    return a in (RT.devices or ())


def _backend_device(device):
    """The backend device a `device=` argument names (None stays None: the default)."""
    return None if device is None else RT.resolve(device)


def _placed(t, device):
    """`t` computed on `device` now, when that is not the default device: a tensor made of
    constants only (zeros, arange of a cached range...) has no input telling the runtime
    where it lives, so it is materialized there."""
    if device is None:
        return t
    dev = RT.resolve(device)
    if dev is RT.device() and not RT._multi:
        return t
    if RT.device_of(t._id) is not dev:
        RT.realize([t._id], device=dev)
        RT.placed_on(dev)
    return t


def device_of_like(t, device):
    """`device=` of a *_like function: the input's device unless given (as torch).
    Internal helper shared by zyx's op modules (not in __all__)."""
    if device is None and RT._multi and isinstance(t, Tensor):
        return RT.device_of(t._id)
    return device


def tensor(data, dtype=None, requires_grad=False, device=None) -> Tensor:
    """Create a tensor from data (torch.tensor), on `device` (default device if None)."""
    return Tensor(data, dtype=dtype, requires_grad=requires_grad, device=device)


def from_numpy(arr: np.ndarray) -> Tensor:
    """A tensor sharing `arr`'s memory (torch.from_numpy): no copy when zyx computes in host
    memory (the C backend), so writes to `arr` before the tensor is realized are seen, as
    in torch. A `backward()` through it computes at the next realization (usually
    `opt.step()`), so refill a reused batch array after the step, not between backward()
    and step(). In-place ops on the tensor (`t.add_(1)`, `t[0] = 5`, through its views and
    detach() too; an optimizer step on it) are computed at once and written into `arr`,
    as torch writes the shared memory; values computed earlier from the tensor keep the
    old ones. Falls back to a copy (nothing shared either way) for other devices,
    non-contiguous arrays and bfloat16."""
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"from_numpy expects a numpy.ndarray, got {type(arr).__name__}")
    d = dt.from_numpy(arr.dtype)
    nid = RT.share_numpy(arr, d) if d is not dt.bfloat16 else None
    return Tensor(arr) if nid is None else share_memory(_wrap(nid))


def from_dlpack(obj) -> Tensor:
    """A tensor sharing the memory of any DLPack producer (numpy arrays, PyTorch and CuPy
    tensors...) without a copy: CPU data becomes a tensor on the "cpu" device, CUDA data
    one on the matching "cuda:<i>" device. The producer must not write to the memory while
    zyx may still read it (as with torch.from_dlpack). In-place ops on the result are
    computed at once and written into the producer's memory, so the producer sees them
    (torch.from_dlpack shares both ways too). Non-contiguous CPU data is copied (then
    nothing is shared)."""
    from . import dlpack
    if isinstance(obj, Tensor):
        return obj
    if not hasattr(obj, "__dlpack__"):
        raise TypeError(f"from_dlpack expects an object with __dlpack__, got "
                        f"{type(obj).__name__}")
    kind, index = obj.__dlpack_device__()
    kind = builtins.int(kind)
    if kind == dlpack.KDL_CPU:
        release, t = dlpack.consume(dlpack.request(obj))
        shape, d, data, _ = dlpack.describe(t)
        arr, copied = dlpack.host_array(release, t, shape, d, data)
        cpu = [dev for n, dev in RT._names if n.type == "cpu"] if RT.devices else []
        if not cpu:
            RT._ensure()
            cpu = [dev for n, dev in RT._names if n.type == "cpu"]
        nid = RT.share_numpy(arr, d, cpu[0]) if cpu and not copied else None
        if nid is None:
            return _wrap(RT.from_numpy(arr, d, cpu[0] if cpu else None))
        if cpu[0] is not RT.device():
            RT.placed_on(cpu[0])
        return share_memory(_wrap(nid))
    if kind in (dlpack.KDL_CUDA, dlpack.KDL_ROCM):
        name = f"{'cuda' if kind == dlpack.KDL_CUDA else 'hip'}:{builtins.int(index)}"
        dev = RT.resolve(name)
        current = getattr(dev, "make_current", None)
        if current is not None:     # the producer checks its device is the current one
            current()
        stream = getattr(dev, "dlpack_stream", None)
        cap = dlpack.request(obj, stream=stream) if stream is not None else dlpack.request(obj)
        release, t = dlpack.consume(cap)
        shape, d, data, compact = dlpack.describe(t)
        nbytes = _prod(shape) * d.itemsize
        owner = dlpack.Borrowed(release, data, nbytes)
        if not compact:
            raise BufferError("from_dlpack: a non-contiguous GPU tensor; pass "
                              "x.contiguous()")
        RT.placed_on(dev)
        return share_memory(_wrap(RT.graph.leaf(dev.pool.borrow_device(owner), shape, d)))
    raise BufferError(f"from_dlpack: DLPack device type {kind} is not supported (cpu, "
                      "cuda and hip are)")


def full(shape, fill_value, dtype=None, device=None, requires_grad=False) -> Tensor:
    shape = shape_args(shape if isinstance(shape, (tuple, list)) else (shape,))
    if any(not isinstance(s, (int, np.integer)) or s < 0 for s in shape):
        raise ShapeError(f"invalid shape {shape}")
    d = dt.to_dtype(dtype) if dtype is not None else dt.scalar_dtype(fill_value)
    check_fits(fill_value, d, "full")
    t = _placed(const_tensor(fill_value, d, tuple(builtins.int(s) for s in shape)), device)
    if requires_grad:
        t.requires_grad = True
    return t


def zeros(*shape, dtype=None, device=None, requires_grad=False) -> Tensor:
    return full(shape_args(shape), 0, dtype or dt.float32, device, requires_grad)


def ones(*shape, dtype=None, device=None, requires_grad=False) -> Tensor:
    return full(shape_args(shape), 1, dtype or dt.float32, device, requires_grad)


empty = zeros


def zeros_like(t, dtype=None, device=None):
    return full(t.shape, 0, dtype or t.dtype, device_of_like(t, device))


def ones_like(t, dtype=None, device=None):
    return full(t.shape, 1, dtype or t.dtype, device_of_like(t, device))


def full_like(t, fill_value, dtype=None, device=None):
    return full(t.shape, fill_value, dtype or t.dtype, device_of_like(t, device))


def arange(start, end=None, step=1, dtype=None, device=None) -> Tensor:
    if end is None:
        start, end = 0, start
    if step == 0:
        raise ValueError("arange step must be nonzero")
    n = builtins.max(0, math.ceil((end - start) / step))
    isfloat = any(isinstance(v, (builtins.float, np.floating)) for v in (start, end, step))
    if dtype is not None:
        d = dt.to_dtype(dtype)
    elif isfloat:
        d = dt.float32
    else:   # Python ints are int32 unless the values need int64 (torch would use int64)
        d = dt.int32 if _fits_int32(start, start + (n - 1) * step) else dt.int64
    if n == 0:
        return _placed(const_tensor(0, d, (0,)), device)
    if d.is_int:
        # torch wraps silently here; a range that does not fit its dtype is a mistake
        check_fits(start, d, "arange")
        check_fits(start + (n - 1) * step, d, "arange")
    # 0..n-1 (cached for small n), scaled and shifted in the kernel that uses it; float64
    # keeps its own precision, f16/bf16 count in float32 (exact up to 2**24)
    idx = iota(n, d if (not d.is_float or d is dt.float64) else dt.float32, device)
    r = idx * step + start if (step != 1 or start != 0) else idx
    return r.cast(d)


_IOTA_CACHE = {}


def iota(n, d, device=None):
    """0..n-1 of dtype d on `device` (default device if None). Small ones are kept per
    device (a training loop asks for the same ones every step, and the graph cache sees the
    same buffer; one per device, or a range shared by two devices would move back and
    forth).
    Internal helper shared by zyx's op modules (not in __all__)."""
    dev = RT.resolve(device) if device is not None else RT.device()
    key = (n, d, dev)
    t = _IOTA_CACHE.get(key)
    if t is None:
        t = Tensor(np.arange(n, dtype=np.float64).astype(d.np if d is not dt.bfloat16 else np.float32),
                   dtype=d, device=None if device is None else dev)
        if n <= 1 << 16:
            _IOTA_CACHE[key] = t
    # a new object on the cached node: an in-place write to one arange (x[1] = 7 rebinds
    # its object) must not change the cache and every later arange
    _graph.retain(t._id)
    return _wrap(t._id)


def linspace(start, end, steps, dtype=None, device=None) -> Tensor:
    if steps < 0:
        raise ValueError("linspace steps must be non-negative")
    d = dt.to_dtype(dtype) if dtype is not None else dt.float32
    if steps == 1:
        return full((1,), start, d, device)
    i = arange(steps, dtype=dt.float32, device=device)
    return (i * ((end - start) / (steps - 1)) + start).cast(d)


def eye(n, m=None, dtype=None, device=None) -> Tensor:
    m = n if m is None else m
    for name, k in (("n", n), ("m", m)):
        if k < 0:
            raise ShapeError(f"{name} must be greater or equal to 0, got {k}")
    d = dt.to_dtype(dtype) if dtype is not None else dt.float32
    r = arange(n, device=device).reshape(n, 1)
    c = arange(m, device=device).reshape(1, m)
    return (r == c).cast(d)


def manual_seed(seed: int) -> None:
    """Seed the generator used by rand/randn/randint/dropout/init (zyx/random.py): the same
    seed gives the same numbers on every device and in every run."""
    _random.set_seed(seed)


def _shape_of(shape):
    shape = shape_args(shape)
    if any(not isinstance(s, (int, np.integer)) or s < 0 for s in shape):
        raise ShapeError(f"invalid shape {shape}")
    return tuple(builtins.int(s) for s in shape)


def rand(*shape, dtype=None, device=None, requires_grad=False) -> Tensor:
    """Uniform [0, 1), computed on the device by zyx's counter-based generator
    (zyx/random.py), so every device gets the same numbers for the same seed."""
    shape = _shape_of(shape)
    d = dt.to_dtype(dtype) if dtype is not None else dt.float32
    if not d.is_float:
        raise DTypeError(f"rand needs a floating dtype, got {d.name}")
    t = _random.uniform(shape, d, _backend_device(device))
    t.requires_grad = requires_grad
    return t


def randn(*shape, dtype=None, device=None, requires_grad=False) -> Tensor:
    """Standard normal (computed on the device, like rand)."""
    shape = _shape_of(shape)
    d = dt.to_dtype(dtype) if dtype is not None else dt.float32
    if not d.is_float:
        raise DTypeError(f"randn needs a floating dtype, got {d.name}")
    t = _random.normal(shape, d, _backend_device(device))
    t.requires_grad = requires_grad
    return t


def uniform(*shape, low=0.0, high=1.0, dtype=None, device=None) -> Tensor:
    return rand(*shape, dtype=dtype, device=device) * (high - low) + low


def normal(*shape, mean=0.0, std=1.0, dtype=None, device=None) -> Tensor:
    return randn(*shape, dtype=dtype, device=device) * std + mean


def randint(low, high=None, size=(), dtype=None, device=None) -> Tensor:
    if high is None:
        low, high = 0, low
    if high <= low:
        raise ValueError(f"randint needs low < high, got {low}, {high}")
    if dtype is not None:
        d = dt.to_dtype(dtype)
    else:
        d = dt.int32 if _fits_int32(low, high - 1) else dt.int64
    size = _shape_of(size if isinstance(size, (tuple, list)) else (size,))
    return _random.integers(builtins.int(low), builtins.int(high), size, d,
                            _backend_device(device))


def _fits_int32(*values):
    return all(-2 ** 31 <= v < 2 ** 31 for v in values)


def _check_condition_kind(kind, what):
    if kind not in "biu":
        raise DTypeError(f"where expects a bool condition, got {what}; compare it first, "
                         "e.g. where(mask > 0.5, a, b)")


def where(cond, a, b) -> Tensor:
    """Elementwise select: `a` where cond is true, else `b` (broadcasting, promotion).
    `cond` is bool (or integer: nonzero selects `a`). A float condition is refused, as
    torch refuses it, rather than read as "nonzero" (0.5 and NaN would select `a`):
    compare it first, e.g. `where(mask > 0.5, a, b)`."""
    if not isinstance(cond, Tensor):
        arr = np.asarray(cond)
        _check_condition_kind(arr.dtype.kind, f"an array of {arr.dtype}")
        cond = Tensor(arr, dtype=dt.bool_)
    _check_condition_kind(cond.dtype.kind, f"a {cond.dtype} tensor")
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        d = dt.promote(a.dtype, b.dtype)
    elif isinstance(a, Tensor):
        d = dt.promote_scalar(a.dtype, b)
    elif isinstance(b, Tensor):
        d = dt.promote_scalar(b.dtype, a)
    else:
        d = dt.promote(dt.scalar_dtype(a), dt.scalar_dtype(b))
    shapes = [cond.shape] + [x.shape for x in (a, b) if isinstance(x, Tensor)]
    shape = broadcast_shape(*shapes)
    c = cond.bool().expand(shape)
    check_fits(a, d, "where")
    check_fits(b, d, "where")
    ta = a.cast(d).expand(shape) if isinstance(a, Tensor) else const_tensor(a, d, shape)
    tb = b.cast(d).expand(shape) if isinstance(b, Tensor) else const_tensor(b, d, shape)
    return c._make(G.WHERE, None, (c, ta, tb), shape, d)


# ---------------------------------------------------------------------------------------
# reductions
def _sum(self, axis=None, keepdim=False, dtype=None, dim=None):
    """Sum over `axis` (int, tuple or None for all). Bool and int sums give int64 like torch."""
    axis = axis_or_dim(axis, dim)
    d = dt.to_dtype(dtype) if dtype is not None else (
        dt.int64 if (self.dtype.is_bool or self.dtype.is_int) else None)
    return self._reduce(K.R_SUM, axis, keepdim, d)


def _prod_r(self, axis=None, keepdim=False, dtype=None, dim=None):
    axis = axis_or_dim(axis, dim)
    d = dt.to_dtype(dtype) if dtype is not None else (
        dt.int64 if (self.dtype.is_bool or self.dtype.is_int) else None)
    return self._reduce(K.R_PROD, axis, keepdim, d)


def _check_nonempty(self, axis, what):
    axes = canonical_axes(axis, self.ndim) if self.ndim else ()   # 0-d: axis 0/-1, one value
    if any(self.shape[a] == 0 for a in axes) or (self.numel() == 0 and not axes):
        raise ShapeError(f"{what} of an empty dimension has no identity (shape {self.shape})")


def _amax(self, axis=None, keepdim=False, dim=None):
    """Maximum values over axis (NaN propagates). Use argmax for indices."""
    axis = axis_or_dim(axis, dim)
    _check_nonempty(self, axis, "max")
    return self._reduce(K.R_MAX, axis, keepdim)


def _amin(self, axis=None, keepdim=False, dim=None):
    axis = axis_or_dim(axis, dim)
    _check_nonempty(self, axis, "min")
    return self._reduce(K.R_MIN, axis, keepdim)


def _widened(x):
    """`x` in the dtype that mean/var/std compute in: float16 and bfloat16 in float32 (as
    torch does: 70000 float16 ones sum past float16's range), cast back once at the end."""
    if x.dtype is dt.float16 or x.dtype is dt.bfloat16:
        return x.cast(dt.float32)
    return x


def _narrowed(r, d):
    return r if r.dtype is d else r.cast(d)


def _mean(self, axis=None, keepdim=False, dtype=None, dim=None):
    axis = axis_or_dim(axis, dim)
    x = self.cast(dtype) if dtype is not None else self._float_input()
    return _narrowed(_mean_of(_widened(x), axis, keepdim), x.dtype)


def _reduced_count(x, axis):
    """How many values a reduction of `x` over `axis` combines (a 0-d tensor's axis 0/-1,
    accepted like torch, combines its one value)."""
    if not x.ndim:
        canonical_axes(axis, 0)      # still rejects axes a 0-d tensor does not have
        return 1
    return _prod([x.shape[a] for a in canonical_axes(axis, x.ndim)])


def _mean_of(x, axis, keepdim):
    n = _reduced_count(x, axis)
    s = x._reduce(K.R_SUM, axis, keepdim)
    return s * (1.0 / n) if n else s / 0.0


def _var(self, axis=None, keepdim=False, correction=1, unbiased=None, dim=None):
    x = self._float_input()
    v = _var_of(_widened(x), axis_or_dim(axis, dim), keepdim, correction, unbiased)
    return _narrowed(v, x.dtype)


def _var_of(x, axis, keepdim, correction, unbiased):
    """Two passes (the mean, then the mean square deviation from it): stable for data far
    from zero, where E[x^2] - E[x]^2 cancels to noise."""
    if unbiased is not None:
        correction = 1 if unbiased else 0
    n = _reduced_count(x, axis)
    m = _mean_of(x, axis, True)
    d = x - m
    s = (d * d)._reduce(K.R_SUM, axis, keepdim)
    denom = builtins.max(n - correction, 0)
    return s * (1.0 / denom) if denom else s / 0.0


def _std(self, axis=None, keepdim=False, correction=1, unbiased=None, dim=None):
    x = self._float_input()
    v = _var_of(_widened(x), axis_or_dim(axis, dim), keepdim, correction, unbiased)
    return _narrowed(v.sqrt(), x.dtype)


def _argext(self, axis, keepdim, largest):
    if axis is None:
        x = self.reshape(-1)
        axis = 0
    else:
        x = self
    axis = canonical_axis(axis, x.ndim)
    if x.ndim == 0:     # torch: the index of a 0-d tensor's only value, 0-d
        return const_tensor(0, dt.int64, ())
    _check_nonempty(x, axis, "argmax" if largest else "argmin")
    n = x.shape[axis]
    m = x._reduce(K.R_MAX if largest else K.R_MIN, axis, True)
    hit = (x == m) | (x.isnan() if x.dtype.is_float else False)
    shape = [1] * x.ndim
    shape[axis] = n
    rev = (iota(n, dt.int64) * -1 + (n - 1)).reshape(shape)   # first hit wins
    score = where(hit, rev, -1)
    r = (n - 1) - score._reduce(K.R_MAX, axis, keepdim)
    if keepdim and x is not self:   # axis=None with keepdim: torch keeps every dim as size 1
        r = r.reshape((1,) * self.ndim)
    return r


def _argmax(self, axis=None, keepdim=False, dim=None):
    """Index of the first maximum (int64); axis=None looks at the flattened tensor."""
    return _argext(self, axis_or_dim(axis, dim), keepdim, True)


def _argmin(self, axis=None, keepdim=False, dim=None):
    return _argext(self, axis_or_dim(axis, dim), keepdim, False)


def _any(self, axis=None, keepdim=False, dim=None):
    return self.bool()._reduce(K.R_MAX, axis_or_dim(axis, dim), keepdim)


def _all(self, axis=None, keepdim=False, dim=None):
    return self.bool()._reduce(K.R_MIN, axis_or_dim(axis, dim), keepdim)


def _logsumexp(self, axis=None, keepdim=False, dim=None):
    axis = axis_or_dim(axis, dim)
    x = self._float_input()
    # (the shift is detached, here and in softmax/log_softmax: the result does not depend
    # on it, so its gradient is zero and autograd need not spread one over the maxima)
    m = x._reduce(K.R_MAX, axis, True).detach()
    m = where(m.isinf(), 0.0, m)   # all -inf rows stay -inf instead of becoming nan
    s = (x - m).exp()._reduce(K.R_SUM, axis, True).log() + m
    if keepdim:
        return s
    axes = canonical_axes(axis, self.ndim)
    return s.reshape(tuple(d for i, d in enumerate(s.shape) if i not in axes))


def _softmax(self, axis=-1, dim=None, dtype=None):
    axis = axis_or_dim(axis if dim is None else None, dim)
    x = self._float_input() if dtype is None else self.cast(dtype)
    m = x._reduce(K.R_MAX, axis, True).detach()
    e = (x - m).exp()
    # one reciprocal per row (hoisted out of the inner loop) instead of a divide per element
    return e * e._reduce(K.R_SUM, axis, True).reciprocal()


def _log_softmax(self, axis=-1, dim=None, dtype=None):
    axis = axis_or_dim(axis if dim is None else None, dim)
    x = self._float_input() if dtype is None else self.cast(dtype)
    m = x._reduce(K.R_MAX, axis, True).detach()
    s = x - m
    return s - s.exp()._reduce(K.R_SUM, axis, True).log()


def _cumsum(self, axis=None, dim=None, dtype=None):
    """Inclusive prefix sum along axis (a windowed reduce: no sequential scan needed)."""
    axis = axis_or_dim(axis, dim)
    if axis is None:
        return _cumsum(self.reshape(-1), 0, dtype=dtype)
    axis = canonical_axis(axis, self.ndim)
    x = self
    if dtype is not None:
        x = x.cast(dtype)
    elif x.dtype.is_bool or x.dtype.is_int:
        x = x.cast(dt.int64)
    n = x.shape[axis]
    if n == 0:
        return x
    # move axis last, build windows [j-n+1 .. j] with zero padding, sum the window
    x = x.transpose(axis, -1)
    pads = [(0, 0)] * (x.ndim - 1) + [(n - 1, 0)]
    xp = x._pad(pads)                                       # (..., 2n-1)
    lead = xp.shape[:-1]
    w = xp.unsqueeze(-2).expand(*lead, n, 2 * n - 1)
    w = w.reshape(*lead, n * (2 * n - 1))._pad([(0, 0)] * len(lead) + [(0, n)])
    w = w.reshape(*lead, n, 2 * n).shrink([(0, s) for s in lead] + [(0, n), (0, n)])
    # row i of w holds x[i-n+1+k] at k: columns k >= n-1-i... reversed windows
    r = w._reduce(K.R_SUM, -1, False)
    return r.transpose(axis, -1)


# movement
def _flatten(self, start_dim=0, end_dim=-1):
    if self.ndim == 0:
        return self.reshape(1)
    s = canonical_axis(start_dim, self.ndim)
    e = canonical_axis(end_dim, self.ndim)
    if e < s:
        raise ShapeError("flatten: end_dim is before start_dim")
    shape = self.shape
    return self.reshape(shape[:s] + (_prod(shape[s:e + 1]),) + shape[e + 1:])


def _squeeze(self, axis=None, dim=None):
    axis = axis_or_dim(axis, dim)
    if axis is None:
        return self.reshape(tuple(s for s in self.shape if s != 1))
    axes = canonical_axes(axis, self.ndim)
    return self.reshape(tuple(s for i, s in enumerate(self.shape) if not (i in axes and s == 1)))


def _unsqueeze(self, axis=None, dim=None):
    axis = axis_or_dim(axis, dim)
    nd = self.ndim + 1
    a = canonical_axis(axis, nd)
    shape = list(self.shape)
    shape.insert(a, 1)
    return self.reshape(tuple(shape))


def _transpose(self, axis0=-2, axis1=-1, dim0=None, dim1=None):
    a0 = dim0 if dim0 is not None else axis0
    a1 = dim1 if dim1 is not None else axis1
    if self.ndim < 2:
        return self
    order = list(range(self.ndim))
    a0, a1 = canonical_axis(a0, self.ndim), canonical_axis(a1, self.ndim)
    order[a0], order[a1] = order[a1], order[a0]
    return self.permute(order)


def _T(self):
    return self.permute(tuple(reversed(range(self.ndim)))) if self.ndim >= 2 else self


def _repeat(self, *repeats):
    repeats = shape_args(repeats)
    if len(repeats) < self.ndim:
        raise ShapeError(f"repeat needs at least {self.ndim} sizes, got {repeats}")
    x = self.reshape((1,) * (len(repeats) - self.ndim) + self.shape)
    base = x.shape
    # (r0, s0, r1, s1, ...) expanded then merged
    inter = []
    for r, s in zip(repeats, base):
        inter += [1, s]
    x = x.reshape(inter)
    exp_shape = []
    for r, s in zip(repeats, base):
        exp_shape += [r, s]
    x = x.expand(exp_shape)
    return x.reshape(tuple(r * s for r, s in zip(repeats, base)))


def _roll(self, shifts, dims=None, axis=None):
    dims = axis_or_dim(axis, dims)
    if dims is None:
        return _roll(self.reshape(-1), shifts, 0).reshape(self.shape)
    if isinstance(shifts, (int, np.integer)):
        shifts, dims = (shifts,), (dims,) if isinstance(dims, (int, np.integer)) else dims
    x = self
    for s, d in zip(shifts, dims if isinstance(dims, (tuple, list)) else (dims,)):
        d = canonical_axis(d, x.ndim)
        n = x.shape[d]
        if n == 0:
            continue
        s = builtins.int(s) % n
        if s == 0:
            continue
        x = cat([shrink_axis(x, d, n - s, n), shrink_axis(x, d, 0, n - s)], d)
    return x


def shrink_axis(x, axis, start, end):
    """x restricted to [start, end) along `axis`.
    Internal helper shared by zyx's op modules (not in __all__)."""
    b = [(0, s) for s in x.shape]
    b[axis] = (start, end)
    return x.shrink(b)


def _pad_torch(self, pad, mode="constant", value=0.0):
    """torch.nn.functional.pad: `pad` lists (left, right) pairs from the last dim backwards."""
    if mode != "constant":
        raise NotImplementedError(f"pad mode {mode!r} (only 'constant' is supported)")
    if len(pad) % 2 or len(pad) // 2 > self.ndim:
        raise ShapeError(f"pad {pad} does not fit a tensor of {self.ndim} dimension(s)")
    check_fits(value, self.dtype, "pad")
    pads = [(0, 0)] * self.ndim
    for i in range(len(pad) // 2):
        pads[self.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    return self._pad(pads, value)


# A cat is a sum of its parts padded into place, and its kernel tests every part at every
# element: a cat of more than 2 * CAT_GROUP parts into at least CAT_GROUP_NUMEL elements
# first stores groups of CAT_GROUP (an LSTM's 30 per-step gate gradients: one 1.8 ms
# kernel before, about 0.2 ms of group kernels and their cat after).
CAT_GROUP = 8
CAT_GROUP_NUMEL = 1 << 16
# Realized parts that need no gradient, into at most this many elements, are
# concatenated right away (Runtime.concat_copy: on the host, or by device copies).
HOST_CAT_NUMEL = 1 << 16
# Windows of at most this many elements cut from a realized tensor that needs no gradient
# are copied right away (Runtime.window_copy: on the host, or by a device copy).
HOST_SLICE_NUMEL = 1 << 12


def cat(tensors: Sequence[Tensor], axis=None, dim=None) -> Tensor:
    """Concatenate along an existing axis (each input padded into place, then summed: one
    fused kernel, no copies; many parts into a large result go through stored groups,
    see CAT_GROUP). Small realized parts in host memory that need no gradient are
    concatenated at once on the host instead (HOST_CAT_NUMEL), and a small cat of two
    parts, one realized, is realized at once elsewhere, so a loop that appends to a
    tensor keeps a realized tensor, not a graph one cat deeper every iteration."""
    axis = _dim0(axis, dim)
    tensors = list(tensors)
    if not tensors:
        raise ShapeError("cat needs at least one tensor")
    ref = tensors[0]
    if ref.ndim == 0:
        raise ShapeError("zero-dimensional tensors cannot be concatenated")
    a = canonical_axis(axis, ref.ndim)
    d = tensors[0].dtype
    for t in tensors[1:]:
        d = dt.promote(d, t.dtype)
        if t.ndim != ref.ndim or any(x != y for i, (x, y) in enumerate(zip(t.shape, ref.shape)) if i != a):
            raise ShapeError(f"cat: shapes {ref.shape} and {t.shape} differ outside axis {a}")
    total = builtins.sum(t.shape[a] for t in tensors)
    numel = _prod([s for i, s in enumerate(ref.shape) if i != a]) * total
    appends = numel <= HOST_CAT_NUMEL and not _records(tensors) \
        and builtins.any(_graph.get(t._id).op == G.LEAF for t in tensors)
    if appends and (builtins.all(_graph.get(t._id).op == G.LEAF for t in tensors) or (
            len(tensors) == 2 and builtins.any(RT.copies_leaf(t._id) for t in tensors))):
        # realized parts are concatenated at once (on the host, or by device copies); an
        # append to one (a sampling step's next token, still lazy) computes its lazy part
        # on its own first (the same graph every step), so no realization has a size
        # that grows
        lazy = [t._id for t in tensors if _graph.get(t._id).op != G.LEAF]
        if lazy:
            RT.realize(lazy)
        nid = RT.concat_copy([t._id for t in tensors], a)
        if nid is not None:
            return _wrap(nid)
    if len(tensors) > 2 * CAT_GROUP and numel >= CAT_GROUP_NUMEL:
        return cat([_stored_copy(cat(tensors[i:i + CAT_GROUP], a))
                    for i in range(0, len(tensors), CAT_GROUP)], a)
    out = None
    off = 0
    for t in tensors:
        n = t.shape[a]
        pads = [(0, 0)] * ref.ndim
        pads[a] = (off, total - off - n)
        off += n
        # float parts pad with -0.0, the identity of +: x + -0.0 is x for every x (with
        # 0.0, a -0.0 element would come out as 0.0)
        p = t.cast(d)._pad(pads, -0.0 if d.is_float else 0)
        if out is None:
            out = p
        elif d.is_bool:
            out = out | p
        else:
            out = out + p
    if appends and len(tensors) == 2:
        # A small append to a realized tensor (a sampling loop's `idx = cat([idx, nxt],
        # 1)` on a GPU, or with nxt still lazy) is computed now, with its lazy part: idx
        # is then a realized tensor at every step, and each step's graph the same ops on
        # a longer idx (bounds.py: a plan per power of two of the length). Left lazy, the
        # next step's graph would hold every earlier step, one cat deeper each time.
        RT.realize([out._id] + [t._id for t in tensors if _graph.get(t._id).op != G.LEAF])
    return out


concatenate = cat


def _records(tensors):
    """Whether an op on `tensors` is recorded for autograd (grad mode on, and an input
    requires grad or a Tape is open)."""
    return _TB.is_recording() and (_TB.tape_entered(0) > 0
                                   or builtins.any(t.requires_grad for t in tensors))


def _stored_copy(t):
    """t in a buffer of its own: a sum over a new size-1 axis is a reduce, which the
    kernelizer stores (0 + x keeps every value but the sign of -0.0, which a cat loses
    anyway; its gradient is the gradient; a bool takes the max)."""
    return t.unsqueeze(0)._reduce(K.R_MAX if t.dtype.is_bool else K.R_SUM, 0, False)


def stack(tensors: Sequence[Tensor], axis=None, dim=None) -> Tensor:
    axis = _dim0(axis, dim)
    tensors = list(tensors)
    if not tensors:
        raise ShapeError("stack needs at least one tensor")
    shape = tensors[0].shape
    for t in tensors:
        if t.shape != shape:
            raise ShapeError(f"stack: all tensors need the same shape, got {shape} and {t.shape}")
    a = canonical_axis(axis, len(shape) + 1)
    return cat([t.unsqueeze(a) for t in tensors], a)


def split(t: Tensor, split_size_or_sections, axis=None, dim=None):
    axis = canonical_axis(_dim0(axis, dim), t.ndim)
    n = t.shape[axis]
    if isinstance(split_size_or_sections, (int, np.integer)):
        s = builtins.int(split_size_or_sections)
        if s <= 0:
            raise ValueError("split size must be positive")
        sizes = [s] * (n // s) + ([n % s] if n % s else [])
    else:
        sizes = list(split_size_or_sections)
        if builtins.sum(sizes) != n:
            raise ShapeError(f"split sizes {sizes} do not add up to {n}")
    out, off = [], 0
    for s in sizes:
        out.append(shrink_axis(t, axis, off, off + s))
        off += s
    return tuple(out)


def chunk(t: Tensor, chunks: int, axis=None, dim=None):
    if not isinstance(chunks, (int, np.integer)) or chunks <= 0:
        raise ShapeError(f"chunk expects chunks to be an int greater than 0, got {chunks!r}")
    axis = canonical_axis(_dim0(axis, dim), t.ndim)
    n = t.shape[axis]
    size = -(-n // chunks) if chunks > 0 else 0
    if size == 0:
        return (t,)
    return split(t, size, axis)


def unbind(t: Tensor, dim=0):
    """torch.unbind: the slices of t along `dim`, each without that dim (views, as t[i])."""
    axis = canonical_axis(dim, t.ndim)
    lead = (slice(None),) * axis
    return tuple(t[lead + (i,)] for i in range(t.shape[axis]))


def _tri(t, diagonal, upper):
    if t.ndim < 2:
        raise ShapeError("tril/triu need at least 2 dimensions")
    r, c = t.shape[-2], t.shape[-1]
    rows = iota(r, dt.int64).reshape(r, 1)
    cols = iota(c, dt.int64).reshape(1, c)
    keep = (cols - rows >= diagonal) if upper else (cols - rows <= diagonal)
    return where(keep, t, const_tensor(0, t.dtype, ()))


def tril(t: Tensor, diagonal=0) -> Tensor:
    return _tri(t, diagonal, False)


def triu(t: Tensor, diagonal=0) -> Tensor:
    return _tri(t, diagonal, True)


# ---------------------------------------------------------------------------------------
# value checks: index ranges and integer divisors, verified by the realization that reads
# them (Runtime._collect_checked / _execute_checked); zyx.set_checks(False) turns them off
def _int_range(d):
    """(lowest, highest) value of integer dtype d."""
    bits = d.itemsize * 8
    if d.kind == "u":
        return 0, (1 << bits) - 1
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def _check_flag(check):
    """A (1,) bool tensor, true when some value of the operand (node `check.opid`) is bad (see
    valuecheck.Check). Built from primitives directly: one compare per finite bound."""
    _graph.retain(check.opid)
    index, lo, hi, exempt = _wrap(check.opid), check.lo, check.hi, check.exempt
    d = index.dtype
    dmin, dmax = _int_range(d)
    n = _prod(index.shape)
    flat = index if index.shape == (n,) else _make(G.RESHAPE, (n,), (index,), (n,), d)

    def cmp(bop, value):
        c = _wrap(_graph.add(G.CONST, value, (), (n,), d))
        return _make(G.BINARY, bop, (flat, c), (n,), dt.bool_)

    def both(bop, a, b):
        return a if b is None else b if a is None else _make(G.BINARY, bop, (a, b), (n,), dt.bool_)

    if check.inside:     # the one such check: a zero divisor, [0, 1)
        bad = cmp(K.B_EQ, lo)
    else:
        bad = both(K.B_OR, cmp(K.B_CMPLT, lo) if lo > dmin else None,
                   cmp(K.B_CMPGT, hi - 1) if hi - 1 < dmax else None)
        if exempt is not None and dmin <= exempt <= dmax:
            bad = _make(G.BINARY, K.B_AND, (bad, cmp(K.B_NOTEQ, exempt)), (n,), dt.bool_)
    return _make(G.REDUCE, (K.R_MAX, (0,)), (bad,), (1,), dt.bool_)


RT.checks.make_flag = _check_flag


def watch_range(watched, index, lo, hi, message, info=(), exempt=None,
                error=IndexOutOfRangeError):
    """Check, when `watched` (the first node computed from `index`) is realized, that every
    value of `index` is in [lo, hi) or equal to `exempt`; else raise
    error(message.format(bad_value, *info)). A constant index is checked now.
    Internal helper shared by zyx's op modules (not in __all__)."""
    if not RT.checks.on:
        return
    node = _graph.get(index._id)
    if node.op == G.CONST:
        v = node.arg
        if not (lo <= v < hi or v == exempt) and _prod(index.shape):
            raise error(message(v) if callable(message) else message.format(v, *info))
        return
    dmin, dmax = _int_range(index.dtype)
    if lo <= dmin and hi - 1 >= dmax or not _prod(index.shape):
        return      # the dtype cannot hold a bad value, or there is none
    RT.checks.add(_graph, watched._id, index._id, lo, hi, exempt, False, error, message, info)


# watch_range's message for an index out of range (shared by the indexing op modules)
INDEX_MESSAGE = "index {} is out of bounds for dimension {} with size {} (in {})"


def _checked_divisor(result, divisor, what):
    """`result` of an integer division by `divisor`; torch raises ZeroDivisionError (as a
    RuntimeError) where zyx's kernels would silently give 0. A constant divisor is checked
    now, a computed one when `result` is realized."""
    if not RT.checks.on or not divisor.dtype.is_int or _prod(divisor.shape) == 0:
        return result
    node = _graph.get(divisor._id)
    while node.op == G.EXPAND:       # a scalar divisor broadcast to the operand's shape
        node = _graph.get(node.srcs[0])
    if node.op == G.CONST:
        if node.arg == 0:
            raise IntegerDivisionByZeroError(f"integer division by zero (in {what})")
        return result
    RT.checks.add(_graph, result._id, divisor._id, 0, 1, None, True, IntegerDivisionByZeroError,
                  "integer division by zero (in {1}): the divisor tensor holds a {0}", (what,))
    return result


def _one_hot_along(idx: Tensor, n: int, axis_pos: int, ndim_out: int):
    """bool tensor: idx (already unsqueezed at axis_pos) == arange(n) along axis_pos."""
    shape = [1] * ndim_out
    shape[axis_pos] = n
    return idx == iota(n, idx.dtype if idx.dtype.is_int else dt.int64).reshape(shape)


def gather(t: Tensor, axis, index: Tensor) -> Tensor:
    """out[i][j][k] = t[i][index[i][j][k]][k] for axis=1 (torch.gather)."""
    axis = canonical_axis(axis, t.ndim)
    if not isinstance(index, Tensor):
        index = Tensor(index, dtype=dt.int64)
    if not index.dtype.is_int:
        raise DTypeError(f"gather index must be integer, got {index.dtype.name}")
    if index.ndim != t.ndim:
        raise ShapeError(f"gather: index has {index.ndim} dims, input {t.ndim}")
    n = t.shape[axis]
    idx = where(index < 0, index + n, index)
    # shrink t to index's extent on other axes, then one-hot select along a new last axis
    bounds = [(0, index.shape[i]) if i != axis else (0, n) for i in range(t.ndim)]
    src = t.shrink(bounds).unsqueeze(axis)        # (..., 1, n, ...) at axis
    sel = _one_hot_along(idx.unsqueeze(axis + 1), n, axis + 1, t.ndim + 1)
    # negative indices count from the end (numpy's take_along_axis; torch's gather raises)
    watch_range(sel, index, -n, n, INDEX_MESSAGE, (axis, n, "gather"))
    return pick_one(src, sel, axis + 1, t)


def pick_one(src, sel, axis, source):
    """The entry of `src` (a view of `source`) that the one-hot bool `sel` (broadcast with
    src) marks along `axis`, which is reduced away: the reduce behind gather and
    index_select. Exact for every value, -0.0 included (a sum from 0.0 would give 0.0 for
    it): when autograd does not record source, a max over -inf elsewhere; else a sum (its
    gradient is the gradient, where a max splits it over tied -inf and drops it at NaN)
    whose zero takes the sign back from a second reduce. Internal helper shared by zyx's
    op modules (not in __all__)."""
    d = src.dtype
    if d.is_bool:
        return (src & sel)._reduce(K.R_MAX, axis, False)
    if not d.is_float:
        return where(sel, src, const_tensor(0, d, ()))._reduce(K.R_SUM, axis, False)
    if not _records((source,)):
        return where(sel, src, const_tensor(float("-inf"), d, ()))._reduce(K.R_MAX, axis, False)
    picked = where(sel, src, const_tensor(0, d, ()))._reduce(K.R_SUM, axis, False)
    neg_zero = sel & (src == 0) & (src.reciprocal() < 0)
    neg_zero = neg_zero._reduce(K.R_MAX, axis, False)
    return where(neg_zero, -(0 - picked), picked)      # -(0 - x): -0.0 at x = 0.0, else x


def masked_fill(t: Tensor, mask, value) -> Tensor:
    return where(mask, value, t)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product with torch semantics: 1-D operands are vectors, leading dims broadcast."""
    if not isinstance(b, Tensor):
        b = Tensor(b)
    na, nb = _graph.get(a._id), _graph.get(b._id)
    if len(na.shape) == 2 and len(nb.shape) == 2 and na.dtype is nb.dtype \
            and na.shape[1] == nb.shape[0]:
        # the common case, as the general path below builds it
        bt = _make(G.PERMUTE, (1, 0), (b,), (nb.shape[1], nb.shape[0]), nb.dtype)
        return matmul_nt(a, bt)
    sa, sb = na.shape, nb.shape
    if len(sa) == len(sb) and len(sa) > 2 and na.dtype is nb.dtype and sa[:-2] == sb[:-2] \
            and sa[-1] == sb[-2]:
        return _batched_matmul(a, b, sa, sb, na.dtype)
    if a.ndim == 0 or b.ndim == 0:
        raise ShapeError("matmul does not accept 0-d tensors; use *")
    d = dt.promote(a.dtype, b.dtype)
    a, b = a.cast(d), b.cast(d)
    va, vb = a.ndim == 1, b.ndim == 1
    if va:
        a = a.reshape(1, a.shape[0])
    if vb:
        b = b.reshape(b.shape[0], 1)
    if a.shape[-1] != b.shape[-2]:
        raise ShapeError(f"matmul: shapes {a.shape if not va else a.shape[1:]} and "
                         f"{b.shape if not vb else b.shape[:1]} cannot be multiplied "
                         f"({a.shape[-1]} != {b.shape[-2]})")
    batch = broadcast_shape(a.shape[:-2], b.shape[:-2])
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    x = a.expand(batch + (m, k)).reshape(batch + (m, 1, k))
    y = b.expand(batch + (k, n)).transpose(-1, -2).reshape(batch + (1, n, k))
    prod = x.expand(batch + (m, n, k)) * y.expand(batch + (m, n, k))
    acc = prod._reduce(K.R_SUM, len(batch) + 2, False)
    if va:
        acc = acc.squeeze(-2)
    if vb:
        acc = acc.squeeze(-1)
    return acc


def _batched_matmul(a: Tensor, b: Tensor, sa: tuple, sb: tuple, d) -> Tensor:
    """a (..., m, k) @ b (..., k, n) of one dtype and equal batch dims (attention's q @ k.T
    and weights @ v): the nodes the general path of matmul makes, made directly, without
    its checks and method calls (a sampling loop builds four per layer every token)."""
    nd = len(sa)
    batch, (m, k), n = sa[:-2], sa[-2:], sb[-1]
    full = batch + (m, n, k)
    xe = _make(G.RESHAPE, batch + (m, 1, k), (a,), batch + (m, 1, k), d)
    if n != 1:
        xe = _make(G.EXPAND, full, (xe,), full, d)
    perm = tuple(range(nd - 2)) + (nd - 1, nd - 2)
    bt = _make(G.PERMUTE, perm, (b,), batch + (n, k), d)
    ye = _make(G.RESHAPE, batch + (1, n, k), (bt,), batch + (1, n, k), d)
    if m != 1:
        ye = _make(G.EXPAND, full, (ye,), full, d)
    prod = _make(G.BINARY, K.B_MUL, (xe, ye), full, d)
    acc = _make(G.REDUCE, (K.R_SUM, (nd,)), (prod,), batch + (m, n, 1), d)
    return _make(G.RESHAPE, batch + (m, n), (acc,), batch + (m, n), d)


def _expand_to(x: Tensor, node, shape: tuple) -> Tensor:
    """x (whose graph node is `node`) broadcast to `shape`, already known to be valid."""
    cur = node.shape
    if cur == shape:
        return x
    if len(cur) < len(shape):
        cur = (1,) * (len(shape) - len(cur)) + cur
        x = _make(G.RESHAPE, cur, (x,), cur, node.dtype)
        if cur == shape:
            return x
    return _make(G.EXPAND, shape, (x,), shape, node.dtype)


def matmul_nt(a: Tensor, bt: Tensor) -> Tensor:
    """a (m, k) times bt (n, k) transposed, same dtype: sum over k of the (m, n, k) product
    (a linear layer's x @ W.T without permuting W twice).
    Internal helper shared by zyx's op modules (not in __all__)."""
    (m, k), n = _graph.get(a._id).shape, _graph.get(bt._id).shape[0]
    d = _graph.get(a._id).dtype
    x = _make(G.EXPAND, (m, n, k), (_make(G.RESHAPE, (m, 1, k), (a,), (m, 1, k), d),),
              (m, n, k), d)
    y = _make(G.EXPAND, (m, n, k), (_make(G.RESHAPE, (1, n, k), (bt,), (1, n, k), d),),
              (m, n, k), d)
    prod = _make(G.BINARY, K.B_MUL, (x, y), (m, n, k), d)
    acc = _make(G.REDUCE, (K.R_SUM, (2,)), (prod,), (m, n, 1), d)
    return _make(G.RESHAPE, (m, n), (acc,), (m, n), d)


def linear_nt(x: Tensor, w: Tensor) -> Tensor:
    """x (..., k) times w (n, k) transposed, same float dtype, x of 3 or more dims: the
    (..., n, k) product of x and w, each broadcast over the other's axes in one expand,
    summed over k (nn.functional.linear's N-D case: w's gradient is then one reduce over
    every leading axis). The nodes Tensor.reshape / expand / mul / sum would make, made
    directly: a linear layer in a sampling loop is built every token, and the checks of
    the public methods were most of its ~40 us.
    Internal helper shared by zyx's op modules (not in __all__)."""
    nx, nw = _graph.get(x._id), _graph.get(w._id)
    lead, (n, k), d = nx.shape[:-1], nw.shape, nx.dtype
    full = lead + (n, k)
    xe = _make(G.RESHAPE, lead + (1, k), (x,), lead + (1, k), d)
    if n != 1:
        xe = _make(G.EXPAND, full, (xe,), full, d)
    ones = (1,) * len(lead)
    we = _make(G.RESHAPE, ones + (n, k), (w,), ones + (n, k), d)
    if lead != ones:
        we = _make(G.EXPAND, full, (we,), full, d)
    prod = _make(G.BINARY, K.B_MUL, (xe, we), full, d)
    acc = _make(G.REDUCE, (K.R_SUM, (len(lead) + 1,)), (prod,), lead + (n, 1), d)
    return _make(G.RESHAPE, lead + (n,), (acc,), lead + (n,), d)


def dot(a: Tensor, b: Tensor) -> Tensor:
    if a.ndim != 1 or b.ndim != 1:
        raise ShapeError(f"dot needs 1-D tensors, got {a.shape} and {b.shape}")
    return matmul(a, b)


# ---------------------------------------------------------------------------------------
# indexing
def _basic_getitem(self, idx):
    """x[idx] for the common case, ints and step-1 slices only (no None, Ellipsis, steps or
    tensors): one shrinking PAD over every axis and, when ints drop axes, one reshape, the
    same nodes the general path makes per axis, made at once (a slice in an LSTM step or a
    training loop is a few microseconds instead of ~10). None: take the general path
    (which also raises the errors)."""
    shape = _graph.get(self._id).shape
    if len(idx) > len(shape):
        return None
    pads = []
    out_shape = []
    cut = drop = False
    for d, n in enumerate(shape):
        if d >= len(idx):
            pads.append((0, 0))
            out_shape.append(n)
            continue
        i = idx[d]
        t = type(i)
        if t is builtins.int:
            if not -n <= i < n:
                return None
            j = i % n
            pads.append((-j, j + 1 - n))
            drop = True
            cut = cut or n != 1
        elif t is slice:
            if i.step is not None and i.step != 1:
                return None
            start, stop, _ = i.indices(n)
            length = builtins.max(0, stop - start)
            pads.append((-start, start + length - n))
            out_shape.append(length)
            cut = cut or length != n
        else:
            return None
    if cut and 0 < _prod(out_shape) <= HOST_SLICE_NUMEL and not _records((self,)) \
            and _one_block(pads, shape):
        # a small window of a realized tensor: copied now (on the host or the device), a
        # leaf (the context a sampling loop crops out of its growing tokens then has one
        # shape every step, and the step's plan is found as is). Only windows that are
        # one block of the row-major buffer, which torch's views are contiguous for: a
        # copy is contiguous, and is_contiguous must still answer as torch does.
        nid = RT.window_copy(self._id, pads, tuple(out_shape))
        if nid is not None:
            return _wrap(nid)
    x = self._pad(pads) if cut else self
    return x.reshape(tuple(out_shape)) if drop else x


def _one_block(pads, shape):
    """Whether the window that shrinking `pads` cut from a row-major `shape` is one
    contiguous block of it: every axis after the first one longer than 1 is whole."""
    longer = False
    for (before, after), n in zip(pads, shape):
        length = n + before + after
        if longer and length != n:
            return False
        if length != 1:
            longer = True
    return True


def _is_mask(i):
    """True for a boolean index tensor, array or (nested) list of bools."""
    if isinstance(i, Tensor):
        return i.dtype.is_bool
    if isinstance(i, np.ndarray):
        return i.dtype == np.bool_
    return isinstance(i, list) and np.asarray(i).dtype == np.bool_


def _mask_getitem(self, idx):
    """x[idx] where idx holds boolean masks (torch's data-dependent selection). A k-dim mask
    stands for the k dims it covers and must match their sizes; they become one dim holding
    the entries where the mask is true, in row-major order: the masked dims are merged and
    indexed by the flat positions of the true entries. Realizes the masks (their counts
    decide the shape). As masked_select: without grad, x is read and indexed on the host
    (a lazy one-hot selection costs size x count); with grad, the selection stays on the
    graph and gradients flow to x."""
    items = []
    for i in idx:
        if _is_mask(i):
            m = np.asarray(i.numpy() if isinstance(i, Tensor) else i, dtype=np.bool_)
            if m.ndim == 0:
                raise IndexError("0-d boolean mask indices are not supported; use "
                                 "unsqueeze or where")
            items.append(m)
        else:
            items.append(i)
    used = builtins.sum(i.ndim if isinstance(i, np.ndarray) and i.dtype == np.bool_ else 1
                        for i in items if i is not None and i is not Ellipsis)
    if builtins.sum(1 for i in items if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis")
    if used > self.ndim:
        raise IndexError(f"too many indices for tensor of dimension {self.ndim}")
    shape, merged, out_idx = self.shape, [], []
    dim = 0
    for i in expand_ellipsis(items, self.ndim, used):
        if isinstance(i, np.ndarray) and i.dtype == np.bool_:
            k = i.ndim
            for j in range(k):
                if i.shape[j] != shape[dim + j]:
                    raise IndexError(f"The shape of the mask {list(i.shape)} at index {j} does "
                                     f"not match the shape of the indexed tensor "
                                     f"{list(shape)} at index {dim + j}")
            merged.append(_prod(i.shape))
            out_idx.append(np.flatnonzero(i).astype(np.int64))
            dim += k
        else:
            if i is not None:
                merged.append(shape[dim])
                dim += 1
            out_idx.append(i)
    x = self.reshape(tuple(merged)) if tuple(merged) != shape else self
    if not _records((self,)):
        host = tuple(i.numpy() if isinstance(i, Tensor) else i for i in out_idx)
        vals = np.ascontiguousarray(np.asarray(x.numpy())[host])
        return Tensor(vals, dtype=self.dtype, device=self.device)
    out_idx = [Tensor(i, dtype=dt.int64, device=self.device) if isinstance(i, np.ndarray)
               else i for i in out_idx]
    return _getitem(x, tuple(out_idx))


def _getitem(self, idx):
    if not isinstance(idx, tuple):
        idx = (idx,)
    fast = _basic_getitem(self, idx)
    if fast is not None:
        return fast
    if builtins.any(_is_mask(i) for i in idx):
        return _mask_getitem(self, idx)
    # expand Ellipsis
    n_real = builtins.sum(1 for i in idx if i is not None and i is not Ellipsis)
    if builtins.sum(1 for i in idx if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis")
    if n_real > self.ndim:
        raise IndexError(f"too many indices for tensor of dimension {self.ndim}")
    full_idx = expand_ellipsis(idx, self.ndim, n_real)
    x = self
    bounds, flips, strides, out_shape_ops = [], [], [], []
    dim = 0
    tensor_idx = []    # (position in result dims, index tensor)
    result_dims = []   # per original dim: what happens
    squeeze_dims = []
    new_shape = []
    # first pass: slices and ints -> shrink/flip/stride; None -> unsqueeze; tensors later
    steps = []
    for i in full_idx:
        if i is None:
            steps.append(("new",))
            continue
        size = self.shape[dim]
        if isinstance(i, (builtins.bool, np.bool_)):
            raise IndexError("boolean scalar indices are not supported")
        if isinstance(i, (builtins.int, np.integer)):
            j = builtins.int(i)
            if not -size <= j < size:
                raise IndexError(f"index {j} is out of bounds for dimension {dim} with size {size}")
            j %= size
            steps.append(("int", dim, j))
        elif isinstance(i, slice):
            start, stop, step = i.indices(size)
            steps.append(("slice", dim, start, stop, step))
        elif isinstance(i, (Tensor, list, np.ndarray)):
            t = i if isinstance(i, Tensor) else Tensor(np.asarray(i))
            if t.dtype.is_bool:
                raise IndexError("boolean mask indexing has a data-dependent shape; use "
                                 "where/masked_fill instead")
            if not t.dtype.is_int:
                raise IndexError(f"tensor indices must be integers, got {t.dtype.name}")
            steps.append(("tensor", dim, t))
        else:
            raise IndexError(f"unsupported index {i!r}")
        dim += 1
    # apply slices/ints
    for s in steps:
        if s[0] == "slice":
            _, d, start, stop, step = s
            x = slice_axis(x, d, start, stop, step)
    # ints -> shrink to 1 (squeezed at the end); tensors applied one by one
    shape_after = list(x.shape)
    for s in steps:
        if s[0] == "int":
            _, d, j = s
            x = shrink_axis(x, d, j, j + 1)
    # tensor indices: advanced indexing (all index tensors broadcast together)
    tsteps = [s for s in steps if s[0] == "tensor"]
    if tsteps:
        x = _advanced_index(x, tsteps, steps)
        return x
    # assemble final shape: drop int dims, insert None dims
    out = []
    for s in steps:
        if s[0] == "new":
            out.append(1)
        elif s[0] == "slice":
            out.append(x.shape[s[1]])
    # trailing dims beyond steps are covered since full_idx included them as slices
    return x.reshape(tuple(out))


def slice_axis(x, d, start, stop, step):
    """x[start:stop:step] along axis d (start, stop, step as slice.indices gives them).
    Internal helper shared by zyx's op modules (not in __all__)."""
    if step > 0:
        length = builtins.max(0, (stop - start + step - 1) // step)
        if step == 1 or length <= 1:
            # at most one element: a plain shrink (the pad-reshape below would build a
            # length * step axis, 2**62 elements for x[::2**62])
            return shrink_axis(x, d, start, start + length)
        end = start + (length - 1) * step + 1 if length else start
        x = shrink_axis(x, d, start, end)
    else:
        length = builtins.max(0, (start - stop - step - 1) // (-step))
        if length == 0:
            return shrink_axis(x, d, 0, 0)
        if length == 1:
            return shrink_axis(x, d, start, start + 1)
        lo = start + (length - 1) * step
        x = shrink_axis(x, d, lo, start + 1).flip(d)
        step = -step
        if step == 1:
            return x
    # stride `step`: pad to a multiple, reshape (len, step), take column 0
    m = x.shape[d]
    total = length * step
    pads = [(0, 0)] * x.ndim
    pads[d] = (0, total - m)
    x = x._pad(pads)
    shape = x.shape
    x = x.reshape(shape[:d] + (length, step) + shape[d + 1:])
    b = [(0, s) for s in x.shape]
    b[d + 1] = (0, 1)
    x = x.shrink(b)
    return x.reshape(shape[:d] + (length,) + shape[d + 1:])


def _advanced_index(x, tsteps, steps):
    """Integer-tensor indexing (torch/numpy rules for the common cases): index tensors
    broadcast together; their dims replace the indexed dims (in place when the indexed
    dims are adjacent, else in front)."""
    idx_shape = broadcast_shape(*[t.shape for _, _, t in tsteps])
    tdims = [d for _, d, _ in tsteps]
    adjacent = tdims == list(range(tdims[0], tdims[0] + len(tdims)))
    # ints already narrowed to size 1: drop them from consideration later
    int_dims = {s[1] for s in steps if s[0] == "int"}
    nd = x.ndim
    k = len(idx_shape)
    # layout: x dims in order, with an index-shape block of k dims appended at the end
    # then one-hot select on each indexed dim and sum those dims away
    xe = x.reshape(x.shape + (1,) * k)
    sel_total = None
    for _, d, t in tsteps:
        n = x.shape[d]
        ti = where(t < 0, t + n, t).expand(idx_shape)
        shape = [1] * (nd + k)
        shape[d] = n
        ar = iota(n, ti.dtype).reshape(shape)
        hit = ti.reshape((1,) * nd + idx_shape) == ar
        watch_range(hit, t, -n, n, INDEX_MESSAGE, (d, n, "getitem"))
        sel_total = hit if sel_total is None else (sel_total & hit)
    if x.dtype.is_bool:
        r = (xe & sel_total)._reduce(K.R_MAX, tuple(tdims), False)
    else:
        zero = const_tensor(0, x.dtype, ())
        r = where(sel_total, xe, zero)._reduce(K.R_SUM, tuple(tdims), False)
    # r dims: non-indexed x dims (in order) + idx block
    rest = [d for d in range(nd) if d not in tdims]
    # build output order following torch: slices/None in order, idx block at first tensor
    # position when adjacent, else first
    out_dims = []
    pos_map = {d: i for i, d in enumerate(rest)}
    block = list(range(len(rest), len(rest) + k))
    placed = False
    if not adjacent:
        out_dims += block
        placed = True
    final_shape = []
    for s in steps:
        if s[0] == "tensor":
            if not placed:
                out_dims += block
                placed = True
        elif s[0] in ("slice", "int"):
            out_dims.append(pos_map[s[1]])
    r = r.permute(out_dims) if out_dims != list(range(len(out_dims))) else r
    # now drop int dims (size 1) and insert None dims
    shape = []
    it = iter(r.shape)
    placed = not adjacent
    if placed:
        shape += [next(it) for _ in range(k)]
    for s in steps:
        if s[0] == "new":
            shape.append(1)
        elif s[0] == "tensor":
            if not placed:
                shape += [next(it) for _ in range(k)]
                placed = True
        elif s[0] == "int":
            next(it)
        else:
            shape.append(next(it))
    return r.reshape(tuple(shape))


# max/min (values, indices with a dim; elementwise with a tensor) are zyx/sorting.py's
for _name, _fn in (("sum", _sum), ("prod", _prod_r), ("amax", _amax), ("amin", _amin),
                   ("mean", _mean), ("var", _var), ("std", _std),
                   ("argmax", _argmax), ("argmin", _argmin), ("any", _any), ("all", _all),
                   ("logsumexp", _logsumexp), ("softmax", _softmax), ("log_softmax", _log_softmax),
                   ("cumsum", _cumsum), ("flatten", _flatten), ("squeeze", _squeeze),
                   ("unsqueeze", _unsqueeze), ("transpose", _transpose), ("repeat", _repeat),
                   ("roll", _roll), ("pad", _pad_torch), ("__getitem__", _getitem),
                   ("matmul", matmul), ("__matmul__", matmul),
                   ("dot", dot), ("split", split), ("chunk", chunk), ("unbind", unbind),
                   ("tril", tril), ("triu", triu),
                   ("gather", gather)):
    setattr(Tensor, _name, _fn)
Tensor.T = property(_T)
Tensor.mT = property(lambda self: self.transpose(-2, -1))
Tensor.__rmatmul__ = lambda self, other: matmul(Tensor(other) if not isinstance(other, Tensor) else other, self)


def _module_fn(name):
    def f(x, *args, **kwargs):
        if not isinstance(x, Tensor):
            x = Tensor(x)
        return getattr(x, name)(*args, **kwargs)
    f.__name__ = name
    f.__doc__ = f"Module-level form of Tensor.{name}."
    return f


for _name in ("exp", "log", "sqrt", "sin", "cos", "tanh", "sigmoid", "relu", "abs", "clamp",
              "clip", "pow", "sum", "mean", "amax", "amin", "argmax", "argmin", "softmax",
              "log_softmax", "logsumexp", "cumsum", "flip", "roll", "reshape", "permute",
              "transpose", "broadcast_to", "squeeze", "unsqueeze", "flatten", "isnan", "isinf",
              "isfinite", "maximum", "minimum"):
    globals()[_name] = _module_fn(_name)


_TB.setup(_graph, Tensor, None)
