"""Memory accounting: buffers go back to the pool and graph nodes go away when tensors are
dropped; temporaries of multi-kernel plans are freed; 10,000 tensors leak nothing."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import zyx

pytestmark = pytest.mark.usefixtures("device")

RT = zyx._RT


def _state():
    gc.collect()
    return RT.pool_bytes(), len(RT.graph)


def _workload(i, a):
    """A mix of leaves, lazy graphs, realized results and multi-kernel plans."""
    x = zyx.Tensor(a)
    y = (x * (i % 3) + 1).exp()
    if i % 4 == 0:
        y = y.softmax(-1)                 # three kernels, two temporaries
    if i % 5 == 0:
        y = y.realize() + zyx.Tensor(a[::-1].copy())
    if i % 7 == 0:   # realized views may share their source's buffer
        y = y.realize().reshape(-1).realize().reshape(4, 8).T.T.realize()
    s = y.sum()
    return s.item()


def test_ten_thousand_tensors_leak_nothing():
    a = np.random.rand(4, 8).astype(np.float32)
    for i in range(20):                   # warm caches (plans, small constants) first
        _workload(i, a)
    bytes0, nodes0 = _state()
    total = 0.0
    for i in range(10_000):
        total += _workload(i, a)
    assert np.isfinite(total)
    bytes1, nodes1 = _state()
    assert bytes1 == bytes0, f"pool bytes {bytes0} -> {bytes1}"
    assert nodes1 == nodes0, f"graph nodes {nodes0} -> {nodes1}"


def test_buffers_return_when_tensors_die():
    bytes0, nodes0 = _state()
    x = zyx.Tensor(np.ones(1000, np.float32))
    assert RT.pool_bytes() == bytes0 + 4000
    y = (x * 2).realize()
    assert RT.pool_bytes() == bytes0 + 8000
    del x          # y is realized: it no longer needs x
    gc.collect()
    assert RT.pool_bytes() == bytes0 + 4000
    assert y.numpy()[0] == 2.0
    del y
    assert _state() == (bytes0, nodes0)


def test_lazy_graph_keeps_its_inputs_alive():
    bytes0, nodes0 = _state()
    x = zyx.Tensor(np.arange(100, dtype=np.float64))
    z = (x + 1) * 2
    del x          # z still needs x's buffer
    gc.collect()
    assert RT.pool_bytes() == bytes0 + 800
    assert z.numpy()[-1] == 200.0
    del z
    assert _state() == (bytes0, nodes0)


def test_multi_kernel_plan_frees_temporaries():
    x = zyx.Tensor(np.random.rand(64, 32).astype(np.float32))
    x.softmax(-1).numpy()                 # warm the plan
    bytes0, _ = _state()
    y = x.softmax(-1).realize()
    # only the result stays: the row max and row sum buffers went back to the pool
    assert RT.pool_bytes() == bytes0 + 64 * 32 * 4
    del y
    assert _state()[0] == bytes0


def test_reference_cycle_is_collected():
    bytes0, nodes0 = _state()

    class Holder:
        pass

    h = Holder()
    h.me = h
    h.t = zyx.Tensor(np.ones(256, np.float32)) * 3
    h.t.realize()
    del h
    assert _state() == (bytes0, nodes0)


def test_stats_report_bytes():
    s = zyx.stats()
    for k in ("kernels_compiled", "kernels_launched", "plans_built", "plan_cache_hits",
              "bytes_allocated"):
        assert k in s
    x = zyx.Tensor(np.ones(512, np.float32))
    assert zyx.stats()["bytes_allocated"] == s["bytes_allocated"] + 2048
    del x


def test_realized_views_keep_values_and_release_memory():
    bytes0, nodes0 = _state()
    a = np.arange(12, dtype=np.float32)
    x = zyx.Tensor(a)
    r = x.reshape(3, 4).realize()          # may share x's buffer
    tt = r.T.T.realize()                   # a copy that is element-for-element: may share too
    s = (x * 2).reshape(4, 3).realize()
    del x
    gc.collect()
    np.testing.assert_array_equal(r.numpy(), a.reshape(3, 4))
    np.testing.assert_array_equal(tt.numpy(), a.reshape(3, 4))
    np.testing.assert_array_equal((r + 1).numpy(), a.reshape(3, 4) + 1)
    np.testing.assert_array_equal(s.numpy(), (a * 2).reshape(4, 3))
    assert RT.pool_bytes() <= bytes0 + 3 * 48
    del r
    gc.collect()
    np.testing.assert_array_equal(tt.numpy(), a.reshape(3, 4))   # still valid
    del tt, s
    assert _state() == (bytes0, nodes0)


def test_memory_counters_and_empty_cache_on_the_default_device():
    """zyx.memory_allocated counts live tensors, memory_reserved adds the freed blocks the
    pool keeps, empty_cache gives those back (torch.cuda's names, for any device)."""
    dev = zyx.get_default_device()
    zyx.empty_cache()
    gc.collect()
    allocated0 = zyx.memory_allocated(dev)
    assert zyx.memory_reserved(dev) == allocated0
    t = (zyx.ones(1000) * 2).realize()
    assert zyx.memory_allocated(dev) == allocated0 + 4000
    assert zyx.memory_allocated() >= zyx.memory_allocated(dev)
    del t
    gc.collect()
    assert zyx.memory_allocated(dev) == allocated0
    assert zyx.memory_reserved(dev) == allocated0 + 4000     # kept for the next step
    t = (zyx.ones(1000) * 2).realize()                      # and reused
    assert zyx.memory_reserved(dev) == allocated0 + 4000
    del t
    gc.collect()
    zyx.empty_cache(dev)
    assert zyx.memory_reserved(dev) == allocated0


def test_zyx_cuda_answers_without_a_cuda_device():
    import zyx.cuda
    if zyx.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert zyx.cuda.device_count() == 0
    zyx.cuda.empty_cache()                          # nothing to give back: no error
    with pytest.raises(Exception, match="cuda"):
        zyx.cuda.memory_allocated()
