"""Helpers shared by the torch-comparison tests of issue 12's ops (sorting, indexing,
einsum/linalg, small ops): values and gradients of a zyx function against torch's."""
import numpy as np
import pytest

import zyx

torch = pytest.importorskip("torch", reason="these tests compare against PyTorch")

_TORCH_DTYPES = {zyx.float32: torch.float32, zyx.float64: torch.float64,
                 zyx.float16: torch.float16, zyx.bfloat16: torch.bfloat16,
                 zyx.int32: torch.int32, zyx.int64: torch.int64, zyx.bool: torch.bool,
                 zyx.uint8: torch.uint8, zyx.int8: torch.int8, zyx.int16: torch.int16}


def both(a, d=zyx.float32, requires_grad=False):
    """The same values as a zyx tensor and a torch tensor of dtype d."""
    z = zyx.tensor(a, dtype=d, requires_grad=requires_grad)
    t = torch.tensor(np.asarray(a)).to(_TORCH_DTYPES[d])
    if requires_grad:
        t.requires_grad_(True)
    return z, t


def as_np(x):
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.dtype == torch.bfloat16:
            x = x.float()
        return x.numpy()
    return np.asarray(x.numpy())


def same(z, t, rtol=1e-5, atol=1e-6):
    """zyx result z equals torch result t (values, shape; NaN where torch has NaN)."""
    a, b = as_np(z), as_np(t)
    assert tuple(a.shape) == tuple(b.shape), (a.shape, b.shape)
    if b.dtype.kind in "biu":
        np.testing.assert_array_equal(a, b)
    else:
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=rtol,
                                   atol=atol, equal_nan=True)


def grads_match(fn, tfn, arrays, d=zyx.float32, rtol=1e-4, atol=1e-5, seed=0):
    """d/dx of sum(fn(x...) * w) for a random w, zyx against torch."""
    zs = [zyx.tensor(a, dtype=d, requires_grad=True) for a in arrays]
    ts = [torch.tensor(np.asarray(a)).to(_TORCH_DTYPES[d]).requires_grad_(True) for a in arrays]
    zo, to = fn(*zs), tfn(*ts)
    w = np.random.default_rng(seed).standard_normal(tuple(to.shape)).astype(np.float32)
    (zo * zyx.tensor(w, dtype=zo.dtype)).sum().backward()
    (to * torch.tensor(w).to(to.dtype)).sum().backward()
    for z, t in zip(zs, ts):
        same(z.grad, t.grad, rtol, atol)
