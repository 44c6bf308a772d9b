"""GPU benchmarks (issue 11): zyx on every GPU it finds (CUDA, OpenCL on a GPU) against
PyTorch CUDA in the same process, and against the device's own copy bandwidth.

Each benchmark round queues `REPS` runs of the workload and then waits for the device
(zyx.synchronize / torch.cuda.synchronize), so a round's time is device time plus the
host's enqueue cost, divided over REPS in `extra_info["reps"]`. Bytes (read + written)
and FLOPs per run are in extra_info; `benches/report.py` prints GB/s, GFLOP/s, the ratio
to PyTorch and, for bandwidth-bound kernels, the fraction of the copy bandwidth measured
in the same run (group "copy").

Skipped, saying why, on a machine without a GPU (OpenCL CPU devices such as PoCL are not
benchmarked here). Run on the GPU machine with `bash .ci/gpu_run.sh` (see there).
"""
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest

import zyx
import zyx.nn as nn
import zyx.nn.functional as F
from zyx import optim

try:
    import torch
    TORCH_CUDA = torch.cuda.is_available()
except ImportError:
    torch = None
    TORCH_CUDA = False

REPS = 10
N_EW = 64 << 20        # elementwise chain: 64M float32
N_SUM = 256 << 20      # sum: 256M float32
SOFTMAX = (16384, 4096)
MM = 4096


def _gpus():
    out = []
    for d in zyx.devices():
        if d.type in ("cpu", "dummy"):
            continue
        info = zyx._RT.resolve(d).info()
        if info.extra.get("cpu"):
            continue          # an OpenCL CPU device (PoCL): not a GPU
        out.append(str(d))
    return out


GPUS = _gpus()
needs_gpu = pytest.mark.skipif(not GPUS, reason="no GPU found by zyx (no CUDA driver, no "
                                                 "OpenCL GPU)")
needs_torch_cuda = pytest.mark.skipif(not TORCH_CUDA, reason="PyTorch with CUDA not available")


@pytest.fixture(params=GPUS or ["none"])
def gpu(request):
    if request.param == "none":
        pytest.skip("no GPU found by zyx (no CUDA driver, no OpenCL GPU)")
    zyx.set_default_device(request.param)
    yield request.param
    zyx.set_default_device(None)


def _run(benchmark, step, sync, info, rounds=15):
    """Time `REPS` calls of step() then sync(); one warm-up round first (compilation)."""
    def block():
        for _ in range(REPS):
            step()
        sync()
    block()
    benchmark.extra_info.update(info)
    benchmark.extra_info["reps"] = REPS
    benchmark.pedantic(block, rounds=rounds, iterations=1)


def _zsync(dev):
    return lambda: zyx.synchronize(dev)


def _tsync():
    torch.cuda.synchronize()


# -- bandwidth ----------------------------------------------------------------------------

@needs_torch_cuda
@pytest.mark.benchmark(group="copy")
def test_copy_torch(benchmark):
    a = torch.randn(N_EW, device="cuda")
    b = torch.empty_like(a)
    _run(benchmark, lambda: b.copy_(a), _tsync, {"bytes": 8 * N_EW})


NCHW = (64, 64, 56, 56)     # bench's conv2d input: the copy its forward makes channels-last


@needs_gpu
@pytest.mark.benchmark(group="channels-last copy 64x64x56x56 f32")
def test_channels_last_copy_zyx(benchmark, gpu):
    """The stored NCHW -> NHWC copy a large GPU convolution reads
    (F._channels_last_input)."""
    from zyx.nn.functional import stored
    x = zyx.randn(*NCHW).realize()
    np.testing.assert_array_equal(stored(x.permute(0, 2, 3, 1)).numpy(),
                                  x.numpy().transpose(0, 2, 3, 1))
    n = int(np.prod(NCHW))
    _run(benchmark, lambda: stored(x.permute(0, 2, 3, 1)).realize(), _zsync(gpu),
         {"bytes": 8 * n})


@needs_torch_cuda
@pytest.mark.benchmark(group="channels-last copy 64x64x56x56 f32")
def test_channels_last_copy_torch(benchmark):
    x = torch.randn(*NCHW, device="cuda")
    n = int(np.prod(NCHW))
    _run(benchmark, lambda: x.permute(0, 2, 3, 1).contiguous(), _tsync, {"bytes": 8 * n})


def _chain(x):
    return ((x * 1.5 + 0.5).sin() * 0.25 + x).tanh()


@needs_gpu
@pytest.mark.benchmark(group="elementwise 64M f32")
def test_elementwise_zyx(benchmark, gpu):
    x = zyx.randn(N_EW).realize()
    out = _chain(x).numpy()
    ref = np.tanh(np.sin(x.numpy() * 1.5 + 0.5) * 0.25 + x.numpy())
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    _run(benchmark, lambda: _chain(x).realize(), _zsync(gpu), {"bytes": 8 * N_EW})


@needs_torch_cuda
@pytest.mark.benchmark(group="elementwise 64M f32")
def test_elementwise_torch(benchmark):
    x = torch.randn(N_EW, device="cuda")
    _run(benchmark, lambda: _chain(x), _tsync, {"bytes": 8 * N_EW})


def _arith_chain(x, maximum):
    """Only + - * and max: no transcendental, whose accurate float32 versions (sinf's
    range reduction) can make a kernel compute-bound."""
    return maximum((x * 1.5 + 0.5) * x - 0.25, x * 0.5)


@needs_gpu
@pytest.mark.benchmark(group="elementwise 64M f32, arithmetic only")
def test_elementwise_arith_zyx(benchmark, gpu):
    x = zyx.randn(N_EW).realize()
    a = x.numpy()
    np.testing.assert_allclose(_arith_chain(x, zyx.maximum).numpy(),
                               _arith_chain(a, np.maximum), rtol=1e-5, atol=1e-6)
    _run(benchmark, lambda: _arith_chain(x, zyx.maximum).realize(), _zsync(gpu),
         {"bytes": 8 * N_EW})


@needs_torch_cuda
@pytest.mark.benchmark(group="elementwise 64M f32, arithmetic only")
def test_elementwise_arith_torch(benchmark):
    x = torch.randn(N_EW, device="cuda")
    _run(benchmark, lambda: _arith_chain(x, torch.maximum), _tsync, {"bytes": 8 * N_EW})


@needs_gpu
@pytest.mark.benchmark(group="sum 256M f32")
def test_sum_zyx(benchmark, gpu):
    x = zyx.rand(N_SUM).realize()
    got = x.sum().item()
    assert abs(got - N_SUM / 2) < N_SUM * 1e-3, got
    _run(benchmark, lambda: x.sum().realize(), _zsync(gpu), {"bytes": 4 * N_SUM})


@needs_torch_cuda
@pytest.mark.benchmark(group="sum 256M f32")
def test_sum_torch(benchmark):
    x = torch.rand(N_SUM, device="cuda")
    _run(benchmark, lambda: x.sum(), _tsync, {"bytes": 4 * N_SUM})


@needs_gpu
@pytest.mark.benchmark(group="softmax 16384x4096 f32")
def test_softmax_zyx(benchmark, gpu):
    x = zyx.randn(*SOFTMAX).realize()
    s = x.softmax(-1).numpy()
    np.testing.assert_allclose(s.sum(-1), 1.0, rtol=1e-4)
    _run(benchmark, lambda: x.softmax(-1).realize(), _zsync(gpu),
         {"bytes": 8 * SOFTMAX[0] * SOFTMAX[1]})


@needs_torch_cuda
@pytest.mark.benchmark(group="softmax 16384x4096 f32")
def test_softmax_torch(benchmark):
    x = torch.randn(*SOFTMAX, device="cuda")
    _run(benchmark, lambda: torch.softmax(x, -1), _tsync, {"bytes": 8 * SOFTMAX[0] * SOFTMAX[1]})


# -- matmul -------------------------------------------------------------------------------
# float32 products at both precisions: "highest" (float32 math; PyTorch's default for
# matmul) and "tf32" (zyx.set_float32_matmul_precision("high"); PyTorch's default for
# cuDNN convolutions, torch.backends.cudnn.allow_tf32), each side set the same way.

@pytest.fixture
def precision(request):
    """Both libraries' float32 product precision for one benchmark."""
    p = request.param
    tf32 = p == "tf32"
    zyx.set_float32_matmul_precision("high" if tf32 else "highest")
    saved = None
    if TORCH_CUDA:
        saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    yield p
    zyx.set_float32_matmul_precision("highest")
    if saved is not None:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


_MM_CASES = [("float32", "highest"), ("float32", "tf32"), ("bfloat16", "highest")]


@needs_gpu
@pytest.mark.parametrize("dtype,precision", _MM_CASES, indirect=["precision"])
def test_matmul_zyx(benchmark, gpu, dtype, precision):
    benchmark.group = f"matmul {MM} {dtype}" + (" tf32" if precision == "tf32" else "")
    a = zyx.randn(MM, MM).cast(dtype).realize()
    b = zyx.randn(MM, MM).cast(dtype).realize()
    an = a.float().numpy()[:64].astype(np.float64)
    bn = b.float().numpy().astype(np.float64)
    c = (a @ b).float().numpy()[:64]
    loose = dtype == "bfloat16" or precision == "tf32"
    np.testing.assert_allclose(c, an @ bn, rtol=2e-2, atol=2e-1 if loose else 2e-2)
    _run(benchmark, lambda: (a @ b).realize(), _zsync(gpu), {"flops": 2 * MM ** 3}, rounds=5)


@needs_torch_cuda
@pytest.mark.parametrize("dtype,precision", _MM_CASES, indirect=["precision"])
def test_matmul_torch(benchmark, dtype, precision):
    benchmark.group = f"matmul {MM} {dtype}" + (" tf32" if precision == "tf32" else "")
    a = torch.randn(MM, MM, device="cuda").to(getattr(torch, dtype))
    b = torch.randn(MM, MM, device="cuda").to(getattr(torch, dtype))
    _run(benchmark, lambda: a @ b, _tsync, {"flops": 2 * MM ** 3}, rounds=5)


# -- attention in bfloat16, written out (scores, softmax, @ values) on both sides ----------

ATTN = (8, 16, 1024, 64)     # batch, heads, sequence, head dim


def _attention(q, k, v, softmax):
    return softmax((q @ k.transpose(-1, -2)) * ATTN[3] ** -0.5) @ v


def _attention_flops():
    b, h, n, d = ATTN
    return 4 * b * h * n * n * d


@needs_gpu
@pytest.mark.benchmark(group="attention 8x16x1024x64 bf16")
def test_attention_zyx(benchmark, gpu):
    q, k, v = (zyx.randn(*ATTN).cast("bfloat16").realize() for _ in range(3))
    out = _attention(q, k, v, lambda s: s.softmax(-1)).float().numpy()[0, 0]
    qn, kn, vn = (x.float().numpy()[0, 0].astype(np.float64) for x in (q, k, v))
    sc = qn @ kn.T * ATTN[3] ** -0.5
    p = np.exp(sc - sc.max(-1, keepdims=True))
    np.testing.assert_allclose(out, (p / p.sum(-1, keepdims=True)) @ vn, atol=3e-2)
    _run(benchmark, lambda: _attention(q, k, v, lambda s: s.softmax(-1)).realize(),
         _zsync(gpu), {"flops": _attention_flops()}, rounds=7)


@needs_torch_cuda
@pytest.mark.benchmark(group="attention 8x16x1024x64 bf16")
def test_attention_torch(benchmark):
    q, k, v = (torch.randn(*ATTN, device="cuda").to(torch.bfloat16) for _ in range(3))
    _run(benchmark, lambda: _attention(q, k, v, lambda s: torch.softmax(s, -1)), _tsync,
         {"flops": _attention_flops()}, rounds=7)


# -- convolution (issue 13: ResNet-style 3x3, batch 64, 64 -> 64 channels, 56 x 56) ---------

CONV = (64, 64, 56, 3)     # batch, channels in = out, height = width, kernel


@needs_gpu
@pytest.mark.parametrize("precision", ["highest", "tf32"], indirect=True)
def test_conv2d_zyx(benchmark, gpu, precision):
    n, c, h, k = CONV
    benchmark.group = f"conv2d {n}x{c}x{h}x{h} k{k} float32 {precision}"
    x = zyx.randn(n, c, h, h).realize()
    w = (zyx.randn(c, c, k, k) * 0.05).realize()
    y = F.conv2d(x, w, padding=1).numpy()
    if torch is not None:
        ref = torch.nn.functional.conv2d(torch.from_numpy(x.numpy()), torch.from_numpy(w.numpy()),
                                         padding=1).numpy()
        tol = 1e-2 if precision == "tf32" else 1e-3
        np.testing.assert_allclose(y, ref, rtol=tol, atol=tol)
    _run(benchmark, lambda: F.conv2d(x, w, padding=1).realize(), _zsync(gpu),
         {"flops": 2 * n * c * c * h * h * k * k}, rounds=5)


@needs_torch_cuda
@pytest.mark.parametrize("precision", ["highest", "tf32"], indirect=True)
def test_conv2d_torch(benchmark, precision):
    n, c, h, k = CONV
    benchmark.group = f"conv2d {n}x{c}x{h}x{h} k{k} float32 {precision}"
    x = torch.randn(n, c, h, h, device="cuda")
    w = torch.randn(c, c, k, k, device="cuda") * 0.05
    _run(benchmark, lambda: torch.nn.functional.conv2d(x, w, padding=1), _tsync,
         {"flops": 2 * n * c * c * h * h * k * k}, rounds=5)


# -- training steps -----------------------------------------------------------------------

B, D, H, C = 64, 784, 128, 10
LR = {"sgd": 0.05, "adam": 1e-3}


def _batches(n=8):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((B, D), dtype=np.float32), rng.integers(0, C, B))
            for _ in range(n)]


def zyx_training_step(workload, opt):
    """(model, step) of a zyx training step on the default device: "mlp" (8 batches) or
    "convnet" (4 batches), with optimizer `opt` ("sgd" or "adam"); each step takes the
    next batch in turn. (int32 labels: WebGPU has no 64-bit integers, and every device
    takes them.)"""
    if workload == "mlp":
        model = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, C))
        data = [(zyx.tensor(x), zyx.tensor(y.astype(np.int32))) for x, y in _batches()]
    else:
        model = _zyx_convnet()
        rng = np.random.default_rng(0)
        data = [(zyx.tensor(rng.standard_normal((B, 1, 28, 28), dtype=np.float32)),
                 zyx.tensor(rng.integers(0, 10, B, dtype=np.int32))) for _ in range(4)]
    o = (optim.SGD if opt == "sgd" else optim.Adam)(model.parameters(), lr=LR[opt])
    it = iter(range(1 << 30))

    def step():
        x, y = data[next(it) % len(data)]
        loss = F.cross_entropy(model(x), y)
        o.zero_grad()
        loss.backward()
        o.step()
    return model, step


@needs_gpu
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_mlp_step_zyx(benchmark, gpu, opt):
    benchmark.group = f"mlp step {opt}"
    model, step = zyx_training_step("mlp", opt)
    for _ in range(3):
        step()
    assert all(p.device == gpu for p in model.parameters())
    _run(benchmark, step, _zsync(gpu), {"ops": 1})


@needs_torch_cuda
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_mlp_step_torch(benchmark, opt):
    benchmark.group = f"mlp step {opt}"
    model = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.ReLU(),
                                torch.nn.Linear(H, C)).cuda()
    o = (torch.optim.SGD if opt == "sgd" else torch.optim.Adam)(model.parameters(), lr=LR[opt])
    data = [(torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()) for x, y in _batches()]
    it = iter(range(1 << 30))

    def step():
        x, y = data[next(it) % len(data)]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        o.zero_grad()
        loss.backward()
        o.step()
    _run(benchmark, step, _tsync, {"ops": 1})


def _zyx_convnet():
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(16 * 7 * 7, 10))


@needs_gpu
def test_convnet_step_zyx(benchmark, gpu):
    benchmark.group = "mnist convnet step (batch 64, adam)"
    _, step = zyx_training_step("convnet", "adam")
    step()
    _run(benchmark, step, _zsync(gpu), {"ops": 1}, rounds=5)


@needs_torch_cuda
def test_convnet_step_torch(benchmark):
    benchmark.group = "mnist convnet step (batch 64, adam)"
    tnn = torch.nn
    model = tnn.Sequential(tnn.Conv2d(1, 8, 3, padding=1), tnn.ReLU(), tnn.MaxPool2d(2),
                           tnn.Conv2d(8, 16, 3, padding=1), tnn.ReLU(), tnn.MaxPool2d(2),
                           tnn.Flatten(), tnn.Linear(16 * 7 * 7, 10)).cuda()
    o = torch.optim.Adam(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    data = [(torch.from_numpy(rng.standard_normal((B, 1, 28, 28), dtype=np.float32)).cuda(),
             torch.from_numpy(rng.integers(0, 10, B)).cuda()) for _ in range(4)]
    it = iter(range(1 << 30))

    def step():
        x, y = data[next(it) % len(data)]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        o.zero_grad()
        loss.backward()
        o.step()
    _run(benchmark, step, _tsync, {"ops": 1}, rounds=5)


# -- launch overhead ----------------------------------------------------------------------

@needs_gpu
@pytest.mark.benchmark(group="tiny realization (4096 f32, cached plan)")
def test_tiny_realization_zyx(benchmark, gpu):
    x = zyx.randn(4096).realize()
    (x + 1).realize()
    _run(benchmark, lambda: (x + 1).realize(), _zsync(gpu), {"ops": 1}, rounds=30)


@needs_torch_cuda
@pytest.mark.benchmark(group="tiny realization (4096 f32, cached plan)")
def test_tiny_op_torch(benchmark):
    x = torch.randn(4096, device="cuda")
    _run(benchmark, lambda: x + 1, _tsync, {"ops": 1}, rounds=30)


# -- first step with an empty kernel cache (issue 13: under 2 s) ---------------------------

_COLD = textwrap.dedent("""
    import time, numpy as np, zyx, zyx.nn as nn, zyx.nn.functional as F
    from zyx import optim
    zyx.set_default_device({device!r})
    zyx.manual_seed(0)
    rng = np.random.default_rng(0)
    if {workload!r} == "mlp":
        model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
        shape = (64, 784)
    else:
        model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Flatten(), nn.Linear(16 * 7 * 7, 10))
        shape = (64, 1, 28, 28)
    opt = optim.Adam(model.parameters(), lr=1e-3)
    x = zyx.tensor(rng.standard_normal(shape, dtype=np.float32))
    y = zyx.tensor(rng.integers(0, 10, 64, dtype=np.int32))  # (WebGPU: no int64)
    zyx.synchronize()
    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        zyx.synchronize()
    t0 = time.perf_counter(); step(); t1 = time.perf_counter(); step(); t2 = time.perf_counter()
    print(t1 - t0, t2 - t1, zyx.stats()["kernels_compiled"])
""")


@needs_gpu
@pytest.mark.parametrize("workload", ["mlp", "convnet"])
def test_first_step_cold_cache_zyx(benchmark, gpu, workload):
    """The first Adam step of a fresh process with an empty kernel cache (every kernel
    lowered and compiled by the device's compiler), then the second step."""
    benchmark.group = "first step, empty kernel cache"
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, XDG_CACHE_HOME=cache)
        res = benchmark.pedantic(lambda: subprocess.run(
            [sys.executable, "-c", _COLD.format(device=gpu, workload=workload)], env=env,
            capture_output=True, text=True, check=True), rounds=1, iterations=1)
    first, second, compiled = res.stdout.split()[-3:]
    benchmark.extra_info.update(first_step_ms=float(first) * 1e3,
                                second_step_ms=float(second) * 1e3, kernels=int(compiled))
    print(f"\nzyx {gpu} {workload} cold first step {float(first) * 1e3:.0f} ms "
          f"({compiled} kernels compiled), second step {float(second) * 1e3:.2f} ms")
