"""Elementwise ops against numpy for every dtype they support: unary math, rounding,
arithmetic, comparisons, bitwise ops, reflected Python scalars, promotion, broadcasting,
non-contiguous inputs, 0-d / empty / large tensors and IEEE special values."""
from __future__ import annotations

import math

import numpy as np
import pytest

import zyx
from conftest import (skip_on_lavapipe, ALL_DTYPES, FLOAT_DTYPES, INT_DTYPES, NUMERIC_DTYPES, SIGNED_INT_DTYPES,
                      assert_close, bf16_round, ids, ref_np, round_to, sample, tol)

pytestmark = pytest.mark.usefixtures("device")

SHAPE = (4, 5)
_erf = np.vectorize(math.erf, otypes=[np.float64])


def _ref(fn, *arrays):
    """Evaluate a numpy reference in float64 (the precise answer) with warnings off."""
    with np.errstate(all="ignore"):
        return fn(*[np.asarray(a, dtype=np.float64) for a in arrays])


# ---------------------------------------------------------------------------------------
# unary float math: float dtypes keep their dtype, ints and bools compute in float32 (torch)

UNARY_FLOAT = {
    # name: (zyx op, float64 reference, input range)
    "exp": (lambda x: x.exp(), np.exp, (-4, 4)),
    "exp2": (lambda x: x.exp2(), np.exp2, (-4, 4)),
    "log": (lambda x: x.log(), np.log, (0.1, 8)),
    "log2": (lambda x: x.log2(), np.log2, (0.1, 8)),
    "sqrt": (lambda x: x.sqrt(), np.sqrt, (0, 8)),
    "rsqrt": (lambda x: x.rsqrt(), lambda a: 1 / np.sqrt(a), (0.1, 8)),
    "reciprocal": (lambda x: x.reciprocal(), lambda a: 1 / a, (0.25, 4)),
    "sin": (lambda x: x.sin(), np.sin, (-4, 4)),
    "cos": (lambda x: x.cos(), np.cos, (-4, 4)),
    "tan": (lambda x: x.tan(), np.tan, (-1.2, 1.2)),
    "sinh": (lambda x: x.sinh(), np.sinh, (-3, 3)),
    "cosh": (lambda x: x.cosh(), np.cosh, (-3, 3)),
    "tanh": (lambda x: x.tanh(), np.tanh, (-4, 4)),
    "erf": (lambda x: x.erf(), _erf, (-3, 3)),
    "sigmoid": (lambda x: x.sigmoid(), lambda a: 1 / (1 + np.exp(-a)), (-6, 6)),
}
# dtypes whose values become float32 before a float op (torch: exp(int tensor) is float32)
PROMOTED_TO_FLOAT = (zyx.bool, zyx.uint8, zyx.int32, zyx.int64)


@pytest.mark.parametrize("name", list(UNARY_FLOAT))
@pytest.mark.parametrize("d", FLOAT_DTYPES + PROMOTED_TO_FLOAT, ids=ids(FLOAT_DTYPES + PROMOTED_TO_FLOAT))
def test_unary_float_ops(name, d):
    op, ref, (lo, hi) = UNARY_FLOAT[name]
    a = sample(SHAPE, d, lo, hi)
    if d.is_bool and name in ("log", "log2", "rsqrt", "reciprocal"):
        a = np.ones(SHAPE, dtype=bool)   # log(False) = -inf is covered in the special values
    out_d = d if d.is_float else zyx.float32
    got = op(zyx.Tensor(a, dtype=d))
    assert_close(got, round_to(_ref(ref, a), out_d), dtype=out_d, scale=2, msg=f"{name} {d}")


SPECIAL = np.array([0.0, -0.0, 1.0, -1.0, 0.5, -2.5, np.inf, -np.inf, np.nan, 1e-30, 88.0,
                    -88.0], dtype=np.float64)


@pytest.mark.parametrize("d", (zyx.float32, zyx.float64), ids=ids((zyx.float32, zyx.float64)))
def test_unary_special_values(d):
    """inf, -inf, nan, signed zeros and extremes go through every float op like in numpy."""
    x_np = SPECIAL.astype(d.np)
    x = zyx.Tensor(x_np)
    for name, (op, ref, _) in UNARY_FLOAT.items():
        expected = _ref(ref, x_np)
        got = op(x)
        assert_close(got, expected.astype(d.np), dtype=d, scale=4, msg=name)
    rounding = {"floor": np.floor, "ceil": np.ceil, "trunc": np.trunc, "round": np.round,
                "abs": np.abs, "neg": np.negative, "square": np.square,
                "sign": lambda a: np.where(np.isnan(a), 0, np.sign(a)),   # torch: sign(nan)=0
                "relu": lambda a: np.where(np.isnan(a), a, np.maximum(a, 0))}
    for name, ref in rounding.items():
        got = getattr(x, name)()
        assert_close(got, _ref(ref, x_np).astype(d.np), dtype=d, msg=name)
    # the sign of zero survives negation and abs (bit patterns, not just values)
    assert np.signbit((-x).numpy()[0]) and not np.signbit(x.abs().numpy()[1])
    for name, ref in (("isnan", np.isnan), ("isinf", np.isinf), ("isfinite", np.isfinite)):
        got = getattr(x, name)()
        assert_close(got, ref(x_np), dtype=zyx.bool, msg=name)


@pytest.mark.parametrize("d", (zyx.float16, zyx.bfloat16), ids=ids((zyx.float16, zyx.bfloat16)))
def test_half_special_values(d):
    x_np = round_to(np.array([0.0, 1.0, -2.5, np.inf, -np.inf, np.nan, 60000.0]), d)
    x = zyx.Tensor(x_np, dtype=d)
    assert_close(x.exp(), round_to(_ref(np.exp, x_np), d), dtype=d)
    assert_close(x.isnan(), np.isnan(x_np), dtype=zyx.bool)
    assert_close(x.isinf(), np.isinf(x_np), dtype=zyx.bool)
    assert_close(x.isfinite(), np.isfinite(x_np), dtype=zyx.bool)
    # float16 overflows to inf above 65504; bfloat16 has float32's range
    big = (x * 2).numpy()[6]
    assert (np.isinf(big) if d is zyx.float16 else big == x_np[6] * 2 and np.isfinite(big))


def test_log_of_zero_and_negative():
    x = zyx.Tensor(np.array([0.0, -1.0, 1.0], dtype=np.float32))
    assert_close(x.log(), np.array([-np.inf, np.nan, 0.0], dtype=np.float32), dtype=zyx.float32)
    assert_close(x.sqrt(), np.array([0.0, np.nan, 1.0], dtype=np.float32), dtype=zyx.float32)
    b = zyx.Tensor(np.array([False, True]))
    assert_close(b.log(), np.array([-np.inf, 0.0], dtype=np.float32), dtype=zyx.float32)


# ---------------------------------------------------------------------------------------
# rounding and sign-like ops: floats round, ints pass through unchanged (same dtype)

ROUNDING = {"floor": np.floor, "ceil": np.ceil, "trunc": np.trunc, "round": np.round}


@pytest.mark.parametrize("name", list(ROUNDING))
@pytest.mark.parametrize("d", NUMERIC_DTYPES, ids=ids(NUMERIC_DTYPES))
def test_rounding(name, d):
    a = sample(SHAPE, d, -6, 6)
    if d.is_float:  # exact halves check round-half-to-even
        a.flat[:6] = round_to(np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5]), d)
    got = getattr(zyx.Tensor(a, dtype=d), name)()
    assert_close(got, round_to(ROUNDING[name](a), d), dtype=d, msg=name)


def test_round_decimals():
    a = np.array([1.2345, -2.5678, 0.125], dtype=np.float64)
    assert_close(zyx.Tensor(a).round(decimals=2), np.round(a, 2), dtype=zyx.float64)


@pytest.mark.parametrize("d", NUMERIC_DTYPES, ids=ids(NUMERIC_DTYPES))
def test_neg_abs_sign_square_relu(d):
    a = sample(SHAPE, d, -5, 5)
    x = zyx.Tensor(a, dtype=d)
    with np.errstate(all="ignore"):
        assert_close(-x, round_to(-a, d), dtype=d, msg="neg")      # unsigned ints wrap
        assert_close(x.neg(), round_to(-a, d), dtype=d, msg="neg()")
        assert_close(abs(x), round_to(np.abs(a), d), dtype=d, msg="abs")
        assert_close(x.sign(), round_to(np.sign(a), d), dtype=d, msg="sign")
        assert_close(x.square(), round_to(a * a, d), dtype=d, msg="square")
        assert_close(x.relu(), round_to(np.maximum(a, 0), d), dtype=d, msg="relu")


def test_bool_unary():
    a = np.array([True, False, True, False])
    x = zyx.Tensor(a)
    assert_close(~x, ~a, dtype=zyx.bool)
    assert_close(x.abs(), a, dtype=zyx.bool)
    assert_close(x.sign(), a, dtype=zyx.bool)
    assert_close(x.logical_not(), ~a, dtype=zyx.bool)
    with pytest.raises(zyx.DTypeError):
        -x


# ---------------------------------------------------------------------------------------
# binary arithmetic for every dtype, same dtype on both sides

def _np_binary(name, a, b, d):
    """Reference for `a op b` in zyx dtype d (bf16 computed in float32 and rounded)."""
    fns = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "floordiv": np.floor_divide,
           "mod": np.remainder, "pow": np.power, "maximum": np.maximum, "minimum": np.minimum}
    with np.errstate(all="ignore"):
        if name == "div":
            r = a.astype(np.float64) / b.astype(np.float64)
            return round_to(r, d if d.is_float else zyx.float32)
        if d is zyx.bool:
            return {"add": np.logical_or, "mul": np.logical_and, "maximum": np.maximum,
                    "minimum": np.minimum}[name](a, b)
        if d.is_float:
            r = fns[name](a.astype(np.float64), b.astype(np.float64))
            return round_to(r, d)
        return fns[name](a, b).astype(d.np)


_BIN = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y,
        "div": lambda x, y: x / y, "floordiv": lambda x, y: x // y, "mod": lambda x, y: x % y,
        "pow": lambda x, y: x ** y, "maximum": zyx.maximum, "minimum": zyx.minimum}
_BOOL_OK = ("add", "mul", "div", "maximum", "minimum")


def _binary_inputs(name, d):
    if name == "pow":
        if d.is_float:
            return sample(SHAPE, d, 0.5, 3), sample(SHAPE, d, -2, 2)
        return sample(SHAPE, d, -3, 3), sample(SHAPE, d, 0, 4)
    a = sample(SHAPE, d, -20, 20)
    b = sample(SHAPE, d, -6, 6)
    if name in ("div", "floordiv", "mod") and not d.is_bool:
        b[b == 0] = 3       # integer division by zero has no defined result
        a.flat[:4] = np.array([7, -7, 6, -6]).astype(a.dtype)   # sign cases of floor/mod
        b.flat[:4] = np.array([2, 2, -4, -4]).astype(b.dtype)
    if d is zyx.bool:
        b = sample(SHAPE, d)
    return a, b


@pytest.mark.parametrize("name", list(_BIN))
@pytest.mark.parametrize("d", ALL_DTYPES, ids=ids(ALL_DTYPES))
def test_binary_same_dtype(name, d):
    if d.is_bool and name not in _BOOL_OK:
        pytest.skip("undefined for bool (tested in test_bool_arithmetic_errors)")
    a, b = _binary_inputs(name, d)
    got = _BIN[name](zyx.Tensor(a, dtype=d), zyx.Tensor(b, dtype=d))
    out_d = zyx.float32 if name == "div" and not d.is_float else d
    expected = _np_binary(name, a, b, d)
    # pow and division accumulate a few roundings in half precision
    assert_close(got, expected, dtype=out_d, scale=2, msg=f"{name} {d}")


def test_bool_arithmetic_is_logical():
    """bool + bool is `or`, bool * bool is `and` (torch/numpy); the stored bytes stay 0/1."""
    a = np.array([True, True, False, False])
    b = np.array([True, False, True, False])
    x, y = zyx.Tensor(a), zyx.Tensor(b)
    s = x + y
    assert s.dtype == zyx.bool
    assert s.numpy().view(np.uint8).tolist() == [1, 1, 1, 0]
    assert (x * y).numpy().view(np.uint8).tolist() == [1, 0, 0, 0]
    assert_close((x + y) == x, (a | b) == a, dtype=zyx.bool)
    assert_close((x + y).cast(zyx.int32), (a | b).astype(np.int32), dtype=zyx.int32)


def test_bool_arithmetic_errors():
    x = zyx.Tensor(np.array([True, False]))
    for fn in (lambda: x - x, lambda: x // x, lambda: x % x, lambda: -x):
        with pytest.raises(zyx.DTypeError):
            fn()


@pytest.mark.parametrize("d", SIGNED_INT_DTYPES, ids=ids(SIGNED_INT_DTYPES))
def test_int_floor_division_and_mod_signs(d):
    """Floor division and remainder follow Python (torch) semantics for every sign combo."""
    a = np.array([7, -7, 7, -7, 0, 6, -6, 1], dtype=d.np)
    b = np.array([2, 2, -2, -2, 3, -4, 4, -5], dtype=d.np)
    x, y = zyx.Tensor(a), zyx.Tensor(b)
    assert_close(x // y, a // b, dtype=d)
    assert_close(x % y, a % b, dtype=d)
    assert_close(x.div(y, rounding_mode="trunc"), np.trunc(a / b).astype(d.np), dtype=d)
    assert_close(x.div(y, rounding_mode="floor"), a // b, dtype=d)
    assert_close(x.fmod(y), np.fmod(a, b), dtype=d)


@pytest.mark.parametrize("d", (zyx.float32, zyx.float64), ids=["float32", "float64"])
def test_float_floor_division_and_remainder_edge_cases(d):
    """Python/numpy/torch semantics: a == (a // b) * b + a % b, so 1 // 0.1 is 9, not the
    10 that floor(1 / 0.1) gives; infinities and zero divisors like numpy."""
    if d is zyx.float64:
        skip_on_lavapipe("float64 floor division of its edge cases differs there")
    a = np.array([1.0, -1.0, np.inf, 5.0, -5.0, 7.5, -7.5, 0.0, 3.0, np.nan, -3.0, 0.7],
                 dtype=d.np)
    b = np.array([0.1, 0.1, 2.0, np.inf, np.inf, -2.0, 2.0, -2.0, 0.0, 1.0, 0.0, -0.1],
                 dtype=d.np)
    x, y = zyx.Tensor(a), zyx.Tensor(b)
    with np.errstate(all="ignore"):
        assert_close(x // y, np.floor_divide(a, b), dtype=d)
        assert_close(x % y, np.remainder(a, b), dtype=d)
        assert_close(x.div(y, rounding_mode="floor"), np.floor_divide(a, b), dtype=d)
        assert_close(x // 0.1, np.floor_divide(a, d.np.type(0.1)), dtype=d)
        assert_close(1.0 // y, np.floor_divide(d.np.type(1.0), b), dtype=d)
    q, r = (x // y).numpy()[[0, 1, 5, 6, 11]], (x % y).numpy()[[0, 1, 5, 6, 11]]
    np.testing.assert_allclose(q * b[[0, 1, 5, 6, 11]] + r, a[[0, 1, 5, 6, 11]], rtol=1e-6)


def test_float_division_by_zero():
    a = np.array([1.0, -1.0, 0.0, 3.0], dtype=np.float32)
    b = np.array([0.0, 0.0, 0.0, -0.0], dtype=np.float32)
    with np.errstate(all="ignore"):
        assert_close(zyx.Tensor(a) / zyx.Tensor(b), a / b, dtype=zyx.float32)


def test_integer_overflow_wraps():
    a = np.array([100, -100, 127, -128], dtype=np.int8)
    x = zyx.Tensor(a)
    with np.errstate(all="ignore"):
        assert_close(x + x, a + a, dtype=zyx.int8)
        assert_close(x * 3, (a * np.int8(3)).astype(np.int8), dtype=zyx.int8)
    u = np.array([250, 3, 0], dtype=np.uint8)
    assert_close(zyx.Tensor(u) + 10, (u + np.uint8(10)).astype(np.uint8), dtype=zyx.uint8)
    assert_close(zyx.Tensor(u) - 5, (u - np.uint8(5)).astype(np.uint8), dtype=zyx.uint8)


# ---------------------------------------------------------------------------------------
# comparisons and bitwise ops

_CMP = {"lt": (lambda x, y: x < y, np.less), "le": (lambda x, y: x <= y, np.less_equal),
        "gt": (lambda x, y: x > y, np.greater), "ge": (lambda x, y: x >= y, np.greater_equal),
        "eq": (lambda x, y: x == y, np.equal), "ne": (lambda x, y: x != y, np.not_equal)}


@pytest.mark.parametrize("name", list(_CMP))
@pytest.mark.parametrize("d", ALL_DTYPES, ids=ids(ALL_DTYPES))
def test_comparisons(name, d):
    a = sample(SHAPE, d, -3, 3)
    b = sample(SHAPE, d, -3, 3)
    b.flat[::3] = a.flat[::3]            # equal elements exercise <=, >=, ==
    if d.is_float:
        a.flat[1] = np.nan                # every comparison with NaN is False except !=
    op, ref = _CMP[name]
    got = op(zyx.Tensor(a, dtype=d), zyx.Tensor(b, dtype=d))
    assert_close(got, ref(a, b), dtype=zyx.bool, msg=f"{name} {d}")


_BITWISE = {"and": (lambda x, y: x & y, np.bitwise_and), "or": (lambda x, y: x | y, np.bitwise_or),
            "xor": (lambda x, y: x ^ y, np.bitwise_xor),
            "shl": (lambda x, y: x << y, np.left_shift), "shr": (lambda x, y: x >> y, np.right_shift)}


@pytest.mark.parametrize("name", list(_BITWISE))
@pytest.mark.parametrize("d", (zyx.bool,) + INT_DTYPES, ids=ids((zyx.bool,) + INT_DTYPES))
def test_bitwise(name, d):
    if d.is_bool and name in ("shl", "shr"):
        with pytest.raises(zyx.DTypeError):
            _BITWISE[name][0](zyx.Tensor(np.array([True])), zyx.Tensor(np.array([True])))
        return
    if name in ("shl", "shr"):
        a = sample(SHAPE, d, -60, 60)
        b = sample(SHAPE, d, 0, 3)
    else:
        a = sample(SHAPE, d, -100, 100)
        b = sample(SHAPE, d, -100, 100)
    op, ref = _BITWISE[name]
    got = op(zyx.Tensor(a, dtype=d), zyx.Tensor(b, dtype=d))
    assert_close(got, ref(a, b).astype(a.dtype), dtype=d, msg=f"{name} {d}")


@pytest.mark.parametrize("d", (zyx.bool,) + INT_DTYPES, ids=ids((zyx.bool,) + INT_DTYPES))
def test_invert(d):
    a = sample(SHAPE, d, -100, 100)
    assert_close(~zyx.Tensor(a, dtype=d), ~a, dtype=d)
    assert_close(zyx.Tensor(a, dtype=d).bitwise_not(), ~a, dtype=d)


def test_bitwise_rejects_floats():
    x = zyx.Tensor(np.ones(3, dtype=np.float32))
    for fn in (lambda: x & x, lambda: x | 1, lambda: ~x, lambda: x << 1, lambda: x ^ x):
        with pytest.raises(zyx.DTypeError, match="float32"):
            fn()


def test_logical_ops():
    a = np.array([0, 1, 2, 0], dtype=np.int32)
    b = np.array([0, 0, 3, 5], dtype=np.int32)
    x, y = zyx.Tensor(a), zyx.Tensor(b)
    assert_close(x.logical_and(y), np.logical_and(a, b), dtype=zyx.bool)
    assert_close(x.logical_or(y), np.logical_or(a, b), dtype=zyx.bool)
    assert_close(x.logical_xor(y), np.logical_xor(a, b), dtype=zyx.bool)
    assert_close(x.logical_not(), np.logical_not(a), dtype=zyx.bool)


# ---------------------------------------------------------------------------------------
# clamp, where, maximum/minimum, pow special cases, isnan & co on ints

@pytest.mark.parametrize("d", NUMERIC_DTYPES, ids=ids(NUMERIC_DTYPES))
def test_clamp_clip(d):
    a = sample(SHAPE, d, -10, 10)
    x = zyx.Tensor(a, dtype=d)
    lo, hi = (2, 7) if d.kind == "u" else (-3, 4)
    assert_close(x.clamp(lo, hi), np.clip(a, lo, hi).astype(a.dtype), dtype=d)
    assert_close(x.clip(min=lo), np.maximum(a, lo).astype(a.dtype), dtype=d)
    assert_close(zyx.clamp(x, max=hi), np.minimum(a, hi).astype(a.dtype), dtype=d)


def test_clamp_with_tensor_bounds_and_nan():
    a = np.array([np.nan, -5.0, 0.5, 9.0], dtype=np.float32)
    lo = np.array([0.0, -1.0, 1.0, 2.0], dtype=np.float32)
    got = zyx.Tensor(a).clamp(zyx.Tensor(lo), 3.0)
    assert_close(got, np.minimum(np.maximum(a, lo), 3.0), dtype=zyx.float32)
    with pytest.raises(ValueError):
        zyx.Tensor(a).clamp()


@pytest.mark.parametrize("d", ALL_DTYPES, ids=ids(ALL_DTYPES))
def test_where(d):
    c = np.random.random(SHAPE) < 0.5
    a = sample(SHAPE, d, -9, 9)
    b = sample((1, 5), d, -9, 9)          # broadcast
    got = zyx.where(zyx.Tensor(c), zyx.Tensor(a, dtype=d), zyx.Tensor(b, dtype=d))
    assert_close(got, np.where(c, a, b), dtype=d)


def test_where_scalars_and_promotion():
    c = np.array([True, False, True])
    a = np.array([1, 2, 3], dtype=np.int32)
    got = zyx.where(zyx.Tensor(c), zyx.Tensor(a), 2.5)        # int tensor, float scalar
    assert_close(got, np.where(c, a, 2.5).astype(np.float32), dtype=zyx.float32)
    got = zyx.where(zyx.Tensor(c), 7, zyx.Tensor(a))
    assert_close(got, np.where(c, 7, a).astype(np.int32), dtype=zyx.int32)
    got = zyx.where(zyx.Tensor(np.array([1, 0, 2], dtype=np.int32)), 1.0, 0.0)  # int cond
    assert_close(got, np.array([1.0, 0.0, 1.0], dtype=np.float32), dtype=zyx.float32)
    got = zyx.Tensor(a).where(zyx.Tensor(c), zyx.Tensor(a * 10))
    assert_close(got, np.where(c, a, a * 10), dtype=zyx.int32)


def test_maximum_minimum_propagate_nan_and_broadcast():
    a = np.array([[1.0, np.nan, 3.0]], dtype=np.float32)
    b = np.array([[2.0], [np.nan], [0.0]], dtype=np.float32)
    assert_close(zyx.maximum(zyx.Tensor(a), zyx.Tensor(b)), np.maximum(a, b), dtype=zyx.float32)
    assert_close(zyx.minimum(zyx.Tensor(a), zyx.Tensor(b)), np.minimum(a, b), dtype=zyx.float32)
    assert_close(zyx.Tensor(a).maximum(2), np.maximum(a, 2), dtype=zyx.float32)


def test_pow_variants():
    a = np.array([0.5, 1.0, 2.0, 3.0], dtype=np.float32)
    x = zyx.Tensor(a)
    for e in (0, 1, 2, 3, 0.5, -1, -2, 1.5):
        assert_close(x ** e, (a.astype(np.float64) ** e).astype(np.float32), dtype=zyx.float32,
                     msg=f"x ** {e}")
        assert_close(x.pow(e), (a.astype(np.float64) ** e).astype(np.float32), dtype=zyx.float32)
    assert_close(2 ** x, (2.0 ** a.astype(np.float64)).astype(np.float32), dtype=zyx.float32)
    assert_close(zyx.pow(x, x), (a.astype(np.float64) ** a).astype(np.float32), dtype=zyx.float32)
    i = np.array([-3, -1, 0, 2, 5], dtype=np.int32)
    assert_close(zyx.Tensor(i) ** 3, i ** 3, dtype=zyx.int32)
    assert_close(2 ** zyx.Tensor(np.abs(i)), 2 ** np.abs(i), dtype=zyx.int32)
    # int ** float scalar is float (torch promotion)
    assert_close(zyx.Tensor(np.abs(i)) ** 0.5, np.sqrt(np.abs(i)).astype(np.float32),
                 dtype=zyx.float32)


@pytest.mark.parametrize("d", (zyx.bool, zyx.int32, zyx.uint8), ids=["bool", "int32", "uint8"])
def test_isnan_family_on_ints(d):
    x = zyx.Tensor(sample(SHAPE, d), dtype=d)
    assert_close(x.isnan(), np.zeros(SHAPE, bool), dtype=zyx.bool)
    assert_close(x.isinf(), np.zeros(SHAPE, bool), dtype=zyx.bool)
    assert_close(x.isfinite(), np.ones(SHAPE, bool), dtype=zyx.bool)


def test_misc_float_ops():
    a = np.array([0.1, 0.5, 2.0, 9.0], dtype=np.float64)
    x = zyx.Tensor(a)
    assert_close(x.log10(), np.log10(a), dtype=zyx.float64)
    assert_close(x.log1p(), np.log1p(a), dtype=zyx.float64)
    assert_close(x.expm1(), np.expm1(a), dtype=zyx.float64)
    assert_close(x.lerp(zyx.Tensor(a * 3), 0.25), a + (a * 3 - a) * 0.25, dtype=zyx.float64)
    assert_close(zyx.sigmoid(x), 1 / (1 + np.exp(-a)), dtype=zyx.float64)
    assert_close(zyx.relu(x - 1), np.maximum(a - 1, 0), dtype=zyx.float64)
    assert_close(zyx.exp(x), np.exp(a), dtype=zyx.float64)


# ---------------------------------------------------------------------------------------
# Python scalars on either side (reflected ops) and promotion

_SCALAR_OPS = {
    "add": (lambda x, s: x + s, lambda s, x: s + x, np.add),
    "sub": (lambda x, s: x - s, lambda s, x: s - x, np.subtract),
    "mul": (lambda x, s: x * s, lambda s, x: s * x, np.multiply),
    "div": (lambda x, s: x / s, lambda s, x: s / x, np.true_divide),
    "floordiv": (lambda x, s: x // s, lambda s, x: s // x, np.floor_divide),
    "mod": (lambda x, s: x % s, lambda s, x: s % x, np.remainder),
    "pow": (lambda x, s: x ** s, lambda s, x: s ** x, np.power),
}


def _scalar_result_dtype(d, s, name):
    if name == "div":
        return d if d.is_float else zyx.float32
    if isinstance(s, float) and not d.is_float:
        return zyx.float32
    if d.is_bool and isinstance(s, int):
        return zyx.int32    # Python ints are int32 in zyx
    return d


@pytest.mark.parametrize("name", list(_SCALAR_OPS))
@pytest.mark.parametrize("d", (zyx.int32, zyx.uint8, zyx.int64, zyx.float32, zyx.float16,
                               zyx.float64), ids=ids((zyx.int32, zyx.uint8, zyx.int64,
                                                      zyx.float32, zyx.float16, zyx.float64)))
@pytest.mark.parametrize("s", (3, 2.5), ids=["int", "float"])
def test_reflected_scalar_ops(name, d, s):
    a = sample(SHAPE, d, 1, 5)            # positive: pow/floordiv/mod stay well defined
    fwd, rev, ref = _SCALAR_OPS[name]
    x = zyx.Tensor(a, dtype=d)
    out_d = _scalar_result_dtype(d, s, name)
    with np.errstate(all="ignore"):
        ef = ref(a.astype(np.float64), float(s))
        er = ref(float(s), a.astype(np.float64))
    if out_d.is_int:
        # int results: integer arithmetic semantics in the tensor's dtype
        ef = ref(a, np.array(s, dtype=a.dtype))
        er = ref(np.array(s, dtype=a.dtype), a)
    assert_close(fwd(x, s), round_to(ef, out_d), dtype=out_d, scale=2, msg=f"x {name} {s}")
    assert_close(rev(s, x), round_to(er, out_d), dtype=out_d, scale=2, msg=f"{s} {name} x")


def test_scalar_does_not_widen():
    """A Python scalar never widens a tensor within its category (torch rule)."""
    x8 = zyx.Tensor(np.array([1, 2], dtype=np.int8))
    assert (x8 + 1000).dtype == zyx.int8
    h = zyx.Tensor(np.array([1, 2], dtype=np.float16))
    assert (h * 2.0).dtype == zyx.float16
    assert (h + 1).dtype == zyx.float16
    assert (x8 + 1.5).dtype == zyx.float32
    b = zyx.Tensor(np.array([True, False]))
    assert (b + True).dtype == zyx.bool
    assert (b * 2).dtype == zyx.int32
    assert_close(b * 2, np.array([2, 0], dtype=np.int32), dtype=zyx.int32)
    assert (b + 0.5).dtype == zyx.float32
    assert (x8 < 3.5).dtype == zyx.bool
    assert_close(x8 < 1.5, np.array([True, False]), dtype=zyx.bool)


def test_scalar_comparisons_and_bitwise_reflected():
    a = np.array([1, 2, 3, 4], dtype=np.int32)
    x = zyx.Tensor(a)
    assert_close(2 < x, 2 < a, dtype=zyx.bool)
    assert_close(2 >= x, 2 >= a, dtype=zyx.bool)
    assert_close(3 == x, 3 == a, dtype=zyx.bool)
    assert_close(6 & x, 6 & a, dtype=zyx.int32)
    assert_close(6 | x, 6 | a, dtype=zyx.int32)
    assert_close(6 ^ x, 6 ^ a, dtype=zyx.int32)
    assert_close(x << 2, a << 2, dtype=zyx.int32)
    assert_close(x >> 1, a >> 1, dtype=zyx.int32)


def test_numpy_scalars_and_arrays_as_operands():
    a = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    x = zyx.Tensor(a)
    assert_close(x + np.float32(2), a + 2, dtype=zyx.float32)
    assert_close(x * [1.0, 0.5, 2.0], a * np.array([1.0, 0.5, 2.0], dtype=np.float32),
                 dtype=zyx.float32)


# ---------------------------------------------------------------------------------------
# promotion: tensor-tensor result dtypes for every pair (checked without running anything)

def _expected_promotion(a, b):
    """PyTorch's result_type where torch defines it; numpy's table elsewhere (torch has no
    promotion for uint16/32/64 with other ints). None for uint64 with a signed int: no
    integer dtype holds both, zyx refuses it as torch does (DTypeError)."""
    torch = pytest.importorskip("torch")
    from conftest import from_torch_dtype, torch_dtype
    try:
        return from_torch_dtype(torch.promote_types(torch_dtype(a), torch_dtype(b)))
    except RuntimeError:
        if {a.kind, b.kind} == {"u", "i"} and 8 in (a.itemsize, b.itemsize) and \
                (a if a.kind == "u" else b).itemsize == 8:
            return None
        return zyx.dtype.from_numpy(np.promote_types(a.np, b.np))


@pytest.mark.parametrize("a", ALL_DTYPES, ids=ids(ALL_DTYPES))
def test_promotion_table(a):
    x = zyx.zeros(2, dtype=a)
    for b in ALL_DTYPES:
        y = zyx.zeros(2, dtype=b)
        exp = _expected_promotion(a, b)
        if exp is None:
            for op in (lambda: x * y, lambda: zyx.maximum(y, x), lambda: zyx.cat([x, y]),
                       lambda: zyx.where(zyx.ones(2, dtype=zyx.bool), x, y)):
                with pytest.raises(zyx.DTypeError, match="promotion of uint64"):
                    op()
            continue
        assert (x * y).dtype == exp, f"{a} * {b}: {(x * y).dtype} != {exp}"
        assert zyx.maximum(y, x).dtype == exp
        assert zyx.where(zyx.ones(2, dtype=zyx.bool), x, y).dtype == exp
        assert zyx.cat([x, y]).dtype == exp


# PyTorch's documented promotion for representative pairs: checked even without torch
_PROMOTION_TABLE = [
    (zyx.bool, zyx.bool, zyx.bool), (zyx.bool, zyx.uint8, zyx.uint8),
    (zyx.bool, zyx.float16, zyx.float16), (zyx.uint8, zyx.int8, zyx.int16),
    (zyx.uint8, zyx.int16, zyx.int16), (zyx.int8, zyx.int64, zyx.int64),
    (zyx.int32, zyx.float16, zyx.float16), (zyx.int64, zyx.bfloat16, zyx.bfloat16),
    (zyx.float16, zyx.bfloat16, zyx.float32), (zyx.float16, zyx.float32, zyx.float32),
    (zyx.bfloat16, zyx.float64, zyx.float64), (zyx.uint8, zyx.float32, zyx.float32),
    (zyx.int32, zyx.int64, zyx.int64), (zyx.float32, zyx.float64, zyx.float64),
    (zyx.uint16, zyx.int32, zyx.int32), (zyx.uint32, zyx.int32, zyx.int64),
    (zyx.uint64, zyx.uint8, zyx.uint64), (zyx.uint16, zyx.uint32, zyx.uint32),
]


@pytest.mark.parametrize("a,b,expected", _PROMOTION_TABLE,
                         ids=[f"{a.name}-{b.name}" for a, b, _ in _PROMOTION_TABLE])
def test_promotion_documented_pairs(a, b, expected):
    x, y = zyx.zeros(1, dtype=a), zyx.zeros(1, dtype=b)
    assert (x + y).dtype == expected and (y - x if not expected.is_bool else y * x).dtype == expected
    assert zyx.dtype.promote(a, b) is expected and zyx.dtype.promote(b, a) is expected


def test_promotion_scalars_against_torch():
    torch = pytest.importorskip("torch")
    from conftest import from_torch_dtype, torch_dtype
    for d in ALL_DTYPES:
        x = zyx.zeros(2, dtype=d)
        t = torch.zeros(2, dtype=torch_dtype(d))
        for s in (2, 2.5, True):
            exp = from_torch_dtype(torch.result_type(t, s))
            if exp is zyx.int64 and d.is_bool:
                exp = zyx.int32   # torch's default int is int64, zyx's is int32 (design §4)
            assert (x + s).dtype == exp, f"{d} + {s!r}"
            assert (s * x).dtype == exp, f"{s!r} * {d}"


_MIXED = [(zyx.int8, zyx.uint8), (zyx.uint8, zyx.int32), (zyx.int32, zyx.float16),
          (zyx.int64, zyx.float32), (zyx.float16, zyx.bfloat16), (zyx.float16, zyx.float32),
          (zyx.bfloat16, zyx.float64), (zyx.bool, zyx.int8), (zyx.bool, zyx.float32),
          (zyx.uint32, zyx.int32), (zyx.uint64, zyx.uint8), (zyx.int16, zyx.float64)]


@pytest.mark.parametrize("a,b", _MIXED, ids=[f"{a.name}-{b.name}" for a, b in _MIXED])
def test_mixed_dtype_values(a, b):
    x_np, y_np = sample(SHAPE, a, 0, 9), sample(SHAPE, b, 0, 9)
    got = zyx.Tensor(x_np, dtype=a) * zyx.Tensor(y_np, dtype=b) + zyx.Tensor(x_np, dtype=a)
    out = got.dtype
    xr = x_np.astype(np.float64)
    expected = round_to(xr * y_np.astype(np.float64) + xr, out)
    assert_close(got, expected, dtype=out, scale=2)


# ---------------------------------------------------------------------------------------
# broadcasting, views, 0-d, empty, large

@pytest.mark.parametrize("sa,sb", [((3, 1, 4), (2, 1)), ((5,), (3, 1)), ((), (2, 3)),
                                   ((1, 1), (4,)), ((2, 3, 1, 5), (3, 4, 1)), ((0, 3), (1, 3))])
def test_broadcasting(sa, sb):
    a = np.asarray(np.random.randn(*sa), dtype=np.float32)
    b = np.asarray(np.random.randn(*sb), dtype=np.float32)
    x, y = zyx.Tensor(a), zyx.Tensor(b)
    assert_close(x * y - x, a * b - a, dtype=zyx.float32)
    assert_close(y / (x.abs() + 1), b / (np.abs(a) + 1), dtype=zyx.float32)


def test_broadcast_mismatch_names_shapes():
    with pytest.raises(zyx.ShapeError, match=r"\(3, 4\).*\(2, 4\)"):
        zyx.ones(3, 4) + zyx.ones(2, 4)


def test_noncontiguous_inputs():
    a = np.random.randn(4, 6).astype(np.float32)
    b = np.random.randn(6, 4).astype(np.float32)
    x, y = zyx.Tensor(a), zyx.Tensor(b)
    assert_close(x.T * y - y.flip(0), a.T * b - b[::-1], dtype=zyx.float32)
    assert_close(x[:, ::2].exp() + x[:, 1::2], np.exp(a[:, ::2]) + a[:, 1::2], dtype=zyx.float32)
    assert_close(x[::-1, 1:5].permute(1, 0) * 2, a[::-1, 1:5].T * 2, dtype=zyx.float32)
    c = np.random.randn(1, 6).astype(np.float32)
    assert_close(zyx.Tensor(c).expand(4, 6) + x.flip((0, 1)), c + a[::-1, ::-1],
                 dtype=zyx.float32)
    # a view of a view of a view, then arithmetic with itself reversed
    v = x.reshape(2, 12)[:, 2:10].reshape(4, 4).transpose(0, 1)
    va = a.reshape(2, 12)[:, 2:10].reshape(4, 4).T
    assert_close(v - v.flip(1), va - va[:, ::-1], dtype=zyx.float32)


def test_zero_dim_tensors():
    x = zyx.Tensor(2.5)
    assert x.shape == () and x.dtype == zyx.float32 and x.ndim == 0
    assert_close(x * 2 + 1, np.array(6.0, dtype=np.float32), dtype=zyx.float32)
    assert (x.exp()).item() == pytest.approx(math.exp(2.5), rel=1e-6)
    y = zyx.Tensor(np.arange(3, dtype=np.float32))
    assert_close(x * y, 2.5 * np.arange(3, dtype=np.float32), dtype=zyx.float32)
    assert_close(zyx.Tensor(7) // 2, np.array(3, dtype=np.int32), dtype=zyx.int32)
    assert float(zyx.Tensor(3) ** 2) == 9.0
    assert int(zyx.Tensor(True) + zyx.Tensor(4)) == 5


def test_empty_tensors():
    a = np.zeros((0, 3), dtype=np.float32)
    x = zyx.Tensor(a)
    assert_close(x.exp() * 2 + 1, a, dtype=zyx.float32)
    assert_close(x + zyx.ones(1, 3), a, dtype=zyx.float32)
    assert (x > 0).numpy().shape == (0, 3)
    assert zyx.Tensor([]).shape == (0,)
    assert zyx.Tensor([]).numpy().shape == (0,)


def test_large_elementwise_chain():
    n = 1 << 24     # 16M elements
    a = np.random.rand(n).astype(np.float32)
    x = zyx.Tensor(a)
    got = ((x * 2.0 - 1.0).abs().sqrt() + x.sin() * 0.5).numpy()
    expected = np.sqrt(np.abs(a * np.float32(2) - np.float32(1))) + np.sin(a) * np.float32(0.5)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert got.shape == (n,)


# ---------------------------------------------------------------------------------------
# PyTorch as an oracle for semantics on tricky inputs (values and result dtypes)

_TRICKY = np.array([-2.5, -1.5, -0.5, -0.0, 0.0, 0.5, 1.5, 2.5, 3.7, -3.7, 1e-8, 7.0, -7.0,
                    np.inf, -np.inf, np.nan], dtype=np.float32)
_TORCH_UNARY = ["round", "floor", "ceil", "trunc", "sign", "abs", "neg", "sigmoid", "tanh",
                "erf", "exp", "exp2", "relu", "square", "reciprocal", "rsqrt", "sqrt", "log",
                "log2", "sin", "cos", "tan", "sinh", "cosh", "isnan", "isinf", "isfinite"]


@pytest.mark.parametrize("name", _TORCH_UNARY)
def test_unary_against_torch(name):
    torch = pytest.importorskip("torch")
    t = getattr(torch, name)(torch.tensor(_TRICKY))
    got = getattr(zyx.Tensor(_TRICKY), name)()
    from conftest import from_torch_dtype
    assert got.dtype == from_torch_dtype(t.dtype)
    assert_close(got, t.numpy(), scale=4, msg=name)


_TORCH_BINARY = {
    "remainder": (lambda x, y: x % y, "remainder"),
    "floor_divide": (lambda x, y: x // y, "floor_divide"),
    "fmod": (lambda x, y: x.fmod(y), "fmod"),
    "div_trunc": (lambda x, y: x.div(y, rounding_mode="trunc"), None),
    "maximum": (zyx.maximum, "maximum"),
    "minimum": (zyx.minimum, "minimum"),
    "pow": (lambda x, y: x ** y, "pow"),
    "lt": (lambda x, y: x < y, "lt"),
    "ge": (lambda x, y: x >= y, "ge"),
}


@pytest.mark.parametrize("name", list(_TORCH_BINARY))
@pytest.mark.parametrize("kind", ["float32", "int32"])
def test_binary_against_torch(name, kind):
    torch = pytest.importorskip("torch")
    from conftest import from_torch_dtype
    if kind == "float32":
        a = np.array([7.5, -7.5, 7.5, -7.5, 0.0, 1.0, 2.0, -2.0, 0.3, np.nan, np.inf],
                     dtype=np.float32)
        b = np.array([2.0, 2.0, -2.0, -2.0, 3.0, 0.1, 0.5, 3.0, 0.7, 1.0, 2.0], dtype=np.float32)
    else:
        if name == "pow":
            a = np.array([-3, -2, 0, 1, 2, 5], dtype=np.int32)
            b = np.array([3, 2, 0, 7, 10, 2], dtype=np.int32)
        else:
            a = np.array([7, -7, 7, -7, 0, 9, -9, 1], dtype=np.int32)
            b = np.array([2, 2, -2, -2, 3, 3, 4, -5], dtype=np.int32)
    fn, tname = _TORCH_BINARY[name]
    ta, tb = torch.tensor(a), torch.tensor(b)
    t = torch.div(ta, tb, rounding_mode="trunc") if tname is None else getattr(torch, tname)(ta, tb)
    got = fn(zyx.Tensor(a), zyx.Tensor(b))
    assert got.dtype == from_torch_dtype(t.dtype)
    assert_close(got, t.numpy(), msg=f"{name} {kind}")


def test_shifts_and_bitwise_against_torch():
    torch = pytest.importorskip("torch")
    a = np.array([-8, -1, 0, 1, 5, 127, -128, 64], dtype=np.int8)
    s = np.array([1, 2, 3, 0, 1, 1, 1, 1], dtype=np.int8)
    x, y = zyx.Tensor(a), zyx.Tensor(s)
    ta, ts = torch.tensor(a), torch.tensor(s)
    assert_close(x >> y, (ta >> ts).numpy(), dtype=zyx.int8)
    assert_close(x << y, (ta << ts).numpy(), dtype=zyx.int8)
    assert_close(~x, (~ta).numpy(), dtype=zyx.int8)
    u = np.array([0, 1, 200, 255], dtype=np.uint8)
    assert_close(~zyx.Tensor(u), (~torch.tensor(u)).numpy(), dtype=zyx.uint8)
    assert_close(-zyx.Tensor(u), (-torch.tensor(u)).numpy(), dtype=zyx.uint8)


def test_reduction_dtypes_against_torch():
    torch = pytest.importorskip("torch")
    from conftest import from_torch_dtype, torch_dtype
    for d in (zyx.bool, zyx.uint8, zyx.int8, zyx.int32, zyx.float16, zyx.bfloat16, zyx.float32):
        x = zyx.zeros(2, 3, dtype=d)
        t = torch.zeros(2, 3, dtype=torch_dtype(d))
        pairs = [(x.sum(0), t.sum(0)), (x.prod(1), t.prod(1)), (x.cumsum(1), t.cumsum(1)),
                 (x.amax(0), t.amax(0))]
        if d is not zyx.uint8:    # torch keeps uint8 for any/all (a legacy quirk); zyx: bool
            pairs += [(x.any(0), t.any(0)), (x.all(), t.all())]
        if not d.is_bool:
            pairs.append((x.argmax(1), t.argmax(1)))
        if d.is_float:
            pairs += [(x.mean(0), t.mean(0)), (x.var(1), t.var(1)), (x.softmax(-1), t.softmax(-1)),
                      (x.logsumexp(0), t.logsumexp(0))]
        for z, tt in pairs:
            assert z.dtype == from_torch_dtype(tt.dtype), (d, z.dtype, tt.dtype)
            assert z.shape == tuple(tt.shape)


def test_exp_of_masked_values_is_exact():
    """An exp whose argument comes from a very negative constant (a causal mask's -inf)
    runs through the C backend's zyx_expf (libmvec's slow path avoided); its values are
    numpy's, denormals, exact zeros, NaN and inf included, on every device. Vulkan and
    WebGPU are held to their APIs' precision instead: exp within 3 + 2|x| ulp, and a
    result below the smallest normal float may be flushed to zero (NVIDIA's driver and
    lavapipe both flush)."""
    xs = np.array([-150.0, -120.0, -103.9, -100.0, -90.0, -87.5, -80.0001, -80.0, -60.0,
                   -1.0, 0.0, 1.0, 88.0, 89.0, np.inf, np.nan, -np.inf, 5.5], np.float32)
    mask = np.arange(xs.size) % 3 == 0
    x = zyx.tensor(xs)
    shader_api = zyx.get_default_device().type in ("vulkan", "wgpu")
    for fill in (-np.inf, -1000.0, -95.0):
        got = zyx.where(zyx.tensor(mask), fill, x).exp().numpy()
        arg = np.where(mask, np.float32(fill), xs)
        with np.errstate(over="ignore"):
            ref = np.exp(arg)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
        ok = ~np.isnan(ref)
        if not shader_api:
            np.testing.assert_allclose(got[ok], ref[ok], rtol=2e-7, atol=0)
            continue
        tiny = np.finfo(np.float32).tiny
        flushed = ok & (ref < tiny) & (got == 0)
        ok &= ~flushed
        ulps = 3 + 2 * np.abs(np.where(np.isfinite(arg), arg, 0).astype(np.float64))
        err = np.abs(got[ok].astype(np.float64) - ref[ok])
        same = got[ok] == ref[ok]   # the infinities and exact zeros
        bound = ulps[ok] * np.spacing(np.abs(ref[ok]).astype(np.float32)).astype(np.float64)
        assert (same | (err <= bound)).all(), (arg[ok], got[ok], ref[ok])
    m = np.triu(np.ones((8, 8), bool), 1)
    a = np.random.default_rng(0).standard_normal((3, 8, 8)).astype(np.float32)
    sm = zyx.tensor(a).masked_fill(zyx.tensor(m), float("-inf")).softmax(-1).numpy()
    e = np.exp(np.where(m, -np.inf, a) - np.where(m, -np.inf, a).max(-1, keepdims=True))
    np.testing.assert_allclose(sm, e / e.sum(-1, keepdims=True), rtol=1e-6, atol=1e-7)
    assert (sm[:, m] == 0).all()


def test_c_backend_uses_zyx_expf_only_where_a_low_constant_reaches_the_exp(monkeypatch):
    """With INLINE_EXP (the default) every float exp is the inlined polynomial; without
    it, zyx_expf only where a very negative constant reaches the exp, else libm's."""
    from zyx.codegen.cpu import render as cb
    from zyx._core.kernelizer import kernelize
    x = zyx.tensor(np.zeros(64, np.float32))
    m = zyx.tensor(np.arange(64) % 2 == 0)

    def source(t):
        g = zyx._RT.graph
        order, _ = g.collect([t._id])
        steps, _ = kernelize(g, order, [t._id], 64)
        (k,) = [s.kernel for s in steps if s.kernel is not None]
        from zyx.codegen.cstyle import render_body
        r, _ = render_body(k, cb.CBackendDialect())
        return "\n".join(r.lines)
    masked, plain = zyx.where(m, float("-inf"), x).exp(), (x * 2).exp()
    assert "zyx_exp_inline(" in source(masked) and "zyx_exp_inline(" in source(plain)
    assert "expf(" not in source(plain)
    monkeypatch.setattr(cb, "INLINE_EXP", False)
    assert "zyx_expf(" in source(masked)
    assert "expf(" in source(plain) and "zyx_expf(" not in source(plain)
    assert "zyx_exp_inline(" not in source(plain)


def test_c_backend_inline_exp_is_within_one_ulp(on_cpu, monkeypatch):
    """The C backend's inlined float exp (zyx_exp_inline) on a stride through every float:
    at most 1 ulp from the exact exp, denormal results and overflow to inf included; NaN
    stays NaN. Then the same values with libm's expf (INLINE_EXP off) as a control: glibc's
    16-wide vector expf (libmvec) is 2.2 ulp off at 1.041, within its 3-ulp bound."""
    from zyx.codegen.cpu import render as cb
    bits = np.arange(0, 1 << 32, 65537, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):     # (signaling NaNs among them)
        want = np.exp(x.astype(np.float64))
    for inline in (True, False):
        monkeypatch.setattr(cb, "INLINE_EXP", inline)
        zyx._RT.plans.clear()
        got = zyx.tensor(x).exp().numpy()
        nan = np.isnan(x)
        assert np.isnan(got[nan]).all()
        with np.errstate(over="ignore"):
            w32 = want[~nan].astype(np.float32)      # overflow -> inf, as exp's result
        g = got[~nan]
        big = np.isinf(w32)
        assert np.isinf(g[big]).all() and (g[big] > 0).all()
        ulp = np.spacing(np.abs(w32[~big]))
        err = np.abs(g[~big].astype(np.float64) - want[~nan][~big]) / ulp
        assert err.max() <= (1.0 if inline else 3.0), (inline, x[~nan][~big][err.argmax()],
                                                        err.max())


def test_c_backend_vectorizes_a_short_last_index_loop_with_the_one_before(on_cpu,
                                                                           monkeypatch):
    """An elementwise kernel whose last index loop is an axis split at a pooling window (2
    long) runs its last two loops as one SIMD loop (`omp simd collapse(2)`); values as
    numpy's with and without (SIMD_COLLAPSE off: the plain simd loop of 2)."""
    from zyx.codegen.cpu import render as cb
    from zyx._core.kernelizer import kernelize
    import zyx.nn.functional as F
    rng = np.random.default_rng(4)
    xn = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    gn = rng.standard_normal((4, 3, 4, 4)).astype(np.float32)
    xr = xn.reshape(4, 3, 4, 2, 4, 2)
    mx = xr.max((3, 5), keepdims=True)
    hit = xr == mx
    want = (hit * (gn[:, :, :, None, :, None] / hit.sum((3, 5), keepdims=True)))
    want = want.reshape(4, 3, 8, 8)
    dev = zyx._RT.device()
    for on in (True, False):
        monkeypatch.setattr(cb, "SIMD_COLLAPSE", on)
        zyx._RT.plans.clear()
        x = zyx.tensor(xn, requires_grad=True)
        (F.max_pool2d(x, 2) * zyx.tensor(gn)).sum().backward()
        g = zyx._RT.graph
        order, _ = g.collect([x.grad._id])
        steps, _ = kernelize(g, order, [x.grad._id], 64)
        srcs = [dev.render(s.kernel, "k") for s in steps if s.kernel is not None]
        assert any("omp simd collapse(2)" in s for s in srcs) == on, srcs
        np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-6, atol=1e-6)


def test_c_backend_unrolls_lane_tile_rows_inside_short_reduce_loops(on_cpu, monkeypatch):
    """A weight gradient over (B, T) whose axes are not neighbours in memory (the input
    laid out (T, B, D)) reduces in two nested loops of 32 and 64 around its lane tile:
    the tile's rows loop carries `#pragma GCC unroll` (gcc leaves it rolled there and
    keeps the accumulators in memory). Over (B, T) contiguous, one 1024-long loop per
    block, gcc unrolls it itself and the kernel has no pragma. Values as numpy's, with
    and without (UNROLL_ROWS 0)."""
    from zyx.codegen.cpu import render as cb
    from zyx._core.kernelizer import kernelize
    rng = np.random.default_rng(5)
    tbd = rng.standard_normal((64, 32, 128)).astype(np.float32)   # (T, B, D)
    btd = rng.standard_normal((32, 64, 128)).astype(np.float32)   # (B, T, D)
    dev = zyx._RT.device()

    def run(a, b):
        g = zyx._RT.graph
        out = zyx.einsum("btd,bte->de", a, b)
        order, _ = g.collect([out._id])
        steps, _ = kernelize(g, order, [out._id], dev.info().preferred_vector_size)
        srcs = [dev.render(s.kernel, "k") for s in steps if s.kernel is not None]
        return any("#pragma GCC unroll" in s for s in srcs), out.numpy()

    want = np.einsum("btd,bte->de", tbd.transpose(1, 0, 2).astype(np.float64), btd)
    want_contig = np.einsum("btd,bte->de", btd.astype(np.float64), btd)
    for rows in (16, 0):
        monkeypatch.setattr(cb, "UNROLL_ROWS", rows)
        zyx._RT.plans.clear()
        strided = zyx.tensor(tbd).permute(1, 0, 2)
        pragma, got = run(strided, zyx.tensor(btd))
        # (the rows are unrolled only when a row's 16 float lanes fit one vector register:
        # on a CPU with 32-byte vectors, AVX2, they do not, and the loop stays rolled)
        assert pragma == (bool(rows) and dev.info().preferred_vector_size >= 64)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
        pragma, got = run(zyx.tensor(btd), zyx.tensor(btd))
        assert not pragma
        np.testing.assert_allclose(got, want_contig, rtol=1e-4, atol=1e-3)
    # a 4x4 tile's reduce loop around its per-lane partial sums (x @ W.T over 48: 6
    # passes of 8 lanes) is no rows loop: unrolled it only made the compile slower
    monkeypatch.setattr(cb, "UNROLL_ROWS", 16)
    xn = rng.standard_normal((64, 48)).astype(np.float32)
    wn = rng.standard_normal((64, 48)).astype(np.float32)
    out = zyx.nn.functional.linear(zyx.tensor(xn), zyx.tensor(wn))
    g = zyx._RT.graph
    order, _ = g.collect([out._id])
    steps, _ = kernelize(g, order, [out._id], dev.info().preferred_vector_size)
    (k,) = [st.kernel for st in steps if st.kernel is not None]
    src = dev.render(k, "k")
    assert "omp simd" in src and "#pragma GCC unroll" not in src
    np.testing.assert_allclose(out.numpy(), xn @ wn.T, rtol=1e-4, atol=1e-4)


def _count_calls(source, fn):
    import re
    return len(re.findall(rf"\b{fn}\(", source))


def test_c_backend_softmax_computes_each_exp_once(on_cpu, monkeypatch):
    """softmax's row kernel sums exp(x - max) in one loop and stores exp(x - max) / sum in
    the next: the first loop keeps each exp in a row buffer (codegen/cpu/rowstash.py) and the
    second reads it back, so the source calls expf once; with STASH_ROWS off, twice.
    log_softmax (no exp in its store loop) is left alone. Values as numpy's either way,
    NaN and inf rows included."""
    from zyx.codegen.cpu import render as cb
    xn = np.random.default_rng(6).standard_normal((33, 257)).astype(np.float32)
    xn[3, 5] = np.nan
    xn[4, 7] = np.inf
    with np.errstate(invalid="ignore"):
        e = np.exp(xn - xn.max(-1, keepdims=True))
        want = e / e.sum(-1, keepdims=True)
    dev = zyx._RT.device()
    for on in (True, False):
        monkeypatch.setattr(cb, "STASH_ROWS", on)
        zyx._RT.plans.clear()
        x = zyx.tensor(xn)
        exp = "zyx_exp_inline" if cb.INLINE_EXP else "expf"
        (k,) = _plan_kernels_of(x.softmax(-1))
        assert _count_calls(dev.render(k, "k"), exp) == (1 if on else 2)
        np.testing.assert_allclose(x.softmax(-1).numpy(), want, rtol=1e-6, atol=1e-7)
        (k,) = _plan_kernels_of(x.log_softmax(-1))
        src = dev.render(k, "k")
        assert _count_calls(src, exp) == 1 and _count_calls(src, "logf") == 1


def _plan_kernels_of(t):
    from zyx._core.kernelizer import kernelize
    g = zyx._RT.graph
    order, _ = g.collect([t._id])
    steps, _ = kernelize(g, order, [t._id], 64)
    return [s.kernel for s in steps if s.kernel is not None]


def test_row_stash_keeps_values_only_between_sibling_loops():
    """rowstash on hand-written IR: two loops of the same length inside one outer loop
    share exp(x[i]) (stashed); the same pair where the later loop sits in another outer
    loop (the buffer would hold the last outer iteration's values) is left alone, and so
    is a later value that reads something computed between the loops."""
    from zyx import dtype as dt
    from zyx._core import kernel as K
    from zyx.codegen.cpu.rowstash import stash_row_values
    f32 = dt.float32

    def kernel(split_parent, between):
        ops = [(K.DEFINE, f32, K.SCOPE_GLOBAL, 0, False, 8, -1),
               (K.DEFINE, f32, K.SCOPE_GLOBAL, 1, True, 8, -1),
               (K.DEFINE, f32, K.SCOPE_REGISTER, 0.0, False, 1, K.R_SUM),   # 2
               (K.LOOP, K.IDX, 2)]                                          # 3: outer
        ops += [(K.LOOP, K.IDX, 8),                                         # 4
                (K.LOAD, f32, 1, 4, -1), (K.UNARY, f32, K.U_EXP, 5),
                (K.LOAD, f32, 2, -1, -1), (K.BINARY, f32, K.B_ADD, 7, 6),
                (K.STORE, None, 2, -1, 8), (K.ENDLOOP, None, 4)]            # 10
        if split_parent:
            ops += [(K.ENDLOOP, None, 3), (K.LOOP, K.IDX, 2)]
        b = len(ops)
        ops += [(K.LOAD, f32, 2, -1, -1)]                                   # the sum
        s = len(ops)
        ops += [(K.LOOP, K.IDX, 8), (K.LOAD, f32, 1, s, -1)]
        x = s + 1
        if between:
            ops += [(K.BINARY, f32, K.B_ADD, x, b)]
            x = len(ops) - 1
        ops += [(K.UNARY, f32, K.U_EXP, x)]
        ops += [(K.BINARY, f32, K.B_DIV, len(ops) - 1, b),
                (K.STORE, None, 0, s, len(ops)), (K.ENDLOOP, None, s),
                (K.ENDLOOP, None, b - 2 if split_parent else 3)]
        return K.Kernel(ops, [(f32, 8, False), (f32, 8, True)])

    def exps(k):
        return sum(1 for op in k.ops if op[0] == K.UNARY and op[2] == K.U_EXP)

    shared = stash_row_values(kernel(False, False))
    assert exps(shared) == 1
    scratch = [op for op in shared.ops if op[0] == K.DEFINE and op[2] == K.SCOPE_REGISTER
               and op[6] == -1]
    assert len(scratch) == 1 and scratch[0][5] == 8 and scratch[0][3] is None
    assert exps(stash_row_values(kernel(True, False))) == 2
    assert exps(stash_row_values(kernel(False, True))) == 2


def test_hoist_moves_loop_invariant_values_out_of_their_loops():
    """hoist.py on hand-written IR: a read-only load whose index depends on the outer
    loop only, and its index math, move in front of the inner loop; a load of a written
    buffer, a register read, and anything inside an IF or a loop that may run zero
    times stay where they are."""
    from zyx import dtype as dt
    from zyx._core import kernel as K
    from zyx.codegen.cpu.hoist import hoist_invariants
    f32, IDX = dt.float32, K.IDX

    def kernel(inner_len, in_if):
        ops = [(K.DEFINE, f32, K.SCOPE_GLOBAL, 0, False, 32, -1),        # 0 out
               (K.DEFINE, f32, K.SCOPE_GLOBAL, 1, True, 32, -1),         # 1 in (ro)
               (K.CONST, IDX, 8),                                        # 2
               (K.LOOP, IDX, 4),                                         # 3 outer
               (K.LOOP, IDX, inner_len)]                                 # 4 inner
        if in_if:
            ops += [(K.BINARY, dt.bool_, K.B_CMPLT, 4, 2), (K.IF_OP, None, 5)]
        b = len(ops)
        ops += [(K.BINARY, IDX, K.B_MUL, 3, 2),                          # b: outer * 8
                (K.LOAD, f32, 1, b, -1),                                 # b+1: invariant
                (K.BINARY, IDX, K.B_ADD, b, 4),                          # b+2: varies
                (K.LOAD, f32, 1, b + 2, -1),
                (K.LOAD, f32, 0, b, -1),                                 # written buffer
                (K.BINARY, f32, K.B_ADD, b + 1, b + 3),
                (K.BINARY, f32, K.B_ADD, b + 5, b + 4),
                (K.STORE, None, 0, b + 2, b + 6)]
        if in_if:
            ops += [(K.END_IF, None)]
        ops += [(K.ENDLOOP, None, 4), (K.ENDLOOP, None, 3)]
        return K.Kernel(ops, [(f32, 32, False), (f32, 32, True)])

    def inner_ops(k):
        start = [i for i, op in enumerate(k.ops) if op[0] == K.LOOP][1]
        end = max(i for i, op in enumerate(k.ops) if op[0] == K.ENDLOOP and op[2] == start)
        return k.ops[start + 1:end]

    moved = hoist_invariants(kernel(8, False))
    inside = inner_ops(moved)
    ro_loads = [op for op in inside if op[0] == K.LOAD and op[2] == 1]
    assert len(ro_loads) == 1          # the varying one; the invariant load moved out
    assert any(op[0] == K.LOAD and op[2] == 0 for op in inside)   # written buffer stays
    assert len(moved.ops) == len(kernel(8, False).ops)
    for k in (kernel(0, False), kernel(8, True)):
        assert hoist_invariants(k) is k


def test_softmax_and_layer_norm_gradients_with_hoisting_on_and_off(on_cpu, monkeypatch):
    """Row kernels' backward (softmax under a causal mask, layer_norm) with the C
    backend's loop-invariant hoisting on and off: the same gradients, as numpy's."""
    from zyx.codegen.cpu import render as cb
    F = zyx.nn.functional
    rng = np.random.default_rng(7)
    xn = rng.standard_normal((6, 16, 16)).astype(np.float32)
    gn = rng.standard_normal((6, 16, 16)).astype(np.float32)
    mask = np.triu(np.ones((16, 16), bool), 1)
    xm = np.where(mask, -np.inf, xn.astype(np.float64))
    s = np.exp(xm - xm.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    want_sm = s * (gn - (gn * s).sum(-1, keepdims=True))
    mu = xn.mean(-1, keepdims=True)
    var = xn.var(-1, keepdims=True)
    xhat = (xn - mu) / np.sqrt(var + 1e-5)
    want_ln = (gn - gn.mean(-1, keepdims=True)
               - xhat * (gn * xhat).mean(-1, keepdims=True)) / np.sqrt(var + 1e-5)
    for on in (True, False):
        monkeypatch.setattr(cb, "HOIST_INVARIANTS", on)
        zyx._RT.plans.clear()
        x = zyx.tensor(xn, requires_grad=True)
        m = zyx.tensor(mask)
        (x.masked_fill(m, float("-inf")).softmax(-1) * zyx.tensor(gn)).sum().backward()
        np.testing.assert_allclose(x.grad.numpy(), want_sm, rtol=1e-4, atol=1e-5)
        x = zyx.tensor(xn, requires_grad=True)
        (F.layer_norm(x, (16,)) * zyx.tensor(gn)).sum().backward()
        np.testing.assert_allclose(x.grad.numpy(), want_ln, rtol=1e-4, atol=1e-4)


def test_c_backend_long_max_min_keep_nan_in_a_flag(on_cpu, monkeypatch):
    """Long float max/min reductions run as OpenMP's plain max/min with NaN tracked by a
    flag beside them (codegen/cpu/nanflag.py); short ones (a pooling window) keep the
    NaN-keeping combiner. Values as numpy's with the rewrite on and off: rows with NaN
    first, last or alone, infinities, -0.0, and softmax/log_softmax over such rows."""
    from zyx.codegen.cpu import render as cb
    from zyx.codegen.cpu import nanflag
    rng = np.random.default_rng(9)
    xn = rng.standard_normal((9, 300)).astype(np.float32)
    xn[1, 0] = np.nan
    xn[2, -1] = np.nan
    xn[3, :] = np.nan
    xn[4, 17] = np.inf
    xn[5, 40] = -np.inf
    xn[6, :] = -np.inf
    xn[7, 3] = np.inf
    xn[7, 9] = np.nan
    xn[8, :] = -0.0
    dev = zyx._RT.device()
    with np.errstate(invalid="ignore"):
        e = np.exp(xn - xn.max(-1, keepdims=True))
        soft = e / e.sum(-1, keepdims=True)
        logsoft = (xn - xn.max(-1, keepdims=True)) - np.log(e.sum(-1, keepdims=True))
    for on in (True, False):
        monkeypatch.setattr(cb, "FLAG_NAN", on)
        zyx._RT.plans.clear()
        x = zyx.tensor(xn)
        (k,) = _plan_kernels_of(x.amax(-1))
        src = dev.render(k, "k")
        assert ("zyx_nanmax" in src) != on and ("reduction(max:" in src) == on
        np.testing.assert_array_equal(x.amax(-1).numpy(), xn.max(-1))
        np.testing.assert_array_equal(x.amin(-1).numpy(), xn.min(-1))
        np.testing.assert_array_equal(np.signbit(x.amax(-1).numpy()), np.signbit(xn.max(-1)))
        np.testing.assert_allclose(x.softmax(-1).numpy(), soft, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(x.log_softmax(-1).numpy(), logsoft, rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(cb, "FLAG_NAN", True)
    short = zyx.tensor(xn[:, :nanflag.MIN_LOOP - 1].copy())
    (k,) = _plan_kernels_of(short.amax(-1))
    assert "zyx_nanmax" in dev.render(k, "k")
    np.testing.assert_array_equal(short.amax(-1).numpy(), xn[:, :nanflag.MIN_LOOP - 1].max(-1))
