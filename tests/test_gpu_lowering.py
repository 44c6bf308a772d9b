"""GPU lowering (zyx/codegen/gpu) on OpenCL through whatever device is installed (PoCL's
CPU device here and in CI): every strategy against numpy, the structure of what is
generated (groups, launches, 32/64-bit index math), the strategy chosen for an H100's
DeviceInfo (rendered only), and kernel counts equal to the C backend's.

Skipped, with the reason, when pyopencl or an OpenCL device is missing."""
from __future__ import annotations

import numpy as np
import pytest

import zyx
import zyx.nn.functional as F
from zyx import dtype as zdt
from zyx._core import kernel as K
from zyx._core.kernelizer import kernelize
from zyx._core.passes import optimize
from zyx.codegen.target import DeviceInfo
from zyx.codegen.gpu import dispatch as gpu
from zyx.codegen.gpu import reduce
from zyx.codegen.gpu import elementwise
from zyx.codegen.gpu import analysis
from zyx.codegen.cstyle import OpenCLDialect

from conftest import only_backend

cl = pytest.importorskip("pyopencl", reason="pyopencl is not installed")

# an H100 as the CUDA backend will describe it (132 SMs, warps of 32, 1024 threads)
H100 = DeviceInfo(name="H100", max_local_threads=1024, warp_size=32, num_cores=132,
                  local_mem_size=228 * 1024, register_tiles=False)


@pytest.fixture(scope="module", autouse=True)
def opencl_device():
    yield from only_backend("opencl", "no OpenCL device")


@pytest.fixture
def lowered(opencl_device, monkeypatch):
    """The GPUKernels lowered while a test runs (programs are not reused from earlier
    tests: the device's caches start empty; every size gets its own kernels, not a plan at
    a bound on a size that grows)."""
    from zyx.backends import opencl
    found = []

    def spy(kernel, dl, info=None, name="zyx_k", schedule=None):
        g = gpu.lower(kernel, dl, info, name, schedule)
        found.append(g)
        return g
    monkeypatch.setattr(opencl, "lower", spy)
    monkeypatch.setattr(opencl_device, "_programs", {})
    monkeypatch.setattr(opencl_device, "_by_source", {})
    monkeypatch.setattr(zyx._RT, "plans", {})
    monkeypatch.setattr(zyx._RT, "growing_sizes", False)
    return found


def close(t, ref, rtol=1e-5, atol=1e-5):
    out = t.numpy()
    assert out.shape == np.shape(ref)
    np.testing.assert_allclose(out.astype(np.float64), np.asarray(ref, np.float64),
                               rtol=rtol, atol=atol)


def rng():
    return np.random.default_rng(7)


def kernels_of(t, register_tiles=False):
    """The optimized kernels a GPU device would get for lazy tensor `t`, not run."""
    g = zyx._RT.graph
    order, _ = g.collect([t._id])
    steps, _ = kernelize(g, order, [t._id], 64, register_tiles)
    return [optimize(s.kernel) for s in steps if s.kernel is not None]


# -- every strategy against numpy ------------------------------------------------------------

def test_full_sum_of_16m_values_is_as_accurate_as_float64(lowered):
    # values near 1000: a float32 running sum would stop growing at 2**24
    a = (rng().random(2 ** 24) + 1000).astype(np.float32)
    x = zyx.from_numpy(a)
    np.testing.assert_allclose(x.sum().item(), a.astype(np.float64).sum(), rtol=1e-7)
    np.testing.assert_allclose(x.mean().item(), a.astype(np.float64).mean(), rtol=1e-7)
    assert [g.strategy for g in lowered] == ["group+partials", "group+partials"]


RAGGED = [(5, 37, 130), (300, 3, 5), (1, 999, 1), (200, 3, 300)]
AXES = [0, 1, 2, (0, 2), None]


@pytest.mark.parametrize("shape", RAGGED)
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
def test_reduce_each_axis_of_ragged_3d(shape, op, lowered):
    r = rng()
    # prod of values near 1 neither overflows nor vanishes
    a = (r.uniform(0.97, 1.03, shape) if op == "prod" else r.standard_normal(shape))
    a = a.astype(np.float32)
    zop = {"max": "amax", "min": "amin"}.get(op, op)     # values only (max(dim) is a pair)
    for axis in AXES:
        got = getattr(zyx.Tensor(a), zop)(axis=axis)
        ref = getattr(np, op)(a, axis=axis)
        close(got, ref, rtol=1e-4)
    # rows, columns and full reductions take different strategies here
    assert {g.strategy for g in lowered} & {"group", "group+partials"}


def test_reduce_keepdim_and_epilogue(lowered):
    a = rng().standard_normal((7, 3000)).astype(np.float32)
    b = rng().standard_normal((7, 1)).astype(np.float32)
    x, y = zyx.Tensor(a), zyx.Tensor(b)
    close(x.sum(axis=1, keepdim=True) * 0.5 + y, a.sum(1, keepdims=True) * 0.5 + b, rtol=1e-4)
    close((x.amax(axis=1) - x.amin(axis=1)).sqrt(), np.sqrt(a.max(1) - a.min(1)))
    # two reductions fused into one epilogue, each split over groups
    c = rng().standard_normal(50000).astype(np.float32)
    z = zyx.Tensor(c)
    close(z.sum() / z.max(), c.astype(np.float64).sum() / c.max(), rtol=1e-4)
    assert "group+partials" in [g.strategy for g in lowered]


def test_mean_var_std(lowered):
    a = (rng().standard_normal((9, 4100)) * 3 + 5).astype(np.float32)
    x = zyx.Tensor(a)
    close(x.mean(), a.astype(np.float64).mean())
    close(x.mean(axis=1), a.mean(1), rtol=1e-5)
    close(x.var(axis=1), a.var(1, ddof=1), rtol=1e-4)
    close(x.var(), a.astype(np.float64).var(ddof=1), rtol=1e-4)
    close(x.std(axis=0), a.std(0, ddof=1), rtol=1e-4)


def test_softmax_log_softmax_logsumexp(lowered):
    a = (rng().standard_normal((37, 1000)) * 4).astype(np.float32)
    x = zyx.Tensor(a)
    m = a.max(-1, keepdims=True)
    e = np.exp(a - m)
    close(x.softmax(-1), e / e.sum(-1, keepdims=True), rtol=1e-4, atol=1e-7)
    close(x.log_softmax(-1), a - m - np.log(e.sum(-1, keepdims=True)), rtol=1e-4, atol=1e-5)
    close(x.logsumexp(-1), (m + np.log(e.sum(-1, keepdims=True)))[:, 0], rtol=1e-5)
    assert "group" in [g.strategy for g in lowered]


@pytest.mark.parametrize("width,group", [(1000, ""), (1024, ""), (1024, "cache=0"),
                                         (4096, "local=512")])
def test_row_kernels_run_as_one_group_per_row(width, group, lowered, monkeypatch):
    # softmax, log_softmax and layer_norm are one kernel each: per row, each reduce nest
    # split over the group's work-items and combined in local memory (every work-item
    # reads the result back), then the store loop split over the work-items. Where the
    # row splits evenly into a few elements per work-item (1024 over 128, 4096 over 512)
    # the first loop keeps them in registers and the later loops read them there.
    import zyx.nn.functional as F
    monkeypatch.setenv(reduce.GROUP_ENV, group)
    a = (rng().standard_normal((37, width)) * 4).astype(np.float32)
    a[0] = -np.inf
    a[1] = 3.0
    t = torch_like_softmax(a)
    close(zyx.Tensor(a).softmax(-1), t, rtol=1e-5, atol=1e-7)
    b = a[1:]
    m = b.max(-1, keepdims=True)
    e = np.exp(b - m)
    close(zyx.Tensor(b).log_softmax(-1), b - m - np.log(e.sum(-1, keepdims=True)),
          rtol=1e-5, atol=1e-5)
    w = rng().standard_normal(width).astype(np.float32)
    c = a[2:]    # (an all-equal row's deviations are rounding, scaled up by 1/sqrt(eps))
    mu = c.astype(np.float64).mean(-1, keepdims=True)
    var = ((c - mu) ** 2).mean(-1, keepdims=True)
    close(F.layer_norm(zyx.Tensor(c), (width,), zyx.Tensor(w)),
          (c - mu) / np.sqrt(var + 1e-5) * w, rtol=1e-4, atol=1e-4)
    assert [g.strategy for g in lowered] == ["group"] * 3
    assert all(g.launches[0].groups == n for g, n in zip(lowered, (37, 36, 35)))
    cached = width % 1000 != 0 and "cache=0" not in group
    # (layer_norm's sums run in blocks of GPU_SUM_BLOCK = 256: with 512 work-items
    # a block does not give each one a whole iteration, so nothing is counted there)
    blocks_fit = gpu.GPU_SUM_BLOCK % lowered[2].variant["local"] == 0
    assert [g.variant["cached_loads"] > 0 for g in lowered] == [cached, cached,
                                                                cached and blocks_fit]


def torch_like_softmax(a):
    """softmax with torch's NaN for a row of -inf."""
    with np.errstate(invalid="ignore"):
        e = np.exp(a - a.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)


def test_row_kernel_store_loop_is_split_and_unguarded():
    dl = OpenCLDialect()
    rows = zyx.Tensor(np.ones((16, 4096), np.float32)).reshape(16, 1, 4096) \
        .expand(16, 1024, 4096).reshape(16384, 4096)
    (k,) = kernels_of(rows.softmax(-1))
    nests = analysis.reduce_nests(k.ops)
    assert [n.stores for n in nests] == [False] * (len(nests) - 1) + [True]
    g = gpu.lower(k, dl, H100, schedule={"group": {"cache": 0}})
    assert g.strategy == "group" and len(g.launches) == 1
    assert g.launches[0].groups == 16384 and g.launches[0].local_size == 256
    store_loop = g.source[g.source.rindex("for (int zyx_f"):]
    assert "+= 256)" in store_loop.splitlines()[0]       # strided over the group
    assert "g0[" in store_loop and "zyx_lid == 0" not in store_loop
    assert g.source.count("g1[") == 3 and g.variant["cached_loads"] == 0
    # with the row cache (the default), x is read from memory once: the max loop keeps
    # its 16 elements per work-item in registers for the sum and store loops
    g = gpu.lower(k, dl, H100)
    assert g.variant["cached_loads"] == 2 and g.source.count("g1[") == 1
    assert "float zyx_c0[16];" in g.source and g.source.count("#pragma unroll") == 3
    store_loop = g.source[g.source.rindex("for (int zyx_k"):]
    assert "zyx_k" in store_loop and "< 16;" in store_loop.splitlines()[0]
    assert "zyx_f" in store_loop and "zyx_lid + zyx_k" in store_loop
    assert "g0[" in store_loop and "zyx_c0[" in store_loop and "zyx_lid == 0" not in store_loop
    # a store nest whose index does not move with its loop is not split
    ops = list(k.ops)
    st = max(i for i, op in enumerate(ops) if op[0] == K.STORE)
    row = next(i for i, op in enumerate(ops) if op[0] == K.INDEX)
    ops[st] = ops[st][:3] + (row,) + ops[st][4:]
    assert analysis.reduce_nests(ops) is None


def test_argmax_argmin(lowered):
    a = rng().standard_normal((13, 517)).astype(np.float32)
    x = zyx.Tensor(a)
    np.testing.assert_array_equal(x.argmax(axis=1).numpy(), a.argmax(1))
    np.testing.assert_array_equal(x.argmin(axis=0).numpy(), a.argmin(0))
    assert int(x.argmax().item()) == int(a.argmax())


@pytest.mark.parametrize("m,k,n", [(33, 65, 17), (4, 5000, 3), (64, 64, 64)])
def test_matmul(m, k, n, lowered):
    r = rng()
    a = r.standard_normal((m, k)).astype(np.float32)
    b = r.standard_normal((k, n)).astype(np.float32)
    close(zyx.Tensor(a) @ zyx.Tensor(b), a @ b, rtol=1e-4, atol=1e-4)
    close(zyx.Tensor(a) @ zyx.Tensor(b.T.copy()).T, a @ b, rtol=1e-4, atol=1e-4)


def test_integer_and_bool_reductions(lowered):
    r = rng()
    i = r.integers(-1000, 1000, (6, 3001)).astype(np.int32)
    x = zyx.Tensor(i)
    np.testing.assert_array_equal(x.sum(axis=1).numpy(), i.sum(1))
    np.testing.assert_array_equal(x.amax(axis=0).numpy(), i.max(0))
    assert int(x.sum().item()) == int(i.astype(np.int64).sum())
    assert int(x.min().item()) == int(i.min())
    big = r.integers(0, 2**40, 20000).astype(np.int64)
    assert int(zyx.Tensor(big).sum().item()) == int(big.sum())
    b = r.random((5, 4001)) > 0.9995
    y = zyx.Tensor(b)
    np.testing.assert_array_equal(y.any(axis=1).numpy(), b.any(1))
    np.testing.assert_array_equal(y.all(axis=1).numpy(), b.all(1))
    assert bool(y.any().item()) == bool(b.any())
    assert bool((~y).all().item()) == bool((~b).all())


@pytest.mark.parametrize("d", [zdt.float16, zdt.bfloat16])
def test_half_precision_reductions(d, lowered):
    a = rng().standard_normal((5, 3000)).astype(np.float32)
    x = zyx.Tensor(a).cast(d)
    ref = x.cast(zdt.float32).numpy().astype(np.float64)    # the rounded inputs
    close(x.sum(axis=1).cast(zdt.float32), ref.sum(1), rtol=1e-2, atol=0.1)
    close(x.amax(axis=1).cast(zdt.float32), ref.max(1))
    close(x.mean().cast(zdt.float32), ref.mean(), rtol=1e-2, atol=1e-2)
    close(x.sum().cast(zdt.float32), ref.sum(), rtol=1e-2, atol=1)


def test_outputs_not_a_multiple_of_the_group(lowered):
    a = rng().standard_normal(1001).astype(np.float32)
    close(zyx.Tensor(a) * 3 - 1, a * 3 - 1)
    g = lowered[-1]
    assert g.strategy == "elementwise"
    assert g.launches[0].groups * g.variant["tile"] >= 1001
    b = rng().standard_normal((37, 300)).astype(np.float32)
    close(zyx.Tensor(b).sum(axis=1), b.sum(1), rtol=1e-4)
    # one group per row (times the groups a blocked row is split into)
    assert lowered[-1].strategy.startswith("group") and lowered[-1].launches[0].groups % 37 == 0


def test_column_reductions_split_over_groups(lowered):
    # 900 columns read contiguously along the output: one work-item per column, each
    # column's rows also split over groups, partials combined by a second launch
    a = (rng().random((200, 3, 300)) + 1000).astype(np.float32)
    x = zyx.Tensor(a)
    close(x.sum(axis=0), a.astype(np.float64).sum(0), rtol=1e-6)
    g = lowered[-1]
    assert g.strategy == "columns" and len(g.launches) == 2
    first, second = g.launches
    assert first.groups > second.groups            # several groups per block of columns
    # (both near 1000: the float32 difference keeps about 1e-4 of absolute precision)
    close(x.amax(axis=0) - x.mean(axis=0), a.max(0) - a.astype(np.float64).mean(0), atol=3e-4)
    assert "columns" in [k.strategy for k in lowered[1:]]


# -- the elementwise strategy's variants (ZYX_GPU_EW) --------------------------------------

# the default, scalar, wide vectors with few items, many items with short vectors and a
# grid-stride loop, and groups smaller than a vector step's worth of the tile
EW_VARIANTS = ["", "items=1,vec=1", "items=4,vec=1", "items=2,vec=8,local=64",
               "items=16,vec=2,local=128,waves=1", "items=1,vec=16,local=32,waves=2"]


@pytest.fixture(params=EW_VARIANTS)
def ew_variant(request, monkeypatch, lowered):
    monkeypatch.setenv(elementwise.EW_ENV, request.param)
    return request.param


def _ew(lowered):
    g = [k for k in lowered if k.strategy == "elementwise"][-1]
    return g, g.variant


# more than one tile per group step on PoCL's 2 compute units, a ragged tail, fewer
# outputs than one group, one output
@pytest.mark.parametrize("n", [2 ** 20 + 5, 65536, 1001, 7, 1])
def test_elementwise_variants_ragged_tails(n, ew_variant, lowered):
    a = rng().standard_normal(n).astype(np.float32)
    x = zyx.Tensor(a)
    close(((x * 1.5 + 0.5).sin() * 0.25 + x).tanh(),
          np.tanh(np.sin(a * 1.5 + 0.5) * 0.25 + a), rtol=2e-6, atol=1e-6)
    g, var = _ew(lowered)
    assert var["tile"] == var["local"] * var["items"] * var["vec"]
    assert g.launches[0].groups * var["tile"] >= n or var["waves"]
    if n > 1 and elementwise.elementwise_variant(ew_variant)["vec"] > 1:
        assert var["vec"] > 1 and var["vector_accesses"] == 2     # x in, result out
    if n % var["tile"]:
        assert f"zyx_base + {var['tile']} <= {n}" in g.source    # the guarded tail


def test_elementwise_variants_broadcasts_and_strided_loads(ew_variant, lowered):
    b = rng().standard_normal((37, 132)).astype(np.float32)
    c = rng().standard_normal(132).astype(np.float32)
    d = rng().standard_normal((37, 1)).astype(np.float32)
    vec = elementwise.elementwise_variant(ew_variant)["vec"] > 1
    # a row broadcast (same element along the row) and a bias (neighbouring elements):
    # the contiguous operand and the result are vectors, the others read per element
    close(zyx.Tensor(b) + zyx.Tensor(c) * zyx.Tensor(d), b + c * d, rtol=1e-6)
    g, var = _ew(lowered)
    assert var["vec"] > 1 if vec else var["vec"] == 1
    if vec:
        assert var["vector_accesses"] == 2
    # a transposed read: a tile through local memory (codegen/gpu/transpose.py) unless the
    # elementwise strategy is asked for by name; then it stays scalar (a work-item's
    # neighbours would be far apart)
    close(zyx.Tensor(b).T * 2 + 1, b.T * 2 + 1, rtol=1e-6)
    assert lowered[-1].strategy == "transpose"
    from zyx.codegen.gpu import transpose
    transpose.ENABLED = False
    try:
        close(zyx.Tensor(b).T * 3 + 1, b.T * 3 + 1, rtol=1e-6)
    finally:
        transpose.ENABLED = True
    assert _ew(lowered)[1]["vec"] == 1
    # a slice: its rows start 1 element in, so only the result is at the flat index
    close(zyx.Tensor(b)[:, 1:] * 2, b[:, 1:] * 2, rtol=1e-6)
    g, var = _ew(lowered)
    if vec:
        assert var["vector_accesses"] == 1
    # padding reads under a mask: never vector loads (they may point outside the buffer)
    close(F.pad(zyx.Tensor(b), (3, 1, 1, 2)) + 1, np.pad(b, ((1, 2), (3, 1))) + 1, rtol=1e-6)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "int8", "uint8", "int16", "int32",
                                  "int64", "float64", "bool"])
def test_elementwise_variants_dtypes(name, ew_variant, lowered):
    n = 3 * 4096 + 3
    r = rng()
    if name == "bool":
        a = r.random(n) < 0.5
        b = r.random(n) < 0.5
        close(zyx.Tensor(a) ^ zyx.Tensor(b), a ^ b)
        close(zyx.Tensor(a.astype(np.float32)) > 0.5, a)
        return
    if name in ("float16", "bfloat16", "float64"):
        a = r.standard_normal(n).astype(np.float32)
        x = zyx.Tensor(a).cast(name)
        ref = zyx.Tensor(a).cast(name).float().numpy().astype(np.float64)
        tol = {"float16": 2e-3, "bfloat16": 1.6e-2, "float64": 2e-7}[name]
        close((x * 3 - 1).float(), ref * 3 - 1, rtol=tol, atol=tol)
        close(x * 3 - 1, ref * 3 - 1, rtol=tol, atol=tol)     # stored in 16 (64) bits
        return
    info = np.iinfo(name)
    a = r.integers(max(info.min, -1000), min(info.max, 1000), n).astype(name)
    x = zyx.Tensor(a)
    out = (x * 3 - 1).numpy()
    assert out.dtype == np.dtype(name)
    np.testing.assert_array_equal(out, (a * 3 - 1).astype(name))
    np.testing.assert_array_equal((x.float() * 0.5).numpy(), a.astype(np.float32) * 0.5)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32", "bool"])
def test_permuted_copies_go_through_a_local_tile(dtype, lowered):
    """Elementwise kernels that read along one output axis and write along another
    (codegen/gpu/transpose.py): a 2-D transpose with arithmetic, NCHW -> NHWC and back
    with ragged tile edges, a batched transpose of a slice, against numpy; contiguous
    and broadcast reads stay elementwise."""
    from zyx.nn.functional import stored
    r = rng()

    def t(*shape):
        a = r.standard_normal(shape).astype(np.float32)
        x = zyx.Tensor(a).cast(dtype).realize()
        return x, x.numpy()
    x, a = t(70, 45)
    # (the same arithmetic on the untransposed tensor, in the same dtype: equal bits)
    if dtype == "bool":
        y, ref = ~x.T, (~x).numpy().T
    else:
        y, ref = x.T * 2 + 1, (x * 2 + 1).numpy().T
    np.testing.assert_array_equal(y.numpy(), ref)
    assert lowered[-1].strategy == "transpose"
    x, a = t(3, 24, 7, 37)                       # NCHW, 7 x 37 pixels, 24 channels
    nhwc = stored(x.permute(0, 2, 3, 1))
    np.testing.assert_array_equal(nhwc.numpy(), a.transpose(0, 2, 3, 1))
    assert lowered[-1].strategy == "transpose"
    back = stored(nhwc.permute(0, 3, 1, 2))
    np.testing.assert_array_equal(back.numpy(), a)
    x, a = t(4, 40, 50)
    np.testing.assert_array_equal(stored(x[:, 3:, 1:].permute(0, 2, 1)).numpy(),
                                  a[:, 3:, 1:].transpose(0, 2, 1))
    assert lowered[-1].strategy == "transpose"
    before = len(lowered)
    x, a = t(64, 48)
    np.testing.assert_array_equal((x + x).numpy(), (a + a).astype(x.numpy().dtype)
                                  if dtype != "bool" else a | a)
    z, c = t(48, 64)
    if dtype != "bool":          # one load along the store, one across: left as it is
        xt = zyx.Tensor(np.ascontiguousarray(a.T)).cast(dtype)
        np.testing.assert_array_equal((x.T + z).numpy(), (xt + z).numpy())
    assert all(g.strategy == "elementwise" for g in lowered[before:])


def test_transpose_plan_needs_long_sides():
    """Sides under transpose.MIN_SIDE (a 3-channel image) stay elementwise."""
    from zyx.codegen.gpu import transpose
    from zyx.nn.functional import stored
    x = zyx.Tensor(np.zeros((2, 3, 40, 40), np.float32))
    (k,) = kernels_of(stored(x.permute(0, 2, 3, 1)))
    assert transpose.plan(k.ops) is None
    x = zyx.Tensor(np.zeros((2, 32, 40, 40), np.float32))
    (k,) = kernels_of(stored(x.permute(0, 2, 3, 1)))
    p = transpose.plan(k.ops)
    assert p is not None and (p.la, p.lb) == (40, 32)


def test_elementwise_vector_types_and_both_index_widths(opencl_device, monkeypatch):
    # rendered (and built by the OpenCL compiler), not run: 2**32 outputs need 64-bit index
    # math; the vector types follow each buffer's storage type (16 bytes at most)
    monkeypatch.setenv(elementwise.EW_ENV, "items=2,vec=8")
    dl = OpenCLDialect()
    big = zyx.Tensor(np.ones(2 ** 16, np.float16)).reshape(1, 2 ** 16).expand(2 ** 16, 2 ** 16)
    small = zyx.Tensor(np.ones((64, 2 ** 12), np.float16))
    for t, bits in ((big * 2, 64), (small.float() * 2 + small, 32)):
        (k,) = kernels_of(t)
        g = gpu.lower(k, dl, H100)
        assert g.strategy == "elementwise" and g.index_bits == bits
        assert g.variant["vec"] == 8
        itype = "long" if bits == 64 else "int"
        assert f"const {itype} zyx_base" in g.source
        cl.Program(opencl_device.pool.ctx, g.source).build()
    assert "*(__global const ushort4*)" in g.source and "*(__global float4*)" in g.source
    # the big one's input is a broadcast of one row: read per element, result stored as
    # ushort4 (8 lanes = two of them per step)
    (k,) = kernels_of(big * 2)
    g = gpu.lower(k, dl, H100)
    assert g.variant["vector_accesses"] == 1 and g.source.count("*(__global ushort4*)") == 4


def test_elementwise_variant_is_read_from_the_environment(monkeypatch):
    assert elementwise.elementwise_variant("") == elementwise.EW_DEFAULT
    assert elementwise.elementwise_variant("items=2, vec=8,waves=3") == dict(
        elementwise.EW_DEFAULT, items=2, vec=8, waves=3)
    for bad in ("items=3", "vec=32", "local=0", "foo=1", "items", "items=x"):
        with pytest.raises(ValueError, match="ZYX_GPU_EW"):
            elementwise.elementwise_variant(bad)
    monkeypatch.setenv(elementwise.EW_ENV, "items=1,vec=2,local=512")
    x = zyx.Tensor(np.ones(2 ** 22, np.float32))
    (k,) = kernels_of(x * 2)
    g = gpu.lower(k, OpenCLDialect(), H100)
    assert g.variant == {"items": 1, "vec": 2, "local": 512, "waves": 0, "tile": 1024,
                         "vector_accesses": 2}
    assert g.launches[0].local_size == 512 and g.launches[0].groups == 2 ** 22 // 1024
    assert "float2" in g.source


def test_elementwise_steps_shrink_for_big_kernels_and_small_outputs(monkeypatch):
    monkeypatch.setenv(elementwise.EW_ENV, "items=8,vec=4")
    dl = OpenCLDialect()
    x = zyx.Tensor(np.ones(2 ** 26, np.float32))
    (k,) = kernels_of(x * 2)
    assert gpu.lower(k, dl, H100).variant["items"] == 8
    # 64K outputs: 8 x 4 per work-item would leave most of 132 SMs idle
    (k,) = kernels_of(zyx.Tensor(np.ones(2 ** 16, np.float32)) * 2)
    assert gpu.lower(k, dl, H100).variant["items"] == 1
    # a long fused body is written items * vec times: the steps shrink to fit EW_MAX_OPS
    y = x
    for j in range(200):
        y = (y * 1.0001 + j).sin()
    k = max(kernels_of(y), key=lambda k: len(k.ops))
    monkeypatch.setattr(elementwise, "EW_MAX_OPS", 12 * len(k.ops))    # (bounded inlining: <100)
    v = gpu.lower(k, dl, H100).variant
    assert v["items"] == 2 and v["vec"] == 4


# -- structure ----------------------------------------------------------------------------

def test_sum_of_4m_uses_many_groups_and_two_launches(lowered):
    a = rng().standard_normal(2 ** 22).astype(np.float32)
    close(zyx.Tensor(a).sum(), a.astype(np.float64).sum(), rtol=1e-6, atol=1e-3)
    g = lowered[-1]
    assert g.strategy == "group+partials"
    assert len(g.launches) == 2
    first, second = g.launches
    assert first.groups > 1 and first.local_size > 1
    assert second.groups == 1
    assert g.scratch == [first.groups * 8]        # one float64 partial per group
    assert ("scratch", 0) in first.args and ("scratch", 0) in second.args


def test_index_math_is_32_bit_when_extents_fit(lowered):
    a = rng().standard_normal((300, 200)).astype(np.float32)
    close(zyx.Tensor(a).T.sum(axis=1) + 1, a.sum(0) + 1, rtol=1e-4)
    g = lowered[-1]
    assert g.index_bits == 32
    assert "long" not in g.source.split("__kernel", 1)[1]


def test_index_math_is_64_bit_when_an_extent_does_not_fit(opencl_device):
    # 2**32 outputs: rendered, never run
    x = zyx.Tensor(np.ones(2 ** 16, np.float32))
    t = x.reshape(1, 2 ** 16).expand(2 ** 16, 2 ** 16) * 2
    (k,) = kernels_of(t)
    g = gpu.lower(k, OpenCLDialect(), opencl_device.info())
    assert g.index_bits == 64
    body = g.source.split("__kernel", 1)[1]
    assert "const long zyx_gid" in body and "const int " not in body
    small = gpu.lower(kernels_of(x * 2)[0], OpenCLDialect(), opencl_device.info())
    assert small.index_bits == 32 and "const int zyx_gid" in small.source


def test_index_ranges_of_affine_div_mod():
    ops = [(K.INDEX, K.IDX, 0, 1000), (K.LOOP, K.IDX, 7000000), (K.CONST, K.IDX, 7000000),
           (K.BINARY, K.IDX, K.B_MUL, 0, 2), (K.BINARY, K.IDX, K.B_ADD, 3, 1),
           (K.CONST, K.IDX, 7), (K.BINARY, K.IDX, K.B_MOD, 4, 5),
           (K.BINARY, K.IDX, K.B_DIV, 4, 5)]
    idx = analysis.index_math(ops)
    assert idx == {0, 1, 3, 4, 6, 7}
    rng_ = analysis.index_ranges(ops, idx)
    assert rng_[4] == (0, 999 * 7000000 + 6999999)
    assert rng_[6] == (0, 6)
    assert rng_[7] == (0, (999 * 7000000 + 6999999) // 7)
    assert analysis.narrow_index(ops, [1024]) == frozenset()    # 7e9 > 2**31
    ops[0] = (K.INDEX, K.IDX, 0, 100)
    assert analysis.narrow_index(ops, [1024]) == frozenset(idx)    # 7e8 fits


def test_h100_strategies_rendered():
    dl = OpenCLDialect()
    # 256M-element float32 sum: many groups per output, blocked float64 partials
    x = zyx.Tensor(np.ones(2 ** 14, np.float32))
    (k,) = kernels_of(x.reshape(1, 2 ** 14).expand(2 ** 14, 2 ** 14).sum())
    g = gpu.lower(k, dl, H100)
    assert g.strategy == "group+partials"
    assert g.launches[0].groups >= 132 * 4 and g.launches[0].local_size == 256
    assert g.index_bits == 32
    # softmax-sized row reductions: one group per row, no second pass
    rows = zyx.Tensor(np.ones((16, 4096), np.float32)).reshape(16, 1, 4096) \
        .expand(16, 1024, 4096).reshape(16384, 4096)
    (k,) = kernels_of(rows.amax(axis=1))
    g = gpu.lower(k, dl, H100)
    assert g.strategy == "group" and g.launches[0].groups == 16384
    assert g.launches[0].local_size == 256
    # 64M-element elementwise chain: groups of 256, each a tile of 4 steps of 4 elements
    # (the default variant; the broadcast operand is read per element)
    (k,) = kernels_of((x.reshape(1, 2 ** 14).expand(2 ** 12, 2 ** 14) * 2).exp() + 1)
    g = gpu.lower(k, dl, H100)
    assert g.strategy == "elementwise" and g.launches[0].local_size == 256
    assert g.launches[0].groups == 2 ** 26 // g.variant["tile"]
    # a big matmul: shared-memory tiles, 128 x 128 outputs (8 x 8 per work-item) where
    # that still gives every SM a group, else 64 x 64
    a = zyx.Tensor(np.ones((4096, 512), np.float32))
    b = zyx.Tensor(np.ones((512, 4096), np.float32))
    (k,) = kernels_of(a @ b)
    g = gpu.lower(k, dl, H100)
    assert g.strategy == "gemm" and g.variant == {"rows": 128, "cols": 128, "k": 8}
    assert g.launches[0].groups == 1024 and g.launches[0].local_size == 256
    a = zyx.Tensor(np.ones((1024, 512), np.float32))
    b = zyx.Tensor(np.ones((512, 1024), np.float32))
    (k,) = kernels_of(a @ b)
    g = gpu.lower(k, dl, H100)
    assert g.strategy == "gemm" and g.variant == {"rows": 64, "cols": 64, "k": 16}
    assert g.launches[0].groups == 256
    # ... unless turned off: then one work-item per output (enough of them, strided
    # right operand)
    assert gpu.lower(k, dl, H100, schedule={"gemm": None}).strategy == "serial"
    # column sums of 4096 x 16384: too few columns to fill 132 SMs one per work-item
    cols = zyx.Tensor(np.ones(16384, np.float32)).reshape(1, 16384).expand(4096, 16384)
    (k,) = kernels_of(cols.sum(axis=0))
    g = gpu.lower(k, dl, H100)
    assert g.strategy == "columns" and g.launches[0].groups == 64 * 17


def test_gpu_devices_tile_only_kernels_with_many_outputs(opencl_device):
    """GPU devices give the CPU's matmul tiles to kernels with at least tile_min_outputs
    outputs (one tile per work-item still fills the device) and never window tiles;
    ZYX_GPU_TILES=0 turns tiles off."""
    info = opencl_device.info()
    assert info.register_tiles is gpu.register_tiles() and info.window_tiles is False
    assert info.tile_min_outputs == gpu.tile_min_outputs(info.num_cores) > 0
    from zyx._core.kernelizer import kernelize
    a = zyx.Tensor(np.ones((64, 64), np.float32))

    def tiled(t, **kw):
        g = zyx._RT.graph
        order, _ = g.collect([t._id])
        steps, _ = kernelize(g, order, [t._id], 64, True, **kw)
        (k,) = [st.kernel for st in steps if st.kernel is not None]
        return any(op[0] == K.DEFINE and op[2] == K.SCOPE_REGISTER and op[5] > 1
                   for op in k.ops)
    assert tiled(a @ a, tile_min_outputs=64 * 64)
    assert not tiled(a @ a, tile_min_outputs=64 * 64 + 1)
    x = zyx.Tensor(np.ones((2, 3, 16, 16), np.float32))
    w = zyx.Tensor(np.ones((8, 3, 3, 3), np.float32))
    import zyx.nn.functional as F
    assert tiled(F.conv2d(x, w))                       # window lanes on the CPU
    assert not tiled(F.conv2d(x, w), window_tiles=False)


def test_kernels_with_cpu_tiles_lower_for_gpus(opencl_device):
    a = zyx.Tensor(np.ones((64, 64), np.float32))
    (tiled,) = kernels_of(a @ a, register_tiles=True)
    (plain,) = kernels_of(a @ a, register_tiles=False)
    assert any(op[0] == K.DEFINE and op[2] == K.SCOPE_REGISTER and op[5] > 1
               for op in tiled.ops)
    assert all(op[5] == 1 for op in plain.ops
               if op[0] == K.DEFINE and op[2] == K.SCOPE_REGISTER)
    # kernels with the CPU's tiles still lower (one work-item per output)
    assert gpu.lower(tiled, OpenCLDialect(), H100).strategy == "serial"


def test_unsupported_nest_falls_back_to_serial():
    # a register updated by something other than its reduce op (a running value) must
    # not be split over work-items
    f = zdt.float32
    ops = [(K.DEFINE, f, K.SCOPE_GLOBAL, 0, False, 1, -1),
           (K.DEFINE, f, K.SCOPE_GLOBAL, 1, True, 4096, -1),
           (K.DEFINE, f, K.SCOPE_REGISTER, 0.0, False, 1, K.R_SUM),
           (K.LOOP, K.IDX, 4096),
           (K.LOAD, f, 1, 3, -1),
           (K.LOAD, f, 2, -1, -1),
           (K.CONST, f, 0.5),
           (K.BINARY, f, K.B_MUL, 5, 6),
           (K.BINARY, f, K.B_ADD, 7, 4),
           (K.STORE, None, 2, -1, 8),
           (K.ENDLOOP, None, 3),
           (K.LOAD, f, 2, -1, -1),
           (K.CONST, K.IDX, 0),
           (K.STORE, None, 0, 12, 11)]
    k = K.Kernel(ops, [(f, 1, False), (f, 4096, True)])
    assert analysis.reduce_nests(ops) is None
    assert gpu.lower(k, OpenCLDialect(), H100).strategy == "serial"


# -- kernel counts -----------------------------------------------------------------------

def _launch_count(build):
    before = zyx.stats()["kernels_launched"]
    build().numpy()
    return zyx.stats()["kernels_launched"] - before


def test_kernel_counts_equal_the_c_backends():
    a = rng().standard_normal((40, 300)).astype(np.float32)
    graphs = [lambda: zyx.Tensor(a).softmax(-1),
              lambda: (zyx.Tensor(a) - zyx.Tensor(a).mean()).sum(axis=0),
              lambda: zyx.Tensor(a).var(axis=1) + zyx.Tensor(a).sum(axis=1),
              lambda: zyx.Tensor(a) @ zyx.Tensor(a).T]
    rt = zyx._RT
    gpu_counts = [_launch_count(b) for b in graphs]
    rt.init()
    try:
        if getattr(rt.device(), "backend", None) == "opencl":
            pytest.skip("no CPU backend to compare with")
        cpu_counts = [_launch_count(b) for b in graphs]
    finally:
        rt.init(only=["opencl"])
    assert gpu_counts == cpu_counts
