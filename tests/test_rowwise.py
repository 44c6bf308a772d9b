"""Row kernels (kernelizer._RowKernels / _Builder.build_rows): a reduce whose result only
comes back over its own axes through an expand into one stored output is computed inside
that output's kernel, once per row. softmax, log_softmax and layer_norm are one kernel
each; values and gradients against torch, on every device of the conftest fixture (the C
backend, and PoCL's OpenCL device where installed)."""
from __future__ import annotations

import numpy as np
import pytest

import zyx
import zyx.nn.functional as F
from zyx._core import kernel as K
from zyx._core import passes
from zyx._core.kernelizer import kernelize

torch = pytest.importorskip("torch", reason="these tests compare against PyTorch")
TF = torch.nn.functional

pytestmark = pytest.mark.usefixtures("device")


def launched(fn):
    """(kernels launched while fn ran, fn's result as numpy)."""
    before = zyx.stats()["kernels_launched"]
    out = fn()
    out = out.numpy() if isinstance(out, zyx.Tensor) else out
    return zyx.stats()["kernels_launched"] - before, out


def kernels_of(t):
    g = zyx._RT.graph
    order, _ = g.collect([t._id])
    steps, _ = kernelize(g, order, [t._id], 64)
    return [passes.optimize(s.kernel) for s in steps if s.kernel is not None]


def rows_data(shape=(48, 100), seed=0):
    a = (np.random.default_rng(seed).standard_normal(shape) * 3).astype(np.float32)
    a[0] = -np.inf                 # a row of -inf: softmax NaN, as torch
    a[1, ::3] = -np.inf            # some -inf
    a[2] = 1.5                     # all equal
    a[3, 5] = 80.0                 # one dominant value (exp of the rest underflows)
    return a


def close(got, ref, rtol=1e-5, atol=1e-6):
    ref = ref.detach().float().numpy() if isinstance(ref, torch.Tensor) else ref
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(ref, np.float64),
                               rtol=rtol, atol=atol, equal_nan=True)


OPS = {
    "softmax": (lambda x: x.softmax(-1), lambda t: t.softmax(-1)),
    "log_softmax": (lambda x: x.log_softmax(-1), lambda t: t.log_softmax(-1)),
    "layer_norm": (lambda x: F.layer_norm(x, (x.shape[-1],)),
                   lambda t: TF.layer_norm(t, (t.shape[-1],))),
}


@pytest.mark.parametrize("name", list(OPS))
def test_forward_is_one_kernel(name):
    a = rows_data()
    if name == "layer_norm":
        # (a row of -inf has no mean; an all-equal row normalizes 0 by ~0, whose value
        # depends on how the mean rounds: a GPU's tree sum gives 1e-5 where numpy gives 0)
        a = a[3:]
    z, t = OPS[name]
    n, out = launched(lambda: z(zyx.Tensor(a)))
    assert n == 1
    close(out, t(torch.tensor(a)), rtol=1e-5, atol=1e-5)


def test_layer_norm_with_affine_and_two_normalized_axes():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((6, 5, 7, 9)).astype(np.float32) * 4 + 10
    w = rng.standard_normal((7, 9)).astype(np.float32)
    b = rng.standard_normal((7, 9)).astype(np.float32)
    n, out = launched(lambda: F.layer_norm(zyx.Tensor(a), (7, 9), zyx.Tensor(w), zyx.Tensor(b)))
    assert n == 1
    close(out, TF.layer_norm(torch.tensor(a), (7, 9), torch.tensor(w), torch.tensor(b)),
          rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("d", [zyx.float16, zyx.bfloat16])
@pytest.mark.parametrize("name", list(OPS))
def test_half_precision(name, d):
    a = rows_data((40, 70))[2:]
    tdt = torch.float16 if d is zyx.float16 else torch.bfloat16
    z, t = OPS[name]
    x = zyx.Tensor(a).cast(d)
    out = z(x)
    assert out.dtype is d
    ref = t(torch.tensor(a).to(tdt).float()).to(tdt)   # torch computes in float32 too
    tol = 1e-2 if d is zyx.float16 else 4e-2
    close(out.cast(zyx.float32).numpy(), ref, rtol=tol, atol=tol)


def test_other_axes_and_views_stay_correct():
    a = rows_data((30, 44))
    ta = torch.tensor(a)
    x = zyx.Tensor(a)
    # reduced axis first: the store loop would be strided, the reduces stay stored
    n, out = launched(lambda: x.softmax(0))
    assert n == 3
    close(out, ta.softmax(0))
    # a permuted (non-contiguous) input, softmax over its last axis: one kernel
    n, out = launched(lambda: x.permute(1, 0).softmax(-1))
    assert n == 1
    close(out, ta.T.softmax(-1))
    close(x.permute(1, 0).log_softmax(0).numpy(), ta.T.log_softmax(0), atol=1e-5)
    # middle axis of a 3-D tensor (not the last): stored as before, right
    b = np.random.default_rng(2).standard_normal((4, 9, 5)).astype(np.float32)
    close(zyx.Tensor(b).softmax(1).numpy(), torch.tensor(b).softmax(1))
    # a flipped view and a sliced one
    close(x.flip(1).softmax(-1).numpy(), ta.flip(1).softmax(-1))
    close(x[:, 3:40:2].log_softmax(-1).numpy(), ta[:, 3:40:2].log_softmax(-1), atol=1e-5)


def test_keepdim_and_reshaped_paths():
    a = rows_data((33, 65))[3:]     # (no all-equal row: its std normalization is 0 / ~0)
    ta = torch.tensor(a)
    x = zyx.Tensor(a)
    n, out = launched(lambda: x - x.amax(-1, keepdim=True))
    assert n == 1
    close(out, ta - ta.amax(-1, keepdim=True))
    # keepdim=False then unsqueeze: a reshape between reduce and expand (stored), right
    close((x - x.amax(-1).unsqueeze(-1)).numpy(), ta - ta.amax(-1).unsqueeze(-1))
    close((x - x.mean(-1, keepdim=True)).numpy(), ta - ta.mean(-1, keepdim=True), atol=1e-5)
    close(x.logsumexp(-1, keepdim=True).numpy(), ta.logsumexp(-1, keepdim=True), atol=1e-5)
    close(x.logsumexp(-1).numpy(), ta.logsumexp(-1), atol=1e-5)
    # std over rows then normalization (var's two passes + the output: one kernel)
    n, out = launched(lambda: (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True))
    assert n == 1
    close(out, (ta - ta.mean(-1, keepdim=True)) / ta.std(-1, keepdim=True), rtol=1e-4,
          atol=1e-5)


def test_reduce_also_returned_is_stored_and_both_right():
    a = rows_data((20, 30))[2:]
    ta = torch.tensor(a)
    x = zyx.Tensor(a)
    m = x.amax(-1, keepdim=True)
    s = (x - m).exp()
    zyx.realize(m, s) if hasattr(zyx, "realize") else (m.realize(), s.realize())
    close(m.numpy(), ta.amax(-1, keepdim=True))
    close(s.numpy(), (ta - ta.amax(-1, keepdim=True)).exp())


def test_long_rows_with_masked_sum_blocks():
    # 5003 (prime) > SUM_BLOCK: the sum's last block is masked; the row max read inside
    # it must still come from the row (memo), and values stay right
    a = rows_data((40, 5003))
    x = zyx.Tensor(a)
    n, out = launched(lambda: x.softmax(-1))
    assert n == 1
    close(out, torch.tensor(a).softmax(-1), rtol=1e-5, atol=1e-8)
    (k,) = kernels_of(zyx.Tensor(a).softmax(-1))
    maxes = [op for op in k.ops if op[0] == K.BINARY and op[2] == K.B_MAX]
    assert len(maxes) == 1        # the max reduce is rendered once, not inside the sum


def test_kernel_shape_rows_then_loops():
    x = zyx.Tensor(np.random.rand(64, 128).astype(np.float32))
    (k,) = kernels_of(x.softmax(-1))
    idx = [op for op in k.ops if op[0] == K.INDEX]
    assert [(op[2], op[3]) for op in idx] == [(0, 64)]
    loops = [op for op in k.ops if op[0] == K.LOOP]
    assert [op[2] for op in loops] == [128, 128, 128]   # max, sum of exp, store
    stores = [i for i, op in enumerate(k.ops) if op[0] == K.STORE
              and k.ops[op[2]][2] == K.SCOPE_GLOBAL]
    assert len(stores) == 1 and stores[0] > k.ops.index(loops[2])


@pytest.mark.parametrize("name", list(OPS))
def test_backward(name):
    a = rows_data((24, 40))[2:]
    z, t = OPS[name]
    g = np.random.default_rng(3).standard_normal(a.shape).astype(np.float32)
    x = zyx.tensor(a, requires_grad=True)
    (z(x) * zyx.Tensor(g)).sum().backward()
    tx = torch.tensor(a, requires_grad=True)
    (t(tx) * torch.tensor(g)).sum().backward()
    close(x.grad.numpy(), tx.grad, rtol=1e-4, atol=1e-5)


def test_cross_entropy_forward_and_backward():
    rng = np.random.default_rng(4)
    a = rows_data((64, 50))[2:]
    y = rng.integers(0, 50, a.shape[0])
    n, out = launched(lambda: F.cross_entropy(zyx.Tensor(a), zyx.Tensor(y)))
    assert n <= 2        # log_softmax and the picked value per row: one row kernel
    close(out, TF.cross_entropy(torch.tensor(a), torch.tensor(y)), rtol=1e-5)
    x = zyx.tensor(a, requires_grad=True)
    F.cross_entropy(x, zyx.Tensor(y)).backward()
    tx = torch.tensor(a, requires_grad=True)
    TF.cross_entropy(tx, torch.tensor(y)).backward()
    close(x.grad.numpy(), tx.grad, rtol=1e-4, atol=1e-6)
    # probability targets and label smoothing go through the general path
    p = rng.random(a.shape).astype(np.float32)
    p /= p.sum(1, keepdims=True)
    close(F.cross_entropy(zyx.Tensor(a), zyx.Tensor(p), label_smoothing=0.1).numpy(),
          TF.cross_entropy(torch.tensor(a), torch.tensor(p), label_smoothing=0.1),
          rtol=1e-5)
