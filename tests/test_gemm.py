"""Shared-memory gemm tiles (codegen/gpu/gemm.py): which kernels are products and how their
axes split, every tile shape against numpy on the OpenCL device (PoCL here and in CI),
the kernelizer leaving gemm kernels without register tiles, and ZYX_GPU_GEMM=0.

Skipped, with the reason, when pyopencl or an OpenCL device is missing (the plan tests
need no device)."""
from __future__ import annotations

import numpy as np
import pytest

import zyx
import zyx.nn.functional as F
from zyx._core import kernel as K
from zyx._core.kernelizer import kernelize
from zyx._core.passes import optimize
from zyx.codegen.target import DeviceInfo
from zyx.codegen.gpu import gemm
from zyx.codegen.gpu import dispatch as gpu
from zyx.codegen.cstyle import CUDADialect, OpenCLDialect

from conftest import only_backend

H100 = DeviceInfo(name="H100", max_local_threads=1024, warp_size=32, num_cores=132,
                  local_mem_size=228 * 1024, register_tiles=False)


def kernels_of(t):
    g = zyx._RT.graph
    order, _ = g.collect([t._id])
    steps, _ = kernelize(g, order, [t._id], 64, False, gpu.GPU_SUM_BLOCK)
    return [optimize(s.kernel) for s in steps if s.kernel is not None]


def the_kernel(t):
    (k,) = kernels_of(t)
    return k


def f(*shape, dtype=np.float32):
    return zyx.Tensor(np.random.default_rng(3).standard_normal(shape).astype(dtype))


def names(k, ids):
    """(axis, length) of INDEX ops `ids`."""
    return [(k.ops[i][2], k.ops[i][3]) for i in ids]


# -- which kernels are products --------------------------------------------------------------

def test_matmul_axes_and_operands():
    k = the_kernel(f(40, 24) @ f(24, 72))
    p = gemm.plan(k.ops)
    assert names(k, p.rows) == [(0, 40)] and names(k, p.cols) == [(1, 72)] and not p.batch
    assert (p.nr, p.nc, p.nk) == (40, 72, 24) and p.block == 0 and p.total is None
    assert p.a_kfast and not p.b_kfast       # a row-major left and right operand


def test_batched_matmul_and_convolution_sets(monkeypatch):
    # (kernels as the CPU makes them, less the channels-last weight copy it makes for its
    # own register tiles: GPU devices keep the weights as they are)
    monkeypatch.setattr(F, "CHANNELS_LAST_WEIGHTS", False)
    k = the_kernel(f(3, 40, 24) @ f(3, 24, 72))
    p = gemm.plan(k.ops)
    assert names(k, p.batch) == [(0, 3)] and (p.nr, p.nc, p.nb) == (40, 72, 3)
    # a convolution: cols are batch x height x width (the input's, with the output's
    # innermost axis), rows the output channels (the weight's), K the input channels x
    # window
    k = the_kernel(F.conv2d(f(4, 8, 12, 12), f(16, 8, 3, 3), padding=1))
    p = gemm.plan(k.ops)
    assert names(k, p.cols) == [(0, 4), (2, 12), (3, 12)] and names(k, p.rows) == [(1, 16)]
    assert p.nk == 8 * 9
    # the innermost output axis is on the cols side, whatever the operand order: stores
    # of neighbouring work-items are neighbours
    assert max(p.rows + p.cols, key=lambda i: k.ops[i][2]) in p.cols


def test_blocked_float_sum_with_a_masked_last_block():
    k = the_kernel(f(64, 521) @ f(521, 64))
    p = gemm.plan(k.ops)
    assert p.total is not None and p.block == 256 and p.nk == 3 * 256 and len(p.masks) == 1


def test_not_products():
    x = f(64, 64)
    assert gemm.plan(the_kernel((x * x).sum(1)).ops) is None        # no cols axis
    assert gemm.plan(the_kernel(x.amax(1)).ops) is None              # not a sum
    assert gemm.plan(the_kernel(x.exp()).ops) is None                # no loop
    assert gemm.plan(the_kernel(f(8, 64) @ f(64, 64)).ops) is None   # rows < MIN_SIDE
    ints = zyx.Tensor(np.ones((32, 32), np.int32))
    assert gemm.plan(the_kernel(ints @ ints).ops) is None            # not a float sum
    # too few tiles for 132 SMs: the other strategies split the reduction instead
    p = gemm.plan(the_kernel(f(64, 4096) @ f(4096, 64)).ops)
    assert p is not None and gemm.choose_tile(p, H100) is None


def test_tile_choice_fills_the_device():
    k = the_kernel(f(4096, 64) @ f(64, 4096))
    p = gemm.plan(k.ops)
    assert gemm.choose_tile(p, H100) == (128, 128, 8)
    p = gemm.plan(the_kernel(f(1024, 64) @ f(64, 1024)).ops)
    assert gemm.choose_tile(p, H100) == (64, 64, 16)
    g = gpu.lower(k, CUDADialect(), H100)
    assert g.strategy == "gemm" and g.launches[0].groups == 32 * 32
    assert g.launches[0].local_size == gemm.SIDE ** 2 and g.index_bits == 32
    assert "__shared__ __align__(16) float zyx_la[" in g.source and "__syncthreads()" in g.source
    # the autotuner's candidates: the other tiles
    labels = [label for label, _ in gpu.schedule_candidates(k, H100)]
    assert labels[0] == "default" and "gemm:64x64" in labels and "gemm:128x128" not in labels


def test_kernelize_leaves_gemm_kernels_untiled():
    a = f(64, 64)

    def layouts(own):
        g = zyx._RT.graph
        t = a @ a
        order, _ = g.collect([t._id])
        steps, _ = kernelize(g, order, [t._id], 64, True, own_tiles=own)
        (k,) = [s.kernel for s in steps if s.kernel is not None]
        return max(op[5] for op in k.ops if op[0] == K.DEFINE and op[2] == K.SCOPE_REGISTER)
    assert layouts(None) > 1
    small = DeviceInfo(max_local_threads=256, num_cores=2, local_mem_size=32 * 1024)
    assert layouts(lambda ops: gemm.wanted(ops, small)) == 1
    assert layouts(lambda ops: gemm.wanted(ops, H100)) > 1   # 4 tiles for 132 SMs
    assert layouts(lambda ops: False) > 1


def test_gemm_off_by_environment(monkeypatch):
    k = the_kernel(f(4096, 64) @ f(64, 4096))
    monkeypatch.setenv(gemm.GEMM_ENV, "0")
    assert not gemm.wanted(k.ops, H100)
    assert gpu.lower(k, OpenCLDialect(), H100).strategy != "gemm"


# -- on the OpenCL device ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def opencl_device():
    pytest.importorskip("pyopencl", reason="pyopencl is not installed")
    yield from only_backend("opencl", "no OpenCL device")


@pytest.fixture
def lowered(opencl_device, monkeypatch):
    """lowered(schedule): every kernel the OpenCL device lowers from now on gets
    `schedule` (None: the default); returns the list of GPUKernels lowered."""
    from zyx.backends import opencl
    found = []

    def use(schedule):
        def spy(kernel, dl, info=None, name="zyx_k", sched=None):
            g = gpu.lower(kernel, dl, info, name, schedule)
            found.append(g)
            return g
        monkeypatch.setattr(opencl, "lower", spy)
        return found
    monkeypatch.setattr(opencl_device, "_programs", {})
    monkeypatch.setattr(opencl_device, "_by_source", {})
    monkeypatch.setattr(zyx._RT, "plans", {})
    return use


def close(t, ref, rtol=1e-4, atol=1e-4):
    np.testing.assert_allclose(t.numpy().astype(np.float64), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("want", [t[:2] for t in gemm.TILES])
def test_every_tile_against_numpy(want, lowered):
    found = lowered({"gemm": want})
    r = np.random.default_rng(11)
    for m, k, n in ((16, 8, 16), (70, 300, 50), (129, 33, 130)):
        a = r.standard_normal((m, k)).astype(np.float32)
        b = r.standard_normal((k, n)).astype(np.float32)
        c = r.standard_normal(n).astype(np.float32)
        ref = a.astype(np.float64) @ b
        close(zyx.Tensor(a) @ zyx.Tensor(b), ref)
        close(zyx.Tensor(a.T.copy()).T @ zyx.Tensor(b.T.copy()).T, ref)
        close((zyx.Tensor(a) @ zyx.Tensor(b) + zyx.Tensor(c)).tanh(), np.tanh(ref + c))
    x = r.standard_normal((2, 6, 9, 9)).astype(np.float32)
    w = r.standard_normal((20, 6, 3, 3)).astype(np.float32)
    y = F.conv2d(zyx.Tensor(x), zyx.Tensor(w), stride=2, padding=1)
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    ref = np.zeros((2, 20, 5, 5))
    for i in range(3):
        for j in range(3):
            ref += np.einsum("nchw,oc->nohw", xp[:, :, i:i + 9:2, j:j + 9:2], w[:, :, i, j])
    close(y, ref)
    used = {(g.variant["rows"], g.variant["cols"]) for g in found if g.strategy == "gemm"}
    assert used == {want}


def test_default_tiles_on_a_transformer_block(lowered, opencl_device, monkeypatch):
    """Attention scores, values, projections and their gradients with the tiles the
    device picks (as if it had 2 compute units: a GPU's would leave these small products
    to the other strategies), against the same block computed without gemm tiles."""
    monkeypatch.setattr(opencl_device.info(), "num_cores", 2)
    r = np.random.default_rng(5)
    xs = r.standard_normal((4, 32, 64)).astype(np.float32)
    ws = [r.standard_normal((64, 64)).astype(np.float32) * 0.1 for _ in range(3)]

    def block(use_gemm):
        import os
        os.environ[gemm.GEMM_ENV] = "1" if use_gemm else "0"
        try:
            zyx._RT.plans.clear()
            x = zyx.Tensor(xs, requires_grad=True)
            wq, wk, wv = (zyx.Tensor(w, requires_grad=True) for w in ws)
            q, k, v = x @ wq, x @ wk, x @ wv
            att = (q @ k.transpose(1, 2) * 0.125).softmax(-1)
            out = att @ v
            (out * out).mean().backward()
            return [t.numpy() for t in (out, x.grad, wq.grad, wk.grad, wv.grad)]
        finally:
            os.environ.pop(gemm.GEMM_ENV, None)
    found = lowered(None)
    with_tiles = block(True)
    assert any(g.strategy == "gemm" for g in found)
    without = block(False)
    for a, b in zip(with_tiles, without):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spec", ["fold=0", "prefetch=0", "hoist=0", "vector=0", "double=0",
                                  "fold=0,prefetch=0,hoist=0,vector=0"])
def test_variants_against_numpy(spec, lowered, monkeypatch):
    """ZYX_GPU_GEMM's knobs: without block totals, without the next step's prefetch, with
    each slot's rows decoded at every K step."""
    monkeypatch.setenv(gemm.GEMM_ENV, spec)
    found = lowered({"gemm": (32, 32)})
    r = np.random.default_rng(2)
    a = r.standard_normal((40, 9000)).astype(np.float32)   # long enough for totals
    b = r.standard_normal((9000, 40)).astype(np.float32)
    # (9000 float32 terms of size ~1 in one accumulator: errors ~1e-4 without totals)
    close(zyx.Tensor(a) @ zyx.Tensor(b), a.astype(np.float64) @ b, atol=2e-3)
    (g,) = [g for g in found if g.strategy == "gemm"]
    assert ("zyx_t0_0" in g.source) == ("fold=0" not in spec)
    with pytest.raises(ValueError, match="ZYX_GPU_GEMM"):
        gemm.variant("tiles=3")


def test_masked_last_block_with_an_operand_infinite_past_the_end(lowered, opencl_device,
                                                                monkeypatch):
    """A blocked sum's last block reads 0 past the real K (guarded loads): an operand
    computed from those zeros may be inf there (1 / y), so both tiles are masked. (As if
    the device had 2 compute units: a GPU's would leave this small product alone.)"""
    monkeypatch.setattr(opencl_device.info(), "num_cores", 2)
    found = lowered(None)
    r = np.random.default_rng(4)
    a = r.standard_normal((70, 521)).astype(np.float32)
    y = r.uniform(1, 2, (521, 50)).astype(np.float32)
    got = zyx.Tensor(a) @ (1 / zyx.Tensor(y))
    close(got, a.astype(np.float64) @ (1 / y.astype(np.float64)))
    assert any(g.strategy == "gemm" for g in found)


@pytest.mark.parametrize("want", [(128, 128), (64, 32)])
def test_vector_copies_against_numpy(want, lowered):
    """Operands that are plain loads are copied 16 bytes at a time (float4), along K or
    along the rows; a view whose rows start at odd offsets reads those vectors value by
    value (the alignment test where the kernel runs); lengths that are not a multiple of
    4 keep the value-by-value copies."""
    found = lowered({"gemm": want})
    r = np.random.default_rng(6)
    a = r.standard_normal((72, 97)).astype(np.float32)
    b = r.standard_normal((96, 40)).astype(np.float32)
    ref = a[:, 1:].astype(np.float64) @ b
    close(zyx.Tensor(a[:, 1:].copy()) @ zyx.Tensor(b), ref)          # aligned rows
    close(zyx.Tensor(a)[:, 1:] @ zyx.Tensor(b), ref)                 # odd row starts
    close(zyx.Tensor(a[:, 1:].T.copy()).T @ zyx.Tensor(b.T.copy()).T, ref)
    vec = [g for g in found if g.strategy == "gemm"]
    assert len(vec) == 3 and all("float4" in g.source for g in vec)
    found.clear()
    c = r.standard_normal((70, 33)).astype(np.float32)
    d = r.standard_normal((33, 50)).astype(np.float32)
    close(zyx.Tensor(c) @ zyx.Tensor(d), c.astype(np.float64) @ d)
    (g,) = [g for g in found if g.strategy == "gemm"]
    assert "float4" not in g.source


def test_convolution_k_order_and_shared_copies(monkeypatch):
    """A convolution's 3-wide window column is a short innermost reduce loop: the flat K
    walks the 16 input channels innermost instead, so a K step crosses no window
    position; the image operand is copied along its rows (contiguous) rather than K
    fastest, and the copies decode the window position once per K step."""
    # (one kernel on any default device: the CPU's register tiles would read the weights
    # through a channels-last copy of their own)
    monkeypatch.setattr(F, "CHANNELS_LAST_WEIGHTS", False)
    k = the_kernel(F.conv2d(f(2, 32, 10, 10), f(24, 32, 3, 3), padding=1))
    p = gemm.plan(k.ops)
    assert k.ops[p.loops[-1]][2] % 16 == 0 and not p.b_kfast
    src = gpu.lower(k, OpenCLDialect(), H100, "zyx_k", {"gemm": (32, 64)}).source
    assert src.count(f"% {k.ops[p.loops[-1]][2]}) + ") >= 2      # per slot: the channel alone
    import os
    os.environ[gemm.GEMM_ENV] = "krun=0"         # the old order: K fastest where contiguous
    try:
        old = gemm.plan(k.ops)
    finally:
        os.environ.pop(gemm.GEMM_ENV)
    assert k.ops[old.loops[-1]][2] == 3 and old.b_kfast


@pytest.mark.parametrize("spec", ["", "krun=0", "hoist=0,vector=0", "double=1"])
@pytest.mark.parametrize("want", [(32, 64), (64, 32)])
@pytest.mark.parametrize("image_last", [False, True])
def test_convolutions_and_gradients_against_numpy(spec, want, image_last, lowered,
                                                  monkeypatch):
    """Convolutions with 16 and 32 input channels (K reordered) and 6 (kept), strided and
    padded, and their input and weight gradients, on every copy path the K order and
    the knobs give; with `image_last` the forward reads a channels-last copy of the
    image (F._channels_last_input, here for any size), whose padded window is copied 16
    bytes at a time under one test where vectors are on."""
    monkeypatch.setenv(gemm.GEMM_ENV, spec)
    monkeypatch.setattr(F, "GPU_IMAGE_MIN", 0 if image_last else 1 << 62)
    found = lowered({"gemm": want})
    r = np.random.default_rng(12)
    for cin, stride, pad in ((16, 1, 1), (32, 2, 1), (6, 1, 0)):
        x = r.standard_normal((2, cin, 9, 9)).astype(np.float32)
        w = (r.standard_normal((20, cin, 3, 3)) * 0.2).astype(np.float32)
        X = zyx.Tensor(x, requires_grad=True)
        W = zyx.Tensor(w, requires_grad=True)
        y = F.conv2d(X, W, stride=stride, padding=pad)
        xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
        ho = (9 + 2 * pad - 3) // stride + 1
        win = np.empty((2, cin, 3, 3, ho, ho))
        for i in range(3):
            for j in range(3):
                win[:, :, i, j] = xp[:, :, i:i + stride * ho:stride, j:j + stride * ho:stride]
        ref = np.einsum("ncijhw,ocij->nohw", win, w)
        close(y, ref)
        g = r.standard_normal(ref.shape).astype(np.float32)
        (y * zyx.Tensor(g)).sum().backward()
        close(W.grad, np.einsum("ncijhw,nohw->ocij", win, g), rtol=1e-4, atol=1e-3)
        gxp = np.zeros_like(xp)
        for i in range(3):
            for j in range(3):
                gxp[:, :, i:i + stride * ho:stride, j:j + stride * ho:stride] += \
                    np.einsum("nohw,oc->nchw", g, w[:, :, i, j])
        close(X.grad, gxp[:, :, pad:pad + 9, pad:pad + 9], rtol=1e-4, atol=1e-3)
    assert sum(g.strategy == "gemm" for g in found) >= 3


def test_split_k_parts_for_an_h100():
    """gemm.parts: the MNIST convnet's weight gradients at batch 128 on 132 SMs. 32 x 800
    outputs over 51200 terms have 25 of the smallest tiles: 16 pieces of 3200 terms give
    400; 64 x 288 over 8192 terms: 16 pieces of 512. A 1-channel 5x5 gradient (32 x 25,
    one tile) cannot reach 132 groups even cut 128 ways, so it stays whole; products
    whose tiles already fill the device, or too short to cut, stay whole."""
    assert gemm.parts(H100, 32, 800, 51200, 128) == 16
    assert gemm.parts(H100, 64, 288, 8192, 128) == 16
    assert gemm.parts(H100, 32, 25, 73728, 128) == 1
    assert gemm.parts(H100, 4096, 4096, 4096, 128) == 1
    assert gemm.parts(H100, 32, 800, 4096, 8) == 8          # (most: the batch's divisors)
    assert gemm.parts(H100, 32, 800, 1024, 128) == 8        # pieces of PART_MIN_K at least
    assert gemm.parts(H100, 8, 800, 51200, 128) == 1        # too narrow to be a gemm
    assert DeviceInfo().product_parts is None               # (the CPU: never cut)


def _weight_gradient_on_h100(y, w):
    """The kernels of w's gradient through y (a zero output gradient, not run), lowered
    for the H100 (rendered only)."""
    gw, = zyx.autograd.grad([y], [w], [zyx.Tensor(np.zeros(y.shape, np.float32))])
    g = zyx._RT.graph
    order, _ = g.collect([gw._id])
    steps, _ = kernelize(g, order, [gw._id], 64, False, gpu.GPU_SUM_BLOCK, None, None,
                         0, False, lambda ops: gemm.wanted(ops, H100))
    return [gpu.lower(optimize(s.kernel), OpenCLDialect(), H100)
            for s in steps if s.kernel is not None]


def test_split_weight_gradient_is_a_gemm_on_an_h100(opencl_device, monkeypatch):
    """With the H100's pieces, the recipe convnet's second weight gradient (32 x 800
    outputs, batch 128) becomes a batched gemm of 16 x 13 tiles and a short sum over the
    pieces; uncut, its 13 tiles leave the gemm strategy to the group strategies."""
    def gradient_kernels(parts, n):
        # (n: a shape of its own for each, as the backward's template is per shape)
        monkeypatch.setattr(opencl_device.info(), "product_parts", parts)
        w = zyx.Tensor(np.zeros((32, 32, 5, 5), np.float32), requires_grad=True)
        return _weight_gradient_on_h100(
            F.conv2d(zyx.Tensor(np.zeros((n, 32, 24, 24), np.float32)), w), w)
    split = gradient_kernels(lambda r, c, k, m: gemm.parts(H100, r, c, k, m), 128)
    assert [g.strategy for g in split] == ["gemm", "serial"]
    assert split[0].launches[0].groups == 16 * 13
    whole = gradient_kernels(None, 120)
    assert "gemm" not in [g.strategy for g in whole]


@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("groups", [1, 2])
def test_split_weight_gradients_against_numpy(parts, groups, lowered, opencl_device,
                                              monkeypatch):
    """Weight gradients cut along the batch into `parts` products (split-K,
    DeviceInfo.product_parts), strided and padded, grouped or not, against numpy; the
    pieces run as gemm tiles."""
    monkeypatch.setattr(opencl_device.info(), "product_parts",
                        lambda r, c, k, most: parts)
    found = lowered(None)
    r = np.random.default_rng(5)
    n, cin, cout = 8, 16, 32
    for stride, pad in ((1, 1), (2, 0)):
        x = r.standard_normal((n, cin, 11, 11)).astype(np.float32)
        w = (r.standard_normal((cout, cin // groups, 3, 3)) * 0.2).astype(np.float32)
        X, W = zyx.Tensor(x), zyx.Tensor(w, requires_grad=True)
        y = F.conv2d(X, W, stride=stride, padding=pad, groups=groups)
        g = r.standard_normal(y.shape).astype(np.float32)
        (y * zyx.Tensor(g)).sum().backward()
        xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
        ho = y.shape[-1]
        win = np.empty((n, cin, 3, 3, ho, ho))
        for i in range(3):
            for j in range(3):
                win[:, :, i, j] = xp[:, :, i:i + stride * ho:stride, j:j + stride * ho:stride]
        cg, og = cin // groups, cout // groups
        ref = np.concatenate([np.einsum("ncijhw,nohw->ocij", win[:, q * cg:(q + 1) * cg],
                                        g[:, q * og:(q + 1) * og]) for q in range(groups)])
        close(W.grad, ref, rtol=1e-4, atol=1e-3)
    assert any(g.strategy == "gemm" for g in found)


def test_split_linear_weight_gradient_is_a_gemm_on_an_h100(opencl_device, monkeypatch):
    """The recipe LM's feed-forward weight gradient (512 x 128 outputs over B x T = 2048
    positions) has 64 of the smallest tiles for 132 SMs: with the H100's pieces it is
    8 gemms of 256 positions each, then their sum; uncut it is no gemm."""
    def gradient_kernels(parts, t):
        monkeypatch.setattr(opencl_device.info(), "product_parts", parts)
        w = zyx.Tensor(np.zeros((512, 128), np.float32), requires_grad=True)
        return _weight_gradient_on_h100(
            F.linear(zyx.Tensor(np.zeros((32, t, 128), np.float32)), w), w)
    split = gradient_kernels(lambda r, c, k, m: gemm.parts(H100, r, c, k, m), 64)
    assert [g.strategy for g in split] == ["gemm", "serial"]
    assert split[0].launches[0].groups >= 8 * 16
    whole = gradient_kernels(None, 63)
    assert "gemm" not in [g.strategy for g in whole]


@pytest.mark.parametrize("parts", [2, 8])
def test_split_linear_and_matmul_weight_gradients_against_numpy(parts, lowered, opencl_device,
                                                               monkeypatch):
    """Weight gradients of a 3-D linear layer (summed over batch and positions) and of a
    2-D matmul, cut into `parts` pieces (split-K), against numpy; the input's gradient
    (a sum over the output features, not the leading axes) is not cut."""
    monkeypatch.setattr(opencl_device.info(), "product_parts",
                        lambda r, c, k, most: parts)
    found = lowered(None)
    r = np.random.default_rng(9)
    x = r.standard_normal((4, 16, 24)).astype(np.float32)
    w = r.standard_normal((40, 24)).astype(np.float32)
    g = r.standard_normal((4, 16, 40)).astype(np.float32)
    X, W = zyx.Tensor(x, requires_grad=True), zyx.Tensor(w, requires_grad=True)
    (F.linear(X, W) * zyx.Tensor(g)).sum().backward()
    close(W.grad, np.einsum("btn,btk->nk", g.astype(np.float64), x))
    close(X.grad, np.einsum("btn,nk->btk", g.astype(np.float64), w))
    a = r.standard_normal((64, 24)).astype(np.float32)
    b = r.standard_normal((24, 32)).astype(np.float32)
    gm = r.standard_normal((64, 32)).astype(np.float32)
    A, B = zyx.Tensor(a, requires_grad=True), zyx.Tensor(b, requires_grad=True)
    ((A @ B) * zyx.Tensor(gm)).sum().backward()
    close(B.grad, a.T.astype(np.float64) @ gm)
    close(A.grad, gm.astype(np.float64) @ b.T)
    assert any(g.strategy == "gemm" for g in found)


def test_padded_channels_last_windows_are_copied_as_vectors():
    """A padded convolution over a channels-last image (F._conv_forward's image_last):
    the window is where(inside, load, 0) with the test independent of the channels, the
    innermost K: its copies take 16-byte vectors (gemm.vector_lanes), 4 float32 or 8
    bfloat16 values; over an NCHW image (channels apart) they stay value by value."""
    for dtype, lanes in ((np.float32, 4), ("bfloat16", 8)):
        x = f(2, 32, 12, 12)
        w = f(48, 32, 3, 3)
        if dtype == "bfloat16":
            x, w = x.cast("bfloat16"), w.cast("bfloat16")
        for image_last, want in ((True, lanes), (False, 1)):
            y = F._conv_forward(x, w, [(1, 1), (1, 1)], (1, 1), (1, 1), 1, 2, True,
                                image_last)
            (p, k), = [(gemm.plan(k.ops), k) for k in kernels_of(y)
                       if gemm.plan(k.ops) is not None]
            window = "a" if k.ops[p.a][0] == K.WHERE else "b"
            kfast = p.a_kfast if window == "a" else p.b_kfast
            assert kfast or not image_last       # the channels, innermost in K
            d = k.ops[p.a if window == "a" else p.b][1]
            assert gemm.vector_lanes(k.ops, p, window, kfast, d) == want, (dtype, image_last)


def test_computed_operands_take_tiles_of_at_most_64x64():
    """A convolution's window over an NCHW image is copied value by value (a guarded
    load and a select): its products take tiles of at most gemm.COMPUTED_TILE, twice
    the groups in flight. Over a channels-last image the window is copied as vectors
    and takes the larger tiles, as a plain matmul keeps the largest that fills the
    device."""
    x, w = f(64, 64, 28, 28), f(64, 64, 3, 3)
    for image_last in (False, True):
        y = F._conv_forward(x, w, [(1, 1), (1, 1)], (1, 1), (1, 1), 1, 2, True,
                            image_last)
        (conv,) = [p for p in (gemm.plan(k.ops) for k in kernels_of(y)) if p is not None]
        assert conv.computed and conv.scalar != image_last
        br, bc, _ = gemm.choose_tile(conv, H100)
        assert (br * bc <= gemm.COMPUTED_TILE) != image_last
    mm = gemm.plan(the_kernel(f(2048, 512) @ f(512, 2048)).ops)
    assert not mm.computed and not mm.scalar
    assert gemm.choose_tile(mm, H100)[:2] == (128, 128)
