"""DLPack both ways on the CPU: numpy and PyTorch read zyx tensors without a copy and zyx
reads theirs; lifetimes are right on both sides. (CUDA exchange is tested in
tests/test_cuda.py on a GPU machine.)"""
from __future__ import annotations

import gc

import numpy as np
import pytest

import zyx
from conftest import ALL_DTYPES, ids, round_to, sample

RT = zyx._RT
needs_cpu = pytest.mark.skipif(not any(d.type == "cpu" for d in zyx.devices()),
                               reason="no C backend device")
NUMPY_DTYPES = [d for d in ALL_DTYPES if d is not zyx.bfloat16]   # numpy has no bfloat16


@pytest.fixture(autouse=True)
def on_cpu():
    if not any(d.type == "cpu" for d in zyx.devices()):
        pytest.skip("no C backend device")
    before = RT.default
    RT.set_default_device("cpu")
    yield
    RT.default = before


@pytest.mark.parametrize("d", NUMPY_DTYPES, ids=ids(NUMPY_DTYPES))
def test_numpy_reads_zyx_without_copy(d):
    a = sample((3, 5), d)
    x = zyx.tensor(a, dtype=d) * 1 if d is not zyx.bool else zyx.tensor(a, dtype=d)
    n = np.from_dlpack(x)
    assert n.dtype == d.np and n.shape == (3, 5)
    np.testing.assert_array_equal(n, round_to(a, d))
    node = RT.graph.get(x._id)
    assert n.ctypes.data == node.buffer.ptr        # the same memory


@pytest.mark.parametrize("d", NUMPY_DTYPES, ids=ids(NUMPY_DTYPES))
def test_zyx_reads_numpy_without_copy(d):
    a = np.ascontiguousarray(sample((4, 3), d))
    x = zyx.from_dlpack(a)
    assert x.dtype is d and x.shape == (4, 3) and x.device == "cpu"
    np.testing.assert_array_equal(x.numpy(), a)
    assert RT.graph.get(x._id).buffer.ptr == a.ctypes.data


def test_exported_memory_outlives_the_zyx_tensor_and_returns_to_the_pool():
    pool = RT.resolve("cpu").pool
    before = pool.used_bytes
    x = zyx.tensor(np.arange(1000, dtype=np.float32)) * 2     # (arange's range is cached)
    x.realize()
    n = np.from_dlpack(x)
    del x
    gc.collect()
    assert pool.used_bytes >= before + 4000          # still held by the numpy array
    junk = [(zyx.ones(1000) * 7).realize() for _ in range(4)]   # would reuse freed memory
    np.testing.assert_array_equal(n, np.arange(1000, dtype=np.float32) * 2)
    del n, junk
    gc.collect()
    assert pool.used_bytes == before


def test_an_unconsumed_capsule_frees_its_reference():
    pool = RT.resolve("cpu").pool
    before = pool.used_bytes
    x = (zyx.ones(256) + 1).realize()
    cap = x.__dlpack__()
    del x
    gc.collect()
    assert pool.used_bytes > before
    del cap
    gc.collect()
    assert pool.used_bytes == before


def test_imported_memory_is_released_to_its_producer():
    released = []

    class Producer:
        def __init__(self, arr):
            self.arr = arr

        def __dlpack__(self, stream=None, **kw):
            return self.arr.__dlpack__()

        def __dlpack_device__(self):
            return self.arr.__dlpack_device__()

    a = np.arange(6, dtype=np.float32)
    import weakref
    p = Producer(a)
    x = zyx.from_dlpack(p)
    weakref.finalize(a, released.append, True)
    del a, p
    gc.collect()
    assert not released                 # zyx still reads it
    assert (x * 2).numpy().tolist() == [0, 2, 4, 6, 8, 10]
    del x
    gc.collect()
    assert released == [True]


def test_non_contiguous_sources_are_copied():
    a = np.arange(20, dtype=np.int64).reshape(4, 5)[:, ::2]
    x = zyx.from_dlpack(a)
    np.testing.assert_array_equal(x.numpy(), a)
    t = np.arange(12.0).reshape(3, 4).T
    np.testing.assert_array_equal(zyx.from_dlpack(t).numpy(), t)


def test_zero_size_and_scalars():
    assert zyx.from_dlpack(np.zeros((0, 3), np.float32)).shape == (0, 3)
    s = zyx.from_dlpack(np.array(2.5))
    assert s.shape == () and s.item() == 2.5
    assert np.from_dlpack(zyx.tensor(3.0)).shape == ()


def test_torch_exchange_including_bfloat16():
    torch = pytest.importorskip("torch", reason="PyTorch not installed")
    for td, zd in [(torch.float32, zyx.float32), (torch.bfloat16, zyx.bfloat16),
                   (torch.int64, zyx.int64), (torch.bool, zyx.bool), (torch.float16, zyx.float16)]:
        t = (torch.arange(12) % 3).to(td).reshape(3, 4)
        z = zyx.from_dlpack(t)
        assert z.dtype is zd
        np.testing.assert_array_equal(z.float().numpy() if zd is zyx.bfloat16 else z.numpy(),
                                      t.float().numpy() if td is torch.bfloat16 else t.numpy())
        back = torch.from_dlpack(z)
        assert back.dtype == td and torch.equal(back, t)
        assert back.data_ptr() == t.data_ptr()      # no copy either way
    t = torch.zeros(4)
    z = zyx.from_dlpack(t)
    t[1] = 5.0                   # shared memory, as with torch.from_dlpack
    assert z.numpy()[1] == 5.0


def test_export_from_a_device_without_dlpack_is_a_clear_error():
    others = [d for d in zyx.devices() if d.type not in ("cpu", "cuda", "hip", "dummy")]
    if not others:
        pytest.skip("no device without DLPack support (e.g. OpenCL) here")
    x = zyx.ones(3, device=str(others[0]))
    with pytest.raises(BufferError, match="cpu"):
        x.__dlpack__()
    np.testing.assert_array_equal(np.from_dlpack(x.cpu()), np.ones(3, np.float32))


def test_read_only_arrays_come_through_versioned_dlpack():
    a = np.arange(6, dtype=np.float32)
    a.flags.writeable = False            # numpy 2 exports these only as DLPack 1.x
    x = zyx.from_dlpack(a)
    assert RT.graph.get(x._id).buffer.ptr == a.ctypes.data
    np.testing.assert_array_equal((x * 2).numpy(), a * 2)
    n = np.from_dlpack(x)                # numpy's own import of our export: read-only view
    np.testing.assert_array_equal(zyx.from_dlpack(n).numpy(), a)
