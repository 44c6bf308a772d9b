"""Trust II: silent wrong results at the edges -- gradients on clamp/hardtanh bounds,
signed zeros, NaNs, invalid arguments, integer promotion. Expected values are torch's
(checked against torch 2.13 when it is installed)."""
from __future__ import annotations

import math

import pytest

import zyx
import zyx.nn.functional as F

try:
    import torch
    import torch.nn.functional as TF
except ImportError:   # the hard-coded expectations still run
    torch = None

NAN = float("nan")


def _grad(fn, vals):
    x = zyx.tensor(vals, requires_grad=True)
    fn(x).sum().backward()
    return x.grad.tolist()


# ---------------------------------------------------------------------------------------
# 1. gradients at the bounds: clamp passes all of it, the hardtanh family none of it

BOUND_CASES = [
    # name, zyx fn, torch fn, inputs, torch's gradient
    ("clamp", lambda x: x.clamp(0, 1), lambda x: x.clamp(0, 1),
     [0.0, 1.0, 0.5, 2.0, -1.0], [1.0, 1.0, 1.0, 0.0, 0.0]),
    ("clamp_min", lambda x: x.clamp(min=0), lambda x: x.clamp(min=0), [0.0, 1.0, -1.0],
     [1.0, 1.0, 0.0]),
    ("clamp_max", lambda x: x.clamp(max=1), lambda x: x.clamp(max=1), [0.0, 1.0, 2.0],
     [1.0, 1.0, 0.0]),
    ("hardtanh", F.hardtanh, lambda x: TF.hardtanh(x), [-1.0, 1.0, 0.0, 2.0],
     [0.0, 0.0, 1.0, 0.0]),
    ("relu6", F.relu6, lambda x: TF.relu6(x), [0.0, 6.0, 3.0, 7.0], [0.0, 0.0, 1.0, 0.0]),
    ("hardsigmoid", F.hardsigmoid, lambda x: TF.hardsigmoid(x), [-3.0, 3.0, 0.0],
     [0.0, 0.0, 1.0 / 6.0]),
    ("hardswish", F.hardswish, lambda x: TF.hardswish(x), [-3.0, 3.0, 0.0],
     [0.0, 1.0, 0.5]),
]


@pytest.mark.parametrize("name,zfn,tfn,vals,want", BOUND_CASES, ids=[c[0] for c in BOUND_CASES])
def test_bound_gradients(name, zfn, tfn, vals, want):
    got = _grad(zfn, vals)
    assert got == pytest.approx(want, abs=1e-6)
    if torch is not None:
        t = torch.tensor(vals, requires_grad=True)
        tfn(t).sum().backward()
        assert got == pytest.approx(t.grad.tolist(), abs=1e-6)


def test_maximum_still_splits_ties():
    # torch.maximum/minimum give each side half the gradient on a tie; clamp does not
    assert _grad(lambda x: zyx.maximum(x, zyx.zeros(1)), [0.0]) == [0.5]
    assert _grad(lambda x: zyx.minimum(x, zyx.zeros(1)), [0.0]) == [0.5]


def test_clamp_tensor_bounds_gradients():
    x = zyx.tensor([0.0, 1.0, -1.0, 2.0], requires_grad=True)
    lo = zyx.zeros(4, requires_grad=True)
    hi = zyx.ones(4, requires_grad=True)
    zyx.clamp(x, lo, hi).sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert lo.grad.tolist() == [0.0, 0.0, 1.0, 0.0]
    assert hi.grad.tolist() == [0.0, 0.0, 0.0, 1.0]


def test_clamp_values_nan_and_signed_zero():
    r = zyx.tensor([1.0, NAN, -0.0, 3.0]).clamp(0, 2).tolist()
    assert r[0] == 1.0 and math.isnan(r[1]) and r[3] == 2.0
    assert r[2] == 0.0 and math.copysign(1, r[2]) == -1   # torch keeps x on a tie
    assert all(math.isnan(v) for v in zyx.tensor([1.0, 2.0]).clamp(NAN).tolist())
    r = zyx.tensor([1.0, 2.0]).clamp(max=zyx.tensor([NAN, 1.0])).tolist()
    assert math.isnan(r[0]) and r[1] == 1.0
    assert zyx.tensor([0.0, 1.0, 2.0]).clamp(1, 0).tolist() == [0.0, 0.0, 0.0]   # min > max
    assert zyx.tensor([1, 5]).clamp(2, 3).tolist() == [2, 3]
    assert math.isnan(F.hardtanh(zyx.tensor([NAN])).tolist()[0])


# ---------------------------------------------------------------------------------------
# 2. small ones: NaN in unique, 0-d iteration, invalid arguments torch refuses

def test_unique_keeps_each_nan():
    vals, inv, counts = zyx.unique(zyx.tensor([NAN, 1.0, NAN, 1.0]), return_inverse=True,
                                   return_counts=True)
    v = vals.tolist()
    assert v[0] == 1.0 and len(v) == 3 and all(math.isnan(x) for x in v[1:])
    assert inv.tolist() == [1, 0, 2, 0] and counts.tolist() == [2, 1, 1]
    if torch is not None:
        t = torch.unique(torch.tensor([NAN, 1.0, NAN, 1.0]))
        assert len(t) == len(v)


def test_iterating_a_0d_tensor_raises():
    with pytest.raises(TypeError, match="iteration over a 0-d tensor"):
        list(zyx.tensor(1.0))
    assert [x.item() for x in zyx.tensor([1.0, 2.0])] == [1.0, 2.0]
    assert [r.tolist() for r in zyx.tensor([[1, 2], [3, 4]])] == [[1, 2], [3, 4]]


@pytest.mark.parametrize("p", [2.0, -0.5, NAN])
def test_bernoulli_refuses_p_outside_0_1(p):
    with pytest.raises(ValueError, match=r"expects p to be in \[0, 1\]"):
        zyx.bernoulli(zyx.tensor([0.5]), p=p)
    assert zyx.bernoulli(zyx.tensor([0.5, 0.5]), p=1.0).tolist() == [1.0, 1.0]


def test_eye_refuses_negative_sizes():
    with pytest.raises(ValueError, match="n must be greater or equal to 0, got -1"):
        zyx.eye(-1)
    with pytest.raises(ValueError, match="m must be greater or equal to 0, got -2"):
        zyx.eye(2, -2)
    assert zyx.eye(0).shape == (0, 0)


@pytest.mark.parametrize("d", [zyx.int32, zyx.int64, zyx.uint8, zyx.bool])
def test_int_to_negative_int_power_raises(d):
    with pytest.raises(TypeError, match="Integers to negative integer powers are not allowed"):
        zyx.tensor([1, 1], dtype=d) ** -1
    with pytest.raises(TypeError, match="Integers to negative integer powers are not allowed"):
        zyx.tensor([2, 3], dtype=d).pow(-2) if d is not zyx.bool else zyx.tensor([True]).pow(-2)


def test_negative_powers_that_torch_allows():
    assert (zyx.tensor([2, 3]) ** 2).tolist() == [4, 9]
    assert (zyx.tensor([2.0]) ** -1).tolist() == [0.5]
    assert (zyx.tensor([2]) ** -1.0).tolist() == [0.5]            # float exponent: float result
    assert (zyx.tensor([2, 1, -1]) ** zyx.tensor(-1)).tolist() == [0, 1, -1]   # as torch


# ---------------------------------------------------------------------------------------
# 3. promotion: uint64 with a signed integer has no integer result dtype

@pytest.mark.parametrize("s", [zyx.int8, zyx.int16, zyx.int32, zyx.int64])
def test_uint64_with_signed_int_is_refused(s):
    u = zyx.tensor([2 ** 63], dtype=zyx.uint64)
    i = zyx.tensor([0], dtype=s)
    with pytest.raises(TypeError, match="promotion of uint64 with"):
        u > i          # was int64 compare of a wrapped value: False
    with pytest.raises(TypeError, match="promotion of uint64 with"):
        i + u
    if torch is not None:
        with pytest.raises(RuntimeError, match="Promotion for uint16, uint32, uint64"):
            torch.promote_types(torch.uint64, torch.int64)


def test_uint64_promotions_that_hold_both():
    u = zyx.tensor([2 ** 63], dtype=zyx.uint64)
    assert (u > 0).tolist() == [True]
    assert (u + zyx.tensor([1], dtype=zyx.uint8)).dtype == zyx.uint64
    assert (u + zyx.tensor([True])).dtype == zyx.uint64
    assert (u.cast(zyx.float64) > zyx.tensor([0], dtype=zyx.int64)).tolist() == [True]
    assert (zyx.tensor([1], dtype=zyx.uint32) + zyx.tensor([1], dtype=zyx.int32)).dtype \
        == zyx.int64


def test_python_int_beyond_int64_needs_dtype():
    with pytest.raises(OverflowError, match="does not fit in int64"):
        zyx.tensor([2 ** 63])
    if torch is not None:
        with pytest.raises((RuntimeError, OverflowError, ValueError)):
            torch.tensor([2 ** 63])
    assert zyx.tensor([2 ** 63], dtype=zyx.uint64).item() == 2 ** 63
    assert zyx.tensor([2 ** 63 - 1]).dtype == zyx.int64


@pytest.mark.parametrize("d", [zyx.float16, zyx.float64])
def test_bound_gradients_other_float_dtypes(d):
    x = zyx.tensor([0.0, 1.0, 0.5, 2.0], dtype=d, requires_grad=True)
    x.clamp(0, 1).sum().backward()                  # int bounds on a float tensor
    assert x.grad.tolist() == [1.0, 1.0, 1.0, 0.0]
    x = zyx.tensor([0.0, 6.0, 3.0], dtype=d, requires_grad=True)
    F.relu6(x).sum().backward()
    assert x.grad.tolist() == [0.0, 0.0, 1.0]


def test_hardtanh_family_on_int_tensors_general_path():
    assert F.relu6(zyx.tensor([-1, 3, 9])).tolist() == [0, 3, 6]
    assert F.hardtanh(zyx.tensor([-3, 0, 3])).tolist() == [-1.0, 0.0, 1.0]
