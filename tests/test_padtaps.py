"""The C backend's narrowed padding taps (zyx/codegen/cpu/padtaps.py): reduce loops over a
window run only over the taps that read inside the input, where every sum they add to
is zero outside it; results against numpy with the narrowing on and off."""
import numpy as np
import pytest

import zyx
import zyx.nn.functional as F
from zyx.codegen.cpu import padtaps


@pytest.fixture
def cpu_device():
    dev = zyx._RT.device()
    if dev.info().own_tiles is not None:
        pytest.skip("the C backend's rendering (the default device is a GPU)")
    return dev


def _sources(dev, t):
    """The C sources of the kernels that compute `t`, as the CPU device makes them."""
    from zyx._core.kernelizer import kernelize
    g = zyx._RT.graph
    order, _ = g.collect([t._id])
    steps, _ = kernelize(g, order, [t._id], dev.info().preferred_vector_size)
    return [dev.render(s.kernel, "k") for s in steps if s.kernel is not None]


def _transposed_ref(x, w, stride, padding, dilation):
    """conv_transpose2d in float64 by scattering each input pixel's products."""
    n, cin, h, wd = x.shape
    cout, k = w.shape[1], w.shape[2]
    full = ((h - 1) * stride + dilation * (k - 1) + 1, (wd - 1) * stride + dilation * (k - 1) + 1)
    out = np.zeros((n, cout) + full)
    for ky in range(k):
        for kx in range(k):
            part = np.einsum("nchw,co->nohw", x, w[:, :, ky, kx])
            out[:, :, ky * dilation:ky * dilation + (h - 1) * stride + 1:stride,
                kx * dilation:kx * dilation + (wd - 1) * stride + 1:stride] += part
    return out[:, :, padding:full[0] - padding, padding:full[1] - padding]


@pytest.mark.parametrize("stride,padding,dilation", [(1, 0, 1), (1, 1, 1), (2, 1, 1),
                                                     (1, 0, 2)])
def test_transposed_convolutions_skip_padding_taps(cpu_device, monkeypatch, stride, padding,
                                                   dilation):
    """conv_transpose2d over a padded input (a convolution's input gradient): a tap loop
    around the tile (here the window rows; the cols move along the tile's lanes) is
    narrowed to the input, a dilation (2 per tap) keeps its guards, and the values
    match numpy's with the narrowing on and off."""
    rng = np.random.default_rng(3)
    xn = rng.standard_normal((2, 6, 7, 5)).astype(np.float32)
    wn = rng.standard_normal((6, 4, 3, 3)).astype(np.float32)
    want = _transposed_ref(xn.astype(np.float64), wn.astype(np.float64), stride, padding,
                           dilation)
    for on in (True, False):
        monkeypatch.setattr(padtaps, "ENABLED", on)
        zyx._RT.plans.clear()
        out = F.conv_transpose2d(zyx.tensor(xn), zyx.tensor(wn), stride=stride,
                                 padding=padding, dilation=dilation)
        srcs = _sources(cpu_device, out)
        narrowed = sum(s.count("= zyx_lo") for s in srcs)
        assert (narrowed > 0) == (on and dilation == 1), srcs
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)


def test_input_gradient_of_a_convolution_skips_padding_taps(cpu_device):
    """The input gradient of conv2d (a transposed convolution of the output gradient,
    which a ReLU's backward computes) reads it through guards whose taps are narrowed;
    the gradients match numpy's."""
    rng = np.random.default_rng(4)
    xn = rng.standard_normal((3, 5, 9, 8)).astype(np.float32)
    wn = rng.standard_normal((7, 5, 3, 3)).astype(np.float32)
    x = zyx.tensor(xn, requires_grad=True)
    y = F.conv2d(x, zyx.tensor(wn)).relu()
    (y * y).sum().backward()
    srcs = _sources(cpu_device, x.grad)
    assert any("= zyx_lo" in s for s in srcs)
    yn = np.maximum(np.einsum("nchwij,ocij->nohw", np.lib.stride_tricks.sliding_window_view(
        xn.astype(np.float64), (3, 3), axis=(2, 3)), wn), 0)
    gy = 2 * yn
    want = _transposed_ref(gy, wn.astype(np.float64), 1, 0, 1)
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-4, atol=1e-4)


def test_sums_that_do_not_vanish_outside_keep_every_tap(cpu_device):
    """A window sum of (padded x + 1) adds 1 for every tap outside the input too: its
    loops keep all taps (the sum is not zero where the guard fails)."""
    xn = np.arange(2 * 3 * 5 * 4, dtype=np.float32).reshape(2, 3, 5, 4)
    x = zyx.tensor(xn)
    win = F._windows(x._pad([(0, 0), (0, 0), (1, 1), (1, 1)]), (3, 3), (1, 1), (1, 1))
    out = (win + 1).sum((4, 5))
    assert not any("= zyx_lo" in s for s in _sources(cpu_device, out))
    padded = np.pad(xn.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    want = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3)).sum((4, 5)) + 9
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6)
