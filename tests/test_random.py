"""zyx's random numbers (zyx/random.py): Threefry-2x32 computed on the device from the seed
and a per-call counter. Known answers, the same numbers on every device and in every run,
statistics of every distribution against critical values (fixed seeds: a test either
passes or fails every time), fusion of a dropout mask into the kernel that reads it, and
one plan for a dropout loop."""
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import zyx
import zyx.nn.functional as F
from zyx import nn
from zyx import random as R

M32 = np.uint32
ROT = (13, 15, 26, 6, 17, 29, 16, 24)


def threefry_ref(c0, c1, k0, k1, rounds):
    """Threefry-2x32 in numpy (the reference the device graph must match)."""
    ks = [M32(k0), M32(k1), M32(k0 ^ k1 ^ 0x1BD11BDA)]
    x0 = (np.asarray(c0, dtype=M32) + ks[0]).astype(M32)
    x1 = (np.asarray(c1, dtype=M32) + ks[1]).astype(M32)
    with np.errstate(over="ignore"):
        for i in range(rounds):
            r = ROT[i % 8]
            x0 = x0 + x1
            x1 = ((x1 << M32(r)) | (x1 >> M32(32 - r))) ^ x0
            if i % 4 == 3:
                g = i // 4 + 1
                x0 = x0 + ks[g % 3]
                x1 = x1 + M32((int(ks[(g + 1) % 3]) + g) & 0xFFFFFFFF)
    return x0, x1


def test_threefry_known_answers(device):
    # Random123's known-answer vectors for Threefry-2x32-20 (kat_vectors)
    c0 = zyx.Tensor(np.array([0, 0xFFFFFFFF, 0x243F6A88], np.uint32))
    c1 = zyx.Tensor(np.array([0, 0xFFFFFFFF, 0x85A308D3], np.uint32))
    keys = [(0, 0), (0xFFFFFFFF, 0xFFFFFFFF), (0x13198A2E, 0x03707344)]
    want = [(0x6B200159, 0x99BA4EFE), (0x1CB996FC, 0xBB002BE7), (0xC4923A9C, 0x483DF7A0)]
    old = R.ROUNDS
    try:
        R.ROUNDS = 20
        for i, (k, w) in enumerate(zip(keys, want)):
            y0, y1 = R.threefry2x32(c0, c1, *k)
            assert (int(y0.numpy()[i]), int(y1.numpy()[i])) == w
    finally:
        R.ROUNDS = old


@pytest.mark.parametrize("shape", [(1000,), (7, 9), (1024, 1024), (100007,), (3, 5, 70000)])
def test_counter_is_the_flat_index(shape):
    c = R.counter(shape).numpy()
    assert c.dtype == np.uint32 and c.shape == shape
    assert (c.ravel().astype(np.int64) == np.arange(c.size)).all()


def test_bits_match_the_reference():
    # the scalar second counter word (the call number) takes the folded first round
    zyx.manual_seed(0x123456789ABCDEF)
    seed, call = R.seed_state()
    y0, y1 = R.bits((3, 1000))
    c0 = np.arange(3000, dtype=np.uint32)
    r0, r1 = threefry_ref(c0, np.full(3000, call, np.uint32), seed & 0xFFFFFFFF, seed >> 32,
                          R.ROUNDS)
    assert (y0.numpy().ravel() == r0).all() and (y1.numpy().ravel() == r1).all()


def _draws(dev):
    zyx.manual_seed(1234)
    return (zyx.rand(5, 300, device=dev).numpy(), zyx.randn(1000, device=dev).numpy(),
            zyx.randint(-3, 1000, (200,), device=dev).numpy(),
            zyx.rand(70, dtype=zyx.float64, device=dev).numpy(),
            F.dropout(zyx.ones(40, 50, device=dev), 0.3).numpy())


def test_same_numbers_on_every_device(device):
    ref = _draws(zyx.devices()[0])
    got = _draws(device)
    for a, b in zip(ref, got):
        assert a.dtype == b.dtype and a.shape == b.shape
    assert (ref[0] == got[0]).all() and (ref[2] == got[2]).all()
    assert (ref[3] == got[3]).all() and (ref[4] == got[4]).all()
    # log/cos/sqrt may differ in the last bit between devices' math libraries
    np.testing.assert_allclose(ref[1], got[1], rtol=1e-5, atol=1e-6)


def test_manual_seed_reproducible_across_runs():
    code = ("import zyx; zyx.manual_seed(7); a = zyx.rand(4, 6).numpy(); "
            "b = zyx.randn(5).numpy(); print(repr(a.tolist()), repr(b.tolist()))")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(zyx.__file__))] +
                                        env.get("PYTHONPATH", "").split(os.pathsep))
    outs = [subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env,
                           capture_output=True, text=True, check=True).stdout for _ in range(2)]
    zyx.manual_seed(7)
    here = f"{zyx.rand(4, 6).numpy().tolist()!r} {zyx.randn(5).numpy().tolist()!r}\n"
    assert outs[0] == outs[1] == here


def test_seed_and_calls_change_the_numbers():
    zyx.manual_seed(3)
    a, b = zyx.rand(1000).numpy(), zyx.rand(1000).numpy()
    zyx.manual_seed(4)
    c = zyx.rand(1000).numpy()
    zyx.manual_seed(3)
    d = zyx.rand(1000).numpy()
    assert (a == d).all()
    assert not (a == b).any() or (a == b).mean() < 0.01
    assert (a != c).mean() > 0.99


CHI2_99_0001 = 148.23     # chi-square critical value, 99 degrees of freedom, p = 0.001


def _chi2(counts, expected):
    return float((((counts - expected) ** 2) / expected).sum())


def test_uniform_statistics(device):
    zyx.manual_seed(11)
    u = zyx.rand(1 << 20).numpy().astype(np.float64)
    assert 0.0 <= u.min() and u.max() < 1.0
    n = u.size
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(u.var() - 1 / 12) < 1e-3
    counts = np.bincount((u * 100).astype(np.int64), minlength=100)
    assert _chi2(counts, n / 100) < CHI2_99_0001
    # no lattice: distinct values and low bits in use
    assert len(np.unique(u)) > 0.95 * n


def test_float64_uniform_has_53_bits():
    zyx.manual_seed(2)
    u = zyx.rand(10000, dtype=zyx.float64).numpy()
    assert u.dtype == np.float64 and 0 <= u.min() and u.max() < 1
    assert (u * 2.0 ** 24 % 1 != 0).mean() > 0.99      # not 24-bit values
    assert abs(u.mean() - 0.5) < 0.02


@pytest.mark.parametrize("dtype", [zyx.float16, zyx.bfloat16])
def test_half_uniform_stays_below_one(dtype):
    zyx.manual_seed(5)
    u = zyx.rand(200000, dtype=dtype).float().numpy()
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01


def test_normal_statistics(device):
    zyx.manual_seed(12)
    z = zyx.randn(1 << 20).numpy().astype(np.float64)
    assert np.isfinite(z).all()
    assert abs(z.mean()) < 5 / math.sqrt(z.size)
    assert abs(z.var() - 1) < 0.01
    # Kolmogorov-Smirnov on 100k of them: D < 1.95 / sqrt(n) at p = 0.001
    s = np.sort(z[:100000])
    cdf = 0.5 * (1 + np.vectorize(math.erf)(s / math.sqrt(2)))
    n = s.size
    d = max((np.arange(1, n + 1) / n - cdf).max(), (cdf - np.arange(n) / n).max())
    assert d < 1.95 / math.sqrt(n)
    assert abs((np.abs(z) > 3).mean() - 0.0027) < 0.0005     # the tails are there


def test_normal_float64_and_api_scaling():
    zyx.manual_seed(13)
    z = zyx.randn(200000, dtype=zyx.float64).numpy()
    assert z.dtype == np.float64 and abs(z.mean()) < 0.02 and abs(z.std() - 1) < 0.01
    x = zyx.normal(100000, mean=3.0, std=2.0).numpy()
    assert abs(x.mean() - 3) < 0.05 and abs(x.std() - 2) < 0.05
    y = zyx.uniform(100000, low=-2.0, high=6.0).numpy()
    assert -2 <= y.min() and y.max() < 6 and abs(y.mean() - 2) < 0.05


def test_successive_calls_are_independent(device):
    zyx.manual_seed(14)
    a = zyx.rand(200000).numpy().astype(np.float64)
    b = zyx.rand(200000).numpy().astype(np.float64)
    assert (a != b).mean() > 0.999
    assert abs(np.corrcoef(a, b)[0, 1]) < 5 / math.sqrt(a.size)
    # neighbours within one call are independent too
    assert abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < 5 / math.sqrt(a.size)


def test_randint_range_and_frequencies(device):
    zyx.manual_seed(15)
    v = zyx.randint(-50, 50, (1 << 20,)).numpy()
    assert v.dtype == np.int32 and v.min() == -50 and v.max() == 49
    counts = np.bincount(v + 50, minlength=100)
    assert _chi2(counts, v.size / 100) < CHI2_99_0001
    w = zyx.randint(7, (50000,)).numpy()
    assert set(np.unique(w)) == set(range(7))


def test_randint_wide_ranges():
    zyx.manual_seed(16)
    big = zyx.randint(0, 3 * 2 ** 31, (100000,)).numpy()   # a range over 2^32: two words
    assert big.dtype == np.int64 and big.min() >= 0 and big.max() < 3 * 2 ** 31
    assert abs(big.mean() / (3 * 2 ** 31) - 0.5) < 0.01
    full = zyx.randint(-2 ** 31, 2 ** 31, (100000,)).numpy()
    assert full.dtype == np.int32 and abs(full.astype(np.float64).mean()) < 2 ** 31 * 0.01
    mid = zyx.randint(-10, 2 ** 31 - 1, (100000,), dtype=zyx.int64).numpy()
    assert mid.min() >= -10 and mid.max() < 2 ** 31 - 1
    assert abs(mid.astype(np.float64).mean() / 2 ** 30 - 1) < 0.02
    u8 = zyx.randint(0, 256, (100000,), dtype=zyx.uint8).numpy()
    assert u8.dtype == np.uint8 and u8.min() == 0 and u8.max() == 255


def test_bernoulli_frequency(device):
    zyx.manual_seed(17)
    b = zyx.bernoulli(zyx.full((1 << 18,), 0.3)).numpy()
    assert set(np.unique(b)) == {0.0, 1.0} and abs(b.mean() - 0.3) < 0.005
    p = zyx.Tensor(np.linspace(0, 1, 1000, dtype=np.float32)).reshape(1, 1000).expand(200, 1000)
    f = zyx.bernoulli(p).numpy().mean(0)
    assert f[0] == 0 and f[-1] == 1
    assert np.abs(f - np.linspace(0, 1, 1000)).mean() < 0.03


def test_dropout_keep_rate_and_scaling(device):
    zyx.manual_seed(18)
    x = zyx.ones(512, 1024)
    y = F.dropout(x, 0.25).numpy()
    kept = y != 0
    assert abs(kept.mean() - 0.75) < 0.003
    np.testing.assert_allclose(y[kept], 1 / 0.75, rtol=1e-6)
    assert (F.dropout(x, 0.25, training=False).numpy() == 1).all()
    assert (F.dropout(x, 1.0).numpy() == 0).all()
    # whole channels
    c = F.dropout2d(zyx.ones(64, 32, 5, 5), 0.5).numpy()
    per = c.reshape(64, 32, 25)
    assert ((per == 0).all(2) | (per == 2).all(2)).all() and abs((per[..., 0] == 0).mean() - 0.5) < 0.05


def test_dropout_mask_fuses():
    """x * dropout(y) is one kernel that writes the result only: no mask, no random words
    stored, nothing uploaded beyond the small cached index buffers."""
    zyx.manual_seed(19)
    x, y = zyx.randn(256, 512), zyx.randn(256, 512)
    zyx.realize(x, y)
    (x * F.dropout(y, 0.1)).numpy()        # warm: the index buffers are cached now
    s0 = dict(zyx.stats())
    out = (x * F.dropout(y, 0.1)).numpy()
    s1 = zyx.stats()
    assert s1["kernels_launched"] - s0["kernels_launched"] == 1
    assert s1["bytes_allocated"] - s0["bytes_allocated"] <= out.nbytes
    assert abs((out != 0).mean() - 0.9) < 0.01


def test_dropout_loop_builds_two_plans():
    zyx.manual_seed(20)
    lin = nn.Linear(64, 64)
    x = zyx.randn(32, 64)
    zyx.realize(x)
    s0 = dict(zyx.stats())
    losses = set()
    for _ in range(50):
        loss = F.dropout(lin(x), 0.2).sum()
        losses.add(float(loss.numpy()))
    s1 = zyx.stats()
    assert s1["plans_built"] - s0["plans_built"] <= 2
    assert len(losses) == 50          # every step drew a new mask


@pytest.mark.parametrize("k,s", [(5, 40), (3000, 4)])   # inverse CDF; Gumbel-max
def test_multinomial_with_replacement(k, s):
    zyx.manual_seed(21)
    w = np.random.default_rng(0).random(k).astype(np.float32) + 0.05
    w[1] = 0.0
    rows = 4000 if k == 5 else 1000
    t = zyx.Tensor(np.tile(w, (rows, 1)))
    out = zyx.multinomial(t, s, replacement=True).numpy()
    assert out.dtype == np.int64 and out.shape == (rows, s)
    assert out.min() >= 0 and out.max() < k and not (out == 1).any()
    if k == 5:
        f = np.bincount(out.ravel(), minlength=k) / out.size
        np.testing.assert_allclose(f, w / w.sum(), atol=0.005)
    else:
        # 4000 draws over 3000 categories, in 10 groups of 300: chi-square, 9 degrees of
        # freedom, critical value 27.88 at p = 0.001
        got = np.bincount(out.ravel() // 300, minlength=10)
        want = w.reshape(10, 300).sum(1) / w.sum() * out.size
        assert _chi2(got, want) < 27.88


def test_multinomial_without_replacement():
    zyx.manual_seed(22)
    w = np.array([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0], np.float32)
    out = zyx.multinomial(zyx.Tensor(np.tile(w, (20000, 1))), 3).numpy()
    assert out.shape == (20000, 3) and not (out == 5).any()
    assert all(len(set(r)) == 3 for r in out[:2000].tolist())
    first = np.bincount(out[:, 0], minlength=6) / 20000
    np.testing.assert_allclose(first, w, atol=0.01)
    # P(second = 1) = sum over i != 1 of w_i * w_1 / (1 - w_i)
    p2 = sum(w[i] * w[1] / (1 - w[i]) for i in range(6) if i != 1)
    assert abs((out[:, 1] == 1).mean() - p2) < 0.01
    one = zyx.multinomial(zyx.Tensor(w), 5).numpy()
    assert sorted(one.tolist()) == [0, 1, 2, 3, 4]


def test_init_functions():
    zyx.manual_seed(23)
    w = zyx.zeros(400, 500)
    nn.init.uniform_(w, -2.0, 3.0)
    a = w.numpy()
    assert a.shape == (400, 500) and -2 <= a.min() and a.max() < 3 and abs(a.mean() - 0.5) < 0.02
    nn.init.normal_(w, 1.0, 0.5)
    a = w.numpy()
    assert abs(a.mean() - 1) < 0.005 and abs(a.std() - 0.5) < 0.005
    nn.init.trunc_normal_(w, 0.0, 1.0, -1.0, 1.5)
    a = w.numpy()
    assert -1 <= a.min() and a.max() <= 1.5
    # the truncated normal's mean and its fraction below 0 (from the normal CDF)
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    z = phi(1.5) - phi(-1.0)
    assert abs(a.mean() - (pdf(-1.0) - pdf(1.5)) / z) < 0.005
    assert abs((a < 0).mean() - (0.5 - phi(-1.0)) / z) < 0.005
    k = zyx.zeros(256, 1024)
    nn.init.kaiming_uniform_(k, nonlinearity="relu")
    assert abs(k.numpy().std() - math.sqrt(2 / 1024)) < 0.002
    nn.init.xavier_normal_(k)
    assert abs(k.numpy().std() - math.sqrt(2 / (256 + 1024))) < 0.001
    d = zyx.zeros(300, 300, dtype=zyx.float64)
    nn.init.normal_(d)
    assert d.numpy().dtype == np.float64 and abs(d.numpy().std() - 1) < 0.01
    q = zyx.zeros(30, 50)
    nn.init.orthogonal_(q)
    np.testing.assert_allclose(q.numpy() @ q.numpy().T, np.eye(30), atol=1e-5)


def test_randperm_is_a_seeded_permutation():
    zyx.manual_seed(24)
    a = zyx.randperm(1000).numpy()
    zyx.manual_seed(24)
    b = zyx.randperm(1000).numpy()
    assert sorted(a.tolist()) == list(range(1000)) and (a == b).all()


def test_too_many_elements_is_refused():
    with pytest.raises(zyx.errors.ShapeError):
        R.counter((1 << 17, 1 << 16))


def test_dropout_kernel_compiles_for_cuda(tmp_path):
    """The generator is uint32 adds, xors and shifts: the CUDA dialect renders them on
    `unsigned int` with unsigned literals (wrapping adds, logical shifts), and NVRTC
    compiles the fused dropout kernel (no GPU needed)."""
    try:
        from zyx.backends.cuda import import_bindings, nvrtc_compiler
        nvrtc = import_bindings()[1]
    except ImportError as e:
        pytest.skip(f"cuda-bindings is not installed: {e}")
    from zyx.backends.binary_cache import BinaryCache
    from zyx.codegen.cstyle import CUDADialect
    from zyx.codegen.gpu.dispatch import lower
    from zyx.codegen.target import DeviceInfo
    from zyx.errors import BackendError
    from gpu_cases import kernels_of
    try:
        comp = nvrtc_compiler((9, 0), nvrtc=nvrtc)
    except BackendError as e:
        pytest.skip(f"NVRTC is not available: {e}")
    comp.disk = BinaryCache("cuda", "cubin", str(tmp_path))
    zyx.manual_seed(0xFFFFFFFFF0000000)
    y = zyx.Tensor(np.ones((300, 1000), np.float32))
    kernels = kernels_of(y * F.dropout(y, 0.1))
    assert len(kernels) == 1
    src = lower(kernels[0], CUDADialect(), DeviceInfo(), "zyx_k").source
    # the key words (over 2^31 with this seed) are unsigned literals
    assert "unsigned int" in src and re.search(r"\b[0-9]{10}u\b", src)
    assert comp.binary(src)[:4] == b"\x7fELF"


def test_output_bits_are_balanced_and_avalanche():
    """Every output bit is 1 half the time, and neighbouring counters (one flipped low bit
    for even i) give outputs that differ in half their 64 bits: the rounds mix fully."""
    zyx.manual_seed(25)
    y0, y1 = R.bits((1 << 18,))
    w = (y0.numpy().astype(np.uint64) << np.uint64(32)) | y1.numpy().astype(np.uint64)
    ones = np.array([((w >> np.uint64(b)) & np.uint64(1)).mean() for b in range(64)])
    assert np.abs(ones - 0.5).max() < 5 * 0.5 / math.sqrt(w.size)
    diff = w[0::2] ^ w[1::2]
    hd = np.array([bin(int(v)).count("1") for v in diff[:50000]])
    assert abs(hd.mean() - 32) < 5 * 4 / math.sqrt(hd.size) and abs(hd.std() - 4) < 0.1
