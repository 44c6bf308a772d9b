"""`x[box] = value` into x's memory (zyx.inplace._write_region, Runtime.region_fits and
write_region): a key/value cache written at one position copies the new row, not the
cache. Values against numpy on every device; which memory a tensor ends on through the
graph's leaves; lazy results made before a write keep the values they read."""
import numpy as np
import pytest

import zyx
from zyx import inplace

from test_bounds import key_value_cache_steps


@pytest.fixture
def in_place(device):
    """Every box write that fits goes into memory, whatever the tensor's size (the
    defaults leave tensors under 64 KiB in host memory, 64 MiB on devices, to the
    functional update)."""
    zyx.zeros(1).realize()          # (the runtime reads its settings when it starts)
    rt = zyx._RT
    before = rt.inplace_region_bytes, rt.inplace_region_device_bytes
    rt.inplace_region_bytes = rt.inplace_region_device_bytes = 0
    try:
        yield device
    finally:
        rt.inplace_region_bytes, rt.inplace_region_device_bytes = before


def _leaf_buffer(t):
    node = zyx._RT.graph.get(t._id)
    assert node.op == 0, "not a realized leaf"
    return node.buffer


def test_key_value_cache_stays_in_its_memory(in_place):
    """test_bounds.key_value_cache_steps (attention over a cache written at step t,
    against numpy at every step): both caches on their first buffers at every step (no
    copy of them), and no more plans than the functional update builds."""
    before = zyx.stats()["plans_built"]
    first = None
    for t, caches in key_value_cache_steps():
        buffers = tuple(_leaf_buffer(c) for c in caches)
        first = first or buffers
        assert buffers == first, t
    assert zyx.stats()["plans_built"] - before <= 8


def test_lazy_results_made_before_a_write_keep_the_old_values(in_place):
    """A lazy result that reads the tensor before the write, still held when the write's
    realization ends, reads the old values when realized later: the write is then
    computed as a whole (a new buffer), and both values are right."""
    a = np.arange(64, dtype=np.float32).reshape(8, 8)
    x = zyx.tensor(a).realize()
    old = x * 2                              # lazy, reads x's values before the write
    with zyx.no_grad():
        x[3] = zyx.tensor(np.full(8, -1, np.float32))
        total = x.sum().item()               # a realization: the write's value computed
    b = a.copy()
    b[3] = -1
    assert total == b.sum()
    assert np.array_equal(old.numpy(), a * 2)
    assert np.array_equal(x.numpy(), b)


def test_lazy_results_dropped_before_the_realization_do_not_block(in_place):
    """A previous step's lazy result that read the old values, dropped before the next
    realization (the loop variable reassigned), lets the write go into memory."""
    a = np.zeros((16, 4), np.float32)
    x = zyx.tensor(a).realize()
    first = _leaf_buffer(x)
    step = None
    with zyx.no_grad():
        for i in range(6):
            x[i] = zyx.tensor(np.full(4, i + 1, np.float32))
            step = x[:i + 1].sum(0)          # replaces the previous step's lazy result
            a[i] = i + 1
            assert np.array_equal(step.numpy(), a[:i + 1].sum(0))
            assert _leaf_buffer(x) is first
    assert np.array_equal(x.numpy(), a)


@pytest.mark.parametrize("key", [(slice(None), 2), (1, slice(3, 6)), (slice(2, 4),),
                                 (Ellipsis, 5), (0, None, slice(1, 3)), (slice(1, 3), 0)])
def test_boxes_and_broadcast_values(in_place, key):
    """Boxes over several runs, slices with None and Ellipsis, and values that broadcast
    (a scalar tensor, a row): against numpy after a realization, and when read at once."""
    a = np.arange(8 * 6 * 8, dtype=np.float32).reshape(8, 6, 8)
    x = zyx.tensor(a).realize()
    first = _leaf_buffer(x)
    shape = np.empty((8, 6, 8))[key].shape
    for value in (np.float32(-3.0) + np.zeros(shape, np.float32),
                  np.arange(shape[-1], dtype=np.float32)):
        with zyx.no_grad():
            x[key] = zyx.tensor(value)
            (x * 1).sum().realize()
        a[key] = value
        assert np.array_equal(x.numpy(), a), key
    assert _leaf_buffer(x) is first
    with zyx.no_grad():
        x[key] = zyx.tensor(np.ones(shape, np.float32))
    a[key] = 1
    assert np.array_equal(x.numpy(), a)      # read at once: computed as a whole


def test_what_stays_a_functional_update(in_place):
    """Writes under autograd, to tensors with live views, of scalars, of masks and index
    tensors, two writes before a realization, and under the size threshold: values as
    numpy's, and the tensor on a new buffer (or not: views share the base's)."""
    a = np.arange(32, dtype=np.float32).reshape(4, 8)
    x = zyx.tensor(a).realize()
    view = x[1]
    with zyx.no_grad():
        x[2] = zyx.tensor(np.ones(8, np.float32))
    a[2] = 1
    assert np.array_equal(view.numpy(), a[1]) and np.array_equal(x.numpy(), a)
    del view
    y = zyx.tensor(a).realize()
    first = _leaf_buffer(y)
    with zyx.no_grad():
        y[0] = 5.0                                   # a scalar
        y[zyx.tensor(np.array([True, False, False, True]))] = zyx.tensor(np.zeros(8, np.float32))
        y[1] = zyx.tensor(np.full(8, 7, np.float32))
        y[1, 2:4] = zyx.tensor(np.full(2, 9, np.float32))   # a second write to y
    b = a.copy()
    b[0] = 5
    b[[0, 3]] = 0
    b[1] = 7
    b[1, 2:4] = 9
    assert np.array_equal(y.numpy(), b)
    assert _leaf_buffer(y) is not first
    w = zyx.tensor(np.zeros(4, np.float32), requires_grad=True)
    z = zyx.tensor(a).realize()
    with zyx.enable_grad():
        z[0, :4] = w * 2                             # recorded: stays differentiable
        z.sum().backward()
    assert np.array_equal(w.grad.numpy(), np.full(4, 2, np.float32))
    zyx._RT.inplace_region_bytes = a.nbytes + 1      # under the thresholds
    zyx._RT.inplace_region_device_bytes = a.nbytes + 1
    u = zyx.tensor(a).realize()
    first = _leaf_buffer(u)
    with zyx.no_grad():
        u[0] = zyx.tensor(np.ones(8, np.float32))
        u.sum().realize()
    assert _leaf_buffer(u) is not first


def test_small_dtypes(in_place):
    """int32, float16 and bool boxes: the bytes copied as they are; on WebGPU (whole
    4-byte words) an odd run of 16- or 8-bit values stays a functional update."""
    for d, np_d in ((zyx.int32, np.int32), (zyx.float16, np.float16), (zyx.bool, np.bool_)):
        try:
            x = zyx.zeros((4, 6), dtype=d).realize()
        except zyx.errors.UnsupportedDTypeError:
            continue
        a = np.zeros((4, 6), np_d)
        for key, val in (((1,), np.ones(6, np_d)), ((2, slice(1, 4)), np.ones(3, np_d))):
            with zyx.no_grad():
                x[key] = zyx.tensor(val)
                (x.cast(zyx.float32)).sum().realize()
            a[key] = val
            assert np.array_equal(x.numpy(), a), (d, key)


def test_no_writes_wait_after_a_realization(in_place):
    """Nothing is left waiting once the write's realization ran (the hook empties the
    table), and a write whose tensor is dropped first is forgotten."""
    x = zyx.zeros((8, 8)).realize()
    with zyx.no_grad():
        x[1] = zyx.ones(8)
        x.sum().realize()
        assert inplace.waiting_region_writes() == 0
        y = zyx.zeros((8, 8)).realize()
        y[2] = zyx.ones(8)
        assert inplace.waiting_region_writes() == 1
        del y
        x.sum().realize()
    assert inplace.waiting_region_writes() == 0


@pytest.mark.parametrize("shape,box", [
    ((8, 8), ((1, 1), (0, 8))),                      # one row: one run
    ((4, 6, 5), ((0, 4), (2, 3), (0, 5))),           # a middle slab: a run per leading row
    ((4, 6, 5), ((1, 2), (0, 6), (1, 3))),           # cut on the last axis: many short runs
    ((3, 4), ((0, 3), (0, 4))),                      # the whole tensor
])
def test_region_runs_cover_exactly_the_box(shape, box):
    """The runs write_region copies are the box's elements in row-major order, and a box
    over more than `most` runs is refused before the list is made."""
    from zyx.runtime import region_runs
    flat = np.arange(np.prod(shape)).reshape(shape)
    want = flat[tuple(slice(s, s + n) for s, n in box)].reshape(-1)
    runs = region_runs(shape, box)
    got = np.concatenate([np.arange(s, s + n) for s, n in runs])
    np.testing.assert_array_equal(got, want)
    assert region_runs(shape, box, most=len(runs)) == runs
    if len(runs) > 1:
        assert region_runs(shape, box, most=len(runs) - 1) is None
