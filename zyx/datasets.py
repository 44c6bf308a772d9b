"""Small datasets for examples and tests, returned as numpy arrays.

- `load_digits()`: scikit-learn's bundled 8x8 handwritten digits (1,797 images; works
  offline, needs `pip install scikit-learn`), with a deterministic train/test split.
- `load_mnist(directory)`: MNIST (or Fashion-MNIST) from the standard IDX files, raw or
  gzip-compressed, in a directory the user downloaded them to. zyx never downloads.
- `read_idx(path)` / `write_idx(path, array)`: the IDX format itself.

Every loader returns ``(x_train, y_train, x_test, y_test)``.
"""
from __future__ import annotations

import gzip
import os
import zlib

import numpy as np

from .errors import ZyxError

__all__ = ["load_digits", "load_mnist", "read_idx", "write_idx", "DatasetError",
           "DatasetNotFoundError", "MNIST_FILES"]


class DatasetError(ZyxError, ValueError):
    """A dataset file is corrupt or its parts do not fit together."""


class DatasetNotFoundError(ZyxError, FileNotFoundError):
    """A dataset file is missing (the message names the file and where it was looked for)."""


# IDX type byte -> big-endian numpy dtype
_IDX_TYPES = {0x08: np.dtype(">u1"), 0x09: np.dtype(">i1"), 0x0B: np.dtype(">i2"),
              0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_IDX_CODE = {dt.newbyteorder("="): code for code, dt in _IDX_TYPES.items()}


def _read_bytes(path):
    """File contents, gunzipped when the file starts with the gzip magic (name does not matter)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise DatasetError(f"{path}: corrupt gzip data ({e})") from None
    return data


def read_idx(path) -> np.ndarray:
    """Read an IDX file (raw or .gz) into a native-byte-order numpy array."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DatasetNotFoundError(f"IDX file {path!r} does not exist")
    data = _read_bytes(path)
    if len(data) < 4:
        raise DatasetError(f"{path}: {len(data)} bytes is too short for an IDX header")
    if data[0] != 0 or data[1] != 0:
        raise DatasetError(f"{path}: bad IDX magic {data[:4].hex()} (expected 0000tt nn: "
                           "two zero bytes, a type byte, a dimension count)")
    code, ndim = data[2], data[3]
    if code not in _IDX_TYPES:
        raise DatasetError(f"{path}: unknown IDX element type 0x{code:02x}")
    if ndim == 0:
        raise DatasetError(f"{path}: IDX header declares 0 dimensions")
    head = 4 + 4 * ndim
    if len(data) < head:
        raise DatasetError(f"{path}: truncated IDX header ({len(data)} bytes, {ndim} dims "
                           f"need {head})")
    dims = tuple(int(x) for x in np.frombuffer(data, ">u4", ndim, 4))
    dtype = _IDX_TYPES[code]
    need = dtype.itemsize * int(np.prod(dims, dtype=np.int64))
    if len(data) - head != need:
        raise DatasetError(f"{path}: shape {dims} of {dtype.name} needs {need} data bytes, "
                           f"the file has {len(data) - head} (truncated or corrupt)")
    arr = np.frombuffer(data, dtype, offset=head).reshape(dims)
    return arr.astype(dtype.newbyteorder("="))


def write_idx(path, array, compress=None) -> None:
    """Write `array` as an IDX file; gzip-compressed when `compress` (default: name ends .gz)."""
    a = np.asarray(array)
    try:
        code = _IDX_CODE[a.dtype.newbyteorder("=")]
    except KeyError:
        raise DatasetError(f"IDX cannot store dtype {a.dtype} (uint8, int8, int16, int32, "
                           "float32, float64)") from None
    if a.ndim == 0 or a.ndim > 255:
        raise DatasetError(f"IDX needs 1 to 255 dimensions, got {a.ndim}")
    body = (bytes([0, 0, code, a.ndim]) + np.asarray(a.shape, ">u4").tobytes() +
            np.ascontiguousarray(a, _IDX_TYPES[code]).tobytes())
    path = os.fspath(path)
    if compress if compress is not None else path.endswith(".gz"):
        body = gzip.compress(body, mtime=0)
    with open(path, "wb") as f:
        f.write(body)


# the four MNIST parts; each is found under any of the usual spellings, raw or .gz
MNIST_FILES = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
               "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte"}


def _find(directory, base):
    names = [base, base.replace("-idx", ".idx")]
    for n in names:
        for cand in (n, n + ".gz"):
            p = os.path.join(directory, cand)
            if os.path.isfile(p):
                return p
    raise DatasetNotFoundError(
        f"MNIST file {base!r} (or {base}.gz) not found in {directory!r}; download the four "
        f"IDX files ({', '.join(MNIST_FILES.values())}) into that directory")


def load_mnist(directory, normalize=False):
    """MNIST from the IDX files in `directory`: ``(x_train, y_train, x_test, y_test)``.

    Images are uint8 arrays of shape (N, rows, cols) (float32 in [0, 1] with
    `normalize=True`), labels int64 of shape (N,)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise DatasetNotFoundError(f"MNIST directory {directory!r} does not exist")
    parts = {k: read_idx(_find(directory, base)) for k, base in MNIST_FILES.items()}
    out = []
    for split in ("train", "test"):
        x, y = parts[f"{split}_images"], parts[f"{split}_labels"]
        if x.ndim != 3:
            raise DatasetError(f"MNIST {split} images must be 3-d (N, rows, cols), "
                               f"got shape {x.shape}")
        if y.ndim != 1:
            raise DatasetError(f"MNIST {split} labels must be 1-d, got shape {y.shape}")
        if len(x) != len(y):
            raise DatasetError(f"MNIST {split}: {len(x)} images but {len(y)} labels")
        if y.size and (y.min() < 0 or y.max() > 9):
            raise DatasetError(f"MNIST {split} labels must be digits 0..9, found "
                               f"{int(y.min())}..{int(y.max())}")
        if normalize:
            x = x.astype(np.float32) / np.float32(255.0)
        out += [x, y.astype(np.int64)]
    return tuple(out)


def load_digits(test_fraction=0.2, seed=0):
    """scikit-learn's 8x8 digits: ``(x_train, y_train, x_test, y_test)``.

    Images are float32 of shape (N, 1, 8, 8) scaled to [0, 1], labels int64. The split is a
    seeded, stratified shuffle (each digit keeps `test_fraction` of its images for testing),
    so it is the same on every machine for the same `seed`."""
    try:
        from sklearn.datasets import load_digits as _sk_digits
    except ImportError:
        raise DatasetNotFoundError("load_digits needs scikit-learn (pip install scikit-learn); "
                                   "it ships the 8x8 digits data") from None
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    bunch = _sk_digits()
    x = (bunch.images.astype(np.float32) / np.float32(16.0)).reshape(-1, 1, 8, 8)
    y = bunch.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    test_idx = []
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        rng.shuffle(idx)
        test_idx.append(idx[:int(round(len(idx) * test_fraction))])
    test = np.zeros(len(y), dtype=bool)
    test[np.concatenate(test_idx)] = True
    train_idx = rng.permutation(np.flatnonzero(~test))
    test_idx = np.flatnonzero(test)
    return x[train_idx], y[train_idx], x[test_idx], y[test_idx]
