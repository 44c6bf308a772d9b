"""zyx.nn.init: PyTorch's weight initializers.

Each `*_` function fills a tensor "in place" and returns it. zyx tensors are immutable
values, so in place means the tensor object is pointed at a new value (its graph node is
swapped); every holder of the object (a module, an optimizer) sees the new value, as with
torch. Random numbers come from zyx's device generator (zyx/random.py, seeded by
`zyx.manual_seed`) and are realized at once, as torch fills at once (a lazy initializer
would be recomputed by every graph that reads the weight until something realizes it);
orthogonal_ alone draws on the host (numpy's Generator in `RT.rng`) for its QR.
"""
from __future__ import annotations

import math

import numpy as np

from .. import dtype as dt
from ..errors import ShapeError
from .. import random as _random
from ..runtime import RT
from ..tensor import Tensor, rebind, where

__all__ = ["calculate_gain", "uniform_", "normal_", "constant_", "zeros_", "ones_", "eye_",
           "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
           "xavier_normal_", "orthogonal_"]



def copy_into(dst: Tensor, src) -> Tensor:
    """Point tensor `dst` at the value of `src` (same shape; cast to dst's dtype).

    The tensor object keeps its identity (and requires_grad/grad), only its graph node
    changes: the zyx form of torch's `dst.copy_(src)`.
    Internal helper shared by zyx.nn's modules (not in __all__)."""
    if not isinstance(src, Tensor):
        src = Tensor(np.asarray(src), dtype=dst.dtype)
    if src.shape != dst.shape:
        raise ShapeError(f"cannot assign a value of shape {src.shape} to a tensor of shape "
                         f"{dst.shape}")
    rebind(dst, src.cast(dst.dtype))
    return dst


def fill_from_array(t: Tensor, values: np.ndarray) -> Tensor:
    """copy_into(t, numpy `values` in t's dtype).
    Internal helper shared by zyx.nn's modules (not in __all__)."""
    d = t.dtype
    arr = values.astype(np.float32 if d is dt.bfloat16 else d.np)
    return copy_into(t, Tensor(arr, dtype=d))


def calculate_gain(nonlinearity, param=None):
    """The recommended gain for an activation (torch.nn.init.calculate_gain)."""
    linear = ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
              "conv_transpose3d", "sigmoid")
    if nonlinearity in linear:
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else float(param)
        return math.sqrt(2.0 / (1 + slope ** 2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ValueError(f"unsupported nonlinearity {nonlinearity!r}")


def fan_in_and_fan_out(t: Tensor):
    """(fan_in, fan_out) of a weight of shape (out, in, *kernel).
    Internal helper shared by zyx.nn's modules (not in __all__)."""
    if t.ndim < 2:
        raise ShapeError(f"fan in and fan out need a tensor of at least 2 dimensions, "
                         f"got {t.shape}")
    receptive = 1
    for s in t.shape[2:]:
        receptive *= s
    return t.shape[1] * receptive, t.shape[0] * receptive


# torch's spelling (private there too), for code ported from torch
_calculate_fan_in_and_fan_out = fan_in_and_fan_out


def _fan(t, mode):
    fan_in, fan_out = fan_in_and_fan_out(t)
    if mode == "fan_in":
        return fan_in
    if mode == "fan_out":
        return fan_out
    raise ValueError(f"mode must be 'fan_in' or 'fan_out', got {mode!r}")


def _fill(tensor: Tensor, value: Tensor) -> Tensor:
    """Point `tensor` at `value` (cast to its dtype) and realize it on tensor's device."""
    copy_into(tensor, value)
    tensor.realize()
    return tensor


def _float_dtype(tensor):
    return dt.float64 if tensor.dtype is dt.float64 else dt.float32


def uniform_(tensor: Tensor, a=0.0, b=1.0, generator=None) -> Tensor:
    """Fill with U(a, b), computed on tensor's device."""
    u = _random.uniform(tensor.shape, _float_dtype(tensor), tensor.device)
    return _fill(tensor, u * (float(b) - float(a)) + float(a))


def normal_(tensor: Tensor, mean=0.0, std=1.0, generator=None) -> Tensor:
    """Fill with N(mean, std^2), computed on tensor's device."""
    z = _random.normal(tensor.shape, _float_dtype(tensor), tensor.device)
    return _fill(tensor, z * float(std) + float(mean))


# redraws of trunc_normal_: a value is kept from the first of them inside [a, b]; the
# chance that all miss is (1 - P[a, b])^8 (6e-12 for the default +-2 std, which are
# 95% likely), and the rare value left over is clamped into [a, b]
_TRUNC_DRAWS = 8


def trunc_normal_(tensor: Tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None) -> Tensor:
    """Normal values redrawn until they fall in [a, b] (bounds in the values' units, as
    torch): up to 8 draws per element on the device, the first one inside wins; when all
    miss (below 1e-11 for +-2 std) the value is clamped."""
    a, b, mean, std = float(a), float(b), float(mean), float(std)
    if not a <= b:
        raise ValueError(f"trunc_normal_ needs a <= b, got a={a}, b={b}")
    d = _float_dtype(tensor)
    draws = [_random.normal(tensor.shape, d, tensor.device) * std + mean
             for _ in range(_TRUNC_DRAWS)]
    out = draws[-1].clamp(a, b)
    for v in reversed(draws[:-1]):
        out = where((v >= a) & (v <= b), v, out)
    return _fill(tensor, out)


def constant_(tensor: Tensor, val) -> Tensor:
    return fill_from_array(tensor, np.full(tensor.shape, val, dtype=np.float64))


def zeros_(tensor: Tensor) -> Tensor:
    return constant_(tensor, 0.0)


def ones_(tensor: Tensor) -> Tensor:
    return constant_(tensor, 1.0)


def eye_(tensor: Tensor) -> Tensor:
    if tensor.ndim != 2:
        raise ShapeError(f"eye_ needs a 2-D tensor, got {tensor.shape}")
    return fill_from_array(tensor, np.eye(*tensor.shape))


def kaiming_uniform_(tensor: Tensor, a=0.0, mode="fan_in", nonlinearity="leaky_relu",
                     generator=None) -> Tensor:
    """U(-bound, bound), bound = gain * sqrt(3 / fan) (He et al.)."""
    if 0 in tensor.shape:  # nothing to fill, and a zero fan would divide by zero
        return tensor
    std = calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor, mode))
    bound = math.sqrt(3.0) * std
    return uniform_(tensor, -bound, bound)


def kaiming_normal_(tensor: Tensor, a=0.0, mode="fan_in", nonlinearity="leaky_relu",
                    generator=None) -> Tensor:
    if 0 in tensor.shape:  # nothing to fill, and a zero fan would divide by zero
        return tensor
    std = calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor, mode))
    return normal_(tensor, 0.0, std)


def xavier_uniform_(tensor: Tensor, gain=1.0, generator=None) -> Tensor:
    """U(-a, a), a = gain * sqrt(6 / (fan_in + fan_out)) (Glorot & Bengio)."""
    if 0 in tensor.shape:  # nothing to fill, and a zero fan would divide by zero
        return tensor
    fan_in, fan_out = fan_in_and_fan_out(tensor)
    a = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(tensor, -a, a)


def xavier_normal_(tensor: Tensor, gain=1.0, generator=None) -> Tensor:
    if 0 in tensor.shape:  # nothing to fill, and a zero fan would divide by zero
        return tensor
    fan_in, fan_out = fan_in_and_fan_out(tensor)
    return normal_(tensor, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)))


def orthogonal_(tensor: Tensor, gain=1.0, generator=None) -> Tensor:
    """A (semi-)orthogonal matrix from the QR decomposition of a normal matrix."""
    if tensor.ndim < 2:
        raise ShapeError(f"orthogonal_ needs at least 2 dimensions, got {tensor.shape}")
    rows = tensor.shape[0]
    cols = tensor.numel() // rows
    m = RT.rng.normal(size=(rows, cols))
    if rows < cols:
        m = m.T
    q, r = np.linalg.qr(m)
    q = q * np.sign(np.diag(r))
    if rows < cols:
        q = q.T
    return fill_from_array(tensor, gain * q.reshape(tensor.shape))
