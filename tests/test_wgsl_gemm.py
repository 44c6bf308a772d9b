"""The WGSL writer's shared-memory product tiles (codegen/wgsl/gemm.py) on WebGPU: which
kernels take them and with which tile, the knobs (ZYX_WGSL_GEMM, ZYX_WGSL_GEMM_TILE) and
the device limits; then matmuls of odd sizes, batched, transposed, with an epilogue, in
16-bit dtypes, long reductions, folded grids and convolutions with both gradients, against
numpy / torch on whatever adapter wgpu finds (lavapipe in CI).

The writer tests need no device; the rest skip with the reason when wgpu-py or an adapter
is missing. The runtime is re-initialized with the wgpu backend alone for this module."""
from __future__ import annotations

import numpy as np
import pytest

import zyx
import zyx.nn.functional as F
from zyx._core.kernelizer import kernelize
from zyx._core.passes import optimize
from zyx.codegen.wgsl import gemm as wg
from zyx.codegen.wgsl import write
from conftest import bf16_round, only_backend


def kernels_of(t):
    """The kernels of realizing `t` as the WebGPU device gets them (no register tiles,
    no float sum blocks)."""
    g = zyx._RT.graph
    order, _ = g.collect([t._id])
    steps, _ = kernelize(g, order, [t._id], 64, False, 1 << 30)
    return [optimize(s.kernel) for s in steps if s.kernel is not None]


def host(*shape, seed=3):
    return zyx.Tensor(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


# -- the writer, without a device --------------------------------------------------------------

def test_products_write_a_matmul_with_workgroup_tiles():
    (k,) = kernels_of(host(200, 64) @ host(64, 300))
    g = write(k, products=wg.Products(units=4))
    assert g.strategy == "gemm" and g.tile == wg.default_tile(128, 128, 8)
    src = g.source
    assert src.count("var<workgroup>") == 2 and "array<vec4<f32>" in src
    assert src.count("workgroupBarrier();") == 2 and "fma(" in src
    assert "@workgroup_size(256)" in src and g.groups == (2 * 3, 1)
    # without products, or with a strategy named, the writer's own strategies
    assert write(k).strategy != "gemm"
    assert write(k, products=wg.Products(), strategy="serial").strategy == "serial"


def test_tile_choice_fills_the_units_and_the_limits():
    (k,) = kernels_of(host(512, 64) @ host(64, 512))
    p = wg.plan(k.ops)
    assert wg.Products(units=16).choose(p) == wg.default_tile(128, 128, 8)
    assert wg.Products(units=64).choose(p) == wg.default_tile(64, 64, 16)
    # a device with less workgroup storage skips the tiles that need more
    small = wg.Products(storage=4 * 8 * (64 + 4 + 128 + 4), units=1)
    assert small.choose(p) == wg.default_tile(128, 64, 8)
    # too few groups and a long K: the writer's split strategies take it
    (k,) = kernels_of(host(16, 9000) @ host(9000, 16))
    assert wg.Products(units=64).plan_tile(k.ops) is None
    assert wg.Products(units=1).plan_tile(k.ops) is not None
    # a K loop over the driver's loop cap is left to the other strategies
    (k,) = kernels_of(host(64, 4096) @ host(4096, 64))
    assert wg.Products(units=1, loop_cap=100).plan_tile(k.ops) is None
    assert wg.Products(units=1, loop_cap=1000).plan_tile(k.ops) is not None


def test_knobs(monkeypatch):
    monkeypatch.setenv(wg.GEMM_ENV, "0")
    assert wg.products({}) is None
    monkeypatch.delenv(wg.GEMM_ENV)
    monkeypatch.setenv(wg.TILE_ENV, "64x32x8x4x2")
    prod = wg.products({"max-compute-workgroup-storage-size": 32768})
    assert prod.tile == (64, 32, 8, 4, 2) and prod.tile.threads == 256
    assert prod.storage == 32768
    assert wg.parse_tile("128x64x16") == (128, 64, 16, 8, 4)
    for bad in ("128x128", "axbxc", "64x64x8x3x4", "0x64x8", "300x300x8"):
        with pytest.raises(ValueError, match=wg.TILE_ENV):
            wg.parse_tile(bad)
    # a forced tile the device cannot run is an error naming the setting and the limit
    (k,) = kernels_of(host(64, 32) @ host(32, 64))
    with pytest.raises(ValueError, match="workgroup memory"):
        wg.Products(tile=wg.parse_tile("128x128x32")).plan_tile(k.ops)
    with pytest.raises(ValueError, match="invocations"):
        wg.Products(tile=wg.parse_tile("64x64x8x1x1")).plan_tile(k.ops)


def test_integer_and_small_products_are_not_tiled():
    a = zyx.Tensor(np.arange(64 * 32, dtype=np.int32).reshape(64, 32), device="cpu")
    (k,) = kernels_of(a @ a.T)
    assert wg.Products(units=1).plan_tile(k.ops) is None        # an int32 accumulator
    (k,) = kernels_of(host(7, 40) @ host(40, 100))
    assert wg.Products(units=1).plan_tile(k.ops) is None        # 7 rows: under a tile side


# -- on the device -----------------------------------------------------------------------------

pytest.importorskip("wgpu", reason="wgpu-py is not installed")
torch = pytest.importorskip("torch", reason="torch is the reference of the convolutions")


@pytest.fixture(scope="module")
def wgpu_device():
    yield from only_backend("wgpu", "no WebGPU adapter (wgpu-py found none)")


@pytest.fixture
def fresh(wgpu_device, monkeypatch):
    """Every kernel is written again from here on (programs, pipelines and plans dropped,
    so the knobs set by the test apply); returns a function listing the strategies (and
    tiles) of the programs built since."""
    monkeypatch.setattr(wgpu_device, "_programs", {})
    monkeypatch.setattr(wgpu_device, "_by_source", {})
    monkeypatch.setattr(zyx._RT, "plans", {})

    def built():
        return [(p.wgsl.strategy, getattr(p.wgsl, "tile", None))
                for p in wgpu_device._programs.values()]
    return built


def close(t, ref, rtol=1e-4, atol=1e-4):
    got = t.numpy() if isinstance(t, zyx.Tensor) else np.asarray(t)
    np.testing.assert_allclose(got.astype(np.float64), ref, rtol=rtol, atol=atol)


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


SIZES = (1, 7, 33, 100, 129)


@pytest.mark.parametrize("m", SIZES)
def test_odd_sized_matmuls(m, fresh):
    r = np.random.default_rng(m)
    for k in SIZES:
        for n in SIZES:
            a, b = rand(r, m, k), rand(r, k, n)
            close(zyx.Tensor(a) @ zyx.Tensor(b), a.astype(np.float64) @ b)
    ran = {s for s, _ in fresh()}
    # products with rows and cols of at least 16 and K of at least 8 take the tiles
    assert ("gemm" in ran) == (m >= 33)


@pytest.mark.parametrize("tile", ["128x128x8", "64x64x16", "32x32x16", "64x32x8x4x2",
                                  "32x64x16x2x4", "64x64x16x8x8", "48x48x8x3x3",
                                  "16x128x4x1x8"])
def test_every_tile_shape(tile, fresh, monkeypatch):
    """Forced tiles, the table's and others: fewer invocations (8x8 sub-tiles of 64x64:
    64), sub-tiles of 3 (scalar workgroup reads, copies that do not fill the last slot),
    a K step of 4; plain, transposed and strided operands."""
    monkeypatch.setenv(wg.TILE_ENV, tile)
    r = np.random.default_rng(1)
    for m, k, n in ((16, 8, 16), (70, 300, 50), (129, 33, 130)):
        a, b = rand(r, m, k), rand(r, k, n)
        ref = a.astype(np.float64) @ b
        close(zyx.Tensor(a) @ zyx.Tensor(b), ref)
        close(zyx.Tensor(a.T.copy()).T @ zyx.Tensor(b.T.copy()).T, ref)
    a = rand(r, 40, 61)
    close(zyx.Tensor(a)[:, 1::2] @ zyx.Tensor(a)[:, :60:2].T,
          a[:, 1::2].astype(np.float64) @ a[:, :60:2].T)
    want = wg.parse_tile(tile)
    assert {t for s, t in fresh() if s == "gemm"} == {want}


def test_batched_and_transposed_matmuls(fresh):
    r = np.random.default_rng(2)
    a, b = rand(r, 3, 40, 24), rand(r, 3, 24, 72)
    close(zyx.Tensor(a) @ zyx.Tensor(b), np.einsum("bmk,bkn->bmn", a.astype(np.float64), b))
    # attention-like: both operands contiguous along K, and a broadcast right operand
    q, kt = rand(r, 2, 4, 33, 16), rand(r, 2, 4, 50, 16)
    close(zyx.Tensor(q) @ zyx.Tensor(kt).transpose(-1, -2),
          np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), kt))
    w = rand(r, 24, 72)
    close(zyx.Tensor(a) @ zyx.Tensor(w), np.einsum("bmk,kn->bmn", a.astype(np.float64), w))
    assert sum(s == "gemm" for s, _ in fresh()) == 3


def test_epilogue_bias_relu_and_a_linear_layer(fresh):
    r = np.random.default_rng(4)
    x, w, bias = rand(r, 100, 70), rand(r, 70, 129), rand(r, 129)
    ref = np.maximum(x.astype(np.float64) @ w + bias, 0)
    close((zyx.Tensor(x) @ zyx.Tensor(w) + zyx.Tensor(bias)).relu(), ref)
    lin = zyx.nn.Linear(70, 129)
    got = lin(zyx.Tensor(x)).tanh()
    ref = np.tanh(x.astype(np.float64) @ lin.weight.numpy().T + lin.bias.numpy())
    close(got, ref)
    assert sum(s == "gemm" for s, _ in fresh()) == 2


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sixteen_bit_inputs(dtype, fresh):
    """16-bit operands (f32 registers holding their values), exact products into a float32
    accumulator, the result stored as 16-bit words through the packed atomic stores."""
    r = np.random.default_rng(5)
    a, b, c = rand(r, 65, 40), rand(r, 40, 33), rand(r, 33)
    rnd = (lambda v: v.astype(np.float16).astype(np.float32)) if dtype == "float16" \
        else bf16_round
    za, zb = zyx.Tensor(a).cast(dtype), zyx.Tensor(b).cast(dtype)
    got = za @ zb
    assert got.dtype.name == dtype
    ref = rnd(a).astype(np.float64) @ rnd(b)
    tol = 2e-3 if dtype == "float16" else 1.6e-2
    close(got.float(), rnd(ref.astype(np.float32)), rtol=tol, atol=tol)
    close((za @ zb).float() + zyx.Tensor(c), ref + c, rtol=tol * 2, atol=tol * 4)
    assert any(s == "gemm" for s, _ in fresh())


def test_int32_matmul_keeps_its_strategy(fresh):
    a = np.random.default_rng(6).integers(-9, 9, (40, 33)).astype(np.int32)
    got = (zyx.Tensor(a) @ zyx.Tensor(a.T.copy())).numpy()
    np.testing.assert_array_equal(got, a.astype(np.int64) @ a.T)
    assert all(s != "gemm" for s, _ in fresh())


def test_long_products_fold_into_totals(wgpu_device, fresh, monkeypatch):
    """More than PLAIN_K terms: the sub-tile folds into totals every FOLD_K terms."""
    monkeypatch.setenv(wg.TILE_ENV, "32x32x16")
    r = np.random.default_rng(7)
    a, b = rand(r, 40, 9000), rand(r, 9000, 40)
    close(zyx.Tensor(a) @ zyx.Tensor(b), a.astype(np.float64) @ b, atol=2e-3)
    (src,) = [p.wgsl.source for p in wgpu_device._programs.values()
              if p.wgsl.strategy == "gemm"]
    assert "zyx_t0_0 = zyx_t0_0 + zyx_s0_0" in src


def test_grid_folded_into_two_dimensions(wgpu_device, fresh, monkeypatch):
    """More groups than one dispatch dimension allows: a 2-D grid whose padding groups
    compute and store nothing (every invocation still reaches the barriers)."""
    monkeypatch.setitem(wgpu_device.limits, "max-compute-workgroups-per-dimension", 5)
    monkeypatch.setenv(wg.TILE_ENV, "32x32x16")
    r = np.random.default_rng(8)
    a, b = rand(r, 100, 40), rand(r, 40, 129)      # 4 x 5 = 20 groups: 5 x 4
    close(zyx.Tensor(a) @ zyx.Tensor(b), a.astype(np.float64) @ b)
    a, b = rand(r, 3, 50, 40), rand(r, 3, 40, 70)  # 3 x 2 x 3 = 18 groups: 5 x 4
    close(zyx.Tensor(a) @ zyx.Tensor(b), np.einsum("bmk,bkn->bmn", a.astype(np.float64), b))
    progs = [p for p in wgpu_device._programs.values() if p.wgsl.strategy == "gemm"]
    assert len(progs) == 2 and all(p.wgsl.groups[1] > 1 for p in progs)
    assert any("zyx_live" in p.wgsl.source for p in progs)


def test_the_strategy_is_off_by_environment(fresh, monkeypatch):
    monkeypatch.setenv(wg.GEMM_ENV, "0")
    r = np.random.default_rng(9)
    a, b = rand(r, 64, 64), rand(r, 64, 64)
    close(zyx.Tensor(a) @ zyx.Tensor(b), a.astype(np.float64) @ b)
    assert all(s != "gemm" for s, _ in fresh())


def test_autotuner_candidates_name_the_other_tiles(wgpu_device):
    (k,) = kernels_of(host(256, 64) @ host(256, 64).T)
    labels = [lbl for lbl, _ in wgpu_device.schedule_candidates(k)]
    tiles = [lbl for lbl in labels if lbl.startswith("gemm:")]
    # (which tiles are offered depends on the adapter's limits: lavapipe's and a GPU's differ)
    assert labels[0] == "default" and len(tiles) >= 2
    for label in (tiles[0], tiles[-1]):
        sched = dict(wgpu_device.schedule_candidates(k))[label]
        g = wgpu_device.render(k, sched)
        assert g.strategy == "gemm"
        assert "x".join(map(str, g.tile)) == label.split(":")[1]


CONVS = [  # (batch, cin, cout, size, kernel, stride, padding)
    (2, 6, 20, 9, 3, 1, 1),
    (2, 16, 24, 11, 3, 2, 1),
    (3, 8, 16, 12, 5, 1, 2),
    (2, 4, 32, 13, 5, 2, 0),
]


@pytest.mark.parametrize("case", CONVS, ids=lambda c: "n{}c{}o{}s{}k{}st{}p{}".format(*c))
def test_conv2d_and_both_gradients(case, fresh):
    n, cin, cout, size, ks, stride, pad = case
    r = np.random.default_rng(10)
    x = rand(r, n, cin, size, size)
    w = rand(r, cout, cin, ks, ks) * 0.2
    bias = rand(r, cout)
    X = zyx.Tensor(x, requires_grad=True)
    W = zyx.Tensor(w, requires_grad=True)
    B = zyx.Tensor(bias, requires_grad=True)
    y = F.conv2d(X, W, B, stride=stride, padding=pad)
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    tw = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    tb = torch.tensor(bias, dtype=torch.float64, requires_grad=True)
    ty = torch.nn.functional.conv2d(tx, tw, tb, stride=stride, padding=pad)
    close(y, ty.detach().numpy())
    g = rand(r, *ty.shape)
    (y * zyx.Tensor(g)).sum().backward()
    (ty * torch.tensor(g, dtype=torch.float64)).sum().backward()
    close(W.grad, tw.grad.numpy(), atol=1e-3)
    close(X.grad, tx.grad.numpy(), atol=1e-3)
    close(B.grad, tb.grad.numpy(), atol=1e-3)
    assert sum(s == "gemm" for s, _ in fresh()) >= 2
