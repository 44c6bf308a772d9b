"""Random expression graphs (chains of unary, binary, reduce and movement ops on small random
shapes) built with zyx and with numpy side by side; every intermediate that is kept is
compared. This is what finds fusion and index-arithmetic bugs that hand-written cases miss.

Examples are derandomized so a warm kernel cache stays warm; set ZYX_HYPOTHESIS_RANDOM=1 to
explore new ones."""
from __future__ import annotations

import os

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import zyx  # noqa: E402

pytestmark = pytest.mark.usefixtures("device")

SETTINGS = settings(max_examples=60, deadline=None,
                    derandomize=not os.environ.get("ZYX_HYPOTHESIS_RANDOM"),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])

# (zyx op, numpy op) pairs; inputs stay bounded so float32 chains do not overflow
UNARY = {
    "neg": (lambda x: -x, lambda a: -a),
    "abs": (lambda x: x.abs(), np.abs),
    "tanh": (lambda x: x.tanh(), np.tanh),
    "sin": (lambda x: x.sin(), np.sin),
    "sigmoid": (lambda x: x.sigmoid(), lambda a: 1 / (1 + np.exp(-a))),
    "relu": (lambda x: x.relu(), lambda a: np.maximum(a, 0)),
    "exp_tanh": (lambda x: x.tanh().exp(), lambda a: np.exp(np.tanh(a))),
    "log1p_abs": (lambda x: (x.abs() + 1).log(), lambda a: np.log(np.abs(a) + 1)),
    "sqrt_abs": (lambda x: x.abs().sqrt(), lambda a: np.sqrt(np.abs(a))),
    "square": (lambda x: x * x, lambda a: a * a),
    "affine": (lambda x: x * 0.5 - 1.25, lambda a: a * 0.5 - 1.25),
    "floor": (lambda x: (x * 3).floor(), lambda a: np.floor(a * 3)),
}
BINARY = {
    "add": (lambda x, y: x + y, np.add),
    "sub": (lambda x, y: x - y, np.subtract),
    "mul": (lambda x, y: x * y, np.multiply),
    "div": (lambda x, y: x / (y.abs() + 1), lambda a, b: a / (np.abs(b) + 1)),
    "max": (zyx.maximum, np.maximum),
    "min": (zyx.minimum, np.minimum),
    "where": (lambda x, y: zyx.where(x > y, x, y * 0.5), lambda a, b: np.where(a > b, a, b * 0.5)),
}
REDUCE = {
    "sum": (lambda x, ax, k: x.sum(ax, keepdim=k), lambda a, ax, k: a.sum(ax, keepdims=k)),
    "max": (lambda x, ax, k: x.amax(ax, keepdim=k), lambda a, ax, k: a.max(ax, keepdims=k)),
    "min": (lambda x, ax, k: x.amin(ax, keepdim=k), lambda a, ax, k: a.min(ax, keepdims=k)),
    "mean": (lambda x, ax, k: x.mean(ax, keepdim=k), lambda a, ax, k: a.mean(ax, keepdims=k)),
}


def _broadcastable(s, t):
    for a, b in zip(reversed(s), reversed(t)):
        if a != b and a != 1 and b != 1:
            return False
    return True


def _step(data, pool):
    """Apply one random op to values in `pool` (list of (zyx tensor, numpy array))."""
    kind = data.draw(st.sampled_from(["unary", "binary", "binary", "reduce", "move", "move"]))
    x, a = pool[data.draw(st.integers(0, len(pool) - 1))]
    nd = a.ndim
    if kind == "unary":
        name = data.draw(st.sampled_from(sorted(UNARY)))
        f, g = UNARY[name]
        return f(x), g(a), name
    if kind == "binary":
        partners = [p for p in pool if _broadcastable(p[1].shape, a.shape)]
        y, b = partners[data.draw(st.integers(0, len(partners) - 1))]
        name = data.draw(st.sampled_from(sorted(BINARY)))
        f, g = BINARY[name]
        if data.draw(st.booleans()):
            return f(x, y), g(a, b), name
        return f(y, x), g(b, a), name + "'"
    if kind == "reduce" and nd > 0 and a.size > 0:
        name = data.draw(st.sampled_from(sorted(REDUCE)))
        ax = data.draw(st.integers(-nd, nd - 1))
        if nd > 1 and data.draw(st.booleans()):   # several axes at once, any order
            ax = tuple(data.draw(st.lists(st.integers(-nd, nd - 1), min_size=2, max_size=nd,
                                          unique_by=lambda v: v % nd)))
        keep = data.draw(st.booleans())
        f, g = REDUCE[name]
        return f(x, ax, keep), g(a, ax, keep), f"{name}({ax}, keepdim={keep})"
    # movement
    ops = ["reshape", "unsqueeze_expand", "pad"] + (["permute", "flip", "slice"] if nd else [])
    op = data.draw(st.sampled_from(ops))
    if op == "permute":
        perm = data.draw(st.permutations(range(nd)))
        return x.permute(*perm), a.transpose(perm), f"permute{tuple(perm)}"
    if op == "flip":
        ax = data.draw(st.integers(0, nd - 1))
        return x.flip(ax), np.flip(a, ax), f"flip({ax})"
    if op == "slice":
        ax = data.draw(st.integers(0, nd - 1))
        n = a.shape[ax]
        start = data.draw(st.integers(-n - 1, n)) if n else 0
        step = data.draw(st.sampled_from([1, 2, 3, -1, -2]))
        sl = (slice(None),) * ax + (slice(start, None, step),)
        return x[sl], a[sl], f"slice(ax={ax}, {start}::{step})"
    if op == "reshape":
        n = a.size
        divs = [d for d in range(1, n + 1) if n % d == 0] or [1]
        d0 = data.draw(st.sampled_from(divs))
        shape = data.draw(st.sampled_from([(n,), (d0, n // d0) if n else (0,),
                                           (n // d0, 1, d0) if n else (0, 1)]))
        return x.reshape(shape), a.reshape(shape), f"reshape{shape}"
    if op == "unsqueeze_expand":
        ax = data.draw(st.integers(0, nd))
        k = data.draw(st.integers(1, 3))
        shape = a.shape[:ax] + (k,) + a.shape[ax:]
        b = np.broadcast_to(np.expand_dims(a, ax), shape)
        return x.unsqueeze(ax).expand(shape), b, f"unsqueeze({ax}).expand({shape})"
    # pad the last dim (torch order), possibly negative (a shrink)
    if nd == 0:
        return x.reshape(1).pad((1, 1), value=0.5), np.pad(a.reshape(1), (1, 1),
                                                           constant_values=0.5), "pad0d"
    n = a.shape[-1]
    lo = data.draw(st.integers(-min(n, 2), 2))
    hi = data.draw(st.integers(-max(0, min(n + lo, 2)) if n + lo > 0 else 0, 2))
    ref = np.pad(a, [(0, 0)] * (nd - 1) + [(max(lo, 0), max(hi, 0))], constant_values=-0.75)
    ref = ref[..., max(-lo, 0):ref.shape[-1] - max(-hi, 0)]
    return x.pad((lo, hi), value=-0.75), ref, f"pad({lo}, {hi})"


@st.composite
def _shapes(draw):
    nd = draw(st.integers(0, 3))
    return tuple(draw(st.integers(1, 4)) for _ in range(nd))


def random_graph(data, shape, steps, np_dt=np.float32):
    """(pool, trace): two random inputs of `shape` and `shape[1:]`, then `steps` random ops
    (`_step`) on what the pool holds; pool entries are (zyx tensor, float64 numpy value),
    trace the ops' names and shapes. Each result's shape is checked against numpy's."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    a0 = rng.uniform(-2, 2, size=shape).astype(np_dt)
    b0 = rng.uniform(-2, 2, size=shape[1:]).astype(np_dt)
    pool = [(zyx.Tensor(a0), a0.astype(np.float64)), (zyx.Tensor(b0), b0.astype(np.float64))]
    trace = []
    for _ in range(steps):
        x, a, name = _step(data, pool)
        trace.append(f"{name} -> {a.shape}")
        assert x.shape == a.shape, " | ".join(trace)
        pool.append((x, np.asarray(a, dtype=np.float64)))
    return pool, trace


def _device_has(name):
    """Whether the default device (the `device` fixture's) stores dtype `name`: WebGPU has
    no float64 or int64. Draws are limited to what it has, rather than the whole test
    skipping at the first such draw (conftest) with its float32 examples unchecked."""
    dtypes = zyx._RT.device().info().dtypes
    return not dtypes or name in dtypes


@SETTINGS
@given(data=st.data(), shape=_shapes(), steps=st.integers(1, 7),
       dtype=st.sampled_from(["float64", "float32"]))
def test_random_expression_graphs(data, shape, steps, dtype):
    if not _device_has(dtype):
        dtype = "float32"
    np_dt = np.float64 if dtype == "float64" else np.float32
    pool, trace = random_graph(data, shape, steps, np_dt)
    scale = max([1.0] + [float(np.abs(p[1]).max()) for p in pool if p[1].size])
    rtol, atol = (1e-9, 1e-9 * scale) if dtype == "float64" else (2e-4, 2e-4 * scale)
    # check the last result, and one earlier intermediate (a second realization that reads
    # realized and unrealized nodes of the same graph)
    picks = [len(pool) - 1, data.draw(st.integers(2, len(pool) - 1))]
    for i in picks:
        x, a = pool[i]
        got = x.numpy()
        assert got.dtype == np_dt and got.shape == a.shape, " | ".join(trace)
        np.testing.assert_allclose(got, a, rtol=rtol, atol=atol, err_msg=" | ".join(trace))


@SETTINGS
@given(data=st.data(), shape=_shapes())
def test_random_int_graphs(data, shape):
    """Integer chains are exact: any index or fusion mistake shows as a wrong value."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    a = rng.integers(-50, 50, size=shape).astype(np.int32)
    x = zyx.Tensor(a)
    ref = a.astype(np.int64)
    for _ in range(data.draw(st.integers(1, 5))):
        op = data.draw(st.sampled_from(["add", "mul", "floordiv", "mod", "flip", "permute",
                                        "sum", "max", "cumsum", "slice", "and"]))
        nd = ref.ndim
        if op == "add":
            x, ref = x + x.flip(), ref + np.flip(ref)
        elif op == "mul":
            x, ref = x * 3 - 7, ref * 3 - 7
        elif op == "floordiv":
            x, ref = x // 4, ref // 4
        elif op == "mod":
            x, ref = x % -3, ref % -3
        elif op == "and":
            x, ref = x & 0x3F, ref & 0x3F
        elif op == "flip" and nd:
            ax = data.draw(st.integers(0, nd - 1))
            x, ref = x.flip(ax), np.flip(ref, ax)
        elif op == "permute" and nd:
            perm = data.draw(st.permutations(range(nd)))
            x, ref = x.permute(*perm), ref.transpose(perm)
        elif op in ("sum", "max", "cumsum") and nd:
            ax = data.draw(st.integers(-nd, nd - 1))
            acc = zyx.int64 if _device_has("int64") else zyx.int32   # as torch: int64 sums
            if op == "sum":
                x, ref = x.sum(ax, dtype=acc), ref.sum(ax)
            elif op == "max":
                x, ref = x.amax(ax, keepdim=True), ref.max(ax, keepdims=True)
            else:
                x, ref = x.cumsum(ax, dtype=acc), np.cumsum(ref, ax)
            x, ref = x.cast(zyx.int32), ref.astype(np.int32).astype(np.int64)
        elif op == "slice" and nd:
            ax = data.draw(st.integers(0, nd - 1))
            sl = (slice(None),) * ax + (slice(None, None, -2),)
            x, ref = x[sl], ref[sl]
    got = x.numpy()
    assert got.shape == ref.shape
    np.testing.assert_array_equal(got.astype(np.int64), ref.astype(got.dtype).astype(np.int64))
