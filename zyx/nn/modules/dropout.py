"""Dropout layers (active in training mode only)."""
from __future__ import annotations

from .. import functional as F
from .module import Module

__all__ = ["Dropout", "Dropout1d", "Dropout2d", "Dropout3d"]


class Dropout(Module):
    """Zero elements with probability p in training and scale the rest by 1/(1-p)."""
    _fn = staticmethod(F.dropout)

    def __init__(self, p: float = 0.5, inplace: bool = False):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.p, self.inplace = p, inplace

    def forward(self, x):
        return type(self)._fn(x, self.p, self.training)

    def extra_repr(self):
        return f"p={self.p}, inplace={self.inplace}"


class Dropout1d(Dropout):
    _fn = staticmethod(F.dropout1d)


class Dropout2d(Dropout):
    """Zero whole channels with probability p."""
    _fn = staticmethod(F.dropout2d)


class Dropout3d(Dropout):
    _fn = staticmethod(F.dropout3d)
