"""conv2d on the CPU, zyx next to PyTorch in one run (issue 13's shapes).

Run:  python -m pytest benches/bench_conv.py --benchmark-only

Shapes (N, C, H, K, O): the MNIST convnet's second conv (128, 32, 24, 5, 32) and a 3x3
one (128, 32, 10, 3, 64); forward alone, and forward + backward (input and weight
gradients) as a training step computes them; and conv_transpose2d of the 3x3 one's output
gradient (what its input gradient computes)."""
import numpy as np
import pytest

import zyx
import zyx.nn.functional as F
from conftest import need_torch

SHAPES = {"n128c32h24k5o32": (128, 32, 24, 5, 32), "n128c32h10k3o64": (128, 32, 10, 3, 64)}


def _data(shape):
    N, C, H, K, O = shape
    rng = np.random.default_rng(0)
    return (rng.standard_normal((N, C, H, H), dtype=np.float32),
            rng.standard_normal((O, C, K, K), dtype=np.float32) * 0.1)


@pytest.mark.parametrize("name", list(SHAPES))
def test_conv_forward_zyx(benchmark, name):
    benchmark.group = f"conv2d forward {name}"
    xn, wn = _data(SHAPES[name])
    x, w = zyx.tensor(xn).realize(), zyx.tensor(wn).realize()
    torch = need_torch()
    ref = torch.nn.functional.conv2d(torch.from_numpy(xn), torch.from_numpy(wn)).numpy()
    np.testing.assert_allclose(F.conv2d(x, w).numpy(), ref, rtol=1e-3, atol=1e-3)
    benchmark(lambda: F.conv2d(x, w).realize())


def _transposed_data():
    """(128, 64, 8, 8) gradient and the (64, 32, 3, 3) weight of the 3x3 shape."""
    rng = np.random.default_rng(1)
    return (rng.standard_normal((128, 64, 8, 8), dtype=np.float32),
            rng.standard_normal((64, 32, 3, 3), dtype=np.float32) * 0.1)


def test_conv_transpose_zyx(benchmark):
    benchmark.group = "conv_transpose2d n128c64h8k3o32"
    gn, wn = _transposed_data()
    g, w = zyx.tensor(gn).realize(), zyx.tensor(wn).realize()
    torch = need_torch()
    ref = torch.nn.functional.conv_transpose2d(torch.from_numpy(gn), torch.from_numpy(wn))
    np.testing.assert_allclose(F.conv_transpose2d(g, w).numpy(), ref.numpy(), rtol=1e-3,
                               atol=1e-3)
    benchmark(lambda: F.conv_transpose2d(g, w).realize())


def test_conv_transpose_torch(benchmark):
    benchmark.group = "conv_transpose2d n128c64h8k3o32"
    torch = need_torch()
    gn, wn = _transposed_data()
    g, w = torch.from_numpy(gn), torch.from_numpy(wn)
    benchmark(lambda: torch.nn.functional.conv_transpose2d(g, w))


@pytest.mark.parametrize("templates", [True, False])
def test_conv_graph_build_zyx(benchmark, templates, monkeypatch):
    """Host time of one conv2d call with bias and padding, nothing realized: its nodes
    replayed from a forward template (replay.ForwardTemplates) or built op by op."""
    from zyx._core import replay
    benchmark.group = "conv2d graph build (host)"
    if not templates:
        monkeypatch.setattr(F, "_CONV_TEMPLATES", replay.ForwardTemplates(0))
    xn, wn = _data(SHAPES["n128c32h10k3o64"])
    x, w = zyx.tensor(xn), zyx.tensor(wn, requires_grad=True)
    b = zyx.tensor(np.zeros(wn.shape[0], np.float32), requires_grad=True)
    F.conv2d(x, w, b, padding=1)
    benchmark(lambda: F.conv2d(x, w, b, padding=1))


@pytest.mark.parametrize("name", list(SHAPES))
def test_conv_forward_torch(benchmark, name):
    benchmark.group = f"conv2d forward {name}"
    torch = need_torch()
    xn, wn = _data(SHAPES[name])
    x, w = torch.from_numpy(xn), torch.from_numpy(wn)
    benchmark(lambda: torch.nn.functional.conv2d(x, w))


@pytest.mark.parametrize("name", list(SHAPES))
def test_conv_backward_zyx(benchmark, name):
    benchmark.group = f"conv2d forward+backward {name}"
    xn, wn = _data(SHAPES[name])
    x = zyx.tensor(xn, requires_grad=True)
    w = zyx.tensor(wn, requires_grad=True)

    def step():
        x.grad = w.grad = None
        y = F.conv2d(x, w)
        (y * y).sum().backward()
        zyx.realize(x.grad, w.grad) if hasattr(zyx, "realize") else (x.grad.realize(),
                                                                     w.grad.realize())
    step()
    torch = need_torch()
    tx = torch.from_numpy(xn).requires_grad_()
    tw = torch.from_numpy(wn).requires_grad_()
    ty = torch.nn.functional.conv2d(tx, tw)
    (ty * ty).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), tw.grad.numpy(), rtol=2e-3, atol=2e-2)
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=2e-3, atol=2e-3)
    benchmark(step)


@pytest.mark.parametrize("name", list(SHAPES))
def test_conv_backward_torch(benchmark, name):
    benchmark.group = f"conv2d forward+backward {name}"
    torch = need_torch()
    xn, wn = _data(SHAPES[name])
    x = torch.from_numpy(xn).requires_grad_()
    w = torch.from_numpy(wn).requires_grad_()

    def step():
        x.grad = w.grad = None
        y = torch.nn.functional.conv2d(x, w)
        (y * y).sum().backward()
    benchmark(step)


# -- issue 13's MNIST convnet: Conv 1-32-5, 32-32-5, pool, 32-64-3, pool, Linear 1024-10,
# batch 128, Adam; one training step (the recipe is 150 of them)
def _convnet(nn):
    return nn.Sequential(nn.Conv2d(1, 32, 5), nn.ReLU(), nn.Conv2d(32, 32, 5), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * 4 * 4, 10))


def _mnist_batch():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((128, 1, 28, 28), dtype=np.float32),
            rng.integers(0, 10, 128).astype(np.int64))


def _bench_steps(benchmark, cross_entropy, model, opt, x, y):
    """Time the training step (either library: they share the spelling), after 3 warm-up
    steps (the first compiles)."""
    def step():
        loss = cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()
    for _ in range(3):
        step()
    benchmark(step)


@pytest.mark.benchmark(group="mnist convnet step (batch 128, Adam)")
def test_convnet_step_zyx(benchmark):
    from zyx import nn
    zyx.manual_seed(0)
    model = _convnet(nn)
    opt = zyx.optim.Adam(model.parameters(), 1e-3)
    xn, yn = _mnist_batch()
    x, y = zyx.tensor(xn).realize(), zyx.tensor(yn).realize()
    _bench_steps(benchmark, F.cross_entropy, model, opt, x, y)


@pytest.mark.benchmark(group="mnist convnet step (batch 128, Adam)")
def test_convnet_step_torch(benchmark):
    torch = need_torch()
    torch.manual_seed(0)
    model = _convnet(torch.nn)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    xn, yn = _mnist_batch()
    x, y = torch.from_numpy(xn), torch.from_numpy(yn)
    _bench_steps(benchmark, torch.nn.functional.cross_entropy, model, opt, x, y)
