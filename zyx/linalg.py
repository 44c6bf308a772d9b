"""zyx.linalg: torch.linalg's spellings of what zyx computes (norms, cross, diagonal,
matmul, vecdot). The implementations live in zyx/products.py; this namespace differs from
the top-level functions only where torch.linalg does (cross and diagonal default to the
last dims, norm's ord=None)."""
from .tensor import matmul
from .products import vector_norm, matrix_norm, linalg_norm as norm, cross as _cross, \
    diagonal as _diagonal


def cross(input, other, *, dim=-1):
    """torch.linalg.cross: the 3-D cross product along dim (default the last)."""
    return _cross(input, other, dim)


def diagonal(A, *, offset=0, dim1=-2, dim2=-1):
    """torch.linalg.diagonal: torch.diagonal with the last two dims as the default."""
    return _diagonal(A, offset, dim1, dim2)


def vecdot(x, y, *, dim=-1):
    """torch.linalg.vecdot: the dot product of x and y (broadcast) along dim."""
    return (x * y).sum(dim)


__all__ = ["norm", "vector_norm", "matrix_norm", "cross", "diagonal", "matmul", "vecdot"]
