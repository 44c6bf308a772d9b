"""The WebGPU backend (wgpu-py) against numpy, on whatever adapter wgpu finds (lavapipe,
Mesa's Vulkan CPU driver, in CI). Skipped, with the reason, when wgpu-py or an adapter is
missing. The runtime is re-initialized with the wgpu backend alone for this module.

The WGSL writer's own checks (text of packed loads and stores, 2-D folding, the split
reduction's passes) need no device and run everywhere wgpu-py is not needed for them."""
from __future__ import annotations

import numpy as np
import pytest

import zyx
from zyx import dtype as dt
from zyx._core import kernel as K
from zyx.codegen.wgsl import supports, write
from zyx.codegen.wgsl.writer import fold
from zyx.errors import BackendError, UnsupportedDTypeError
from conftest import bf16_round, only_backend


# -- the writer, without a device -----------------------------------------------------------

def _copy_kernel(d_out, d_in, n, op=None):
    """IR of out[i] = f(in[i]) over n elements (f: None copies, else a BINARY op with 1)."""
    ops = [(K.DEFINE, d_out, K.SCOPE_GLOBAL, 0, False, n, None),
           (K.INDEX, K.IDX, 0, n),
           (K.DEFINE, d_in, K.SCOPE_GLOBAL, 1, True, n, None),
           (K.LOAD, d_in, 2, 1, -1)]
    v = 3
    if d_in is not d_out:
        ops.append((K.CAST, d_out, 3))
        v = 4
    ops.append((K.STORE, None, 0, 1, v))
    return K.Kernel(ops, [(d_out, n, False), (d_in, n, True)])


def _sum_kernel(n, d=dt.float32):
    ops = [(K.DEFINE, d, K.SCOPE_GLOBAL, 0, False, 1, None),
           (K.DEFINE, d, K.SCOPE_GLOBAL, 1, True, n, None),
           (K.DEFINE, d, K.SCOPE_REGISTER, 0.0, False, 1, K.R_SUM),
           (K.LOOP, K.IDX, n),
           (K.LOAD, d, 1, 3, -1),
           (K.LOAD, d, 2, -1, -1),
           (K.BINARY, d, K.B_ADD, 5, 4),
           (K.STORE, None, 2, -1, 6),
           (K.ENDLOOP, None, 3),
           (K.LOAD, d, 2, -1, -1),
           (K.CONST, K.IDX, 0),
           (K.STORE, None, 0, 10, 9)]
    return K.Kernel(ops, [(d, 1, False), (d, n, True)])


def test_packed_int8_load_sign_extends_and_store_uses_atomics():
    src = write(_copy_kernel(dt.int8, dt.int8, 10)).source
    # the output shares words between invocations: atomics; the input is plain words
    assert "g0: array<atomic<u32>>" in src and "g1: array<u32>;" in src
    assert "atomicAnd(&g0[w]" in src and "atomicOr(&g0[w]" in src
    # sign extension: the byte is shifted to the top of the word, then arithmetically down
    assert "bitcast<i32>(g1[" in src and ">> 24u" in src


@pytest.mark.parametrize("d", [dt.bool_, dt.uint8, dt.int8, dt.uint16, dt.int16,
                               dt.float16, dt.bfloat16], ids=lambda d: d.name)
def test_small_dtypes_are_packed_words(d):
    src = write(_copy_kernel(d, d, 7)).source
    assert "array<atomic<u32>>" in src
    shift = "2u" if d.itemsize == 1 else "1u"
    assert f">> {shift}]" in src


def test_fold_into_two_dimensions():
    assert fold(100) == (100, 1)
    assert fold(65535) == (65535, 1)
    x, y = fold(65536)
    assert y == 2 and x * y >= 65536 and x <= 65535
    x, y = fold(10**7)
    assert x <= 65535 and y <= 65535 and x * y >= 10**7
    # a grid beyond the limit is written 2-D: the linear id uses both group ids
    k = write(_copy_kernel(dt.float32, dt.float32, 70000), max_groups=100)
    assert k.groups[1] > 1 and k.groups[0] <= 100
    assert f"wid.y * {k.groups[0]}u + wid.x" in k.source


def test_refuses_wide_dtypes():
    assert "float64" in supports(_copy_kernel(dt.float64, dt.float32, 4))
    assert "int64" in supports(_copy_kernel(dt.float32, dt.int64, 100))
    # a short read-only int64 buffer is a value read at launch (a slice start): allowed
    assert supports(_copy_kernel(dt.float32, dt.int64, 1)) is None
    assert "uint64" in supports(_copy_kernel(dt.uint64, dt.uint64, 4))
    assert supports(_copy_kernel(dt.float32, dt.int32, 4)) is None


def test_long_single_sum_is_split_in_two_passes():
    k = write(_sum_kernel(1 << 20))
    assert k.strategy == "split" and len(k.passes) == 2 and k.scratch > 0
    assert "zyx_part[gid]" in k.passes[0][0] and "workgroupBarrier" in k.passes[1][0]
    # the first pass runs 4 strided iterations per trip where they divide the loop
    assert "r3_u < 4" in k.passes[0][0] and "let r3: i32 = r3_o + r3_u *" in k.passes[0][0]
    assert "r3_u" not in write(_sum_kernel((1 << 20) + 3)).passes[0][0]
    assert write(_sum_kernel(1000)).strategy in ("rows", "serial")


def _nested_sum_kernel(n_out, a, b, d=dt.float32):
    """IR of out[i] = sum over (a, b) of in[i, a, b]: two perfectly nested reduce loops (a
    convolution's weight gradient has three: batch, height, width)."""
    ops = [(K.DEFINE, d, K.SCOPE_GLOBAL, 0, False, n_out, None),
           (K.INDEX, K.IDX, 0, n_out),
           (K.DEFINE, d, K.SCOPE_GLOBAL, 1, True, n_out * a * b, None),
           (K.DEFINE, d, K.SCOPE_REGISTER, 0.0, False, 1, K.R_SUM),
           (K.LOOP, K.IDX, a),
           (K.LOOP, K.IDX, b),
           (K.CONST, K.IDX, a * b),
           (K.BINARY, K.IDX, K.B_MUL, 1, 6),
           (K.CONST, K.IDX, b),
           (K.BINARY, K.IDX, K.B_MUL, 4, 8),
           (K.BINARY, K.IDX, K.B_ADD, 7, 9),
           (K.BINARY, K.IDX, K.B_ADD, 10, 5),
           (K.LOAD, d, 2, 11, -1),
           (K.LOAD, d, 3, -1, -1),
           (K.BINARY, d, K.B_ADD, 13, 12),
           (K.STORE, None, 3, -1, 14),
           (K.ENDLOOP, None, 5),
           (K.ENDLOOP, None, 4),
           (K.LOAD, d, 3, -1, -1),
           (K.STORE, None, 0, 1, 18)]
    return K.Kernel(ops, [(d, n_out, False), (d, n_out * a * b, True)])


def test_few_outputs_of_a_long_nest_spread_it_over_a_workgroup():
    k = _nested_sum_kernel(1152, 64, 196)
    # a GPU (128 units): 1152 invocations would leave it idle, so a workgroup per output
    # runs the 64 x 196 iterations as one loop strided over its invocations
    rows = write(k, units=128)
    assert rows.strategy == "rows" and rows.groups == (1152, 1)
    src = rows.source
    assert "for (var f4: i32 = i32(lid.x); f4 < 12544; f4 += 256)" in src
    assert "let r4: i32 = f4 / 196;" in src and "let r5: i32 = (f4) % 196;" in src
    assert "r5 < 196" not in src              # the inner loop is not written again
    # a CPU adapter of one core: one invocation per output loops over the nest
    assert write(k, units=1).strategy == "serial"


# -- on the device --------------------------------------------------------------------------

pytest.importorskip("wgpu", reason="wgpu-py is not installed")


@pytest.fixture(scope="module")
def wgpu_device():
    yield from only_backend("wgpu", "no WebGPU adapter (wgpu-py found none)")


def test_the_device_is_wgpu(wgpu_device):
    info = wgpu_device.info()
    assert info.name.startswith("WebGPU ")
    assert "float64" not in info.dtypes and "int64" not in info.dtypes
    assert "float32" in info.dtypes and "int8" in info.dtypes
    assert [str(d) for d in zyx.devices()][0] == "wgpu:0"
    # limits were asked from the adapter, not WebGPU's defaults
    assert wgpu_device.limits["max-storage-buffers-per-shader-stage"] >= 8


ROUND_TRIP = [dt.bool_, dt.uint8, dt.int8, dt.uint16, dt.int16, dt.uint32, dt.int32,
              dt.float16, dt.bfloat16, dt.float32]


@pytest.mark.parametrize("d", ROUND_TRIP, ids=lambda d: d.name)
@pytest.mark.parametrize("n", [1, 7, 4099])
def test_dtype_load_op_store(wgpu_device, d, n):
    """Odd lengths leave partial words; every invocation stores into a word it shares."""
    rng = np.random.default_rng(n)
    if d is dt.bool_:
        a = rng.random(n) < 0.5
        np.testing.assert_array_equal((~zyx.Tensor(a)).numpy(), ~a)
        return
    if d.is_float:
        a = rng.uniform(-8, 8, n).astype(np.float32)
        a = bf16_round(a) if d is dt.bfloat16 else a.astype(d.np)
        x = zyx.Tensor(a if d is not dt.bfloat16 else a, dtype=d)
        got = (x * 2 - 1).numpy()
        ref = a.astype(np.float32) * 2 - 1
        ref = bf16_round(ref) if d is dt.bfloat16 else ref.astype(d.np)
        if d is dt.bfloat16:
            got = bf16_round(np.asarray(got, np.float32)) if got.dtype == np.float32 else \
                (got.astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_allclose(np.asarray(got, np.float32), ref.astype(np.float32),
                                   rtol=1e-2 if d.itemsize == 2 else 1e-6)
        return
    info = np.iinfo(d.np)
    a = rng.integers(info.min, int(info.max) + 1, n, dtype=np.int64).astype(d.np)
    # wrapping arithmetic at the dtype's width, and sign extension on load
    np.testing.assert_array_equal((zyx.Tensor(a) * 3 + 5).numpy(), a * d.np.type(3) + d.np.type(5))
    np.testing.assert_array_equal((zyx.Tensor(a) < 0).numpy(), a < 0)


def test_casts_between_packed_dtypes(wgpu_device):
    a = np.arange(-300, 301, dtype=np.int32)
    x = zyx.Tensor(a)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(x.to(zyx.int8).numpy(), a.astype(np.int8))
        np.testing.assert_array_equal(x.to(zyx.uint8).numpy(), a.astype(np.uint8))
        np.testing.assert_array_equal(x.to(zyx.int8).to(zyx.int16).numpy(),
                                      a.astype(np.int8).astype(np.int16))
    f = np.linspace(-3, 3, 1001).astype(np.float32)
    np.testing.assert_array_equal(zyx.Tensor(f).half().numpy(), f.astype(np.float16))


def test_two_dimensional_dispatch_on_the_device(wgpu_device, monkeypatch):
    monkeypatch.setitem(wgpu_device.limits, "max-compute-workgroups-per-dimension", 4)
    monkeypatch.setattr(wgpu_device, "_programs", {})
    monkeypatch.setattr(wgpu_device, "_by_source", {})
    zyx._RT.plans.clear()
    a = np.random.rand(5 * 256 * 4 + 3).astype(np.float32)   # 21 groups > 4 in x
    try:
        np.testing.assert_allclose((zyx.Tensor(a) * 3 + 1).numpy(), a * 3 + 1, rtol=1e-6)
        b = np.random.rand(40, 300).astype(np.float32)        # rows: 40 groups > 4
        np.testing.assert_allclose(zyx.Tensor(b).sum(1).numpy(), b.sum(1), rtol=1e-5)
    finally:
        zyx._RT.plans.clear()


def test_float64_and_int64_are_refused_naming_the_device(wgpu_device):
    zyx._RT.plans.clear()
    with pytest.raises(UnsupportedDTypeError, match="wgpu"):
        (zyx.Tensor(np.arange(4.0)) * 2).numpy()
    with pytest.raises(zyx.DTypeError, match="int64"):
        (zyx.Tensor(np.arange(4, dtype=np.int64)) + 1).numpy()


def test_too_many_buffers_is_refused_when_planned(wgpu_device, monkeypatch):
    monkeypatch.setitem(wgpu_device.limits, "max-storage-buffers-per-shader-stage", 3)
    monkeypatch.setitem(wgpu_device.limits, "max-uniform-buffers-per-shader-stage", 0)
    monkeypatch.setattr(wgpu_device, "_programs", {})
    zyx._RT.plans.clear()
    xs = [zyx.Tensor(np.full(8, i, np.float32)) for i in range(4)]
    try:
        with pytest.raises(BackendError, match="storage buffers per shader stage"):
            (xs[0] + xs[1] + xs[2] + xs[3]).numpy()
    finally:
        zyx._RT.plans.clear()


def _step(x, w):
    return ((x @ w).softmax(1).sum(0)).numpy()


def test_pipelines_and_bind_groups_are_reused(wgpu_device):
    x = zyx.Tensor(np.random.rand(16, 32).astype(np.float32))
    w = zyx.Tensor(np.random.rand(32, 8).astype(np.float32))
    first = _step(x, w)
    _step(x, w)
    p, b = wgpu_device.pipelines_created, wgpu_device.bind_groups_created
    third = _step(x, w)
    assert (wgpu_device.pipelines_created, wgpu_device.bind_groups_created) == (p, b)
    np.testing.assert_allclose(third, first, rtol=1e-6)
    ref = x.numpy() @ w.numpy()
    ref = np.exp(ref - ref.max(1, keepdims=True))
    np.testing.assert_allclose(first, (ref / ref.sum(1, keepdims=True)).sum(0), rtol=1e-5)


def test_one_submit_per_realization(wgpu_device):
    pool = wgpu_device.pool
    x = zyx.Tensor(np.random.rand(64, 64).astype(np.float32)).realize()
    wgpu_device.synchronize()
    launched = zyx.stats()["kernels_launched"]
    submits = pool.submits
    y = ((x @ x).relu().softmax(1) + x.sum(0)).realize()
    # all the dispatches in one encoder, submitted once the plan was recorded: the GPU
    # runs them while the host goes on
    assert zyx.stats()["kernels_launched"] - launched >= 2
    assert pool.submits - submits == 1 and pool.encoder is None
    y = y.numpy()
    assert pool.submits - submits == 2        # the read's copy to the staging buffer
    a = x.numpy()
    r = np.maximum(a @ a, 0)
    r = np.exp(r - r.max(1, keepdims=True))
    np.testing.assert_allclose(y, r / r.sum(1, keepdims=True) + a.sum(0), rtol=1e-5)


def test_staging_buffer_is_persistent(wgpu_device):
    pool = wgpu_device.pool
    x = zyx.Tensor(np.random.rand(1000).astype(np.float32))
    (x + 1).numpy()
    created = pool.staging_created
    for _ in range(3):
        np.testing.assert_allclose((x * 2).numpy(), x.numpy() * 2, rtol=1e-6)
        (x[:10] + 1).numpy()
    assert pool.staging_created == created


def test_long_sum_and_softmax_rows(wgpu_device):
    # a single sum longer than the 65,535 loop iterations lavapipe runs per invocation
    a = np.random.rand(1 << 22).astype(np.float32)
    assert abs(zyx.Tensor(a).sum().item() - a.astype(np.float64).sum()) <= 1e-5 * a.sum()
    assert zyx.Tensor(a).max().item() == a.max()
    b = np.random.randn(64, 4096).astype(np.float32)
    e = np.exp(b - b.max(1, keepdims=True))
    np.testing.assert_allclose(zyx.Tensor(b).softmax(1).numpy(), e / e.sum(1, keepdims=True),
                               rtol=1e-5, atol=1e-7)


def test_small_read_only_buffers_become_uniforms_past_the_storage_limit(wgpu_device, monkeypatch):
    """A kernel over the storage-buffer limit binds its smallest read-only buffers (the
    runtime's scalars) as uniform buffers instead of being refused."""
    monkeypatch.setitem(wgpu_device.limits, "max-storage-buffers-per-shader-stage", 3)
    monkeypatch.setattr(wgpu_device, "_programs", {})
    zyx._RT.plans.clear()
    a = np.random.rand(100).astype(np.float32)
    s = [np.array([v], np.float32) for v in (1.5, -2.0, 0.25)]
    i8 = np.array([-3, 7, -128, 127, 5], np.int8)
    try:
        x = zyx.Tensor(a)
        out = (x * zyx.Tensor(s[0]) + zyx.Tensor(s[1]) - zyx.Tensor(s[2])).numpy()
        np.testing.assert_allclose(out, a * 1.5 - 2.0 - 0.25, rtol=1e-6)
        y = (x[:5] + zyx.Tensor(i8).float() * zyx.Tensor(s[0]) + zyx.Tensor(s[1])).numpy()
        np.testing.assert_allclose(y, a[:5] + i8 * 1.5 - 2.0, rtol=1e-6)
        # a uniform binding in the plan's arena would conflict with its storage binding:
        # these plans launch kernel by kernel
        from zyx.backends.wgpu import WGPUPlanLaunches
        assert not any(isinstance(p.launcher, WGPUPlanLaunches) for p in zyx._RT.plans.values())
    finally:
        zyx._RT.plans.clear()


def test_launch_values_share_one_uniform_arena_past_every_limit(wgpu_device, monkeypatch):
    """Past both the storage and the uniform limits, the small read-only buffers are copied
    at launch into one uniform buffer (the arena), in queue order: each launch reads its
    own values."""
    monkeypatch.setitem(wgpu_device.limits, "max-storage-buffers-per-shader-stage", 2)
    monkeypatch.setitem(wgpu_device.limits, "max-uniform-buffers-per-shader-stage", 1)
    monkeypatch.setattr(wgpu_device, "_programs", {})
    zyx._RT.plans.clear()
    a = np.random.rand(50).astype(np.float32)
    x = zyx.Tensor(a)
    try:
        outs = []
        for k in range(3):
            s = [zyx.Tensor(np.array([v + k], np.float32)) for v in (1.5, -2.0, 0.25, 3.0)]
            outs.append(x * s[0] + s[1] - s[2] * s[3])
        for k, o in enumerate(outs):     # realized together: one encoder, three launches
            np.testing.assert_allclose(o.numpy(), a * (1.5 + k) + (-2.0 + k)
                                       - (0.25 + k) * (3.0 + k), rtol=1e-6)
        prog = next(p for p in wgpu_device._programs.values() if p.wgsl.uniforms.arena)
        assert prog.arena is not None
    finally:
        zyx._RT.plans.clear()


def test_several_outputs_per_invocation_cover_every_element():
    k = write(_copy_kernel(dt.float32, dt.float32, 1000003), per=4)
    assert "for (var e: u32 = 0u; e < 4u; e++)" in k.source
    # enough invocations for every element: groups * 256 * 4 >= n
    assert k.groups[0] * k.groups[1] * 256 * 4 >= 1000003


def test_large_elementwise_with_several_outputs_per_invocation(wgpu_device):
    a = np.random.rand((1 << 20) + 5).astype(np.float32)
    i8 = np.random.randint(-128, 128, (1 << 20) + 3).astype(np.int8)
    np.testing.assert_allclose((zyx.Tensor(a) * 2 + 1).numpy(), a * 2 + 1, rtol=1e-6)
    np.testing.assert_array_equal((zyx.Tensor(i8) * 3).numpy(), i8 * np.int8(3))


def test_large_contiguous_kernel_reads_vec4s(monkeypatch):
    monkeypatch.delenv("ZYX_WGSL_EW", raising=False)
    n = (1 << 20) + 3
    src = write(_copy_kernel(dt.float32, dt.float32, n)).source
    from zyx.codegen.wgsl.writer import EW_DEFAULT
    tile = EW_DEFAULT["per"] * EW_DEFAULT["vec"] * EW_DEFAULT["wg"]   # outputs per workgroup
    assert src.count("array<vec4<f32>>") == 2 and f"base + {tile}u <=" in src
    # packed dtypes keep their u32 words
    assert "vec4" not in write(_copy_kernel(dt.int8, dt.int8, n)).source.split("fn ")[0]
    monkeypatch.setenv("ZYX_WGSL_EW", "vec=1")
    assert "array<vec4" not in write(_copy_kernel(dt.float32, dt.float32, n)).source


@pytest.mark.parametrize("spec", ["", "per=1,wg=64", "vec=1"])
def test_large_elementwise_vec4_layouts(wgpu_device, monkeypatch, spec):
    """Each ZYX_WGSL_EW layout against numpy: a ragged last tile, offset slices (not a
    multiple of 4: those buffers stay scalar), broadcasts, transposes, packed dtypes."""
    monkeypatch.setenv("ZYX_WGSL_EW", spec)
    rng = np.random.default_rng(0)
    n = (1 << 20) + 3
    x = rng.standard_normal(n).astype(np.float32)
    t = zyx.Tensor(x)
    np.testing.assert_allclose(((t * 2 + 1).exp() * 0.5 - t).numpy(),
                               np.exp(x * 2 + 1) * 0.5 - x, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal((t[4:] + t[:-4]).numpy(), x[4:] + x[:-4])
    np.testing.assert_array_equal((t[1:] * t[:-1]).numpy(), x[1:] * x[:-1])
    m = x[:1 << 20].reshape(1024, 1024)
    tm = zyx.Tensor(m)
    np.testing.assert_array_equal((tm + tm[0]).numpy(), m + m[0])
    np.testing.assert_array_equal((tm.permute(1, 0) + 1).numpy(), m.T + 1)
    h = x.astype(np.float16)
    np.testing.assert_array_equal((zyx.Tensor(h) * 2).numpy(), h * np.float16(2))
    i = (x * 100).astype(np.int32)
    np.testing.assert_array_equal((zyx.Tensor(i) * 3 - 1).numpy(), i * 3 - 1)


@pytest.mark.parametrize("n,cin,cout,size,k,stride,pad", [(8, 3, 5, 12, 3, 1, 1),
                                                         (4, 1, 6, 17, 5, 2, 2)])
def test_weight_gradient_rows_on_a_gpu_sized_device(wgpu_device, monkeypatch, n, cin, cout,
                                                     size, k, stride, pad):
    """A convolution's weight gradient (few outputs, a batch x height x width nest) as
    a GPU adapter lowers it: a workgroup per weight, the nest one flat strided loop."""
    from zyx.backends.wgpu import WGPUDevice
    monkeypatch.setattr(WGPUDevice, "units", property(lambda self: 128))
    monkeypatch.setenv("ZYX_WGSL_GEMM", "0")        # (lavapipe would take tiles here)
    rng = np.random.default_rng(size)
    x = rng.standard_normal((n, cin, size, size), dtype=np.float32)
    w = rng.standard_normal((cout, cin, k, k), dtype=np.float32)
    out = (size + 2 * pad - k) // stride + 1
    g = rng.standard_normal((n, cout, out, out), dtype=np.float32)
    wt = zyx.tensor(w, requires_grad=True)
    (zyx.nn.functional.conv2d(zyx.tensor(x), wt, stride=stride, padding=pad)
     * zyx.tensor(g)).sum().backward()
    got = wt.grad.numpy()
    xp = np.pad(x, [(0, 0), (0, 0), (pad, pad), (pad, pad)])
    win = np.lib.stride_tricks.sliding_window_view(xp, (k, k), axis=(2, 3))
    win = win[:, :, ::stride, ::stride][:, :, :out, :out]      # (n, cin, out, out, k, k)
    want = np.einsum("nchwij,nohw->ocij", win.astype(np.float64), g.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    size_w = cout * cin * k * k
    found = [p.wgsl.strategy for kern, p in wgpu_device._programs.items()
             if kern.args[0][1] == size_w and len(kern.args) == 3]
    assert "rows" in found


@pytest.mark.parametrize("spec", ["cache=1", "cache=0"])
def test_rows_row_cache(wgpu_device, monkeypatch, spec):
    """ZYX_WGSL_REDUCE: softmax / log_softmax / layer_norm rows with and without the row
    cache against torch (odd lengths where rows do not split evenly and the cache is
    off, NaN and infinities, 16-bit floats); with the cache on, a 4096 row's kernel reads
    the input buffer once."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("ZYX_WGSL_REDUCE", spec)
    monkeypatch.setattr(wgpu_device, "_programs", {})
    zyx._RT._drop_plans()
    rng = np.random.default_rng(7)
    for n in (257, 4096, 4099):
        x = rng.standard_normal((3, n)).astype(np.float32)
        x[1, n // 2] = np.nan
        x[2, n - 1] = np.inf
        t, tt = zyx.Tensor(x), torch.tensor(x)
        np.testing.assert_allclose(t.softmax(-1).numpy(), tt.softmax(-1).numpy(),
                                   rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(t.log_softmax(-1).numpy(), tt.log_softmax(-1).numpy(),
                                   rtol=2e-5, atol=2e-5)
    z = rng.standard_normal((4, 4096)).astype(np.float32)
    np.testing.assert_allclose(
        zyx.nn.functional.layer_norm(zyx.Tensor(z), (4096,)).numpy(),
        torch.nn.functional.layer_norm(torch.tensor(z), (4096,)).numpy(), rtol=1e-4, atol=1e-4)
    h = z.astype(np.float16)
    np.testing.assert_allclose(
        zyx.Tensor(h).softmax(-1).cast(zyx.float32).numpy(),
        torch.tensor(h).float().softmax(-1).half().float().numpy(), rtol=2e-3, atol=1e-4)
    cached = [p for p in wgpu_device._programs.values()
              if any("zyx_c0" in src for src, _ in p.wgsl.passes)]
    assert bool(cached) == (spec == "cache=1")


class _FakeAdapter:
    """An adapter as adapter_memory sees one: only its info dict."""
    def __init__(self, **info):
        self.info = info


def test_adapter_memory_comes_from_config_then_vulkan_then_a_guess(monkeypatch):
    """WebGPU reports no memory size: config memory_mb wins, a CPU adapter gets 2 GiB, a
    GPU adapter over Vulkan the device-local heap Vulkan reports for its PCI ids, and
    anything else 8 GiB."""
    from zyx.backends import wgpu as W
    asked = []

    def heap(vendor, device):
        asked.append((vendor, device))
        return 141 << 30 if (vendor, device) == (0x10DE, 0x2335) else None
    monkeypatch.setattr(W, "device_local_bytes", heap)
    gpu = _FakeAdapter(adapter_type="DiscreteGPU", backend_type="Vulkan",
                       vendor_id=0x10DE, device_id=0x2335)
    assert W.adapter_memory(gpu, {"memory_mb": 1000}) == 1000 << 20
    assert W.adapter_memory(gpu, {}) == 141 << 30
    other = _FakeAdapter(adapter_type="DiscreteGPU", backend_type="Vulkan",
                         vendor_id=0x1002, device_id=1)
    assert W.adapter_memory(other, {}) == 8192 << 20
    metal = _FakeAdapter(adapter_type="IntegratedGPU", backend_type="Metal")
    assert W.adapter_memory(metal, {}) == 8192 << 20
    cpu = _FakeAdapter(adapter_type="CPU", backend_type="Vulkan", vendor_id=65541, device_id=0)
    assert W.adapter_memory(cpu, {}) == 2048 << 20
    assert asked == [(0x10DE, 0x2335), (0x1002, 1)]


def test_vulkan_reports_the_device_local_heap_of_a_listed_device():
    """device_local_bytes finds a Vulkan device by its PCI ids and gives the heap the
    Vulkan backend sizes its own pool by; unknown ids give None."""
    from zyx.backends.vkmemory import device_local_bytes
    vk_devs = [d for d in zyx.devices() if d.type == "vulkan"]
    if not vk_devs:
        pytest.skip("no Vulkan device here (apt mesa-vulkan-drivers libvulkan1 gives lavapipe)")
    import vulkan as vk
    instance = vk.vkCreateInstance(vk.VkInstanceCreateInfo(
        pApplicationInfo=vk.VkApplicationInfo(apiVersion=vk.VK_MAKE_VERSION(1, 1, 0))), None)
    try:
        props = vk.vkGetPhysicalDeviceProperties(vk.vkEnumeratePhysicalDevices(instance)[0])
        ids = (props.vendorID, props.deviceID)
    finally:
        vk.vkDestroyInstance(instance, None)
    got = device_local_bytes(*ids)
    assert got == vk_devs[0].memory     # the Vulkan backend's pool: the same heap
    assert device_local_bytes(0xFFFF, 0xFFFF) is None


def test_shader_checks_config_values():
    from zyx.backends.wgpu_direct import parse_checks
    assert parse_checks("none") == 0
    assert parse_checks("standard") is None and parse_checks(None) is None
    assert parse_checks("bounds") == 1 and parse_checks("loops") == 2
    assert parse_checks(["bounds", "loops"]) == 3 == parse_checks("bounds, loops")
    with pytest.raises(BackendError, match="shader_checks.*'nope'"):
        parse_checks("bounds,nope")


def test_shaders_are_built_without_naga_loop_counters(wgpu_device, monkeypatch):
    """zyx's shaders go through wgpu-native's trusted entry point with index clamping but
    not naga's per-loop 64-bit counters (they halved long reductions on NVIDIA); results
    with the default, with no checks and with wgpu's standard path agree with numpy, and
    a WGSL error still raises."""
    from zyx.backends import wgpu_direct
    if not wgpu_direct.available(wgpu_device.device):
        pytest.skip("this wgpu-py has no trusted shader entry point zyx can call")
    assert wgpu_device.shader_checks == wgpu_direct.CHECK_BITS["bounds"]
    built = []
    real = wgpu_direct.shader_module

    def counted(device, source, checks):
        built.append(checks)
        return real(device, source, checks)
    monkeypatch.setattr(wgpu_direct, "shader_module", counted)
    rng = np.random.default_rng(5)
    a = rng.standard_normal((48, 700)).astype(np.float32)
    v = rng.random(300_000).astype(np.float32)
    ref_soft = np.exp(a - a.max(1, keepdims=True))
    ref_soft /= ref_soft.sum(1, keepdims=True)
    results = {}
    for checks in (wgpu_direct.CHECK_BITS["bounds"], 0, None):
        monkeypatch.setattr(wgpu_device, "shader_checks", checks)
        monkeypatch.setattr(wgpu_device, "_programs", {})
        monkeypatch.setattr(wgpu_device, "_by_source", {})
        zyx._RT.plans.clear()
        before = len(built)
        soft = zyx.Tensor(a).softmax(1).numpy()
        total = zyx.Tensor(v).sum().item()
        assert (len(built) > before) == (checks is not None)
        np.testing.assert_allclose(soft, ref_soft, rtol=1e-5, atol=1e-7)
        assert abs(total - v.sum(dtype=np.float64)) < 1e-5 * v.size
        results[checks] = (soft, total)
    np.testing.assert_allclose(results[0][0], results[None][0], rtol=1e-6, atol=1e-8)
    zyx._RT.plans.clear()
    with pytest.raises(Exception, match="no definition in scope for identifier"):
        real(wgpu_device.device, "@compute @workgroup_size(1) fn main() { let x: f32 = y; }", 0)


def test_plan_launches_give_the_same_training_as_kernel_by_kernel_launches(wgpu_device,
                                                                           monkeypatch):
    """A cached plan's dispatches recorded from its prepared list (WGPUPlanLaunches: the
    temporaries as ranges of one arena buffer, bind groups fetched again only for slots
    whose buffer moved) train exactly as launching kernel by kernel does."""
    import launch_loop
    from zyx.backends.wgpu import WGPUPlanLaunches
    if wgpu_device.recorder is None:
        pytest.skip("this wgpu-py has no wgpu-native library zyx can call directly")
    monkeypatch.setattr(wgpu_device, "plan_launches", False)
    plain = launch_loop.train_fresh(steps=12, labels=np.int32)
    assert not launch_loop.launchers()
    monkeypatch.setattr(wgpu_device, "plan_launches", True)
    prepared = launch_loop.train_fresh(steps=12, labels=np.int32)
    ours = [ln for ln in launch_loop.launchers() if isinstance(ln, WGPUPlanLaunches)]
    assert ours
    # some plan binds temporaries at offsets of its arena (slot 0)
    assert any(ln.users[0] for ln in ours)
    launch_loop.assert_same(plain, prepared)
    zyx._RT._drop_plans()
