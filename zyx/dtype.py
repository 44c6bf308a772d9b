"""Data types and PyTorch-style type promotion."""
from __future__ import annotations

import numpy as np

from .errors import DTypeError

__all__ = ["DType", "bool_", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32",
           "int64", "float16", "bfloat16", "float32", "float64", "promote", "promote_scalar",
           "from_numpy", "to_dtype", "DTYPES"]


class DType:
    """A tensor element type. Instances are unique; compare with `is` or `==`."""
    __slots__ = ("name", "itemsize", "kind", "cname", "np", "code", "category", "__weakref__")

    def __init__(self, name, itemsize, kind, cname, np_dtype, code):
        self.name = name            # torch-style name: 'float32'
        self.itemsize = itemsize    # bytes per element
        self.kind = kind            # 'b' bool, 'u' unsigned, 'i' signed, 'f' float
        self.cname = cname          # C storage type used by C-family backends
        self.np = np_dtype          # numpy dtype used for host transfers (bf16 travels as uint16)
        self.code = code            # small stable integer, used in cache keys and files
        # promotion order of kinds: bool < integers < floats (a plain attribute: promotion
        # runs on every op with a Python scalar)
        self.category = {"b": 0, "u": 1, "i": 1, "f": 2}[kind]

    @property
    def is_float(self):
        return self.kind == "f"

    @property
    def is_int(self):
        return self.kind in "iu"

    @property
    def is_signed(self):
        return self.kind in "if"

    @property
    def is_bool(self):
        return self.kind == "b"

    def __repr__(self):
        return f"zyx.{self.name}"

    def __reduce__(self):
        return (to_dtype, (self.name,))


bool_ = DType("bool", 1, "b", "unsigned char", np.dtype(np.bool_), 0)
uint8 = DType("uint8", 1, "u", "unsigned char", np.dtype(np.uint8), 1)
uint16 = DType("uint16", 2, "u", "unsigned short", np.dtype(np.uint16), 2)
uint32 = DType("uint32", 4, "u", "unsigned int", np.dtype(np.uint32), 3)
uint64 = DType("uint64", 8, "u", "unsigned long long", np.dtype(np.uint64), 4)
int8 = DType("int8", 1, "i", "signed char", np.dtype(np.int8), 5)
int16 = DType("int16", 2, "i", "short", np.dtype(np.int16), 6)
int32 = DType("int32", 4, "i", "int", np.dtype(np.int32), 7)
int64 = DType("int64", 8, "i", "long long", np.dtype(np.int64), 8)
float16 = DType("float16", 2, "f", "unsigned short", np.dtype(np.float16), 9)
bfloat16 = DType("bfloat16", 2, "f", "unsigned short", np.dtype(np.uint16), 10)
float32 = DType("float32", 4, "f", "float", np.dtype(np.float32), 11)
float64 = DType("float64", 8, "f", "double", np.dtype(np.float64), 12)

DTYPES = (bool_, uint8, uint16, uint32, uint64, int8, int16, int32, int64,
          float16, bfloat16, float32, float64)
_BY_NAME = {d.name: d for d in DTYPES}
_BY_NAME.update({"bool_": bool_, "half": float16, "float": float32, "double": float64,
                 "int": int32, "long": int64, "bf16": bfloat16, "f16": float16, "f32": float32,
                 "f64": float64, "i8": int8, "i16": int16, "i32": int32, "i64": int64,
                 "u8": uint8, "u16": uint16, "u32": uint32, "u64": uint64})
_BY_NP = {d.np: d for d in DTYPES if d is not bfloat16}

default_float = float32
default_int = int32


def from_numpy(npdt) -> DType:
    """The zyx dtype holding numpy dtype `npdt`."""
    npdt = np.dtype(npdt)
    try:
        return _BY_NP[npdt]
    except KeyError:
        raise DTypeError(f"numpy dtype {npdt} has no zyx equivalent "
                         f"(supported: {', '.join(d.name for d in DTYPES)})") from None


def is_dtype_name(name: str) -> bool:
    """Whether `name` is a dtype's name ("float32", "bfloat16"...)."""
    return name in _BY_NAME


def to_dtype(x) -> DType:
    """Accept a DType, a name ('float32'), a numpy dtype or a Python type (float/int/bool)."""
    if isinstance(x, DType):
        return x
    if x is float:
        return default_float
    if x is int:
        return default_int
    if x is bool:
        return bool_
    if isinstance(x, str):
        try:
            return _BY_NAME[x]
        except KeyError:
            raise DTypeError(f"unknown dtype name {x!r}") from None
    try:
        return from_numpy(x)
    except TypeError:
        raise DTypeError(f"cannot interpret {x!r} as a dtype") from None


def _promote_same_category(a: DType, b: DType) -> DType:
    if a.is_float:
        if {a, b} == {float16, bfloat16}:
            return float32
        if a is bfloat16:
            return b if b.itemsize > 2 else a
        if b is bfloat16:
            return a if a.itemsize > 2 else b
        return a if a.itemsize >= b.itemsize else b
    if a.kind == b.kind:
        return a if a.itemsize >= b.itemsize else b
    u, s = (a, b) if a.kind == "u" else (b, a)
    if s.itemsize > u.itemsize:
        return s
    if u.itemsize == 8:
        # no integer dtype holds both ranges: int64 would wrap values >= 2**63, so
        # uint64(2**63) > int64(0) came out False. torch refuses the promotion too.
        raise DTypeError(f"promotion of uint64 with {s.name} is not supported: no integer "
                         f"dtype holds both; cast one side first (e.g. to float64 or int64)")
    return {1: int16, 2: int32, 4: int64, 8: int64}[u.itemsize]


def promote(a: DType, b: DType) -> DType:
    """Result dtype of a binary op between two tensors (PyTorch rules)."""
    if a is b:
        return a
    ca, cb = a.category, b.category
    if ca == cb:
        return _promote_same_category(a, b)
    return a if ca > cb else b


def scalar_dtype(v) -> DType:
    if isinstance(v, (bool, np.bool_)):
        return bool_
    if isinstance(v, (int, np.integer)):
        return default_int
    if isinstance(v, (float, np.floating)):
        return default_float
    raise DTypeError(f"unsupported scalar {v!r} of type {type(v).__name__}")


def promote_scalar(t: DType, v) -> DType:
    """Result dtype of tensor(t) op python-scalar v: a scalar never widens within a category."""
    s = scalar_dtype(v)
    if s.category <= t.category:
        return t
    return s
