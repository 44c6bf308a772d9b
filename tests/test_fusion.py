"""Fusion and caching, counted through zyx.stats(): elementwise chains, elementwise into
reductions, reduction epilogues and movement ops each cost one kernel; so does softmax (a row
kernel: tests/test_rowwise.py);
a graph with the same structure reuses its cached plan; a second process compiles nothing."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import zyx
from conftest import assert_close

pytestmark = pytest.mark.usefixtures("device")


def launched(fn):
    """(kernels launched while fn ran, fn's result)."""
    before = zyx.stats()["kernels_launched"]
    out = fn()
    return zyx.stats()["kernels_launched"] - before, out


@pytest.fixture
def xy():
    a = np.random.randn(8, 16).astype(np.float32)
    b = np.random.randn(8, 16).astype(np.float32)
    return a, b, zyx.Tensor(a), zyx.Tensor(b)


def test_elementwise_chain_is_one_kernel(xy):
    a, b, x, y = xy
    n, out = launched(lambda: ((x * 2 + 1).exp().sqrt() - y.abs() / (y * y + 1)).numpy())
    assert n == 1
    np.testing.assert_allclose(out, np.sqrt(np.exp(a * 2 + 1)) - np.abs(b) / (b * b + 1),
                               rtol=1e-5)


def test_elementwise_into_reduce_is_one_kernel(xy):
    a, b, x, y = xy
    n, out = launched(lambda: ((x * y).exp() + 1).sum(1).numpy())
    assert n == 1
    np.testing.assert_allclose(out, (np.exp(a * b) + 1).sum(1), rtol=1e-5)


def test_reduce_epilogue_is_one_kernel(xy):
    a, b, x, y = xy
    n, out = launched(lambda: (x.sum(1) * 2 + 1).numpy())
    assert n == 1
    np.testing.assert_allclose(out, a.sum(1) * 2 + 1, rtol=1e-5)
    n, out = launched(lambda: (x.amax(-1).exp() - x.amin(-1)).sqrt().numpy())
    assert n == 1
    np.testing.assert_allclose(out, np.sqrt(np.exp(a.max(-1)) - a.min(-1)), rtol=1e-5)


def test_softmax_last_axis_is_one_kernel(xy):
    a, b, x, y = xy
    n, out = launched(lambda: x.softmax(-1).numpy())
    assert n == 1
    e = np.exp(a - a.max(-1, keepdims=True))
    np.testing.assert_allclose(out, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)


def test_movement_ops_are_index_math_not_kernels(xy):
    a, b, x, y = xy
    n, out = launched(lambda: (x.T.flip(0)[::2].reshape(4, 16) * 2 + y[:4]).numpy())
    assert n == 1
    np.testing.assert_allclose(out, a.T[::-1][::2].reshape(4, 16) * 2 + b[:4], rtol=1e-6)
    n, out = launched(lambda: zyx.cat([x, y.flip(1), x * 3], 0).numpy())
    assert n == 1
    np.testing.assert_allclose(out, np.concatenate([a, b[:, ::-1], a * 3]), rtol=1e-6)
    n, _ = launched(lambda: x.pad((1, 1)).expand(2, 8, 18).permute(2, 0, 1).numpy())
    assert n == 1


def test_matmul_is_one_kernel():
    a = np.random.randn(6, 5).astype(np.float32)
    b = np.random.randn(5, 7).astype(np.float32)
    n, out = launched(lambda: ((zyx.Tensor(a) @ zyx.Tensor(b)) * 0.5 + 1).relu().numpy())
    assert n == 1
    np.testing.assert_allclose(out, np.maximum((a @ b) * 0.5 + 1, 0), rtol=1e-5, atol=1e-6)


def test_constants_need_no_buffers_and_realized_tensors_no_kernels():
    n, out = launched(lambda: (zyx.ones(3, 4) * 2 + zyx.full((4,), 0.5)).numpy())
    assert n == 1 and np.all(out == 2.5)
    x = zyx.Tensor(np.ones(5, np.float32))
    n, _ = launched(lambda: x.numpy())          # a leaf reads its buffer, no kernel
    assert n == 0
    y = (x * 3).realize()
    n, out = launched(lambda: y.numpy())        # already realized
    assert n == 0 and np.all(out == 3)
    n, _ = launched(lambda: (y + 1).numpy())    # the realized value is read, not recomputed
    assert n == 1


def test_shared_subexpression_two_results(xy):
    a, b, x, y = xy
    e = (x * y).exp()
    p, q = e + 1, e * 2
    n1, pv = launched(lambda: p.numpy())
    n2, qv = launched(lambda: q.numpy())
    assert n1 == 1 and n2 == 1
    np.testing.assert_allclose(pv, np.exp(a * b) + 1, rtol=1e-5)
    np.testing.assert_allclose(qv, np.exp(a * b) * 2, rtol=1e-5)


def test_graph_cache_reuses_plan_with_new_buffers():
    def step(a, b):
        x, y = zyx.Tensor(a), zyx.Tensor(b)
        return ((x @ y).relu().sum(0) * 0.5 - x.mean()).numpy()

    a1, b1 = np.random.randn(4, 3).astype(np.float32), np.random.randn(3, 5).astype(np.float32)
    a2, b2 = np.random.randn(4, 3).astype(np.float32), np.random.randn(3, 5).astype(np.float32)
    step(a1, b1)                     # builds (or reuses) the plan
    s0 = zyx.stats()
    out = step(a2, b2)               # same structure, new buffers
    s1 = zyx.stats()
    assert s1["plans_built"] == s0["plans_built"]
    assert s1["plan_cache_hits"] == s0["plan_cache_hits"] + 1
    assert s1["kernels_compiled"] == s0["kernels_compiled"]
    # and the cached plan computed with the new inputs
    np.testing.assert_allclose(out, np.maximum(a2 @ b2, 0).sum(0) * 0.5 - a2.mean(), rtol=1e-5,
                               atol=1e-6)


def test_graph_cache_distinguishes_structure():
    x = zyx.Tensor(np.arange(6, dtype=np.float32))
    (x * 2).numpy()
    s0 = zyx.stats()
    out = (x * 3).numpy()            # a different constant is a different graph
    assert zyx.stats()["plans_built"] == s0["plans_built"] + 1
    assert out.tolist() == [0, 3, 6, 9, 12, 15]
    z = zyx.Tensor(np.arange(6, dtype=np.int32))
    s0 = zyx.stats()
    assert (z * 3).numpy().tolist() == [0, 3, 6, 9, 12, 15]      # different dtype
    assert zyx.stats()["plans_built"] == s0["plans_built"] + 1


def test_second_process_compiles_nothing(tmp_path, device):
    """Compiled kernels live in the disk cache: a second process finds them there (for
    each device: C libraries, OpenCL program binaries, CUDA cubins, Vulkan's pipeline
    cache)."""
    if str(device).startswith("wgpu"):
        pytest.skip("WebGPU (wgpu-py 0.32) has no API to keep compiled pipelines between "
                    "processes: each process builds its shaders again")
    script = tmp_path / "prog.py"
    script.write_text(
        "import numpy as np, zyx\n"
        "x = zyx.Tensor(np.arange(12, dtype=np.float32).reshape(3, 4))\n"
        "print(float((x.exp() * 1.25 - 0.75).sum(1).max().item()))\n")
    # a private, empty cache: the first process must compile, the second must not
    env = dict(os.environ, ZYX_DEBUG="32", XDG_CACHE_HOME=str(tmp_path / "cache"),
               ZYX_DEVICE=str(device))
    runs = [subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           env=env, timeout=300) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    assert runs[0].stdout == runs[1].stdout
    assert "compiled" in runs[0].stderr, runs[0].stderr
    assert "compiled" not in runs[1].stderr, runs[1].stderr
    e = np.exp(np.arange(12, dtype=np.float32).reshape(3, 4)) * 1.25 - 0.75
    assert float(runs[1].stdout) == pytest.approx(float(e.sum(1).max()), rel=1e-5)


def test_fused_results_match_unfused(xy):
    """The same values whether intermediates are realized (kernel boundaries) or fused."""
    a, b, x, y = xy
    fused = ((x * y).exp().sum(1, keepdim=True) / (x.abs() + 1)).log_softmax(-1).numpy()
    t = (x * y).exp().realize()
    t = t.sum(1, keepdim=True).realize()
    t = (t / (x.abs() + 1)).realize()
    split = t.log_softmax(-1).numpy()
    assert_close(fused, split, dtype=zyx.float32, rtol=1e-5, atol=1e-5)


def test_graph_cache_tells_signed_zero_constants_apart():
    x = zyx.Tensor(np.array([-0.0, 1.0], np.float32))
    a = (x + (-0.0)).numpy()
    b = (x + 0.0).numpy()
    assert np.signbit(a[0]) and not np.signbit(b[0])


def _plan_kernels(*ts):
    """The kernels a realization of `ts` would run (kernelize, no compile)."""
    from zyx._core.kernelizer import kernelize
    g = zyx._RT.graph
    ids = [t._id for t in ts]
    order, _ = g.collect(ids)
    steps, _ = kernelize(g, order, ids, 64)
    return [s.kernel for s in steps if s.kernel is not None]


def _divides_an_index(kernel):
    from zyx._core import kernel as K
    return any(op[0] == K.BINARY and op[1] is K.IDX and op[2] in (K.B_DIV, K.B_MOD)
               for op in kernel.ops)


def test_axes_merged_from_parts_apart_in_memory_index_with_strides():
    """Attention heads merged back into features, (N, H, L, d) -> (N, L, H*d), then a
    linear layer: its reduce (forward) and its weight gradient's output axis run over
    the merged axis. The kernelizer cuts that axis into its parts (H, d), so no index is
    a division or a remainder and the matmuls get register tiles; values as numpy's."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 4, 8, 16)).astype(np.float32)
    wn = rng.standard_normal((24, 64)).astype(np.float32)
    w = zyx.tensor(wn, requires_grad=True)
    x = zyx.tensor(a).permute(0, 2, 1, 3).reshape(2, 8, 64)
    y = zyx.nn.functional.linear(x, w)
    xn = a.transpose(0, 2, 1, 3).reshape(2, 8, 64)
    (k,) = _plan_kernels(y)
    assert not _divides_an_index(k)
    assert_close(y, xn @ wn.T, rtol=1e-4, atol=1e-4)
    (y * y).sum().backward()
    gw = w.grad
    kernels = _plan_kernels(gw)
    assert len(kernels) == 2 and not any(_divides_an_index(k) for k in kernels)
    # (one kernel for 2 * y, one for the weight gradient: a single reduce over both
    # leading axes, no (batch, out, in) intermediate)
    ref = 2 * np.einsum("blo,bli->oi", xn @ wn.T, xn)
    assert_close(gw, ref, rtol=1e-4, atol=1e-3)


def test_an_activation_feeding_a_matmul_is_computed_once():
    """GELU between the two linears of a feed-forward block is stored by the first
    linear's kernel, not recomputed inside the second for every output column (erf per
    multiply-add: the forward of a 2-layer transformer took 44 ms instead of 27)."""
    from zyx._core import kernel as K
    layer = zyx.nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
    blocks = zyx.nn.TransformerEncoder(layer, 2)
    x = zyx.tensor(np.random.default_rng(0).standard_normal((4, 64, 128)).astype(np.float32))
    with zyx.no_grad():
        y = blocks(x)
    with_erf = [k for k in _plan_kernels(y)
                if any(op[0] == K.UNARY and op[2] == K.U_ERF for op in k.ops)]
    assert len(with_erf) == 2
    for k in with_erf:      # the first linear's kernels (4 * 64 * 512 outputs), no others
        assert k.args[0][1] == 4 * 64 * 512


def test_a_large_gradient_read_by_several_kernels_is_computed_once(monkeypatch):
    """conv -> relu -> max-pool, backward: the pool's gradient at the conv's output feeds
    the conv's input gradient (through a padded copy), its weight gradient and its bias
    gradient. On a large output (SHARED_LARGE elements or more) it is stored once by a
    kernel of its own. With the rule off, on the CPU (where the weight gradient reads it
    through a channels-last copy) each of those kernels recomputes it behind padding
    guards. Gradients match either way."""
    from zyx._core import kernelizer as KZ
    F = zyx.nn.functional
    rng = np.random.default_rng(0)
    xn = rng.standard_normal((8, 32, 36, 36)).astype(np.float32)   # conv out 8x32x32x32
    wn = rng.standard_normal((32, 32, 5, 5)).astype(np.float32) * 0.05
    bn = rng.standard_normal(32).astype(np.float32) * 0.1
    conv_out = 8 * 32 * 32 * 32

    def grads():
        x = zyx.tensor(xn, requires_grad=True)
        w = zyx.tensor(wn, requires_grad=True)
        b = zyx.tensor(bn, requires_grad=True)
        y = F.max_pool2d(F.relu(F.conv2d(x, w, b)), 2)
        (y * y).sum().backward()
        gs = [x.grad, w.grad, b.grad]
        # kernels computing the pool gradient: they read pooled-size tensors and write
        # something else (stored once: one kernel; else the padded copy, the
        # channels-last copy and the bias gradient each)
        readers = [k for k in _plan_kernels(*gs) if k.args[0][1] != conv_out // 4
                   and any(a[1] == conv_out // 4 for a in k.args[1:])]
        return len(readers), [g.numpy() for g in gs]

    assert conv_out >= KZ.SHARED_LARGE
    monkeypatch.setattr(zyx.autograd, "_templates", {})
    n_on, on = grads()
    monkeypatch.setattr(KZ, "SHARED_LARGE_LIMIT", 1 << 30)
    n_off, off = grads()
    assert n_on == 1, n_on
    if zyx._RT.device().info().window_tiles:
        assert n_off == 3, n_off
    for g, r in zip(on, off):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4 * np.abs(r).max())


def test_lanes_rows_avoid_strides_that_share_cache_sets():
    """A "lanes" tile's rows are the output axis before the lanes unless the operand
    broadcast over the lanes steps by a multiple of 1024 elements along it (its rows
    would share L1 sets): out[j, i, :] = x[i, j, :] @ w with x's i stride 8192 takes
    its 16 rows along j (stride 128) instead; values as numpy's."""
    from zyx._core import kernel as K
    rng = np.random.default_rng(1)
    xn = rng.standard_normal((16, 64, 128)).astype(np.float32)
    wn = rng.standard_normal((128, 64)).astype(np.float32)
    y = zyx.tensor(xn).permute(1, 0, 2) @ zyx.tensor(wn)
    (k,) = _plan_kernels(y)
    index = {op[2]: op[3] for op in k.ops if op[0] == K.INDEX}
    assert any(op[0] == K.DEFINE and op[2] == K.SCOPE_REGISTER and op[5] == 256
               for op in k.ops)                      # a 16 x 16 tile
    assert index.get(0) == 64 // 16 and index.get(1, 1) == 16     # rows along axis 0
    assert_close(y, xn.transpose(1, 0, 2) @ wn, rtol=1e-4, atol=1e-4)
    # the same product from a contiguous x (axis 1's stride 128): rows before the lanes
    y2 = zyx.tensor(xn.transpose(1, 0, 2).copy()) @ zyx.tensor(wn)
    (k2,) = _plan_kernels(y2)
    index2 = {op[2]: op[3] for op in k2.ops if op[0] == K.INDEX}
    assert index2.get(1) == 16 // 16 or 1 not in index2


def test_reduced_axes_neighbours_in_memory_are_one_loop():
    """A weight gradient over (B, T) of (B, T, D) activations reduces two axes that are
    neighbours in memory: the CPU kernel walks them with one loop (gcc keeps its register
    tile in registers across it), values as numpy's. Axes that are not neighbours in
    memory (a transposed operand's) keep a loop each."""
    from zyx._core import kernel as K
    rng = np.random.default_rng(2)
    xn = rng.standard_normal((8, 16, 32)).astype(np.float32)
    hn = rng.standard_normal((8, 16, 48)).astype(np.float32)
    x, h = zyx.tensor(xn), zyx.tensor(hn)
    gw = (x.unsqueeze(-1) * h.unsqueeze(-2)).sum((0, 1))
    (k,) = _plan_kernels(gw)
    loops = [op[2] for op in k.ops if op[0] == K.LOOP]
    assert loops[0] == 8 * 16, loops      # (the loops after it are the register tile's)
    assert_close(gw, np.einsum("btd,bte->de", xn, hn), rtol=1e-4, atol=1e-4)
    # the batch axis of a (T, B, D) view is not next to the time axis in memory
    xt = zyx.tensor(xn.transpose(1, 0, 2).copy()).permute(1, 0, 2)
    gw2 = (xt.unsqueeze(-1) * h.unsqueeze(-2)).sum((0, 1))
    (k2,) = _plan_kernels(gw2)
    assert [op[2] for op in k2.ops if op[0] == K.LOOP][:2] == [8, 16]
    assert_close(gw2, np.einsum("btd,bte->de", xn, hn), rtol=1e-4, atol=1e-4)


def _lane_tile(kernel):
    """(register tile size, lengths of the tile's loops) of a kernel's reduce."""
    from zyx._core import kernel as K
    size = max((op[5] for op in kernel.ops
                if op[0] == K.DEFINE and op[2] == K.SCOPE_REGISTER), default=0)
    return size, [op[2] for op in kernel.ops if op[0] == K.LOOP]


def test_convolution_lanes_over_output_channels(device, monkeypatch):
    """A convolution whose output width is no whole vector (8 here) reads its weights
    through a stored copy with output channels innermost, and its register tile takes
    vector lanes over the channels (32: two vectors) times rows along the output axis
    where the most rows divide; the weight gradient reads gy channels-last the same way. Values as numpy's; without the copy
    (CHANNELS_LAST_WEIGHTS off) the tile has no 32-lane loop."""
    import zyx.nn.functional as F
    from gpu_cases import _conv2d_grads_ref, _conv2d_ref
    if device.type != "cpu":
        pytest.skip(f"the channels-last copy is made for the CPU's register tiles, not "
                    f"for {device}")
    rng = np.random.default_rng(3)
    xn = rng.standard_normal((4, 8, 12, 12)).astype(np.float32)
    wn = (rng.standard_normal((32, 8, 5, 5)) * 0.2).astype(np.float32)
    gn = rng.standard_normal((4, 32, 8, 8)).astype(np.float32)

    def conv():
        x = zyx.tensor(xn, requires_grad=True)
        w = zyx.tensor(wn, requires_grad=True)
        y = F.conv2d(x, w)
        return x, w, y
    x, w, y = conv()
    kernels = _plan_kernels(y)
    assert len(kernels) == 2                     # the weights' copy, the convolution
    size, loops = _lane_tile(kernels[-1])
    assert loops[-1] == 32 and size % 32 == 0 and size > 32, (size, loops)
    assert_close(y, _conv2d_ref(xn, wn, 0), rtol=1e-4, atol=1e-4)
    (y * zyx.tensor(gn)).sum().backward()
    gx, gw = _conv2d_grads_ref(xn, wn, gn, 0)
    assert_close(x.grad, gx, rtol=1e-4, atol=1e-4)
    assert_close(w.grad, gw, rtol=1e-4, atol=1e-3)
    _, w2, y2 = conv()
    (y2 * zyx.tensor(gn)).sum().backward()
    tiles = [_lane_tile(k) for k in _plan_kernels(w2.grad)]
    assert any(t[1] and t[1][-1] == 32 and t[0] > 32 for t in tiles), tiles
    monkeypatch.setattr(F, "CHANNELS_LAST_WEIGHTS", False)
    _, _, y3 = conv()
    (k3,) = _plan_kernels(y3)
    assert _lane_tile(k3)[1][-1] != 32
    assert_close(y3, _conv2d_ref(xn, wn, 0), rtol=1e-4, atol=1e-4)
