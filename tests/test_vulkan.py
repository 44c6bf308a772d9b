"""The Vulkan backend against numpy, on whatever Vulkan device is installed (lavapipe, Mesa's
CPU driver, in CI: apt `mesa-vulkan-drivers libvulkan1`). Skipped, with the reason, when
the `vulkan` package, the Vulkan loader or a device is missing.

The runtime is re-initialized with the Vulkan backend alone for this module, and every
SPIR-V module compiled here is checked by spirv-val (ZYX_SPIRV_VALIDATE=1) when it is
installed. (test_device_ranking.py tests the ranking of one GPU seen through several
APIs and the generic dtype refusal with fake devices; test_spirv.py the SPIR-V writer
without a device.)"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import zyx
from conftest import bf16_round, only_backend
from gpu_cases import close
from zyx.errors import DTypeError


# -- on a Vulkan device ------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def vk_device():
    pytest.importorskip("vulkan", reason="the vulkan package is not installed",
                        exc_type=ImportError)
    from zyx.backends.vulkan import VALIDATE_ENV, spirv_val
    old = os.environ.get(VALIDATE_ENV)
    if spirv_val()[0] is not None:
        os.environ[VALIDATE_ENV] = "1"
    try:
        yield from only_backend("vulkan", "no Vulkan loader or device")
    finally:
        if old is None:
            os.environ.pop(VALIDATE_ENV, None)
        else:
            os.environ[VALIDATE_ENV] = old


def test_the_device_is_vulkan(vk_device):
    info = vk_device.info()
    assert info.name.startswith("Vulkan ")
    assert info.hardware and len(info.hardware) == 32
    assert "float32" in info.dtypes
    assert [str(d) for d in zyx.devices()] == [f"vulkan:{i}" for i in range(len(zyx.devices()))]
    if info.extra["cpu"]:       # lavapipe ranks below the C backend
        assert info.compute < 2e10


def test_elementwise_reduce_softmax(vk_device):
    x = np.random.randn(37, 300).astype(np.float32)
    t = zyx.tensor(x)
    close((t * 2 + 1).exp(), np.exp(x * 2 + 1), rtol=1e-5)
    close(t.sum(1), x.astype(np.float64).sum(1), rtol=1e-5, atol=1e-4)
    e = np.exp(x - x.max(1, keepdims=True))
    close(t.softmax(1), e / e.sum(1, keepdims=True), rtol=1e-5)


def test_huge_sum_is_split_in_two_passes(vk_device):
    # a size no other test sums, so this sum's program is a new one; counted by the
    # programs of this device (its compile count stays still where the disk cache has it)
    a = np.random.rand((1 << 23) + 17).astype(np.float32)
    before = set(map(id, vk_device._programs.values()))
    got = zyx.tensor(a).sum().item()
    assert abs(got - a.astype(np.float64).sum()) <= 1e-5 * a.sum()
    new = [p for p in vk_device._programs.values() if id(p) not in before]
    assert [len(p.launches) for p in new] == [2]


def test_a_realization_is_submitted_once_without_a_read(vk_device):
    ctx = vk_device.ctx
    x = np.random.randn(64, 64).astype(np.float32)
    t = zyx.tensor(x)
    vk_device.synchronize()
    launched = zyx.stats()["kernels_launched"]
    before = ctx.submits
    outs = [(t * i).sum(0) for i in range(1, 5)] + [t @ t, t.softmax(-1).max()]
    zyx.realize(*outs)
    # one submission for all its dispatches, made when the plan was queued: the GPU runs
    # it while the host goes on (nothing is left recording)
    assert zyx.stats()["kernels_launched"] - launched >= 3
    assert ctx.submits - before == 1 and ctx.pending is None
    vals = outs[-1].numpy()
    assert ctx.submits - before == 2          # the read's copy is a batch of its own
    e = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(vals, (e / e.sum(-1, keepdims=True)).max(), rtol=1e-5)


def _sgd_steps(n, seed=0):
    """Losses of `n` SGD steps of a small MLP on the default device (fresh parameters
    from `seed`), and the parameters after them."""
    rng = np.random.default_rng(seed)
    w1 = zyx.tensor(rng.standard_normal((32, 16), dtype=np.float32) * 0.3, requires_grad=True)
    w2 = zyx.tensor(rng.standard_normal((4, 32), dtype=np.float32) * 0.3, requires_grad=True)
    x = zyx.tensor(rng.standard_normal((8, 16), dtype=np.float32))
    y = zyx.tensor(rng.integers(0, 4, 8, dtype=np.int32))
    opt = zyx.optim.SGD([w1, w2], lr=0.1)
    losses = []
    for _ in range(n):
        loss = zyx.nn.functional.cross_entropy((x @ w1.T).relu() @ w2.T, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return losses, w1.numpy(), w2.numpy()


def test_plans_replay_their_recordings(vk_device):
    """A training loop's steps replay the command buffers recorded for the buffer sets
    the pool hands back, and compute what dispatch-by-dispatch runs compute."""
    rec = vk_device.ctx.recordings
    made, replayed = rec.recorded, rec.replayed
    a = np.random.rand(37, 3).astype(np.float32)
    np.testing.assert_allclose((zyx.tensor(a).exp() * 2).sum(0).numpy(),
                               (np.exp(a) * 2).sum(0), rtol=1e-5)
    assert rec.recorded == made           # a plan run once is not recorded
    # the parameters alternate between three buffer sets: three steps run into the batch,
    # three record, then every step replays
    losses, w1, w2 = _sgd_steps(12)
    assert rec.replayed - replayed >= 6
    assert rec.recorded - made <= 12 - 6
    assert losses[-1] < losses[0]
    vk_device.plan_launches = False
    try:
        zyx._RT.plans.clear()
        base_losses, b1, b2 = _sgd_steps(12)
    finally:
        vk_device.plan_launches = True
        zyx._RT.plans.clear()             # (the plans made meanwhile have no launcher)
    np.testing.assert_allclose(losses, base_losses, rtol=1e-5)
    np.testing.assert_allclose(w1, b1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(w2, b2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("room", ["one plan and a half", "less than one plan"])
def test_replays_survive_an_emptied_set_cache_and_released_programs(vk_device, monkeypatch,
                                                                     room):
    """A descriptor-set cache that fills up while a plan fetches its sets is emptied
    (freeing the sets fetched before, and every recording): the plan fetches them again
    and records anew; one with more kernels than the cache holds sets records kernel by
    kernel and makes no recording. Releasing a program drops the recordings. The steps
    compute what dispatch-by-dispatch runs compute."""
    import zyx.backends.vulkan as vulkan_backend
    rec = vk_device.ctx.recordings
    zyx._RT.plans.clear()
    _sgd_steps(1, seed=2)
    kernels = max(len(p.launcher.steps) for p in zyx._RT.plans.values()
                  if p.launcher is not None)
    room_sets = kernels * 3 // 2 if room == "one plan and a half" else kernels // 2
    monkeypatch.setattr(vulkan_backend, "MAX_CACHED_SETS", room_sets)
    vk_device.ctx.sets.clear()
    clears, made = vk_device.ctx.sets.clears, rec.recorded
    losses, w1, w2 = _sgd_steps(9, seed=2)
    assert vk_device.ctx.sets.clears - clears >= 2
    if room == "one plan and a half":
        assert rec.recorded > made
    else:
        assert rec.recorded == made
    assert losses[-1] < losses[0]
    prog = next(iter(vk_device._programs.values()))
    vk_device.release(prog)
    assert not rec.by_buffer and not [r for r in rec.retired if r.seq <= vk_device.ctx._done]
    vk_device.plan_launches = False
    try:
        zyx._RT.plans.clear()
        base_losses, b1, b2 = _sgd_steps(9, seed=2)
    finally:
        vk_device.plan_launches = True
        zyx._RT.plans.clear()
    np.testing.assert_allclose(losses, base_losses, rtol=1e-5)
    np.testing.assert_allclose(w1, b1, rtol=1e-5, atol=1e-6)


def test_recordings_are_freed_with_their_buffers(vk_device):
    """Destroying a buffer (the pool's trim) drops the recordings that bind it, and they
    are freed once the device has run them."""
    rec = vk_device.ctx.recordings
    _sgd_steps(6, seed=1)                      # (the last three steps make recordings)
    assert rec.by_buffer
    vk_device.pool.trim()                      # waits for the device, destroys kept buffers
    vk_device.synchronize()
    live = {r for users in rec.by_buffer.values() for r in users}
    assert all(r.owner.get(r.key) is r for r in live)
    assert not [r for r in rec.retired if r.seq <= vk_device.ctx._done]


def test_more_groups_than_the_x_limit_are_folded(vk_device, monkeypatch):
    monkeypatch.setenv("ZYX_VK_EW", "items=1,vec=1,local=256")    # one output per invocation
    # a GPU allows 2^31 - 1 groups in x: fold as lavapipe's 65535 would need
    limit = min(vk_device.max_groups[0], 65535)
    monkeypatch.setattr(vk_device, "max_groups", (limit, vk_device.max_groups[1]))
    n = 256 * (limit + 7) + 5
    a = (np.arange(n) % 251).astype(np.uint8)
    got = (zyx.tensor(a) + 3).numpy()
    assert np.array_equal(got, a + 3)
    k = [p for p in vk_device._programs.values() if p.spirv.groups > limit]
    assert k, "no launch needed more groups than the x limit"


EW_SIZES = [1, 3, 4, 4097, (1 << 20) + 3]


@pytest.mark.parametrize("spec", ["", "vload=0", "items=1,local=64", "stride=1"])
@pytest.mark.parametrize("n", EW_SIZES)
def test_elementwise_tiles_and_vectors(vk_device, monkeypatch, spec, n):
    """Every ZYX_VK_EW layout against numpy: ragged tails, offset slices (not a multiple
    of 4: those loads fall back to scalars), broadcasts, transposes, 16-bit and byte
    buffers; contiguous float32 kernels do take vector accesses."""
    monkeypatch.setenv("ZYX_VK_EW", spec)
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    t = zyx.tensor(x)
    close((t * 2 + 1).exp() * 0.5 - t, np.exp(x * 2 + 1) * 0.5 - x, rtol=1e-5, atol=1e-6)
    if n > 1:
        close(t[1:] + t[:-1], x[1:] + x[:-1], rtol=0)
    m = rng.standard_normal((max(n // 64, 1), 64)).astype(np.float32)
    tm = zyx.tensor(m)
    close(tm.permute(1, 0) * 3, m.T * 3, rtol=0)
    close(tm + tm[:1], m + m[:1], rtol=0)
    i8 = rng.integers(-100, 100, n).astype(np.int8)
    assert np.array_equal((zyx.tensor(i8) * 3).numpy(), i8 * np.int8(3))
    assert np.array_equal((zyx.tensor(i8) > 0).numpy(), i8 > 0)
    h = x.astype(np.float16)
    assert np.array_equal((zyx.tensor(h) * 2).numpy(), h * np.float16(2))
    b = zyx.tensor(x).cast(zyx.bfloat16)
    assert np.array_equal((b + b).cast(zyx.float32).numpy(), bf16_round(bf16_round(x) * 2))
    lays = [sk.items for p in vk_device._programs.values() for sk in p.launches
            if sk.strategy == "elementwise"]
    assert lays
    if spec == "" and n >= 4096:
        assert any(lay.vload and lay.vec == 4 and lay.flat for lay in lays)


def test_max_propagates_nan_like_torch(vk_device):
    torch = pytest.importorskip("torch")
    a = np.array([1.0, np.nan, 3.0, -np.inf, np.nan, 2.0], np.float32)
    b = np.array([np.nan, 2.0, 1.0, 5.0, np.nan, -1.0], np.float32)
    got = zyx.maximum(zyx.tensor(a), zyx.tensor(b)).numpy()
    np.testing.assert_array_equal(got, torch.maximum(torch.tensor(a), torch.tensor(b)).numpy())
    got = zyx.minimum(zyx.tensor(a), zyx.tensor(b)).numpy()
    np.testing.assert_array_equal(got, torch.minimum(torch.tensor(a), torch.tensor(b)).numpy())
    assert np.isnan(zyx.tensor(a).max().item())
    rows = np.random.randn(4, 300).astype(np.float32)
    rows[2, 17] = np.nan
    m = zyx.tensor(rows).max(1).values.numpy()
    assert np.isnan(m[2]) and np.array_equal(m[[0, 1, 3]], rows[[0, 1, 3]].max(1))


def test_half_conversions_round_to_nearest_even(vk_device):
    a = np.concatenate([np.random.randn(1000).astype(np.float32) * 1e3,
                        np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 65504.0, 65520.0, 1e5,
                                  6e-8, 3e-8, 1e-5, -2.5e-6], np.float32)])
    got = zyx.tensor(a).cast(zyx.float16).cast(zyx.float32).numpy()
    with np.errstate(over="ignore"):     # 1e5 overflows to inf, as it should
        np.testing.assert_array_equal(got, a.astype(np.float16).astype(np.float32))
    got = zyx.tensor(a).cast(zyx.bfloat16).cast(zyx.float32).numpy()
    np.testing.assert_array_equal(got, bf16_round(a))


def test_dtype_the_device_lacks_is_refused(vk_device, monkeypatch):
    info = vk_device.info()
    monkeypatch.setattr(info, "dtypes", tuple(n for n in info.dtypes if n != "float64"))
    with pytest.raises(DTypeError, match=r"float64 is not supported by device vulkan:\d+ \(Vulkan"):
        zyx.tensor(np.ones(4))
    t = zyx.tensor(np.ones(4, np.float32))
    with pytest.raises(DTypeError, match="float64"):
        t.cast(zyx.float64).numpy()          # at compile at the latest


def test_pipeline_cache_is_written_and_reused(tmp_path):
    pytest.importorskip("vulkan", reason="the vulkan package is not installed",
                        exc_type=ImportError)
    script = ("import numpy as np, zyx\n"
              "zyx.devices()\n"
              "d = [x for x in zyx._RT.devices if getattr(x, 'backend', '') == 'vulkan'][0]\n"
              "print(int(d.pipeline_cache_loaded))\n"
              "t = zyx.tensor(np.arange(5, dtype=np.float32), device='vulkan:0')\n"
              "assert ((t * 3 + 1).numpy() == np.arange(5) * 3 + 1).all()\n"
              "print(int(d.save_pipeline_cache() or d.pipeline_cache_loaded))\n"
              "print(d.pipeline_cache_path)\n")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), ZYX_DEVICE="vulkan")
    env.pop("ZYX_SPIRV_VALIDATE", None)
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, timeout=300)
        if r.returncode != 0 and "IndexError" in r.stderr:
            pytest.skip("no Vulkan device")
        assert r.returncode == 0, r.stderr
        runs.append(r.stdout.split())
    (loaded1, saved1, path), (loaded2, _, path2) = runs
    assert loaded1 == "0" and saved1 == "1" and os.path.getsize(path) > 0
    assert loaded2 == "1" and path2 == path


# -- shared-memory product tiles (codegen/spirv/gemm.py) -------------------------------

@pytest.fixture
def gemm_tile(vk_device, monkeypatch):
    """Returns a function running `fn()` with ZYX_VK_GEMM_TILE (None: the default tile
    choice) and giving (fn's result, the strategies of the programs it compiled). Plans
    and programs are dropped first, so a graph compiled earlier with another tile is
    compiled again. The strategy is switched on (ZYX_VK_GEMM=1: lavapipe is a CPU
    driver, where it is off by default) with the device's `own_tiles` as at a start
    with it on."""
    from zyx.codegen.spirv import gemm as spirv_gemm
    monkeypatch.setenv("ZYX_VK_GEMM", "1")
    info = vk_device.info()
    monkeypatch.setattr(info, "own_tiles", spirv_gemm.own_tiles(info))

    def run(tile, fn):
        if tile is None:
            monkeypatch.delenv("ZYX_VK_GEMM_TILE", raising=False)
        else:
            monkeypatch.setenv("ZYX_VK_GEMM_TILE", tile)
        zyx._RT.plans.clear()
        vk_device._programs.clear()
        out = fn()
        return out, [p.launches[0].strategy for p in vk_device._programs.values()]
    return run


def _rng_f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("tile", ["32x32x8", "16x64x8", "128x64x16"])
@pytest.mark.parametrize("m,k,n", [(1, 7, 33), (7, 33, 100), (33, 100, 129), (100, 129, 33),
                                   (129, 33, 7), (129, 300, 100)])
def test_gemm_matmul_odd_sizes(gemm_tile, tile, m, k, n):
    rng = np.random.default_rng(m * 1000 + n)
    a, b = _rng_f32(rng, m, k), _rng_f32(rng, k, n)
    got, ran = gemm_tile(tile, lambda: (zyx.tensor(a) @ zyx.tensor(b)).numpy())
    np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
    # the plan takes products of at least 16 rows and cols (gpu.gemm.MIN_SIDE) and 8 terms
    assert ("gemm" in ran) == (min(m, n) >= 16 and k >= 8), ran


@pytest.mark.parametrize("prefetch", ["1", "0"])
def test_gemm_transposed_batched_and_epilogue(gemm_tile, monkeypatch, prefetch):
    monkeypatch.setenv("ZYX_VK_GEMM_PREFETCH", prefetch)
    rng = np.random.default_rng(1)
    a, b, c = _rng_f32(rng, 3, 40, 24), _rng_f32(rng, 3, 24, 72), _rng_f32(rng, 72)
    f64 = a.astype(np.float64)
    cases = [
        (lambda: zyx.tensor(a) @ zyx.tensor(b), f64 @ b),
        (lambda: (zyx.tensor(a) @ zyx.tensor(b) + zyx.tensor(c)).relu(),
         np.maximum(f64 @ b + c, 0)),
        (lambda: zyx.tensor(a) @ zyx.tensor(b[0]), f64 @ b[0]),
        # both operands contiguous along K (a linear layer's x @ w.T) and neither
        (lambda: zyx.tensor(a[0]) @ zyx.tensor(b[0].T.copy()).T, f64[0] @ b[0]),
        (lambda: zyx.tensor(a[0].T.copy()).T @ zyx.tensor(b[0]), f64[0] @ b[0]),
    ]
    for fn, ref in cases:
        got, ran = gemm_tile("32x32x8", lambda: fn().numpy())
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
        assert "gemm" in ran, ran


def test_gemm_long_reduction_adds_block_totals(gemm_tile):
    from zyx.codegen.gpu import gemm as gpu_gemm
    k = gpu_gemm.PLAIN_K + 1000          # past PLAIN_K the sub-tile folds into totals
    rng = np.random.default_rng(2)
    a, b = _rng_f32(rng, 20, k), _rng_f32(rng, k, 24)
    got, ran = gemm_tile("32x32x16", lambda: (zyx.tensor(a) @ zyx.tensor(b)).numpy())
    np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-4, atol=2e-3)
    assert "gemm" in ran, ran


@pytest.mark.parametrize("d", ["float16", "bfloat16"])
def test_gemm_16bit_operands(gemm_tile, d):
    rng = np.random.default_rng(3)
    a, b = _rng_f32(rng, 64, 96, scale=0.5), _rng_f32(rng, 96, 48, scale=0.5)
    zd = getattr(zyx, d)
    # the operands' 16-bit values, multiplied exactly and summed in float32
    a16 = zyx.tensor(a).cast(zd).cast(zyx.float32).numpy().astype(np.float64)
    b16 = zyx.tensor(b).cast(zd).cast(zyx.float32).numpy().astype(np.float64)
    got, ran = gemm_tile("32x32x8", lambda: (zyx.tensor(a).cast(zd) @ zyx.tensor(b).cast(zd))
                         .cast(zyx.float32).numpy())
    assert "gemm" in ran, ran
    ref = zyx.tensor(a16 @ b16).cast(zd).cast(zyx.float32).numpy()     # rounded once
    ulp = 2.0 ** (-10 if d == "float16" else -7)
    np.testing.assert_allclose(got, ref, rtol=ulp, atol=1e-3)


@pytest.mark.parametrize("k,pad,stride", [(3, 1, 1), (3, 0, 2), (5, 2, 1), (5, 1, 2)])
def test_gemm_conv2d_and_its_gradients(gemm_tile, k, pad, stride):
    torch = pytest.importorskip("torch")
    import zyx.nn.functional as F
    rng = np.random.default_rng(k * 10 + pad + stride)
    x, w = _rng_f32(rng, 2, 16, 11, 11), _rng_f32(rng, 32, 16, k, k, scale=0.1)
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    yt = torch.nn.functional.conv2d(xt, wt, padding=pad, stride=stride)
    g = _rng_f32(rng, *yt.shape)
    (yt * torch.tensor(g, dtype=torch.float64)).sum().backward()

    def step():
        xz = zyx.tensor(x, requires_grad=True)
        wz = zyx.tensor(w, requires_grad=True)
        y = F.conv2d(xz, wz, padding=pad, stride=stride)
        (y * zyx.tensor(g)).sum().backward()
        return y.numpy(), xz.grad.numpy(), wz.grad.numpy()
    (y, gx, gw), ran = gemm_tile("32x32x8", step)
    for got, ref in ((y, yt), (gx, xt.grad), (gw, wt.grad)):
        np.testing.assert_allclose(got, ref.detach().numpy(), rtol=1e-4, atol=1e-4)
    assert ran.count("gemm") >= 2, ran       # the forward and the weight gradient at least


def test_gemm_default_choice_and_the_off_switch(gemm_tile, monkeypatch, vk_device):
    rng = np.random.default_rng(4)
    # 1024 x 1024 outputs: enough 64 x 64 tiles to fill a GPU's 128 units (and lavapipe's)
    a, b = _rng_f32(rng, 1024, 64), _rng_f32(rng, 64, 1024)
    ref = a.astype(np.float64) @ b
    got, ran = gemm_tile(None, lambda: (zyx.tensor(a) @ zyx.tensor(b)).numpy())
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    assert ran == ["gemm"]
    monkeypatch.delenv("ZYX_VK_GEMM")          # the default: on for GPUs, off on a CPU driver
    got, ran = gemm_tile(None, lambda: (zyx.tensor(a) @ zyx.tensor(b)).numpy())
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    on_cpu = zyx._RT.resolve(zyx.get_default_device()).info().extra.get("cpu")
    assert ran == (["serial"] if on_cpu else ["gemm"])
    monkeypatch.setenv("ZYX_VK_GEMM", "0")
    got, ran = gemm_tile(None, lambda: (zyx.tensor(a) @ zyx.tensor(b)).numpy())
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    assert "gemm" not in ran and ran


# the numerical cases every GPU backend must pass (gpu_cases.py), collected here so that
# they run under this module's Vulkan-only runtime
from gpu_cases import *  # noqa: E402,F401,F403


def test_descriptor_sets_past_one_pool(vk_device):
    """More buffer combinations than one descriptor pool holds (SETS_PER_POOL): each
    launch gets its own cached set, a full pool is followed by a new one (NVIDIA reports
    VK_ERROR_OUT_OF_POOL_MEMORY there; lavapipe may not), and every result is right."""
    from zyx.backends.vulkan import SETS_PER_POOL
    rng = np.random.default_rng(9)
    base = rng.standard_normal(64).astype(np.float32)
    x = zyx.tensor(base)
    ys = [(x + float(i)).realize() for i in range(SETS_PER_POOL + 40)]   # distinct buffers
    outs = [(y * 2.0).realize() for y in ys]
    ctx = zyx._RT.resolve(zyx.get_default_device()).ctx
    assert len(ctx.sets) >= SETS_PER_POOL + 40
    for i in (0, SETS_PER_POOL - 1, SETS_PER_POOL, SETS_PER_POOL + 39):
        np.testing.assert_allclose(outs[i].numpy(), (base + i) * 2, rtol=1e-6)


REDUCE_SPECS = ["", "cache=1", "subgroup=0,cache=0,ilp=1,vec=1", "ilp=8,cache=0",
                "subgroup=0,ilp=2,vec=1", "ilp=16,vec=2"]


@pytest.mark.parametrize("spec", REDUCE_SPECS)
def test_reduce_knobs(vk_device, monkeypatch, spec):
    """Every ZYX_VK_REDUCE setting (row cache, subgroup combine, split ilp and vector
    loads) against
    torch: softmax / log_softmax / layer_norm of odd row lengths, rows with NaN and
    infinities, max/argmax ties, int and bool sums, 16-bit floats, and whole-tensor sums
    long enough for the split strategy (a ragged last share)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("ZYX_VK_REDUCE", spec)
    # lower again under this spec: no cached plan, no compiled program
    zyx._RT._drop_plans()
    monkeypatch.setattr(vk_device, "_programs", {})
    rng = np.random.default_rng(len(spec))
    for n in (1, 7, 257, 4099):
        x = rng.standard_normal((3, n)).astype(np.float32)
        x[1, n // 2] = np.nan
        x[2, n - 1] = np.inf
        t, tt = zyx.tensor(x), torch.tensor(x)
        close(t.softmax(-1), tt.softmax(-1).numpy(), rtol=2e-5, atol=1e-6)
        close(t.log_softmax(-1), tt.log_softmax(-1).numpy(), rtol=2e-5, atol=2e-5)
        close(t.max(-1).values, tt.max(-1).values.numpy(), rtol=0)
        y = np.round(rng.standard_normal((3, n)) * 2).astype(np.float32)    # many ties
        assert np.array_equal(zyx.tensor(y).argmax(-1).numpy(), y.argmax(-1))
        assert np.array_equal(zyx.tensor(y).argmin(-1).numpy(), y.argmin(-1))
        i = rng.integers(-1000, 1000, (3, n)).astype(np.int32)
        assert np.array_equal(zyx.tensor(i).sum(-1).numpy(), i.sum(-1))
        assert np.array_equal(zyx.tensor(i).min(-1).values.numpy(), i.min(-1))
        b = rng.random((3, n)) < 0.5
        assert np.array_equal(zyx.tensor(b).sum(-1).numpy(), b.sum(-1))
    z = rng.standard_normal((4, 4096)).astype(np.float32)
    close(zyx.nn.functional.layer_norm(zyx.tensor(z), (4096,)),
          torch.nn.functional.layer_norm(torch.tensor(z), (4096,)).numpy(), rtol=1e-4, atol=1e-4)
    h = z.astype(np.float16)
    close(zyx.tensor(h).softmax(-1).cast(zyx.float32),
          torch.tensor(h).float().softmax(-1).half().float().numpy(), rtol=2e-3, atol=1e-4)
    bf = zyx.tensor(z).cast(zyx.bfloat16)
    close(bf.sum(-1).cast(zyx.float32), bf16_round(bf16_round(z).astype(np.float64).sum(-1)),
          rtol=1e-2, atol=1e-1)
    for n in (1_000_003, 3 << 20):
        big = rng.standard_normal(n).astype(np.float32)
        close(zyx.tensor(big).sum(), big.astype(np.float64).sum(), rtol=1e-5, atol=1e-3)
        close(zyx.tensor(big).max(), big.max(), rtol=0)
        i = rng.integers(-5, 5, n).astype(np.int32)
        assert zyx.tensor(i).sum().numpy() == i.sum()
    strategies = {sk.strategy for p in vk_device._programs.values() for sk in p.launches}
    assert {"group", "split"} <= strategies
