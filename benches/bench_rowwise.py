"""Row-wise reductions expanded back over their rows (softmax, log_softmax, layer_norm,
cross-entropy's forward), zyx next to PyTorch in one run.

Run:  python -m pytest benches/bench_rowwise.py --benchmark-only

"zyx" is one row kernel per op (the reduces computed per row inside the kernel that
stores the output: kernelizer._RowKernels); "zyx_stored" is the same op compiled with row
kernels turned off (each reduce stored by a kernel of its own, as before), on a
(1, R, C) view so that it gets a plan of its own. softmax 16384x4096 (the GPU case) is
not run here: 256 MiB per tensor on a 2-core machine."""
import numpy as np
import pytest

import zyx
import zyx.nn.functional as F
from conftest import need_torch

ROWS, COLS = 4096, 1024


@pytest.fixture(scope="module")
def data(rng):
    x = rng.standard_normal((ROWS, COLS), dtype=np.float32) * 3
    w = rng.standard_normal(COLS, dtype=np.float32)
    b = rng.standard_normal(COLS, dtype=np.float32)
    y = rng.integers(0, COLS, ROWS)
    return x, w, b, y


def _softmax(x, w, b, y):
    return x.softmax(-1)


def _log_softmax(x, w, b, y):
    return x.log_softmax(-1)


def _layer_norm(x, w, b, y):
    return F.layer_norm(x, (COLS,), w, b)


def _cross_entropy(x, w, b, y):
    return F.cross_entropy(x.reshape(ROWS, COLS), y)


def _torch_ops(t):
    tf = t.nn.functional
    return {"softmax": lambda x, w, b, y: t.softmax(x, -1),
            "log_softmax": lambda x, w, b, y: t.log_softmax(x, -1),
            "layer_norm": lambda x, w, b, y: tf.layer_norm(x, (COLS,), w, b),
            "cross_entropy": lambda x, w, b, y: tf.cross_entropy(x, y)}


OPS = {"softmax": _softmax, "log_softmax": _log_softmax, "layer_norm": _layer_norm,
       "cross_entropy": _cross_entropy}


def _stored(fn, *args):
    """fn(*args) compiled without row kernels (its plan is cached that way)."""
    from zyx._core import kernelizer
    saved = kernelizer.ROW_MIN, kernelizer.ROW_SMALL
    kernelizer.ROW_MIN, kernelizer.ROW_SMALL = 1 << 62, 0
    try:
        return fn(*args).realize()
    finally:
        kernelizer.ROW_MIN, kernelizer.ROW_SMALL = saved


def _check(name, out, data):
    t = need_torch()
    x, w, b, y = (t.from_numpy(np.asarray(a)) for a in data)
    ref = _torch_ops(t)[name](x, w, b, y).numpy()
    np.testing.assert_allclose(out.numpy(), ref, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("name", list(OPS))
def test_rowwise_zyx(benchmark, data, name):
    benchmark.group = f"{name}-{ROWS}x{COLS}"
    x, w, b, y = (zyx.Tensor(a) for a in data)
    fn = OPS[name]
    _check(name, fn(x, w, b, y), data)
    benchmark(lambda: fn(x, w, b, y).realize())


@pytest.mark.parametrize("name", list(OPS))
def test_rowwise_zyx_stored(benchmark, data, name):
    benchmark.group = f"{name}-{ROWS}x{COLS}"
    x, w, b, y = (zyx.Tensor(a) for a in data)
    x3 = x.reshape(1, ROWS, COLS)
    fn = OPS[name]
    _check(name, _stored(fn, x3, w, b, y).reshape(ROWS, COLS) if name != "cross_entropy"
           else _stored(fn, x3, w, b, y), data)
    benchmark(lambda: fn(x3, w, b, y).realize())


@pytest.mark.parametrize("name", list(OPS))
def test_rowwise_torch(benchmark, data, name):
    benchmark.group = f"{name}-{ROWS}x{COLS}"
    t = need_torch()
    x, w, b, y = (t.from_numpy(np.asarray(a)) for a in data)
    fn = _torch_ops(t)[name]
    benchmark(lambda: fn(x, w, b, y))
