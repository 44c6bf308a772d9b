"""zyx.datasets: IDX files, the MNIST loader and the bundled 8x8 digits."""
import gzip
import struct

import numpy as np
import pytest

import zyx
from zyx.datasets import (DatasetError, DatasetNotFoundError, load_mnist, read_idx, write_idx,
                          MNIST_FILES)


def make_mnist(directory, n_train=12, n_test=5, rows=28, cols=28, gz=False, seed=0):
    """Write the four MNIST IDX files (hand-built headers, as the real files are laid out)."""
    rng = np.random.default_rng(seed)
    data = {"train_images": rng.integers(0, 256, (n_train, rows, cols), dtype=np.uint8),
            "train_labels": rng.integers(0, 10, n_train, dtype=np.uint8),
            "test_images": rng.integers(0, 256, (n_test, rows, cols), dtype=np.uint8),
            "test_labels": rng.integers(0, 10, n_test, dtype=np.uint8)}
    for key, base in MNIST_FILES.items():
        a = data[key]
        raw = (struct.pack(">HBB", 0, 0x08, a.ndim) + struct.pack(f">{a.ndim}I", *a.shape) +
               a.tobytes())
        path = directory / (base + (".gz" if gz else ""))
        path.write_bytes(gzip.compress(raw) if gz else raw)
    return data


@pytest.mark.parametrize("gz", [False, True])
def test_load_mnist_raw_and_gz(tmp_path, gz):
    ref = make_mnist(tmp_path, gz=gz)
    x, y, xt, yt = load_mnist(tmp_path)
    assert x.dtype == np.uint8 and x.shape == (12, 28, 28)
    assert y.dtype == np.int64 and y.shape == (12,)
    np.testing.assert_array_equal(x, ref["train_images"])
    np.testing.assert_array_equal(y, ref["train_labels"])
    np.testing.assert_array_equal(xt, ref["test_images"])
    np.testing.assert_array_equal(yt, ref["test_labels"])
    xn = load_mnist(tmp_path, normalize=True)[0]
    assert xn.dtype == np.float32
    np.testing.assert_allclose(xn, ref["train_images"] / 255.0, rtol=1e-6)


def test_idx_roundtrip_every_type(tmp_path):
    rng = np.random.default_rng(3)
    for dtype in (np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64):
        a = (rng.standard_normal((3, 4, 2)) * 50).astype(dtype)
        for name in ("a.idx", "a.idx.gz"):
            write_idx(tmp_path / name, a)
            b = read_idx(tmp_path / name)
            assert b.dtype == dtype and b.dtype.isnative
            np.testing.assert_array_equal(a, b)
    # big-endian on disk, as the format says
    write_idx(tmp_path / "be.idx", np.array([1, 256], np.int16))
    assert (tmp_path / "be.idx").read_bytes() == b"\0\0\x0b\x01\0\0\0\x02\x00\x01\x01\x00"


def test_missing_directory_and_files_are_named(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="does not exist"):
        load_mnist(tmp_path / "nowhere")
    make_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DatasetNotFoundError, match="t10k-labels-idx1-ubyte") as info:
        load_mnist(tmp_path)
    assert isinstance(info.value, zyx.ZyxError) and isinstance(info.value, FileNotFoundError)


def _corrupt(path, fn):
    path.write_bytes(fn(path.read_bytes()))


@pytest.mark.parametrize("damage, match", [
    (lambda b: b[:-3], "truncated or corrupt"),
    (lambda b: b + b"\0", "truncated or corrupt"),
    (lambda b: b[:2], "too short"),
    (lambda b: b"\x01" + b[1:], "bad IDX magic"),
    (lambda b: b[:2] + b"\x07" + b[3:], "unknown IDX element type"),
    (lambda b: b[:4] + b"\0\0", "truncated IDX header"),
])
def test_corrupt_idx_files_raise(tmp_path, damage, match):
    make_mnist(tmp_path)
    _corrupt(tmp_path / "train-images-idx3-ubyte", damage)
    with pytest.raises(DatasetError, match=match):
        load_mnist(tmp_path)


def test_corrupt_gzip_and_mismatched_parts(tmp_path):
    make_mnist(tmp_path, gz=True)
    _corrupt(tmp_path / "train-labels-idx1-ubyte.gz", lambda b: b[:len(b) // 2])
    with pytest.raises(DatasetError, match="corrupt gzip"):
        load_mnist(tmp_path)
    d2 = tmp_path / "mismatch"
    d2.mkdir()
    make_mnist(d2)
    write_idx(d2 / "train-labels-idx1-ubyte", np.zeros(11, np.uint8))
    with pytest.raises(DatasetError, match="12 images but 11 labels"):
        load_mnist(d2)
    write_idx(d2 / "train-labels-idx1-ubyte", np.full(12, 10, np.uint8))
    with pytest.raises(DatasetError, match="0..9"):
        load_mnist(d2)


def test_load_digits_split_is_deterministic_and_stratified():
    pytest.importorskip("sklearn")
    x, y, xt, yt = zyx.datasets.load_digits()
    assert x.shape[1:] == (1, 8, 8) and x.dtype == np.float32 and y.dtype == np.int64
    assert len(x) + len(xt) == 1797
    assert 0.0 <= x.min() and x.max() <= 1.0
    x2, y2, xt2, yt2 = zyx.datasets.load_digits()
    np.testing.assert_array_equal(y, y2)
    np.testing.assert_array_equal(xt, xt2)
    # every digit is in both splits in about the requested proportion
    n_test = np.bincount(yt, minlength=10)
    frac = n_test / (np.bincount(y, minlength=10) + n_test)
    np.testing.assert_allclose(frac, 0.2, atol=0.01)
    # the split is a partition of the data set: no image in both halves
    from sklearn.datasets import load_digits as sk
    allx = sk().images.reshape(-1, 64).astype(np.float32) / 16
    assert len(np.unique(np.concatenate([x.reshape(-1, 64), xt.reshape(-1, 64)]), axis=0)) == \
        len(np.unique(allx, axis=0))
    other = zyx.datasets.load_digits(seed=1)[1]
    assert not np.array_equal(other, y)
