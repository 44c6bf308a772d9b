"""Tiny integer graphs evaluated on the host (zyx/host_eval.py): `item()`, `int()` and a
tensor used as an index give the values a realization gives, without one, for integer and
bool arithmetic and movement on small realized tensors; everything else (floats,
divisions, reductions, large tensors, nodes value checks watch) still realizes. Iterating
a lazy tensor computes it once, not once per element. On every device (the conftest
`device` fixture), against numpy."""
import numpy as np
import pytest

import zyx
from zyx import host_eval


def _realizations():
    return zyx.stats()["realizations"]


def test_slice_bounds_from_iterated_random_starts(device):
    """nanoGPT's batching: `for i in ix: data[i:i + T]`, ix random starts on the device.
    One realization computes ix; its elements and their sums with T are read on the host."""
    data_np = np.arange(1000, dtype=np.int64) * 3
    data = zyx.tensor(data_np).realize()
    ix = zyx.randint(0, 900, (8,))
    before = _realizations()
    bounds = [(int(i), int(i + 64), int(i + 1), (i + 65).item()) for i in ix]
    assert _realizations() == before + 1          # ix itself, once
    starts = ix.numpy()
    assert bounds == [(s, s + 64, s + 1, s + 65) for s in starts.tolist()]
    x = zyx.stack([data[i:i + 64] for i in ix])
    np.testing.assert_array_equal(x.numpy(), np.stack([data_np[s:s + 64] for s in starts]))


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32, np.int64, np.uint32])
def test_integer_ops_match_a_realization(device, dtype):
    """Every op the host takes, with wrap-around, against the device's own result."""
    rng = np.random.default_rng(4)
    info = np.iinfo(dtype)
    a_np = rng.integers(info.min, info.max, (4, 5), dtype=dtype, endpoint=True)
    a = zyx.tensor(a_np).realize()
    exprs = [lambda t: t[1, 2] + 7, lambda t: t[3, 4] * 3 - t[0, 0],
             lambda t: t.T[2, 1], lambda t: t.flip(0)[0, 1], lambda t: (t[2] & 5)[3],
             lambda t: t[1:3, 2:][1, 0] ^ t[0, 1], lambda t: t.maximum(t.flip(1))[2, 2],
             lambda t: (t[0, 1] < t[1, 0]), lambda t: -t[2, 3] if dtype != np.uint8 else t[2, 3],
             lambda t: t[0, 0].cast(zyx.int64) + 1, lambda t: (t[1, 1] == t[1, 1]) & (t[0, 0] != 1)]
    for f in exprs:
        want = f(zyx.tensor(a_np)).numpy().reshape(()).item()     # through a realization
        got = f(a)
        before = _realizations()
        assert got.item() == want
        assert _realizations() == before                # computed on the host


def test_what_is_not_taken(device):
    """Floats, divisions (their divisor is checked for zero by the realization),
    reductions, large tensors: left to a realization, with the same values."""
    x = zyx.tensor(np.arange(10, dtype=np.float32)).realize()
    n = zyx.tensor(np.arange(10, dtype=np.int64)).realize()
    big = zyx.tensor(np.arange(host_eval.MAX_LEAF_NUMEL + 1, dtype=np.int64)).realize()
    for t, want in ((x[3] + 1, 4.0), (n[7] // 2, 3), (n[7] % 4, 3), (n.sum(), 45),
                    (big.flip(0)[5] + 1, host_eval.MAX_LEAF_NUMEL - 4)):
        before = _realizations()
        assert t.item() == want
        assert _realizations() > before


def test_reads_are_kept_until_something_may_write(device, monkeypatch):
    """host_item's reads of device memory are kept while nothing ran that could have
    written it (Runtime._leaf_read): 32 bounds from one tensor of starts read it once;
    an in-place write, and any realization, makes the next read fresh."""
    ix = zyx.tensor(np.arange(32, dtype=np.int64) * 5).realize()
    pool = zyx._RT.graph.get(ix._id).buffer.pool
    reads = []
    real = pool.pool_to_host

    def counted(src, dst, wait_events=()):
        reads.append(src.nbytes)
        return real(src, dst, wait_events)
    monkeypatch.setattr(pool, "pool_to_host", counted)
    host = type(pool).__name__ == "HostMemoryPool"
    assert [int(i + 3) for i in ix] == [5 * k + 3 for k in range(32)]
    assert host or len(reads) == 1, reads
    ix[4] = 1000                          # a new node for ix (and a realization later)
    assert int(ix[4] + 1) == 1001 and int(ix[5] + 1) == 26
    zyx.tensor(np.ones(3)).sum().item()   # a realization: kept reads are dropped
    assert int(ix[4] - 1) == 999
