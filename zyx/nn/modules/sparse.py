"""Embedding: a lookup table of vectors indexed by integers."""
from __future__ import annotations

import numpy as np

from ...errors import ShapeError
from ...tensor import Tensor
from .. import functional as F
from .. import init
from .module import Module, new_parameter

__all__ = ["Embedding"]


class Embedding(Module):
    """weight (num_embeddings, embedding_dim) ~ N(0, 1); the padding_idx row starts at zero.

    max_norm: rows looked up whose norm_type-norm exceeds max_norm are renormalized to
    max_norm before the lookup, as torch. torch writes them into the weight in place; zyx
    rebinds `self.weight` (the same tensor object, so optimizers keep it) to the
    renormalized value, realized at the call."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx=None, max_norm=None,
                 norm_type=2.0, scale_grad_by_freq=False, sparse=False, _weight=None,
                 _freeze=False, device=None, dtype=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ShapeError(f"padding_idx {padding_idx} must be within num_embeddings "
                                 f"{num_embeddings}")
            padding_idx %= num_embeddings
        self.padding_idx = padding_idx
        self.max_norm, self.norm_type = max_norm, norm_type
        self.weight = new_parameter(num_embeddings, embedding_dim, dtype=dtype)
        if _weight is None:
            self.reset_parameters()
        else:
            init.copy_into(self.weight, _weight)
        self.weight.requires_grad = not _freeze

    def reset_parameters(self) -> None:
        v = np.asarray(init.RT.rng.normal(0.0, 1.0, size=self.weight.shape))
        if self.padding_idx is not None:
            v[self.padding_idx] = 0.0
        init.fill_from_array(self.weight, v)

    @classmethod
    def from_pretrained(cls, embeddings, freeze=True, padding_idx=None, max_norm=None,
                        norm_type=2.0, scale_grad_by_freq=False, sparse=False):
        e = embeddings if isinstance(embeddings, Tensor) else Tensor(np.asarray(embeddings))
        if e.ndim != 2:
            raise ShapeError(f"embeddings must be 2-D, got {e.shape}")
        return cls(e.shape[0], e.shape[1], padding_idx, max_norm, norm_type, _weight=e,
                   _freeze=freeze, dtype=e.dtype)

    def forward(self, idx):
        return F.embedding(idx, self.weight, self.padding_idx, self.max_norm, self.norm_type)

    def extra_repr(self):
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        return s + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else "")
