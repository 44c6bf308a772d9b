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


# ---------------------------------------------------------------------------------------
# recursion: the module walks are compiled (no Python recursion check), so a module that
# contains itself or a deep nesting overflowed the C stack. Each case runs in a subprocess
# so that a segfault fails the test instead of killing pytest.

_RECURSION_SCRIPT = """
import sys
import zyx
from zyx import nn
kind, what = sys.argv[1], sys.argv[2]
if kind == "cycle":
    m = nn.Sequential(nn.Linear(2, 2))
    m.add_module("me", m)
else:
    m = nn.Linear(2, 2)
    for _ in range(20000):
        m = nn.Sequential(m)
calls = {
    "state_dict": lambda: m.state_dict(),
    "load_state_dict": lambda: m.load_state_dict({}),
    "apply": lambda: m.apply(lambda x: None),
    "repr": lambda: repr(m),
    "named_modules_dups": lambda: list(m.named_modules(remove_duplicate=False)),
    "named_modules": lambda: list(m.named_modules()),
    "parameters": lambda: list(m.parameters()),
    "train": lambda: m.train(),
}
try:
    calls[what]()
    print("OK")
except RecursionError:
    print("RecursionError")
"""


def _walk(kind, what):
    r = subprocess.run([sys.executable, "-c", _RECURSION_SCRIPT, kind, what],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"crashed (rc={r.returncode}): {r.stderr[-500:]}"
    return r.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("kind", ["cycle", "deep"])
@pytest.mark.parametrize("what", ["state_dict", "load_state_dict", "apply", "repr",
                                  "named_modules_dups"])
def test_recursive_module_walk_raises_recursion_error(kind, what):
    if kind == "deep" and what == "named_modules_dups":   # iterative: a deep nesting is fine
        assert _walk(kind, what) == "OK"
    else:
        assert _walk(kind, what) == "RecursionError"     # torch's error for each


@pytest.mark.parametrize("what", ["named_modules", "parameters", "train"])
def test_self_containing_module_deduplicated_walks(what):
    # torch's named_modules/parameters skip a module already seen, so a cycle ends
    assert _walk("cycle", what) == "OK"


def test_named_modules_order_unchanged():
    inner = nn.Sequential(nn.Linear(1, 1), nn.ReLU())
    m = nn.Sequential(inner, nn.Sequential(nn.Linear(1, 2)), inner)
    assert [n for n, _ in m.named_modules()] == ["", "0", "0.0", "0.1", "1", "1.0"]
    assert [n for n, _ in m.named_modules(remove_duplicate=False)] == \
        ["", "0", "0.0", "0.1", "1", "1.0", "2", "2.0", "2.1"]


# ---------------------------------------------------------------------------------------
# errors that leaked internals (ZeroDivisionError, AttributeError, a raw ValueError)

def test_linear_with_zero_in_features():
    # torch allows it (init is a no-op): the output is the bias
    m = nn.Linear(0, 3)
    assert m.weight.shape == (3, 0)
    y = m(zyx.ones(2, 0))
    np.testing.assert_allclose(y.numpy(), np.broadcast_to(m.bias.numpy(), (2, 3)))


@pytest.mark.parametrize("kw", [{"stride": 0}, {"stride": -1}, {"dilation": 0}])
def test_conv_non_positive_stride_or_dilation(kw):
    from zyx.errors import InvalidArgumentError
    m = nn.Conv2d(1, 1, 3, **kw)
    with pytest.raises(RuntimeError, match="stride|dilation") as e:   # torch: RuntimeError
        m(zyx.ones(1, 1, 5, 5))
    assert isinstance(e.value, (InvalidArgumentError, ValueError))
    with pytest.raises(RuntimeError):
        nn.functional.max_pool2d(zyx.ones(1, 1, 4, 4), 2, **kw)


def test_lstm_sequence_length_zero():
    with pytest.raises(RuntimeError, match="sequence length"):   # torch: RuntimeError
        nn.LSTM(3, 4)(zyx.ones(0, 2, 3))
    with pytest.raises(RuntimeError, match="sequence length"):
        nn.GRU(3, 4, batch_first=True)(zyx.ones(2, 0, 3))


def test_einsum_equation_not_a_string():
    with pytest.raises(TypeError, match="must be str, not int"):
        zyx.einsum(5, zyx.ones(3))


def test_safetensors_shape_too_large(tmp_path):
    import json
    import struct
    from zyx.io.safetensors import SafetensorsError, load
    h = json.dumps({"a": {"dtype": "F32", "shape": [0, 2 ** 64 + 5],
                          "data_offsets": [0, 0]}}).encode()
    p = tmp_path / "big.safetensors"
    p.write_bytes(struct.pack("<Q", len(h)) + h)
    with pytest.raises(SafetensorsError, match="too large"):
        load(str(p))
