"""Convolution layers: Conv1d/2d/3d and ConvTranspose1d/2d/3d (torch's parameters, init and
state_dict keys)."""
from __future__ import annotations

import math

from ...errors import ShapeError
from .. import functional as F
from .. import init
from .module import Module, new_parameter

__all__ = ["Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"]


class _ConvNd(Module):
    _nd = 2
    _transposed = False

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True, padding_mode="zeros", output_padding=0, device=None,
                 dtype=None):
        super().__init__()
        nd = self._nd
        if groups <= 0 or in_channels % groups or out_channels % groups:
            raise ShapeError(f"{type(self).__name__}: in_channels {in_channels} and out_channels "
                             f"{out_channels} must be divisible by groups {groups}")
        if padding_mode not in ("zeros", "reflect", "replicate", "circular"):
            raise ValueError(f"padding_mode must be zeros, reflect, replicate or circular, "
                             f"got {padding_mode!r}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size = F.int_tuple(kernel_size, nd, "kernel_size")
        self.stride = F.int_tuple(stride, nd, "stride")
        self.padding = padding if isinstance(padding, str) else \
            F.int_tuple(padding, nd, "padding")
        self.dilation = F.int_tuple(dilation, nd, "dilation")
        self.output_padding = F.int_tuple(output_padding, nd, "output_padding")
        self.groups = groups
        self.padding_mode = padding_mode
        if self._transposed:
            shape = (in_channels, out_channels // groups) + self.kernel_size
        else:
            shape = (out_channels, in_channels // groups) + self.kernel_size
        self.weight = new_parameter(*shape, dtype=dtype)
        if bias:
            self.bias = new_parameter(out_channels, dtype=dtype)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # torch: kaiming_uniform_(a=sqrt(5)) gives U(+-1/sqrt(fan_in)); fan_in is computed
        # from weight.shape[1], which for transposed convs is out_channels/groups
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = init.fan_in_and_fan_out(self.weight)
            if fan_in:
                bound = 1 / math.sqrt(fan_in)
                init.uniform_(self.bias, -bound, bound)

    def extra_repr(self):
        nd = self._nd
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, " \
            f"stride={self.stride}"
        if self.padding != (0,) * nd:
            s += f", padding={self.padding!r}" if isinstance(self.padding, str) else \
                f", padding={self.padding}"
        if self.dilation != (1,) * nd:
            s += f", dilation={self.dilation}"
        if self._transposed and self.output_padding != (0,) * nd:
            s += f", output_padding={self.output_padding}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        if self.padding_mode != "zeros":
            s += f", padding_mode={self.padding_mode}"
        return s


class _Conv(_ConvNd):
    def forward(self, x):
        fn = (F.conv1d, F.conv2d, F.conv3d)[self._nd - 1]
        if self.padding_mode == "zeros":
            return fn(x, self.weight, self.bias, self.stride, self.padding, self.dilation,
                      self.groups)
        pads = F.conv_padding(self.padding, self.kernel_size, self.dilation, self.stride,
                              self._nd, type(self).__name__)
        flat = []
        for before, after in reversed(pads):
            flat += [before, after]
        x = F.pad(x, flat, mode=self.padding_mode)
        return fn(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class Conv1d(_Conv):
    """1-D convolution over (N, C, L); weight (out, in/groups, k)."""
    _nd = 1

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True, padding_mode="zeros", device=None, dtype=None):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias, padding_mode, dtype=dtype)


class Conv2d(_Conv):
    """2-D convolution over (N, C, H, W); weight (out, in/groups, kH, kW)."""
    _nd = 2

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True, padding_mode="zeros", device=None, dtype=None):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias, padding_mode, dtype=dtype)


class Conv3d(_Conv):
    """3-D convolution over (N, C, D, H, W)."""
    _nd = 3

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True, padding_mode="zeros", device=None, dtype=None):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias, padding_mode, dtype=dtype)


class _ConvTranspose(_ConvNd):
    _transposed = True

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0,
                 output_padding=0, groups=1, bias=True, dilation=1, padding_mode="zeros",
                 device=None, dtype=None):
        if padding_mode != "zeros":
            raise ValueError(f"only 'zeros' padding_mode is supported for {type(self).__name__}")
        if isinstance(padding, str):
            raise ValueError(f"{type(self).__name__} does not accept string padding")
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias, padding_mode, output_padding, dtype=dtype)

    def _output_padding(self, x, output_size):
        if output_size is None:
            return self.output_padding
        nd = self._nd
        size = tuple(output_size)[-nd:]
        ins = x.shape[-nd:]
        out = []
        for i, want, s, p, d, k in zip(ins, size, self.stride, self.padding, self.dilation,
                                       self.kernel_size):
            base = (i - 1) * s - 2 * p + d * (k - 1) + 1
            if not base <= want < base + max(s, d):
                raise ShapeError(f"requested output size {tuple(output_size)} is not reachable "
                                 f"from input {x.shape} (each dim must be in [{base}, "
                                 f"{base + max(s, d) - 1}])")
            out.append(want - base)
        return tuple(out)

    def forward(self, x, output_size=None):
        fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[self._nd - 1]
        return fn(x, self.weight, self.bias, self.stride, self.padding,
                  self._output_padding(x, output_size), self.groups, self.dilation)


class ConvTranspose1d(_ConvTranspose):
    _nd = 1


class ConvTranspose2d(_ConvTranspose):
    """Transposed 2-D convolution; weight (in, out/groups, kH, kW) as in torch."""
    _nd = 2


class ConvTranspose3d(_ConvTranspose):
    _nd = 3
