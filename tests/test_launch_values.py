"""Values that change between otherwise equal graphs (slice starts, constants' scalars)
become kernel parameters read at launch (runtime._values_plan): the plan of the second
such graph serves every later one, so a loop over a changing Python scalar compiles
nothing after its second iteration; windows into a realized tensor (a batch
`data[i:i + T]`, a row `X[i]`) are parameters from the first graph on. Results are checked
against numpy on every device (the conftest `device` fixture), compile counts with
zyx.stats()."""
import numpy as np
import pytest

import zyx
from zyx import nn

from conftest import assert_close


def _compiled():
    return zyx.stats()["kernels_compiled"]


def _plans():
    return zyx.stats()["plans_built"]


def test_random_batches_of_slices_compile_twice_then_never(device):
    """The char-LM batching idiom: stack(data[i:i + T] for i in random starts)."""
    rng = np.random.default_rng(1)
    data_np = rng.integers(0, 65, 5000).astype(np.int64)
    data = zyx.tensor(data_np).realize()
    T, B = 32, 8
    counts = []
    for _ in range(8):
        ix = rng.integers(0, len(data_np) - T - 1, B)
        x = zyx.stack([data[int(i):int(i) + T] for i in ix])
        y = zyx.stack([data[int(i) + 1:int(i) + T + 1] for i in ix])
        assert np.array_equal(x.numpy(), np.stack([data_np[i:i + T] for i in ix]))
        assert np.array_equal(y.numpy(), np.stack([data_np[i + 1:i + T + 1] for i in ix]))
        counts.append((_compiled(), _plans()))
    # windows into a realized tensor are parameters from the first batch on: nothing new
    # after it
    assert counts[0] == counts[-1], counts


def test_rows_of_a_dataset_tensor_compile_once(device):
    """`X[i]` in a Python loop (a window of one row of a realized tensor)."""
    a = np.random.default_rng(5).standard_normal((200, 7)).astype(np.float32)
    x = zyx.tensor(a).realize()
    seen = []
    for i in (0, 3, 199, 57, 100):
        assert np.array_equal((x[i] * 2).numpy(), a[i] * 2)
        assert np.array_equal(x[-i - 1].numpy(), a[-i - 1])
        seen.append(_compiled())
    assert seen[0] == seen[-1], seen


def test_constants_that_change_become_parameters(device):
    x_np = np.linspace(-3, 3, 1000).astype(np.float32)
    x = zyx.tensor(x_np).realize()
    seen = []
    for c in (0.5, 0.25, 3.0, -1.5, 1e-30, float("inf"), 0.1):
        with np.errstate(all="ignore"):
            ref = np.maximum(x_np * np.float32(c), np.float32(c) - 1)
        assert_close((x * c).maximum(zyx.full((1000,), c) - 1), ref)
        seen.append(_compiled())
    assert seen[1] == seen[-1], seen


def test_same_graph_again_after_values_varied(device):
    """The first graph's own values keep hitting its specialized plan."""
    x = zyx.tensor(np.arange(10, dtype=np.float32)).realize()
    for c in (2.0, 3.0, 2.0, 4.0, 2.0):
        assert_close(x + c, np.arange(10, dtype=np.float32) + np.float32(c))
    before = _compiled()
    for c in (5.0, 2.0, 6.0):
        assert_close(x + c, np.arange(10, dtype=np.float32) + np.float32(c))
    assert _compiled() == before


def test_alternating_graphs_with_changing_values_and_slices(device):
    """Two graphs of different structure taking turns, each with a constant and a slice
    start that change every time: each finds its own family (the runtime remembers the
    last family to skip a second walk of the graph, and must not take the other's), and
    every value is right; nothing compiles after the first rounds."""
    data_np = np.arange(200, dtype=np.float32)
    data = zyx.tensor(data_np).realize()
    seen = []
    for r in range(6):
        c, i = 0.5 + r, 3 * r
        assert_close(data[i:i + 10] * c + 1, data_np[i:i + 10] * np.float32(c) + 1)
        assert_close((data[i + 1:i + 11] - c).exp().sum(),
                     np.exp(data_np[i + 1:i + 11] - np.float32(c)).sum(), rtol=1e-5)
        assert_close(data[:10] + c, data_np[:10] + np.float32(c))
        seen.append(_compiled())
    assert seen[2] == seen[-1], seen


@pytest.mark.parametrize("dtype", [zyx.int8, zyx.uint8, zyx.int32, zyx.uint32, zyx.int64,
                                   zyx.uint64, zyx.float16, zyx.bfloat16, zyx.float32,
                                   zyx.float64, zyx.bool],
                         ids=lambda d: d.name)
def test_parameter_constants_of_every_dtype(device, dtype):
    if dtype is zyx.float64 and not device_supports_f64(device):
        pytest.skip(f"{device} has no float64")
    n = 64
    if dtype is zyx.bool:
        base = np.arange(n) % 3 == 0
        values = (True, False, True, False)
        op = lambda t, c: t ^ c
        ref = lambda c: base ^ c
    elif dtype.is_float:
        base = np.linspace(-2, 2, n)
        values = (0.5, -1.25, 3.0, 8.0)
        op = lambda t, c: t * c - c
        ref = lambda c: base * c - c
    else:
        info = np.iinfo(dtype.np)
        base = np.arange(n) % 100
        values = (1, 7, int(info.max) - 100, 42)
        op = lambda t, c: t + c
        ref = lambda c: (base.astype(object) + c).astype(dtype.np)
    x = zyx.tensor(base, dtype=dtype).realize()
    if dtype.is_float:       # the reference starts from the values as stored
        base = np.asarray(x.numpy(), np.float64)
    counts = []
    for c in values:
        r = op(x, c)
        want = zyx.tensor(ref(c), dtype=dtype).numpy()   # rounded the way zyx stores dtype
        if dtype.is_float:
            tight = 1e-6 if dtype.itemsize >= 4 else 1e-2
            got = r.numpy().astype(np.float64) if dtype is not zyx.bfloat16 else r.numpy()
            np.testing.assert_allclose(np.asarray(got, np.float64), want.astype(np.float64),
                                       rtol=tight, atol=tight)
        else:
            assert np.array_equal(r.numpy(), want), (c, r.numpy()[:4], want[:4])
        counts.append(_compiled())
    assert counts[1] == counts[-1], counts


def device_supports_f64(device):
    try:
        zyx.ones(2, dtype=zyx.float64).numpy()
        return True
    except zyx.errors.ZyxError:
        return False


def test_two_dimensional_windows_and_real_pads_stay_right(device):
    """Cut axes read their start at launch; axes with real padding keep it in the source
    (a pad's amount changes the shape or the guarded region, so it stays in the key)."""
    rng = np.random.default_rng(2)
    a_np = rng.standard_normal((40, 50)).astype(np.float32)
    a = zyx.tensor(a_np).realize()
    counts = []
    for i, j in ((0, 0), (3, 7), (10, 20), (30, 40), (5, 1)):
        w = a[i:i + 10, j:j + 10]
        padded = zyx.nn.functional.pad(w, (1, 2))       # real pads on the last axis
        assert_close(padded, np.pad(a_np[i:i + 10, j:j + 10], ((0, 0), (1, 2))))
        assert_close(w.sum(1), a_np[i:i + 10, j:j + 10].sum(1), rtol=1e-5, atol=1e-5)
        assert_close(w.T.reshape(-1), a_np[i:i + 10, j:j + 10].T.reshape(-1))
        counts.append(_compiled())
    assert counts[1] == counts[-1], counts


def test_slice_starts_in_reductions_and_index_math(device):
    """A parameter start inside reshapes (div/mod index math) and a long reduction."""
    rng = np.random.default_rng(3)
    a_np = rng.standard_normal(10000).astype(np.float32)
    a = zyx.tensor(a_np).realize()
    counts = []
    for i in (0, 1, 17, 999, 2345, 7):
        s = a[i:i + 6000]
        assert_close(s.reshape(60, 100).sum(0), a_np[i:i + 6000].reshape(60, 100).sum(0),
                     rtol=1e-4, atol=1e-4)
        assert_close(s.sum(), a_np[i:i + 6000].sum(dtype=np.float64), rtol=1e-5, atol=1e-4)
        assert_close(s.reshape(60, 100).permute(1, 0)[3:50:2],
                     a_np[i:i + 6000].reshape(60, 100).T[3:50:2])
        counts.append(_compiled())
    assert counts[1] == counts[-1], counts


def test_training_on_random_batches_reuses_its_plan(device):
    """Batches sliced from one tensor feed an embedding + linear model unrealized; after
    the second step the step compiles nothing, and the losses equal those of the same
    steps fed batches copied from numpy."""
    rng = np.random.default_rng(4)
    data_np = rng.integers(0, 20, 3000).astype(np.int64)
    T, B = 16, 4
    starts = [rng.integers(0, len(data_np) - T - 1, B) for _ in range(6)]

    def run(sliced):
        zyx.manual_seed(0)
        model = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 20))
        opt = zyx.optim.Adam(model.parameters(), lr=1e-2)
        data = zyx.tensor(data_np).realize()
        losses, counts = [], []
        for ix in starts:
            if sliced:
                x = zyx.stack([data[int(i):int(i) + T] for i in ix])
                y = zyx.stack([data[int(i) + 1:int(i) + T + 1] for i in ix])
            else:
                x = zyx.tensor(np.stack([data_np[i:i + T] for i in ix]))
                y = zyx.tensor(np.stack([data_np[i + 1:i + T + 1] for i in ix]))
            loss = zyx.nn.functional.cross_entropy(model(x).reshape(-1, 20), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            counts.append(_compiled())
        return losses, counts

    sliced, counts = run(True)
    copied, _ = run(False)
    np.testing.assert_allclose(sliced, copied, rtol=1e-5)
    assert counts[1] == counts[-1], counts      # the second step reuses the first's plan


def test_values_plans_are_bounded_by_the_plan_cache(device, monkeypatch):
    """Values plans live in the plan cache (LRU), so many families do not pile up: the
    cache never holds more than max_plans entries, the second key of a window's first
    graph included (a small bound here, so the test does not depend on what earlier
    tests left in the cache)."""
    rt = zyx._RT
    monkeypatch.setattr(rt, "max_plans", 8)
    monkeypatch.setattr(rt, "plans", dict(list(rt.plans.items())[:8]))
    x = zyx.tensor(np.arange(32, dtype=np.float32)).realize()
    for n in range(1, 20):
        for c in (1.5, 2.5, 3.5):
            assert_close(x[:n] * c, np.arange(n, dtype=np.float32) * np.float32(c))
            assert len(rt.plans) <= rt.max_plans


def test_the_family_hint_tells_another_graph_apart():
    """The last family's skeleton test (`Runtime._values_plan`) on a graph whose key has
    the family's length but not its structure: where the family had a slice's PAD arg,
    this graph has a source position, after an entry that happens to equal PAD's code.
    It is not of the family (None), instead of being masked as a PAD arg."""
    from zyx._core.graph import CONST, PAD
    from zyx.runtime import _Family
    first = (CONST, 2.5, (), 1, PAD, (((-1, -2), (0, 0)), 0.0), (4,), 1, 0)
    family = _Family(first, None, [(1, 0), (5, 1)])
    assert family.skeleton_of(first) == \
        (CONST, None, (), 1, PAD, ((None, None), 0.0), (4,), 1, 0)
    other = first[:5] + (3,) + first[6:]
    assert family.skeleton_of(other) is None
    assert family.skeleton_of(first[:-1]) is None          # another length
