"""safetensors files: `save(state_dict, path)` and lazy `load(path)`.

Format (https://github.com/huggingface/safetensors): an 8-byte little-endian unsigned header
length N, N bytes of UTF-8 JSON mapping each tensor name to
``{"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}`` (offsets relative to the
byte buffer that follows the header) plus an optional ``"__metadata__"`` string map, then the
raw little-endian tensor bytes. The header is padded with spaces so the data starts 8-byte
aligned.

Loading maps the file through a disk pool (`Runtime.open_file`) and makes one LEAF node per tensor whose
buffer is a view of the mapping; a tensor's bytes are read only when a kernel (or `numpy()`)
needs them. The whole header is validated before any tensor is made, so a truncated or
corrupt file raises `SafetensorsError` and loads nothing.
"""
from __future__ import annotations

import json
import os
import re
import struct
from typing import Mapping

import numpy as np

from .. import dtype as dt
from ..errors import ZyxError
from ..files import write_atomic
from ..runtime import RT

__all__ = ["save", "load", "load_metadata", "read_header", "SafetensorsError", "DTYPE_CODES"]

# safetensors dtype code <-> zyx dtype (all 13 zyx dtypes; bf16 is stored as its bit pattern)
DTYPE_CODES = {"BOOL": dt.bool_, "U8": dt.uint8, "U16": dt.uint16, "U32": dt.uint32,
               "U64": dt.uint64, "I8": dt.int8, "I16": dt.int16, "I32": dt.int32,
               "I64": dt.int64, "F16": dt.float16, "BF16": dt.bfloat16, "F32": dt.float32,
               "F64": dt.float64}
_CODE_OF = {d: c for c, d in DTYPE_CODES.items()}

_ALIGN = 8
_MAX_HEADER = 100 << 20     # the reference implementation refuses headers above 100 MB


class SafetensorsError(ZyxError, ValueError):
    """A safetensors file is truncated or corrupt, or the tensors given cannot be saved."""


# ---------------------------------------------------------------------------------------------
# saving
# ---------------------------------------------------------------------------------------------
def _host_bytes(tensors):
    """(dtype, shape, contiguous little-endian ndarray) for each value; Tensors realize together."""
    from ..tensor import Tensor
    RT.realize([v._id for v in tensors.values() if isinstance(v, Tensor)])
    out = {}
    for name, v in tensors.items():
        if isinstance(v, Tensor):
            node = RT.graph.get(v._id)
            d, shape = node.dtype, tuple(node.shape)
            arr = np.empty(shape, dtype=d.np)   # bf16 travels as its uint16 bit pattern
            buf = node.buffer
            if arr.nbytes:
                buf.pool.pool_to_host(buf, arr, [buf.event] if buf.event is not None else [])
        elif isinstance(v, np.ndarray):
            d = dt.from_numpy(v.dtype)          # raises DTypeError for unsupported numpy types
            shape = v.shape
            arr = np.ascontiguousarray(v)
        else:
            raise SafetensorsError(f"tensor {name!r}: cannot save a {type(v).__name__}; "
                                   "values must be zyx.Tensor or numpy.ndarray")
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        out[name] = (d, shape, arr)
    return out


def save(tensors, path, metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` (a name -> Tensor/ndarray mapping, or anything with `state_dict()`)
    to `path` in safetensors format. Tensors are realized first.

    The file is written next to `path` and renamed over it, so a failed save leaves the old
    file intact and tensors still lazily mapped from the old file stay valid."""
    if hasattr(tensors, "state_dict") and not isinstance(tensors, Mapping):
        tensors = tensors.state_dict()
    if not isinstance(tensors, Mapping):
        raise SafetensorsError("save needs a mapping of names to tensors, got "
                               f"{type(tensors).__name__}")
    for name in tensors:
        if not isinstance(name, str):
            raise SafetensorsError(f"tensor names must be strings, got {name!r}")
        if name == "__metadata__":
            raise SafetensorsError("'__metadata__' is reserved; pass metadata= instead")
    if metadata is not None:
        if not isinstance(metadata, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise SafetensorsError("metadata must map strings to strings")
    data = _host_bytes(dict(tensors))

    # Data is laid out widest dtype first (stable in the given order), so with an 8-aligned
    # data start every tensor is aligned to its element size; the header keeps the given order.
    order = sorted(data, key=lambda n: -data[n][0].itemsize)
    offsets, pos = {}, 0
    for name in order:
        n = data[name][2].nbytes
        offsets[name] = (pos, pos + n)
        pos += n
    header = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    for name, (d, shape, _) in data.items():
        header[name] = {"dtype": _CODE_OF[d], "shape": [int(s) for s in shape],
                        "data_offsets": list(offsets[name])}
    hbytes = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    hbytes += b" " * ((-(8 + len(hbytes))) % _ALIGN)

    def write(f):
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for name in order:
            arr = data[name][2]
            if arr.nbytes:
                f.write(arr.reshape(-1).view(np.uint8).data)
    path = os.path.abspath(os.fspath(path))
    write_atomic(path, write, mode=0o666 & ~_umask(), prefix=".zyx-save-", suffix=".tmp")


def _umask():
    m = os.umask(0)
    os.umask(m)
    return m


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------
MAX_NESTING = 64      # deeper JSON in a header is reported as nesting, not as its type
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def _nesting_depth(raw: bytes) -> int:
    """Deepest bracket nesting of a JSON text (strings skipped), without recursion."""
    a = np.frombuffer(_JSON_STRING.sub(b"", raw), dtype=np.uint8)
    if a.size == 0:
        return 0
    step = ((a == ord("[")) | (a == ord("{"))).astype(np.int64) - \
        ((a == ord("]")) | (a == ord("}"))).astype(np.int64)
    return int(np.cumsum(step).max())


def _no_duplicates(pairs):
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {dup!r}")
    return d


_CONVERT = ("convert it once with PyTorch: `sd = torch.load(path, map_location='cpu', "
            "weights_only=True)` then `safetensors.torch.save_file(sd, 'model.safetensors')` "
            "(pip install safetensors), and load that file")


def _foreign_format(pool):
    """A message naming what a file that is not safetensors is (a PyTorch checkpoint), or
    None. Only asked when the header length is impossible, so real files pay nothing."""
    head = pool.read(0, min(pool.total_bytes, 8))
    where = pool.path
    if head.startswith(b"PK\x03\x04"):
        import zipfile
        try:
            with zipfile.ZipFile(where) as z:
                names = z.namelist()
        except (zipfile.BadZipFile, OSError):
            names = []
        if any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
            return (f"{where} is a PyTorch checkpoint (torch.save's zip format with data.pkl), "
                    f"not a safetensors file; zyx does not unpickle files: {_CONVERT}")
        return f"{where} is a zip archive, not a safetensors file"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return (f"{where} is a Python pickle (PyTorch's legacy torch.save format?), not a "
                f"safetensors file; zyx does not unpickle files: {_CONVERT}")
    return None


def _parse_header(pool):
    """Validate the header of the mapped file; return (entries, metadata, data_start) where
    entries is a list of (name, dtype, shape, begin, end) in header order."""
    size = pool.total_bytes
    where = pool.path
    if size < 8:
        raise SafetensorsError(f"{where}: truncated file ({size} bytes): shorter than the "
                               "8-byte header length")
    (n,) = struct.unpack("<Q", pool.read(0, 8))
    if n > size - 8 or n > _MAX_HEADER:
        foreign = _foreign_format(pool)
        if foreign:
            raise SafetensorsError(foreign)
    if n > size - 8:
        raise SafetensorsError(f"{where}: header length {n} exceeds the {size - 8} bytes after "
                               "the length field (truncated or not a safetensors file)")
    if n > _MAX_HEADER:
        raise SafetensorsError(f"{where}: header length {n} is larger than the 100 MB limit")
    raw = pool.read(8, n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as e:
        raise SafetensorsError(f"{where}: header is not valid JSON ({e})") from None
    except RecursionError:
        header = None      # too deep for this Python's parser (said below)
    if header is None or not isinstance(header, dict):
        if header is None or _nesting_depth(raw) > MAX_NESTING:
            # a valid header is two levels deep (tensor -> entry); thousands of nested
            # brackets are a corrupt or hostile file, not something to parse further
            # (Python 3.12's parser takes them without a RecursionError)
            raise SafetensorsError(f"{where}: header nests JSON values too deeply; a "
                                   "safetensors header maps names to flat entries")
        raise SafetensorsError(f"{where}: header is a JSON {type(header).__name__}, not an object")
    data_start = 8 + n
    data_len = size - data_start

    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError(f"{where}: __metadata__ must be an object of strings")

    entries = []
    for name, info in header.items():
        what = f"{where}: tensor {name!r}"
        if not isinstance(info, dict):
            raise SafetensorsError(f"{what}: entry is not an object")
        missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
        if missing:
            raise SafetensorsError(f"{what}: entry lacks {', '.join(missing)}")
        code = info["dtype"]
        d = DTYPE_CODES.get(code) if isinstance(code, str) else None
        if d is None:
            raise SafetensorsError(f"{what}: unknown dtype {code!r} (zyx reads "
                                   f"{', '.join(DTYPE_CODES)})")
        shape = info["shape"]
        if not isinstance(shape, list) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise SafetensorsError(f"{what}: shape {shape!r} is not a list of non-negative ints")
        offs = info["data_offsets"]
        if (not isinstance(offs, list) or len(offs) != 2 or not all(
                isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise SafetensorsError(f"{what}: data_offsets {offs!r} is not a pair of ints")
        begin, end = offs
        if not 0 <= begin <= end <= data_len:
            raise SafetensorsError(f"{what}: data_offsets [{begin}, {end}] are out of range of "
                                   f"the {data_len}-byte data section (truncated file?)")
        need = d.itemsize
        for s in shape:
            need *= s
        span = d.itemsize            # an array's extent ignoring size-0 axes must be addressable
        for s in shape:
            span *= max(s, 1)
        if span >= 2 ** 63:
            raise SafetensorsError(f"{what}: shape {tuple(shape)} of {code} is too large to "
                                   "address (more than 2**63 bytes, ignoring size-0 axes)")
        if end - begin != need:
            raise SafetensorsError(f"{what}: shape {tuple(shape)} of {code} needs {need} bytes "
                                   f"but data_offsets [{begin}, {end}] give {end - begin}")
        entries.append((name, d, tuple(shape), begin, end))

    spans = sorted((b, e, name) for name, _, _, b, e in entries if e > b)
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise SafetensorsError(f"{where}: tensors {n0!r} [{b0}, {e0}] and {n1!r} "
                                   f"[{b1}, {e1}] overlap")
    return entries, metadata, data_start


def read_header(path):
    """(entries, metadata) of a safetensors file without making tensors: entries maps each
    name to (dtype, shape). Raises SafetensorsError on a corrupt header."""
    entries, metadata, _ = _parse_header(RT.open_file(path))
    return {name: (d, shape) for name, d, shape, _, _ in entries}, metadata


def load_metadata(path) -> dict:
    """The `__metadata__` string map of a safetensors file ({} when absent)."""
    return read_header(path)[1]


def load(path) -> dict:
    """Open a safetensors file lazily: a dict name -> Tensor in header order.

    Each Tensor is a LEAF whose buffer lives in the file's disk pool; its bytes are read
    the first time a kernel uses it (then it lives in the device pool) or `numpy()` reads it."""
    from ..tensor import Tensor
    pool = RT.open_file(path)
    entries, _, data_start = _parse_header(pool)
    out = {}
    for name, d, shape, begin, end in entries:
        buf = pool.view(data_start + begin, end - begin)
        out[name] = Tensor._wrap(RT.graph.leaf(buf, shape, d))
    return out
