"""zyx.save / zyx.load (safetensors) and the disk memory pool."""
import json
import os
import struct

import numpy as np
import pytest

import zyx
from zyx.backends.disk import DiskMemoryPool
from zyx.io import SafetensorsError

RT = zyx._RT


def _bf16_bits(x):
    """float32 values that bf16 holds exactly -> their 16-bit patterns."""
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _sample(name, shape, rng):
    """Random values of every zyx dtype (bf16 given as exactly representable float32)."""
    if name == "bool":
        return rng.random(shape) > 0.5
    if name == "bfloat16":
        return (rng.integers(-64, 64, shape) / 8).astype(np.float32)
    if name.startswith("float"):
        return rng.standard_normal(shape).astype(name)
    info = np.iinfo(name)
    return rng.integers(info.min, info.max, shape, dtype=name, endpoint=True)


ALL_DTYPES = ["bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
              "float16", "bfloat16", "float32", "float64"]


def _pool_of(t):
    return RT.graph.get(t._id).buffer.pool


def test_roundtrip_every_dtype(tmp_path):
    rng = np.random.default_rng(0)
    ref = {name: _sample(name, (3, 5), rng) for name in ALL_DTYPES}
    tensors = {name: zyx.Tensor(v, dtype=name) for name, v in ref.items()}
    # a 0-d value made by a reduction (and one given as a 0-d numpy array)
    tensors["scalar"] = zyx.Tensor(np.array([1.0, 1.5], np.float32)).sum()
    tensors["np_scalar"] = np.array(7, np.int64)
    tensors["empty"] = zyx.Tensor(np.zeros((0, 4), np.int16))
    path = tmp_path / "all.safetensors"
    zyx.save(tensors, path)
    out = zyx.load(path)
    assert list(out) == list(tensors)                   # header order is the given order
    for name in ALL_DTYPES:
        t = out[name]
        assert t.dtype is zyx.dtype.to_dtype(name)
        assert t.shape == (3, 5)
        np.testing.assert_array_equal(t.numpy(), ref[name])
    assert out["scalar"].shape == () and out["scalar"].item() == 2.5
    assert out["np_scalar"].shape == () and out["np_scalar"].item() == 7
    assert out["empty"].shape == (0, 4) and out["empty"].dtype is zyx.int16


def test_file_layout_follows_the_spec(tmp_path):
    path = tmp_path / "m.safetensors"
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([1, -2, 3], np.int8)
    zyx.save({"b": zyx.Tensor(b), "a": zyx.Tensor(a)}, path, metadata={"format": "zyx"})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0, "data must start 8-byte aligned"
    text = raw[8:8 + n].decode("utf-8")
    assert text.startswith("{") and text.rstrip(" ").endswith("}")   # padded with spaces only
    header = json.loads(text)
    assert header["__metadata__"] == {"format": "zyx"}
    assert header["a"]["dtype"] == "F32" and header["a"]["shape"] == [2, 3]
    assert header["b"]["dtype"] == "I8" and header["b"]["shape"] == [3]
    data = raw[8 + n:]
    ba, ea = header["a"]["data_offsets"]
    bb, eb = header["b"]["data_offsets"]
    assert np.frombuffer(data[ba:ea], "<f4").tolist() == a.ravel().tolist()
    assert np.frombuffer(data[bb:eb], "i1").tolist() == b.tolist()
    assert len(data) == max(ea, eb) and ba % 4 == 0


def test_bf16_is_stored_as_its_bit_pattern(tmp_path):
    vals = np.array([1.5, -2.25, 3.140625, 0.0], np.float32)
    path = tmp_path / "bf.safetensors"
    zyx.save({"w": zyx.Tensor(vals, dtype=zyx.bfloat16)}, path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert json.loads(raw[8:8 + n])["w"]["dtype"] == "BF16"
    np.testing.assert_array_equal(np.frombuffer(raw[8 + n:], "<u2"), _bf16_bits(vals))


def test_save_realizes_lazy_tensors_and_numpy_values(tmp_path):
    x = zyx.Tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    path = tmp_path / "lazy.safetensors"
    zyx.save({"y": (x * 2 + 1).sum(axis=0), "z": x.permute(1, 0),
              "n": np.arange(3, dtype=np.uint32)}, path)
    out = zyx.load(path)
    xs = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(out["y"].numpy(), (xs * 2 + 1).sum(axis=0))
    np.testing.assert_array_equal(out["z"].numpy(), xs.T)
    np.testing.assert_array_equal(out["n"].numpy(), np.arange(3, dtype=np.uint32))


def test_load_is_lazy_only_used_tensors_are_read(tmp_path):
    rng = np.random.default_rng(1)
    ref = {k: rng.standard_normal((4, 8)).astype(np.float32) for k in ("a", "b", "c")}
    path = tmp_path / "lazy.safetensors"
    zyx.save({k: zyx.Tensor(v) for k, v in ref.items()}, path)
    out = zyx.load(path)
    pool = _pool_of(out["a"])
    assert isinstance(pool, DiskMemoryPool)
    assert pool.bytes_read == 0
    assert pool.used_bytes == 3 * 4 * 8 * 4          # three views into the mapping
    y = (out["b"] * 2 + 1).numpy()                  # a kernel reads "b" only
    np.testing.assert_allclose(y, ref["b"] * 2 + 1, rtol=1e-6)
    assert pool.bytes_read == ref["b"].nbytes
    assert _pool_of(out["a"]) is pool and _pool_of(out["c"]) is pool   # never touched
    assert _pool_of(out["b"]) is not pool           # moved into the device pool, once
    (out["b"] - 1).numpy()
    assert pool.bytes_read == ref["b"].nbytes
    np.testing.assert_array_equal(out["c"].numpy(), ref["c"])   # numpy() reads from the file
    assert pool.bytes_read == ref["b"].nbytes + ref["c"].nbytes
    assert pool.used_bytes == 2 * ref["a"].nbytes   # "b"'s view went back when it moved
    del out
    assert pool.used_bytes == 0


def test_disk_leaf_feeds_kernels_in_every_dtype_family(tmp_path):
    path = tmp_path / "k.safetensors"
    vals = np.array([1.5, -2.25, 3.0, 0.5], np.float32)
    ints = np.array([1, 2, 3, 4], np.int64)
    zyx.save({"h": zyx.Tensor(vals, dtype=zyx.bfloat16), "i": zyx.Tensor(ints)}, path)
    out = zyx.load(path)
    np.testing.assert_array_equal((out["h"].cast(zyx.float32) * 2).numpy(), vals * 2)
    np.testing.assert_array_equal((out["i"] + 1).numpy(), ints + 1)


def test_overwriting_a_loaded_file_keeps_lazy_tensors_valid(tmp_path):
    path = tmp_path / "w.safetensors"
    first = np.arange(4, dtype=np.float32)
    zyx.save({"w": zyx.Tensor(first)}, path)
    old = zyx.load(path)
    zyx.save({"w": zyx.Tensor(first + 100), "extra": zyx.Tensor(first)}, path)
    np.testing.assert_array_equal(old["w"].numpy(), first)      # still the old file's bytes
    np.testing.assert_array_equal(zyx.load(path)["w"].numpy(), first + 100)
    # saving lazily loaded tensors back over their own file works too
    again = zyx.load(path)
    zyx.save(again, path)
    np.testing.assert_array_equal(zyx.load(path)["extra"].numpy(), first)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_metadata_and_header_helpers(tmp_path):
    path = tmp_path / "m.safetensors"
    zyx.save({"x": np.zeros((2, 2), np.float64)}, path, metadata={"epoch": "3"})
    assert zyx.io.load_metadata(path) == {"epoch": "3"}
    entries, meta = zyx.io.read_header(path)
    assert entries == {"x": (zyx.float64, (2, 2))} and meta == {"epoch": "3"}


@pytest.mark.parametrize("bad, match", [
    ({"x": [1, 2]}, "cannot save a list"),
    ({1: np.zeros(2)}, "names must be strings"),
    ({"__metadata__": np.zeros(2)}, "reserved"),
])
def test_save_rejects_bad_input(tmp_path, bad, match):
    # the plain safetensors writer; zyx.save stores lists and int keys as a nested
    # checkpoint (tests/test_checkpoints.py)
    with pytest.raises(SafetensorsError, match=match):
        zyx.io.save(bad, tmp_path / "x.safetensors")
    assert not os.listdir(tmp_path)


def _write(path, header, data=b"", pad=True, length=None):
    h = json.dumps(header).encode() if not isinstance(header, bytes) else header
    if pad:
        h += b" " * ((-(8 + len(h))) % 8)
    path.write_bytes(struct.pack("<Q", len(h) if length is None else length) + h + data)
    return path


def _good_entry(**kw):
    e = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    e.update(kw)
    return e


CORRUPT = [
    ("short", lambda p: p.write_bytes(b"\x01\x02\x03"), "truncated file"),
    ("empty", lambda p: p.write_bytes(b""), "truncated file"),
    ("huge length", lambda p: _write(p, {"x": _good_entry()}, b"\0" * 8, length=1 << 40),
     "header length"),
    ("bad json", lambda p: _write(p, b'{"x": {"dtype": "F32",', b"\0" * 8), "not valid JSON"),
    ("not utf8", lambda p: _write(p, b'{"\xff\xfe": 1}', b""), "not valid JSON"),
    ("array header", lambda p: _write(p, [1, 2], b""), "not an object"),
    ("entry not object", lambda p: _write(p, {"x": 3}, b""), "not an object"),
    ("missing field", lambda p: _write(p, {"x": {"dtype": "F32", "shape": [2]}}, b"\0" * 8),
     "lacks data_offsets"),
    ("unknown dtype", lambda p: _write(p, {"x": _good_entry(dtype="F8_E4M3")}, b"\0" * 8),
     "unknown dtype 'F8_E4M3'"),
    ("negative dim", lambda p: _write(p, {"x": _good_entry(shape=[-2])}, b"\0" * 8), "shape"),
    ("offsets out of range", lambda p: _write(p, {"x": _good_entry(data_offsets=[0, 16],
                                                                   shape=[4])}, b"\0" * 8),
     "out of range"),
    ("reversed offsets", lambda p: _write(p, {"x": _good_entry(data_offsets=[8, 0])}, b"\0" * 8),
     "out of range"),
    ("shape/bytes mismatch", lambda p: _write(p, {"x": _good_entry(shape=[3])}, b"\0" * 8),
     "needs 12 bytes"),
    ("overlap", lambda p: _write(p, {"x": _good_entry(), "y": _good_entry(data_offsets=[4, 12])},
                                 b"\0" * 12), "overlap"),
    ("duplicate name", lambda p: _write(
        p, b'{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
           b'"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', b"\0" * 8), "duplicate"),
    ("bad metadata", lambda p: _write(p, {"__metadata__": {"a": 1}, "x": _good_entry()},
                                      b"\0" * 8), "__metadata__"),
]


@pytest.mark.parametrize("make, match", [c[1:] for c in CORRUPT], ids=[c[0] for c in CORRUPT])
def test_corrupt_files_raise_and_load_nothing(tmp_path, make, match):
    path = tmp_path / "bad.safetensors"
    make(path)
    nodes = len(RT.graph)
    with pytest.raises(SafetensorsError, match=match) as info:
        zyx.load(path)
    assert isinstance(info.value, zyx.ZyxError)
    assert len(RT.graph) == nodes


def test_truncated_copy_of_a_real_file_raises(tmp_path):
    path = tmp_path / "full.safetensors"
    zyx.save({"a": np.ones(16, np.float32), "b": np.ones(16, np.float64)}, path)
    raw = path.read_bytes()
    for cut in (len(raw) - 1, len(raw) - 70, 20, 7):
        p = tmp_path / f"cut{cut}.safetensors"
        p.write_bytes(raw[:cut])
        with pytest.raises(SafetensorsError):
            zyx.load(p)


def test_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        zyx.load(tmp_path / "nope.safetensors")


# ---- the disk pool itself ------------------------------------------------------------------
def test_disk_pool_read_only_views_and_accounting(tmp_path):
    path = tmp_path / "raw.bin"
    path.write_bytes(bytes(range(32)))
    pool = DiskMemoryPool(path)
    assert pool.total_bytes == 32 and pool.used_bytes == 0
    buf = pool.view(8, 4)
    assert pool.used_bytes == 4
    dst = np.empty(4, np.uint8)
    pool.pool_to_host(buf, dst)
    assert dst.tolist() == [8, 9, 10, 11] and pool.bytes_read == 4
    with pytest.raises(zyx.AllocationError, match="read-only"):
        pool.allocate(4)
    with pytest.raises(zyx.AllocationError, match="outside"):
        pool.view(30, 4)
    pool.deallocate(buf)
    assert pool.used_bytes == 0


def test_disk_pool_writable_allocate_roundtrip(tmp_path):
    path = tmp_path / "rw.bin"
    path.write_bytes(b"\0" * 64)
    pool = DiskMemoryPool(path, writable=True)
    a, _ = pool.allocate(16)
    b, _ = pool.allocate(16)
    assert (a.handle, b.handle) == (0, 16) and pool.used_bytes == 32
    pool.host_to_pool(np.arange(4, dtype=np.float32), b)
    out = np.empty(4, np.float32)
    pool.pool_to_host(b, out)
    assert out.tolist() == [0, 1, 2, 3]
    pool.deallocate(a)
    assert pool.allocate(16)[0].handle == 0          # freed block reused
    with pytest.raises(zyx.AllocationError):
        pool.allocate(64)
    pool.flush()
    assert np.frombuffer(path.read_bytes()[16:32], np.float32).tolist() == [0, 1, 2, 3]


# ---- interop with the safetensors package ----------------------------------------------------
def test_safetensors_numpy_reads_zyx_files_and_back(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(2)
    ref = {n: _sample(n, (2, 3), rng) for n in ALL_DTYPES if n != "bfloat16"}
    path = tmp_path / "z.safetensors"
    zyx.save({k: zyx.Tensor(v) for k, v in ref.items()}, path, metadata={"k": "v"})
    theirs = st.load_file(str(path))
    assert set(theirs) == set(ref)
    for k, v in ref.items():
        assert theirs[k].dtype == v.dtype
        np.testing.assert_array_equal(theirs[k], v)
    path2 = tmp_path / "np.safetensors"
    st.save_file(ref, str(path2), metadata={"format": "np"})
    ours = zyx.load(path2)
    for k, v in ref.items():
        np.testing.assert_array_equal(ours[k].numpy(), v)
    assert zyx.io.load_metadata(path2) == {"format": "np"}


def test_safetensors_torch_bf16_interop(tmp_path):
    pytest.importorskip("safetensors")
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file
    vals = np.array([[1.5, -2.25], [3.140625, 0.0078125]], np.float32)
    path = tmp_path / "z.safetensors"
    zyx.save({"w": zyx.Tensor(vals, dtype=zyx.bfloat16)}, path)
    w = load_file(str(path))["w"]
    assert w.dtype == torch.bfloat16
    np.testing.assert_array_equal(w.float().numpy(), vals)
    path2 = tmp_path / "t.safetensors"
    save_file({"t": torch.tensor(vals, dtype=torch.bfloat16),
               "i": torch.arange(6, dtype=torch.int64).reshape(2, 3)}, str(path2))
    ours = zyx.load(path2)
    assert ours["t"].dtype is zyx.bfloat16
    np.testing.assert_array_equal(ours["t"].numpy(), vals)
    np.testing.assert_array_equal(ours["i"].numpy(), np.arange(6).reshape(2, 3))
