"""Recurrent cells: RNNCell, GRUCell, LSTMCell (torch's gate order, parameters and init)."""
from __future__ import annotations

import math

from ...errors import ShapeError
from ...tensor import zeros
from .. import functional as F
from .. import init
from .module import Module, _param

__all__ = ["RNNCell", "GRUCell", "LSTMCell"]


class _CellBase(Module):
    _gates = 1

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, device=None,
                 dtype=None):
        super().__init__()
        self.input_size, self.hidden_size, self.bias = input_size, hidden_size, bias
        g = self._gates * hidden_size
        self.weight_ih = _param(g, input_size, dtype=dtype)
        self.weight_hh = _param(g, hidden_size, dtype=dtype)
        if bias:
            self.bias_ih = _param(g, dtype=dtype)
            self.bias_hh = _param(g, dtype=dtype)
        else:
            self.register_parameter("bias_ih", None)
            self.register_parameter("bias_hh", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        stdv = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0
        for p in self.parameters():
            init.uniform_(p, -stdv, stdv)

    def _prepare(self, x, hx):
        """(batched input, batched hidden state or None, whether the input was unbatched)."""
        if x.ndim not in (1, 2) or x.shape[-1] != self.input_size:
            raise ShapeError(f"{type(self).__name__}: expected input (N, {self.input_size}) or "
                             f"({self.input_size},), got {x.shape}")
        unbatched = x.ndim == 1
        if unbatched:
            x = x.unsqueeze(0)
        return x, unbatched

    def _hidden(self, h, n, unbatched, x):
        if h is None:
            return zeros(n, self.hidden_size, dtype=x.dtype)
        if unbatched:
            h = h.unsqueeze(0)
        if h.shape != (n, self.hidden_size):
            raise ShapeError(f"{type(self).__name__}: hidden state must have shape "
                             f"{(n, self.hidden_size)}, got {h.shape}")
        return h

    def _proj(self, x, h):
        return F.linear(x, self.weight_ih, self.bias_ih), F.linear(h, self.weight_hh, self.bias_hh)

    def extra_repr(self):
        s = f"{self.input_size}, {self.hidden_size}"
        return s + (", bias=False" if not self.bias else "")


class RNNCell(_CellBase):
    """h' = tanh(W_ih x + b_ih + W_hh h + b_hh) (or relu)."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 nonlinearity: str = "tanh", device=None, dtype=None):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}")
        super().__init__(input_size, hidden_size, bias, dtype=dtype)
        self.nonlinearity = nonlinearity

    def forward(self, x, hx=None):
        x, unbatched = self._prepare(x, hx)
        h = self._hidden(hx, x.shape[0], unbatched, x)
        a, b = self._proj(x, h)
        out = (a + b).tanh() if self.nonlinearity == "tanh" else (a + b).relu()
        return out.squeeze(0) if unbatched else out


class GRUCell(_CellBase):
    """Gates r, z, n (torch's order): n = tanh(W_in x + b_in + r * (W_hn h + b_hn)),
    h' = (1 - z) * n + z * h."""
    _gates = 3

    def forward(self, x, hx=None):
        x, unbatched = self._prepare(x, hx)
        h = self._hidden(hx, x.shape[0], unbatched, x)
        gi, gh = self._proj(x, h)
        ir, iz, in_ = gi.chunk(3, 1)
        hr, hz, hn = gh.chunk(3, 1)
        r = (ir + hr).sigmoid()
        z = (iz + hz).sigmoid()
        n = (in_ + r * hn).tanh()
        out = (1 - z) * n + z * h
        return out.squeeze(0) if unbatched else out


class LSTMCell(_CellBase):
    """Gates i, f, g, o (torch's order): c' = f*c + i*g, h' = o * tanh(c'). Returns (h', c')."""
    _gates = 4

    def forward(self, x, hx=None):
        x, unbatched = self._prepare(x, hx)
        n = x.shape[0]
        h, c = (None, None) if hx is None else hx
        h = self._hidden(h, n, unbatched, x)
        c = self._hidden(c, n, unbatched, x)
        gi, gh = self._proj(x, h)
        i, f, g, o = (gi + gh).chunk(4, 1)
        c2 = f.sigmoid() * c + i.sigmoid() * g.tanh()
        h2 = o.sigmoid() * c2.tanh()
        if unbatched:
            return h2.squeeze(0), c2.squeeze(0)
        return h2, c2
