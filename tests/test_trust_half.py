"""float16 / bfloat16 results do not depend on fusion (issue 29).

The C-family backends compute 16-bit floats in float registers; every op's result must
still be a value of its dtype, as torch's op-by-op results are: 65504 * 2 overflows to inf
inside a fused chain as it does when the product is stored. Each test runs on every device
(`device` fixture) and checks against torch on the CPU (float16/bfloat16 tensors, one op
at a time) or against the same expression realized op by op. The last tests check the
CUDA source of such chains with NVRTC (no GPU needed)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import zyx
from zyx._core import kernel as K
from zyx.codegen.cstyle import CUDADialect, half_rounds
from zyx.codegen.gpu.dispatch import lower
from zyx.codegen.target import DeviceInfo

from gpu_cases import kernels_of

HALVES = [zyx.float16, zyx.bfloat16]
_TORCH = {zyx.float16: torch.float16, zyx.bfloat16: torch.bfloat16}
# one unit in the last place at 1.0 of each dtype
_ULP1 = {zyx.float16: 2.0 ** -10, zyx.bfloat16: 2.0 ** -7}


def _z(a, d):
    return zyx.tensor(np.asarray(a, np.float32), dtype=d)


def _t(a, d):
    return torch.tensor(np.asarray(a, np.float32)).to(_TORCH[d])


def _np(x):
    """Values of a zyx or torch tensor as float64 numpy (bfloat16 through float32)."""
    if isinstance(x, torch.Tensor):
        if x.dtype in (torch.float16, torch.bfloat16):
            x = x.float()
        return x.numpy().astype(np.float64)
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    return np.asarray(x.numpy()).astype(np.float64)


def _same(got, want, msg=""):
    """Exactly the same values (NaN where torch has NaN, infinities of the same sign)."""
    g, w = _np(got), _np(want)
    assert g.shape == w.shape, f"{msg}: shape {g.shape} != {w.shape}"
    bad = ~((g == w) | (np.isnan(g) & np.isnan(w)))
    assert not bad.any(), f"{msg}: {bad.sum()} of {g.size} differ, e.g. {g[bad][:5]} vs {w[bad][:5]}"


def _near(got, want, d, ulps=2, atol=1e-6, msg=""):
    """Within `ulps` units in the last place of dtype d (relative), infinities and NaN at
    the same places; for chains with transcendental functions, whose float32 results
    differ in the last bit between libraries and may then round to the other neighbour."""
    g, w = _np(got), _np(want)
    assert g.shape == w.shape, f"{msg}: shape {g.shape} != {w.shape}"
    assert np.array_equal(np.isnan(g), np.isnan(w)), f"{msg}: NaN at other places"
    assert np.array_equal(np.isposinf(g), np.isposinf(w)), f"{msg}: +inf at other places"
    assert np.array_equal(np.isneginf(g), np.isneginf(w)), f"{msg}: -inf at other places"
    fin = np.isfinite(w)
    np.testing.assert_allclose(g[fin], w[fin], rtol=ulps * _ULP1[d], atol=atol, err_msg=msg)


# -- overflow inside fused chains ------------------------------------------------------

def test_product_overflows_to_inf_inside_a_chain(device):
    h = _z([65504.0, -65504.0, 1000.0], zyx.float16)
    _same((h * 2) / 2, torch.tensor([np.inf, -np.inf, 1000.0]), "(h*2)/2")
    _same(((h * 2) / 2).float(), torch.tensor([np.inf, -np.inf, 1000.0]), "float()")
    assert (h * 2).isinf().numpy().tolist() == [True, True, False]
    assert (h * 2).isfinite().numpy().tolist() == [False, False, True]
    # the same chain stored between the ops gives the same values
    _same((h * 2) / 2, (h * 2).realize() / 2, "stored")


@pytest.mark.parametrize("name", ["mul", "add", "exp", "pow", "sub_neg", "div"])
def test_overflow_in_a_fused_chain_matches_torch(device, name):
    chains = {
        "mul": (lambda x: (x * 300) * 0.25 - 1, [100.0, 300.0, -400.0, 3.0]),
        "add": (lambda x: (x + 32) - 64, [65504.0, 65472.0, -65504.0, 1.0]),
        "exp": (lambda x: x.exp() / 4, [11.5, 11.0, -3.0, 10.9]),
        "pow": (lambda x: (x ** 3) / 8, [50.0, 40.0, -50.0, 2.5]),
        "sub_neg": (lambda x: (-(x * 3)).abs() * 0.5, [30000.0, 20000.0, 1.5, -21845.0]),
        "div": (lambda x: (x / 2.0 ** -13) * 2.0 ** -13, [7.0, 8.0, 0.5, -8.0]),
    }
    f, vals = chains[name]
    d = zyx.float16
    _near(f(_z(vals, d)), f(_t(vals, d)), d, ulps=1, msg=name)


@pytest.mark.parametrize("d", HALVES, ids=str)
def test_isinf_and_isfinite_of_a_fused_expression(device, d):
    # the largest value plus half its last place rounds (to even) to inf; the float32 sum
    # is finite (bfloat16's: 2**128 - 2**119)
    big, half_ulp = (65504.0, 16.0) if d is zyx.float16 else (2.0 ** 128 - 2.0 ** 120, 2.0 ** 119)
    vals = [big, -big, 1.0, 0.5 * big]
    x, t = _z(vals, d), _t(vals, d)
    assert (x + half_ulp).isinf().numpy().tolist() == (t + half_ulp).isinf().tolist() \
        == [True, False, False, False]
    assert ((x - half_ulp) * 1).isfinite().numpy().tolist() == \
        ((t - half_ulp) * 1).isfinite().tolist() == [True, False, True, True]
    assert (x * 2 - big).isinf().numpy().tolist() == (t * 2 - big).isinf().tolist()


@pytest.mark.parametrize("d", HALVES, ids=str)
def test_rounding_between_fused_ops_matches_torch(device, d):
    # 2048 + 1 is a float16 tie (rounds back to 2048), 256 + 1 a bfloat16 one
    base = 2048.0 if d is zyx.float16 else 256.0
    vals = [base, base + 2, 1.0, -base]
    x, t = _z(vals, d), _t(vals, d)
    _same((x + 1) - x, (t + 1) - t, "(x+1)-x")
    _same((x / 3) * 3, (t / 3) * 3, "(x/3)*3")


def test_bfloat16_square_is_the_stored_square(device):
    a = zyx.randn(1000, dtype=zyx.bfloat16)
    a.realize()
    assert ((a * a) == (a * a).realize()).all().item()
    assert ((a * a - a) == ((a * a).realize() - a)).all().item()


# -- chains of mixed ops against torch, op by op ----------------------------------------

def _inputs(d, n=2000, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 4).astype(np.float32)
    y = (rng.standard_normal(n) * 4).astype(np.float32)
    return (_z(x, d), _z(y, d)), (_t(x, d), _t(y, d))


def _where(lib):
    return zyx.where if lib == "zyx" else torch.where


# Scalars are values of both 16-bit dtypes: zyx rounds a scalar to the tensor's dtype (as
# torch's add does; torch's mul and div keep it as a float32).
_EXACT = {   # + - * / abs max where casts: torch's and zyx's float32 steps are IEEE
    "arith": lambda w, x, y: (((x * 1.5 + 0.25) * y - x) / (y.abs() + 1.0)).maximum(x) * 0.5,
    "where": lambda w, x, y: w(x > y, x * y, y - x * 3) / 7 + w(x < 0, -x, x * 0.375),
    "casts": lambda w, x, y: (((x * 3.25).float() / 3.3).to(x.dtype) * y - 1).abs() + x,
    "div": lambda w, x, y: ((x / (y * y + 0.5)) * (x - y)) / 3 - y / 9 + x,
    "minmax": lambda w, x, y: (x * 1.125).minimum(y * 2.25).maximum(x - 7) * (y + 0.125),
}
_NEAR = {    # with transcendental functions: within a unit in the last place
    "exp": lambda w, x, y: y / (1 + (x - (x * 0.5).exp() * y).exp()) + (y * 0.375).tanh(),
    "pow_sqrt": lambda w, x, y: ((x.abs() + 1) ** 1.75 - y).abs().sqrt() * 2 - x / 5,
    "log_sin": lambda w, x, y: (x.abs() + 0.5).log() * y.sin() + w(x > 0, x * 9, y),
}


@pytest.mark.parametrize("d", HALVES, ids=str)
@pytest.mark.parametrize("name", sorted(_EXACT))
def test_exact_chain_equals_torch(device, d, name):
    (x, y), (tx, ty) = _inputs(d)
    f = _EXACT[name]
    _same(f(zyx.where, x, y), f(torch.where, tx, ty), name)


@pytest.mark.parametrize("d", HALVES, ids=str)
@pytest.mark.parametrize("name", sorted(_NEAR))
def test_transcendental_chain_near_torch(device, d, name):
    (x, y), (tx, ty) = _inputs(d)
    f = _NEAR[name]
    got, want = f(zyx.where, x, y), f(torch.where, tx, ty)
    # (absolute: the chains subtract values of a few units)
    _near(got, want, d, ulps=4, atol=16 * _ULP1[d], msg=name)
    # and nearly all of it exactly: only values at a rounding boundary may differ
    g, w = _np(got), _np(want)
    assert np.mean((g == w) | (np.isnan(g) & np.isnan(w))) > 0.95, name


@pytest.mark.parametrize("d", HALVES, ids=str)
def test_reduction_result_is_rounded_before_the_chain(device, d):
    # row sums of integers (exact in float32 in any order), then a chain whose first
    # product overflows float16 for the large rows
    rng = np.random.default_rng(1)
    a = rng.integers(-40, 400, size=(16, 128)).astype(np.float32)
    x, t = _z(a, d), _t(a, d)
    _same(((x.sum(1) * 3) - 5) / 3, ((t.sum(1) * 3) - 5) / 3, "sum chain")
    _same((x.amax(1) * 200 - x.amin(1)).isinf(), (t.amax(1) * 200 - t.amin(1)).isinf(), "max chain")
    _same(x - x.mean(1, keepdim=True) * 1.5, t - t.mean(1, keepdim=True) * 1.5, "mean chain")


@pytest.mark.parametrize("d", HALVES, ids=str)
def test_matmul_epilogue_equals_torch(device, d):
    # small integers: every product and sum is exact in float32, so zyx's and torch's
    # accumulation orders give the same product; the epilogue rounds op by op
    rng = np.random.default_rng(2)
    a = rng.integers(-3, 4, size=(24, 40)).astype(np.float32)
    b = rng.integers(-3, 4, size=(40, 12)).astype(np.float32)
    bias = (rng.standard_normal(12) * 3).astype(np.float32)
    (x, w, c), (tx, tw, tc) = [_z(v, d) for v in (a, b, bias)], [_t(v, d) for v in (a, b, bias)]
    _same(((x @ w) + c).relu(), ((tx @ tw) + tc).relu(), "relu(x@w+b)")
    _same(((x @ w) * 0.375 + c) * 7, ((tx @ tw) * 0.375 + tc) * 7, "(x@w*0.375+b)*7")
    if d is zyx.float16:
        # an epilogue that overflows: 60 * 2000 is inf in float16
        _same(((x @ w) * 2000 + c) / 2000, ((tx @ tw) * 2000 + tc) / 2000, "overflowing")


@pytest.mark.parametrize("d", HALVES, ids=str)
def test_random_matmul_with_bias_near_torch(device, d):
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((33, 64)), rng.standard_normal((64, 17))
    bias = rng.standard_normal(17)
    x, w, c = _z(a, d), _z(b, d), _z(bias, d)
    tx, tw, tc = _t(a, d), _t(b, d), _t(bias, d)
    got = ((x @ w) + c).relu()
    want = ((tx.float() @ tw.float()).to(_TORCH[d]) + tc).relu()
    _near(got, want, d, ulps=2, msg="matmul")


@pytest.mark.parametrize("d", HALVES, ids=str)
def test_softmax_in_half_near_torch(device, d):
    rng = np.random.default_rng(4)
    a = (rng.standard_normal((8, 100)) * 3).astype(np.float32)
    x, t = _z(a, d), _t(a, d)
    got = x.softmax(-1)
    assert got.dtype == d
    want = t.softmax(-1)
    # torch's softmax rounds once, zyx's steps (max, exp, sum, divide) each round
    np.testing.assert_allclose(_np(got), _np(want), rtol=4 * _ULP1[d], atol=4 * _ULP1[d] / 64)
    np.testing.assert_allclose(_np(got.float().sum(-1)), np.ones(8), rtol=0, atol=64 * _ULP1[d])


@pytest.mark.parametrize("d", HALVES, ids=str)
def test_conversions_of_every_value(device, d):
    # every 16-bit pattern read and written back through float32, and float32 values
    # (random bit patterns, ties, overflow and subnormal edges) rounded to d, as torch does
    bits = np.arange(65536, dtype=np.uint32)
    if d is zyx.float16:
        h = bits.astype(np.uint16).view(np.float16)
        f = h.astype(np.float32)
    else:
        f = (bits << 16).view(np.float32)
    x = zyx.tensor(f).to(d)
    back = x.float().numpy()
    assert np.array_equal(np.isnan(back), np.isnan(f))
    ok = ~np.isnan(f)
    assert np.array_equal(back[ok].view(np.uint32), f[ok].view(np.uint32))
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 2 ** 32, size=200000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array([65519.99, 65520.0, 65504.0, 2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -25,
                      2.0 ** -14, 2049.0, 2051.0, 3.3895e38, 3.4e38, 1 + 2.0 ** -8,
                      1 + 3 * 2.0 ** -8, -0.0], np.float32)
    src = np.concatenate([raw, edges, -edges])
    got = _np(zyx.tensor(src).to(d) * 1)          # rounded by the cast, then by the op
    want = _np(torch.tensor(src).to(_TORCH[d]) * 1)
    _same(got, want, "float32 -> 16-bit")


# -- the rendered source ------------------------------------------------------------------

def test_rounding_is_left_out_where_it_changes_nothing():
    # loads, a comparison, max / abs of rounded values, a store of the final result
    x = zyx.Tensor(np.ones(64, np.float16))
    y = zyx.Tensor(np.ones(64, np.float16))
    (k,) = kernels_of(((x * 3).abs().maximum(y) + y) * 2)
    ops = k.ops
    rounded = half_rounds(ops)
    assert all(ops[i][0] == K.BINARY or ops[i][0] == K.UNARY for i in rounded)
    assert [ops[i][2] for i in rounded] == [K.B_MAX, K.B_ADD]
    # x * 3 is deferred into abs (which rounds it, abs commutes with rounding), abs into
    # max, max rounds, + y rounds, the last * 2 is rounded by the store's conversion
    assert len(rounded) == 2, [ops[i] for i in rounded]


# NVRTC compiles the CUDA source of half chains without a GPU
def _nvrtc_compiler(tmp_path):
    try:
        from zyx.backends.cuda import import_bindings, nvrtc_compiler
        nvrtc = import_bindings()[1]
        comp = nvrtc_compiler((9, 0), nvrtc=nvrtc)
    except Exception as e:    # no cuda-python / NVRTC on this machine
        pytest.skip(f"NVRTC not available: {e}")
    from zyx.backends.binary_cache import BinaryCache
    comp.disk = BinaryCache("cuda", "cubin", str(tmp_path))
    return comp


@pytest.mark.parametrize("d", ["float16", "bfloat16"])
def test_cuda_source_of_a_half_chain_compiles_with_nvrtc(tmp_path, d):
    comp = _nvrtc_compiler(tmp_path)
    npd = np.float16 if d == "float16" else np.float32
    x = zyx.Tensor(np.ones((64, 33), npd)).cast(d)
    y = zyx.Tensor(np.ones(33, npd)).cast(d)
    chains = [((x * 1.5 + y) / (y.abs() + 1)).exp().maximum(x) * 0.5,
              (x.sum(1) * 3 - 1).sigmoid(),
              ((x @ y.reshape(33, 1)) + 1).relu()]
    rh = "zyx_rh(" if d == "float16" else "zyx_rbf("
    seen = False
    for t in chains:
        for k in kernels_of(t):
            src = lower(k, CUDADialect(), DeviceInfo(), "zyx_k").source
            seen = seen or rh in src
            assert comp.binary(src)[:4] == b"\x7fELF"
    assert seen, "no rounding in the CUDA source of a half chain"


# the HIP prelude's rounding helpers, compiled for the host (HIP's device names shimmed)
_HIP_SHIM = r"""
#include <cstring>
#define __device__
#define __forceinline__ inline
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
"""
_HIP_EXPORTS = r"""
extern "C" {
void rh(const float* x, float* y, long n) { for (long i = 0; i < n; i++) y[i] = zyx_rh(x[i]); }
void rbf(const float* x, float* y, long n) { for (long i = 0; i < n; i++) y[i] = zyx_rbf(x[i]); }
}
"""


def test_hip_rounding_helpers_round_like_torch(tmp_path):
    import ctypes
    import shutil
    import subprocess
    from zyx.codegen.cstyle import HIP_PRELUDE
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    src, lib = tmp_path / "p.cpp", tmp_path / "p.so"
    src.write_text(_HIP_SHIM + HIP_PRELUDE + _HIP_EXPORTS)
    proc = subprocess.run([cxx, "-std=c++20", "-O1", "-shared", "-fPIC", str(src), "-o", str(lib)],
                          capture_output=True, text=True)
    if proc.returncode != 0 and "_Float16" in proc.stderr:
        pytest.skip(f"{cxx} lacks _Float16 for C++")
    assert proc.returncode == 0, proc.stderr
    so = ctypes.CDLL(str(lib))
    rng = np.random.default_rng(6)
    x = np.concatenate([rng.integers(0, 2 ** 32, 100000, dtype=np.uint64).astype(np.uint32)
                        .view(np.float32), rng.standard_normal(10000).astype(np.float32),
                        np.array([65519.99, 65520.0, 2.0 ** -25, 1 + 2.0 ** -8], np.float32)])
    for fn, td in ((so.rh, torch.float16), (so.rbf, torch.bfloat16)):
        y = np.empty_like(x)
        fn(x.ctypes.data_as(ctypes.c_void_p), y.ctypes.data_as(ctypes.c_void_p),
           ctypes.c_long(x.size))
        want = torch.tensor(x).to(td).float().numpy()
        assert np.array_equal(np.isnan(y), np.isnan(want))
        ok = ~np.isnan(want)
        assert np.array_equal(y[ok], want[ok]), fn
