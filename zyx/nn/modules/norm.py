"""Normalization layers: LayerNorm, RMSNorm, GroupNorm, BatchNorm1d/2d/3d, InstanceNorm1d/2d."""
from __future__ import annotations

import numpy as np

from ... import dtype as dt
from ...errors import ShapeError
from ..._core.graph import LEAF
from ...runtime import RT
from .. import functional as F
from .. import init
from .module import Module, new_buffer, new_parameter

__all__ = ["LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
           "InstanceNorm1d", "InstanceNorm2d"]


def _shape(normalized_shape):
    if isinstance(normalized_shape, (int, np.integer)):
        return (int(normalized_shape),)
    return tuple(int(s) for s in normalized_shape)


def _affine(module, shape, affine, bias, dtype):
    """torch's affine parameters of a norm layer: weight ones and bias zeros of `shape`, or
    registered as None (so state_dict and named_parameters match torch)."""
    if affine:
        module.weight = new_parameter(*shape, dtype=dtype, fill=1.0)
    else:
        module.register_parameter("weight", None)
    if affine and bias:
        module.bias = new_parameter(*shape, dtype=dtype)
    else:
        module.register_parameter("bias", None)


class LayerNorm(Module):
    """Normalize over the trailing `normalized_shape` dims; weight ones, bias zeros."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        _affine(self, self.normalized_shape, elementwise_affine, bias, dtype)

    def reset_parameters(self):
        if self.weight is not None:
            init.ones_(self.weight)
        if self.bias is not None:
            init.zeros_(self.bias)

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, " \
               f"elementwise_affine={self.elementwise_affine}"


class RMSNorm(Module):
    """x / rms(x) * weight over the trailing dims (eps None: the dtype's epsilon)."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine: bool = True, device=None,
                 dtype=None):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        if elementwise_affine:
            self.weight = new_parameter(*self.normalized_shape, dtype=dtype, fill=1.0)
        else:
            self.register_parameter("weight", None)

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, " \
               f"elementwise_affine={self.elementwise_affine}"


class GroupNorm(Module):
    """Normalize groups of channels of (N, C, *); per-channel affine."""

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if num_channels % num_groups:
            raise ShapeError(f"num_channels {num_channels} must be divisible by num_groups "
                             f"{num_groups}")
        self.num_groups, self.num_channels = num_groups, num_channels
        self.eps, self.affine = eps, affine
        _affine(self, (num_channels,), affine, True, dtype)

    def forward(self, x):
        return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"


def _realize_pending(*tensors):
    """Realize buffers still holding last step's lazy update, so the chain of running-stat
    updates never grows past one step (a training loop rarely reads them)."""
    ids = [t._id for t in tensors if t is not None and RT.graph.get(t._id).op != LEAF]
    if ids:
        RT.realize(ids)


class _BatchNorm(Module):
    _dims = (2, 3)

    def __init__(self, num_features: int, eps: float = 1e-5, momentum=0.1, affine: bool = True,
                 track_running_stats: bool = True, device=None, dtype=None):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        _affine(self, (num_features,), affine, True, dtype)
        if track_running_stats:
            d = dtype or dt.float32
            self.register_buffer("running_mean", new_buffer(np.zeros(num_features), d))
            self.register_buffer("running_var", new_buffer(np.ones(num_features), d))
            self.register_buffer("num_batches_tracked",
                                 new_buffer(np.zeros((), np.int64), dt.int64))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)

    def reset_running_stats(self):
        if self.track_running_stats:
            init.zeros_(self.running_mean)
            init.ones_(self.running_var)
            init.zeros_(self.num_batches_tracked)

    def forward(self, x):
        if x.ndim not in self._dims:
            raise ShapeError(f"{type(self).__name__} expects a "
                             f"{' or '.join(f'{d}-D' for d in self._dims)} input, got {x.shape}")
        if x.shape[1] != self.num_features:
            raise ShapeError(f"{type(self).__name__}({self.num_features}) got an input with "
                             f"{x.shape[1]} channels (shape {x.shape})")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            _realize_pending(self.running_mean, self.running_var, self.num_batches_tracked)
            init.copy_into(self.num_batches_tracked, self.num_batches_tracked + 1)
            if self.momentum is None:   # cumulative moving average
                factor = 1.0 / self.num_batches_tracked.cast(dt.float32)
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        return F.batch_norm(x, self.running_mean if track else None,
                            self.running_var if track else None, self.weight, self.bias,
                            use_batch, factor, self.eps)

    def extra_repr(self):
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, " \
               f"affine={self.affine}, track_running_stats={self.track_running_stats}"


class BatchNorm1d(_BatchNorm):
    """Batch norm over (N, C) or (N, C, L)."""
    _dims = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Batch norm over (N, C, H, W): per-channel statistics over N, H, W."""
    _dims = (4,)


class BatchNorm3d(_BatchNorm):
    _dims = (5,)


class _InstanceNorm(Module):
    _nd = 2

    def __init__(self, num_features: int, eps: float = 1e-5, momentum=0.1, affine: bool = False,
                 track_running_stats: bool = False, device=None, dtype=None):
        super().__init__()
        if track_running_stats:
            raise NotImplementedError("InstanceNorm with track_running_stats=True")
        self.num_features, self.eps = num_features, eps
        self.momentum, self.affine = momentum, affine
        self.track_running_stats = False
        _affine(self, (num_features,), affine, True, dtype)

    def forward(self, x):
        unbatched = x.ndim == self._nd + 1
        if unbatched:
            x = x.unsqueeze(0)
        y = F.instance_norm(x, weight=self.weight, bias=self.bias, eps=self.eps)
        return y.squeeze(0) if unbatched else y

    def extra_repr(self):
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, " \
               f"affine={self.affine}, track_running_stats=False"


class InstanceNorm1d(_InstanceNorm):
    _nd = 1


class InstanceNorm2d(_InstanceNorm):
    _nd = 2
