"""Trust II: crashes and leaked internals on edge inputs (recursion, zero-size tensors,
errors that name their cause, boolean-mask getitem, the layout of views)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import zyx
from zyx import nn


# ---------------------------------------------------------------------------------------
# zero-size tensors

@pytest.mark.parametrize("shape,new,axis", [
    ((0, 2), (2, 0), 1),
    ((0, 2), (2, 0, 1), 1),
    ((0, 4), (2, 0, 2), (0, 1)),
    ((3, 0), (0, 3), 0),
    ((0, 6), (3, 2, 0), 2),
])
def test_zero_size_reshape_reduce(shape, new, axis):
    a = np.zeros(shape, np.float32)
    x = zyx.tensor(a)
    np.testing.assert_array_equal(x.reshape(*new).sum(axis).numpy(), a.reshape(new).sum(axis))
    np.testing.assert_array_equal(x.reshape(*new).prod(axis).numpy(), a.reshape(new).prod(axis))


def test_zero_size_reshape_reduce_backward():
    x = zyx.zeros(0, 2, requires_grad=True)
    y = (x.reshape(2, 0) * 2).sum(1)
    np.testing.assert_array_equal(y.numpy(), np.zeros(2, np.float32))
    y.sum().backward()
    assert x.grad.shape == (0, 2)


def test_lstm_batch_zero_forward_backward():
    m = nn.LSTM(3, 4, batch_first=True)
    x = zyx.zeros(0, 5, 3, requires_grad=True)
    out, (h, c) = m(x)
    assert out.shape == (0, 5, 4) and h.shape == (1, 0, 4)
    (out.sum() + h.sum() + c.sum()).backward()
    assert x.grad.shape == (0, 5, 3)
    np.testing.assert_array_equal(m.weight_ih_l0.grad.numpy(), np.zeros((16, 3), np.float32))
