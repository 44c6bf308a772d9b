"""Activation layers: thin Modules around zyx.nn.functional."""
from __future__ import annotations

from .. import functional as F
from .. import init
from .module import Module, new_parameter

__all__ = ["ReLU", "ReLU6", "GELU", "SiLU", "Tanh", "Sigmoid", "LeakyReLU", "ELU", "SELU", "CELU",
           "Mish", "Hardtanh", "Hardsigmoid", "Hardswish", "Softsign", "Softplus", "LogSigmoid",
           "Softmax", "LogSoftmax", "Softmin", "GLU", "PReLU", "Threshold", "Tanhshrink",
           "Softshrink", "Hardshrink"]


def _simple(name, fn, doc):
    """A parameterless activation Module calling `fn(x)`."""
    def forward(self, x):
        return fn(x)
    return type(name, (Module,), {"forward": forward, "__doc__": doc,
                                  "__init__": lambda self, inplace=False: Module.__init__(self)})


ReLU = _simple("ReLU", F.relu, "max(x, 0)")
ReLU6 = _simple("ReLU6", F.relu6, "min(max(x, 0), 6)")
SiLU = _simple("SiLU", F.silu, "x * sigmoid(x)")
Tanh = _simple("Tanh", F.tanh, "tanh(x)")
Sigmoid = _simple("Sigmoid", F.sigmoid, "1 / (1 + exp(-x))")
SELU = _simple("SELU", F.selu, "scale * elu(x, alpha) with the self-normalizing constants")
Mish = _simple("Mish", F.mish, "x * tanh(softplus(x))")
Hardsigmoid = _simple("Hardsigmoid", F.hardsigmoid, "clamp(x / 6 + 1/2, 0, 1)")
Hardswish = _simple("Hardswish", F.hardswish, "x * hardsigmoid(x)")
Softsign = _simple("Softsign", F.softsign, "x / (1 + |x|)")
LogSigmoid = _simple("LogSigmoid", F.logsigmoid, "log(sigmoid(x)), computed stably")
Tanhshrink = _simple("Tanhshrink", F.tanhshrink, "x - tanh(x)")
for _cls in (ReLU, ReLU6, SiLU, Tanh, Sigmoid, SELU, Mish, Hardsigmoid, Hardswish, Softsign,
             LogSigmoid, Tanhshrink):
    _cls.__module__ = __name__


class GELU(Module):
    """x * Phi(x); approximate='tanh' uses the tanh formula."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x):
        return F.gelu(x, self.approximate)

    def extra_repr(self):
        return f"approximate={self.approximate!r}"


class LeakyReLU(Module):
    def __init__(self, negative_slope: float = 0.01, inplace: bool = False):
        super().__init__()
        self.negative_slope = negative_slope

    def forward(self, x):
        return F.leaky_relu(x, self.negative_slope)

    def extra_repr(self):
        return f"negative_slope={self.negative_slope}"


class ELU(Module):
    def __init__(self, alpha: float = 1.0, inplace: bool = False):
        super().__init__()
        self.alpha = alpha

    def forward(self, x):
        return F.elu(x, self.alpha)

    def extra_repr(self):
        return f"alpha={self.alpha}"


class CELU(ELU):
    def forward(self, x):
        return F.celu(x, self.alpha)


class Hardtanh(Module):
    def __init__(self, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False):
        super().__init__()
        self.min_val, self.max_val = min_val, max_val

    def forward(self, x):
        return F.hardtanh(x, self.min_val, self.max_val)

    def extra_repr(self):
        return f"min_val={self.min_val}, max_val={self.max_val}"


class Softplus(Module):
    def __init__(self, beta: float = 1.0, threshold: float = 20.0):
        super().__init__()
        self.beta, self.threshold = beta, threshold

    def forward(self, x):
        return F.softplus(x, self.beta, self.threshold)

    def extra_repr(self):
        return f"beta={self.beta}, threshold={self.threshold}"


class Threshold(Module):
    def __init__(self, threshold: float, value: float, inplace: bool = False):
        super().__init__()
        self.threshold, self.value = threshold, value

    def forward(self, x):
        return F.threshold(x, self.threshold, self.value)

    def extra_repr(self):
        return f"threshold={self.threshold}, value={self.value}"


class Softshrink(Module):
    def __init__(self, lambd: float = 0.5):
        super().__init__()
        self.lambd = lambd

    def forward(self, x):
        return F.softshrink(x, self.lambd)

    def extra_repr(self):
        return str(self.lambd)


class Hardshrink(Softshrink):
    def forward(self, x):
        return F.hardshrink(x, self.lambd)


class Softmax(Module):
    """softmax along `dim`."""
    _fn = staticmethod(F.softmax)

    def __init__(self, dim=None):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return type(self)._fn(x, self.dim)

    def extra_repr(self):
        return f"dim={self.dim}"


class LogSoftmax(Softmax):
    _fn = staticmethod(F.log_softmax)


class Softmin(Softmax):
    _fn = staticmethod(F.softmin)


class GLU(Module):
    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return F.glu(x, self.dim)

    def extra_repr(self):
        return f"dim={self.dim}"


class PReLU(Module):
    """max(0, x) + a * min(0, x) with a learned slope (one, or one per channel)."""

    def __init__(self, num_parameters: int = 1, init: float = 0.25, device=None, dtype=None):
        super().__init__()
        self.num_parameters = num_parameters
        self.weight = new_parameter(num_parameters, dtype=dtype, fill=init)

    def forward(self, x):
        return F.prelu(x, self.weight)

    def extra_repr(self):
        return f"num_parameters={self.num_parameters}"


del init
