"""Autograd: every differentiable op against float64 central differences and, when PyTorch
is installed, against torch.autograd.grad on the same inputs; Tape and torch-style APIs,
higher-order gradients, no_grad/detach, graph freeing."""

import numpy as np
import pytest

import zyx

# every test runs on every device zyx finds (conftest `device`: the CPU, OpenCL on PoCL
# in CI, CUDA on a GPU machine)
pytestmark = pytest.mark.usefixtures("device")

try:
    import torch
except ImportError:   # the numeric check still runs
    torch = None

EPS = 1e-6


def _weights(shape):
    return np.random.RandomState(7).uniform(0.5, 1.5, shape)


def check(fn, inputs, tfn=None, numeric=True, rtol=1e-5, atol=1e-6):
    """Gradient of sum(fn(*inputs) * w) for random w: tape vs central differences vs torch.
    `fn` receives zyx tensors, `tfn` the same ops written for torch tensors."""
    inputs = [np.asarray(a, dtype=np.float64) for a in inputs]
    xs = [zyx.Tensor(a) for a in inputs]
    with zyx.Tape() as tape:
        out = fn(*xs)
    w = _weights(out.shape)
    grads = tape.gradient(out, xs, output_gradients=zyx.Tensor(w))
    got = [g.numpy() for g in grads]
    for g, a in zip(got, inputs):
        assert g.shape == a.shape and g.dtype == np.float64
    if numeric:
        def f(arrs):
            with zyx.no_grad():
                return float((fn(*[zyx.Tensor(a) for a in arrs]).numpy() * w).sum())
        for i, a in enumerate(inputs):
            num = np.zeros_like(a)
            for j in range(a.size):
                hi = [b.copy() for b in inputs]
                lo = [b.copy() for b in inputs]
                hi[i].reshape(-1)[j] += EPS
                lo[i].reshape(-1)[j] -= EPS
                num.reshape(-1)[j] = (f(hi) - f(lo)) / (2 * EPS)
            np.testing.assert_allclose(got[i], num, rtol=1e-4, atol=1e-5,
                                       err_msg=f"input {i} vs central differences")
    if tfn is not None and torch is not None:
        ts = [torch.tensor(a, requires_grad=True) for a in inputs]
        tout = tfn(*ts)
        assert tuple(tout.shape) == out.shape
        ref = torch.autograd.grad(tout, ts, grad_outputs=torch.tensor(w), allow_unused=True)
        for i, (g, r) in enumerate(zip(got, ref)):
            r = np.zeros_like(inputs[i]) if r is None else r.numpy()
            np.testing.assert_allclose(g, r, rtol=rtol, atol=atol, err_msg=f"input {i} vs torch")
    return got


def rnd(*shape, lo=-2.0, hi=2.0):
    return np.random.uniform(lo, hi, shape)


def pos(*shape):
    return np.random.uniform(0.5, 2.0, shape)


# ---------------------------------------------------------------------------------------
# elementwise

UNARY = [
    ("neg", lambda x: -x, lambda x: -x, rnd),
    ("exp", lambda x: x.exp(), lambda x: x.exp(), rnd),
    ("exp2", lambda x: x.exp2(), lambda x: x.exp2(), rnd),
    ("log", lambda x: x.log(), lambda x: x.log(), pos),
    ("log2", lambda x: x.log2(), lambda x: x.log2(), pos),
    ("log10", lambda x: x.log10(), lambda x: x.log10(), pos),
    ("log1p", lambda x: x.log1p(), lambda x: x.log1p(), pos),
    ("expm1", lambda x: x.expm1(), lambda x: x.expm1(), rnd),
    ("reciprocal", lambda x: x.reciprocal(), lambda x: x.reciprocal(), pos),
    ("sqrt", lambda x: x.sqrt(), lambda x: x.sqrt(), pos),
    ("rsqrt", lambda x: x.rsqrt(), lambda x: x.rsqrt(), pos),
    ("sin", lambda x: x.sin(), lambda x: x.sin(), rnd),
    ("cos", lambda x: x.cos(), lambda x: x.cos(), rnd),
    ("tan", lambda x: x.tan(), lambda x: x.tan(), lambda *s: rnd(*s, lo=-1, hi=1)),
    ("tanh", lambda x: x.tanh(), lambda x: x.tanh(), rnd),
    ("sinh", lambda x: x.sinh(), lambda x: x.sinh(), rnd),
    ("cosh", lambda x: x.cosh(), lambda x: x.cosh(), rnd),
    ("erf", lambda x: x.erf(), lambda x: x.erf(), rnd),
    ("abs", lambda x: x.abs(), lambda x: x.abs(), rnd),
    ("sigmoid", lambda x: x.sigmoid(), lambda x: x.sigmoid(), rnd),
    ("relu", lambda x: x.relu(), lambda x: x.relu(), rnd),
    ("square", lambda x: x.square(), lambda x: x.square(), rnd),
    ("pow3", lambda x: x ** 3, lambda x: x ** 3, rnd),
    ("pow_frac", lambda x: x ** 1.7, lambda x: x ** 1.7, pos),
    ("rpow", lambda x: 2.5 ** x, lambda x: 2.5 ** x, rnd),
    ("clamp", lambda x: x.clamp(-1.0, 1.0), lambda x: x.clamp(-1.0, 1.0), rnd),
    ("floor", lambda x: x.floor() + x, lambda x: x.floor() + x, rnd),
    ("sign", lambda x: x.sign() * x, lambda x: x.sign() * x, rnd),
    ("trunc_ceil_round", lambda x: x.trunc() * x + x.ceil() + x.round(),
     lambda x: x.trunc() * x + x.ceil() + x.round(), rnd),
    ("lerp", lambda x: x.lerp(x * x, 0.3), lambda x: x.lerp(x * x, 0.3), rnd),
]


@pytest.mark.parametrize("name,fn,tfn,gen", UNARY, ids=[u[0] for u in UNARY])
def test_unary(name, fn, tfn, gen):
    check(fn, [gen(2, 3)], tfn)


BINARY = [
    ("add", lambda a, b: a + b, None),
    ("sub", lambda a, b: a - b, None),
    ("mul", lambda a, b: a * b, None),
    ("div", lambda a, b: a / b, None),
    ("pow", lambda a, b: a ** b, None),
    ("maximum", lambda a, b: a.maximum(b), lambda a, b: torch.maximum(a, b)),
    ("minimum", lambda a, b: a.minimum(b), lambda a, b: torch.minimum(a, b)),
    ("fmod", lambda a, b: a.fmod(b), lambda a, b: torch.fmod(a, b)),
    ("remainder", lambda a, b: a % b, lambda a, b: torch.remainder(a, b)),
    ("floordiv_mix", lambda a, b: a * (a // b), lambda a, b: a * torch.div(a, b, rounding_mode="floor")),
    ("atan_like", lambda a, b: (a * b) / (1 + a * a + b * b), None),
]


@pytest.mark.parametrize("name,fn,tfn", BINARY, ids=[b[0] for b in BINARY])
@pytest.mark.parametrize("shapes", [((2, 3), (2, 3)), ((2, 3), (3,)), ((4, 1, 3), (2, 1))],
                         ids=["same", "bcast_row", "bcast_both"])
def test_binary_broadcasting(name, fn, tfn, shapes):
    a = pos(*shapes[0]) * np.random.choice([1, 1.5], shapes[0])
    b = pos(*shapes[1]) + 0.05
    check(fn, [a, b], tfn or fn)


def test_binary_with_scalars_both_sides():
    check(lambda x: 3.0 - x / 2.0 + 1.5 * x - 2.0 / x, [pos(5)],
          lambda x: 3.0 - x / 2.0 + 1.5 * x - 2.0 / x)


def test_maximum_ties_split_like_torch():
    a = np.array([1.0, 2.0, 3.0, -1.0])
    b = np.array([1.0, 0.0, 3.0, 2.0])
    got = check(lambda x, y: x.maximum(y), [a, b], lambda x, y: torch.maximum(x, y),
                numeric=False)
    w = _weights((4,))
    np.testing.assert_allclose(got[0], w * [0.5, 1, 0.5, 0])
    np.testing.assert_allclose(got[1], w * [0.5, 0, 0.5, 1])


def test_where():
    c = np.array([[True, False, True], [False, False, True]])
    check(lambda a, b: zyx.where(zyx.Tensor(c), a, b), [rnd(2, 3), rnd(1, 3)],
          lambda a, b: torch.where(torch.tensor(c), a, b))
    check(lambda a: zyx.where(a > 0, a * 2, 0.5), [rnd(2, 3)],
          lambda a: torch.where(a > 0, a * 2, 0.5))
    check(lambda a: a.masked_fill(zyx.Tensor(c), 0.0), [rnd(2, 3)],
          lambda a: a.masked_fill(torch.tensor(c), 0.0))


def test_cast():
    # float64 -> float32 -> float64: the gradient is cast back each way (float32 rounding
    # makes central differences useless here; torch is the reference)
    got = check(lambda x: (x.float() * 3).double() * x, [rnd(2, 3)],
                lambda x: (x.float() * 3).double() * x, numeric=False, rtol=1e-6, atol=1e-6)
    assert got[0].dtype == np.float64
    # through an integer: no gradient
    check(lambda x: x.int().double() * x, [rnd(2, 3) * 3],
          lambda x: x.int().double() * x)


def test_float32_gradients_match_torch_dtype():
    if torch is None:
        pytest.skip("torch not installed")
    a = rnd(3, 4).astype(np.float32)
    x = zyx.Tensor(a, requires_grad=True)
    (x.tanh() * x).sum().backward()
    assert x.grad.dtype == zyx.float32
    t = torch.tensor(a, requires_grad=True)
    (t.tanh() * t).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), t.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_gradients(dtype):
    if torch is None:
        pytest.skip("torch not installed")
    a = rnd(3, 4).astype(np.float32)
    x = zyx.Tensor(a, dtype=getattr(zyx, dtype), requires_grad=True)
    (x.softmax(axis=1) * x.exp()).sum().backward()
    assert x.grad.dtype == getattr(zyx, dtype)
    t = torch.tensor(a, dtype=getattr(torch, dtype), requires_grad=True)
    (t.softmax(dim=1) * t.exp()).sum().backward()
    ref = t.grad.float().numpy()
    np.testing.assert_allclose(x.grad.numpy(), ref, rtol=3e-2, atol=3e-2 * np.abs(ref).max())


# ---------------------------------------------------------------------------------------
# reductions

REDUCTIONS = [
    ("sum_all", lambda x: x.sum(), lambda x: x.sum()),
    ("sum_axis", lambda x: x.sum(axis=1), lambda x: x.sum(dim=1)),
    ("sum_axes_keep", lambda x: x.sum(axis=(0, 2), keepdim=True), lambda x: x.sum(dim=(0, 2), keepdim=True)),
    ("mean", lambda x: x.mean(axis=-1), lambda x: x.mean(dim=-1)),
    ("mean_all", lambda x: x.mean(), lambda x: x.mean()),
    ("var", lambda x: x.var(axis=1), lambda x: x.var(dim=1)),
    ("var_biased", lambda x: x.var(axis=(0, 1), correction=0), lambda x: x.var(dim=(0, 1), correction=0)),
    ("std", lambda x: x.std(axis=2), lambda x: x.std(dim=2)),
    ("prod", lambda x: x.prod(axis=1), lambda x: x.prod(dim=1)),
    ("amax", lambda x: x.amax(axis=1), lambda x: x.amax(dim=1)),
    ("amin_keep", lambda x: x.amin(axis=(1, 2), keepdim=True), lambda x: x.amin(dim=(1, 2), keepdim=True)),
    ("max_all", lambda x: x.max(), lambda x: x.max()),
    ("logsumexp", lambda x: x.logsumexp(axis=1), lambda x: x.logsumexp(dim=1)),
    ("softmax", lambda x: x.softmax(axis=-1), lambda x: x.softmax(dim=-1)),
    ("softmax_axis0", lambda x: x.softmax(axis=0), lambda x: x.softmax(dim=0)),
    ("log_softmax", lambda x: x.log_softmax(axis=1), lambda x: x.log_softmax(dim=1)),
    ("cumsum", lambda x: x.cumsum(axis=1), lambda x: x.cumsum(dim=1)),
    ("cumsum_last", lambda x: x.cumsum(axis=-1), lambda x: x.cumsum(dim=-1)),
]


@pytest.mark.parametrize("name,fn,tfn", REDUCTIONS, ids=[r[0] for r in REDUCTIONS])
def test_reduction(name, fn, tfn):
    check(fn, [rnd(2, 3, 4)], tfn)


def test_amax_ties_split_equally_like_torch():
    a = np.array([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 0.0]])
    got = check(lambda x: x.amax(axis=1), [a], lambda x: x.amax(dim=1), numeric=False)
    w = _weights((2,))
    np.testing.assert_allclose(got[0], [[0, w[0] / 2, w[0] / 2, 0], [w[1] / 3] * 3 + [0]])
    check(lambda x: x.amin(), [np.array([2.0, 1.0, 1.0])], lambda x: x.amin(), numeric=False)


def test_prod_with_zeros_like_torch():
    a = np.array([[0.0, 2.0, 3.0], [0.0, 0.0, 4.0], [1.5, 2.0, -1.0]])
    got = check(lambda x: x.prod(axis=1), [a], lambda x: x.prod(dim=1), numeric=False)
    w = _weights((3,))
    np.testing.assert_allclose(got[0][0], [6.0 * w[0], 0, 0])
    np.testing.assert_allclose(got[0][1], [0, 0, 0])


# ---------------------------------------------------------------------------------------
# movement

MOVEMENT = [
    ("reshape", lambda x: x.reshape(4, 6) * 1.0, lambda x: x.reshape(4, 6)),
    ("permute", lambda x: x.permute(2, 0, 1), lambda x: x.permute(2, 0, 1)),
    ("transpose", lambda x: x.transpose(0, 2), lambda x: x.transpose(0, 2)),
    ("T_flatten", lambda x: x.flatten(1).T, lambda x: x.flatten(1).T),
    ("expand", lambda x: x[:, :1].expand(2, 5, 4), lambda x: x[:, :1].expand(2, 5, 4)),
    ("unsqueeze_squeeze", lambda x: x.unsqueeze(1).squeeze(), lambda x: x.unsqueeze(1).squeeze()),
    ("flip", lambda x: x.flip(axis=(0, 2)), lambda x: x.flip(dims=(0, 2))),
    ("pad", lambda x: x.pad((1, 2, 0, 1)), lambda x: torch.nn.functional.pad(x, (1, 2, 0, 1))),
    ("pad_value", lambda x: x.pad((2, 0), value=3.0) * x.pad((0, 2)),
     lambda x: torch.nn.functional.pad(x, (2, 0), value=3.0) * torch.nn.functional.pad(x, (0, 2))),
    ("pad_negative", lambda x: x.pad((-1, 1)), lambda x: torch.nn.functional.pad(x, (-1, 1))),
    ("slice", lambda x: x[1:, ::2, 1:3], lambda x: x[1:, ::2, 1:3]),
    ("slice_step3", lambda x: x[:, :, ::3], lambda x: x[:, :, ::3]),
    ("slice_negative_step", lambda x: x[::-1, 2:0:-1], lambda x: x.flip(0)[:, [2, 1]]),
    ("int_index", lambda x: x[1, :, 2], lambda x: x[1, :, 2]),
    ("none_ellipsis", lambda x: x[None, ..., 1], lambda x: x[None, ..., 1]),
    ("int_tensor", lambda x: x[zyx.Tensor(np.array([1, 0, 1]))],
     lambda x: x[torch.tensor([1, 0, 1])]),
    ("int_tensor_2d", lambda x: x[:, zyx.Tensor(np.array([[0, 1], [2, 2]]))],
     lambda x: x[:, torch.tensor([[0, 1], [2, 2]])]),
    ("int_tensors_pair", lambda x: x[zyx.Tensor(np.array([0, 1, 1])), :, zyx.Tensor(np.array([3, 0, 3]))],
     lambda x: x[torch.tensor([0, 1, 1]), :, torch.tensor([3, 0, 3])]),
    ("int_list_ellipsis", lambda x: x[..., [2, 0, 2, 3]], lambda x: x[..., [2, 0, 2, 3]]),
    ("repeat", lambda x: x.repeat(2, 1, 2), lambda x: x.repeat(2, 1, 2)),
    ("roll", lambda x: x.roll(2, 2), lambda x: x.roll(2, 2)),
    ("tril", lambda x: x.tril(), lambda x: x.tril()),
    ("triu_diag", lambda x: x.triu(1), lambda x: x.triu(1)),
]


@pytest.mark.parametrize("name,fn,tfn", MOVEMENT, ids=[m[0] for m in MOVEMENT])
def test_movement(name, fn, tfn):
    shape = (3, 4) if name == "pad_negative" else (2, 3, 4)
    check(fn, [rnd(*shape)], tfn)


def test_cat_stack_split():
    check(lambda a, b: zyx.cat([a, b, a], axis=1), [rnd(2, 3), rnd(2, 1)],
          lambda a, b: torch.cat([a, b, a], dim=1))
    check(lambda a, b: zyx.stack([a, b], axis=1), [rnd(2, 3), rnd(2, 3)],
          lambda a, b: torch.stack([a, b], dim=1))
    check(lambda a: a.split(2, axis=1)[1] * a.chunk(3, axis=1)[0], [rnd(2, 6)],
          lambda a: a.split(2, dim=1)[1] * a.chunk(3, dim=1)[0])


def test_gather():
    idx = np.array([[0, 2, 2], [1, 0, 1]])
    check(lambda a: a.gather(1, zyx.Tensor(idx)), [rnd(2, 4)],
          lambda a: a.gather(1, torch.tensor(idx)))
    idx0 = np.array([[1, 0, 1, 1]])
    check(lambda a: zyx.gather(a, 0, zyx.Tensor(idx0)), [rnd(3, 4)],
          lambda a: torch.gather(a, 0, torch.tensor(idx0)))


@pytest.mark.parametrize("shapes", [((3, 4), (4, 2)), ((2, 3, 4), (4, 5)), ((4,), (4, 3)),
                                    ((2, 1, 3, 4), (3, 4, 2)), ((3, 4), (4,))],
                         ids=["2d", "batched", "vec_mat", "bcast_batch", "mat_vec"])
def test_matmul(shapes):
    check(lambda a, b: a @ b, [rnd(*shapes[0]), rnd(*shapes[1])], lambda a, b: a @ b)


def test_composite_mlp():
    def net(x, w1, w2):
        return ((x @ w1).relu() @ w2).log_softmax(axis=1)
    check(net, [rnd(4, 3), rnd(3, 5), rnd(5, 2)],
          lambda x, w1, w2: ((x @ w1).relu() @ w2).log_softmax(dim=1))


# ---------------------------------------------------------------------------------------
# API behaviour

def test_backward_accumulates_and_realizes_once():
    a = np.array([1.0, 2.0, 3.0])
    x = zyx.Tensor(a, requires_grad=True)
    loss = (x * x * x).sum()
    before = zyx.stats()["realizations"]
    loss.backward()
    # deferred: loss and gradients are computed by the next realization, in one pass
    assert zyx.stats()["realizations"] == before
    np.testing.assert_allclose(x.grad.numpy(), 3 * a ** 2)
    assert zyx.stats()["realizations"] - before == 1
    assert zyx._RT.graph.get(x.grad._id).op == 0 and zyx._RT.graph.get(loss._id).op == 0
    np.testing.assert_allclose(loss.item(), 36.0)
    assert zyx.stats()["realizations"] - before == 1
    (x * 2).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 3 * a ** 2 + 2)
    assert x.is_leaf and not loss.is_leaf and x.grad.is_leaf and not x.grad.requires_grad


def test_backward_defers_to_the_next_realization():
    """backward() + opt.step() is one realization; gradients accumulated by two pending
    backward() calls add up; tensors the user dropped are neither kept nor computed."""
    from zyx import optim
    a = np.array([1.0, 2.0, 3.0], np.float32)
    w = zyx.Tensor(a, requires_grad=True)
    opt = optim.SGD([w], lr=0.1)
    loss = (w * w).sum()
    before = zyx.stats()["realizations"]
    loss.backward()
    opt.step()
    assert zyx.stats()["realizations"] - before == 1        # loss, grad and update together
    np.testing.assert_allclose(w.numpy(), a - 0.1 * 2 * a, rtol=1e-6)
    np.testing.assert_allclose(loss.item(), (a * a).sum(), rtol=1e-6)
    assert zyx.stats()["realizations"] - before == 1
    # two backward() calls before anything is realized accumulate
    x = zyx.Tensor(a, requires_grad=True)
    (x * x).sum().backward()          # losses dropped at once: never computed
    (x * 3).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * a + 3, rtol=1e-6)
    # cleared gradients of pending passes free their graphs, and the list stays bounded
    nodes = len(zyx._RT.graph)
    for _ in range(600):
        x.grad = None
        (x * x).sum().backward()
    x.grad = None
    assert len(zyx._RT.pending) <= 300
    zyx.Tensor(a).sum().numpy()       # a realization empties the list
    assert zyx._RT.pending == [] and len(zyx._RT.graph) <= nodes + 2


def test_backward_errors():
    x = zyx.Tensor(np.ones((2, 2)), requires_grad=True)
    y = x * 2
    with pytest.raises(zyx.ShapeError, match=r"\(2, 2\)"):
        y.backward()
    y.backward(zyx.Tensor(np.full((2, 2), 0.5)))
    np.testing.assert_allclose(x.grad.numpy(), np.ones((2, 2)))
    with pytest.raises(zyx.ZyxError, match="does not require grad"):
        zyx.Tensor(np.ones(2)).sum().backward()


def test_retain_graph():
    x = zyx.Tensor(np.array([2.0]), requires_grad=True)
    h = x.exp()
    l1, l2 = (h * 3).sum(), (h * h).sum()
    l1.backward()
    with pytest.raises(zyx.ZyxError, match="retain_graph"):
        l2.backward()
    x.grad = None
    h = x.exp()
    l1, l2 = (h * 3).sum(), (h * h).sum()
    l1.backward(retain_graph=True)
    l2.backward()
    np.testing.assert_allclose(x.grad.numpy(), 3 * np.exp(2.0) + 2 * np.exp(4.0))


def test_gradient_of_intermediate_and_unconnected():
    a = zyx.Tensor(np.array([0.5, 2.0]))
    b = zyx.Tensor(np.array([1.0, 1.0]))
    with zyx.Tape() as tape:
        h = a.exp()
        z = (h * a).sum()
    gh, ga, gb = tape.gradient(z, [h, a, b])
    np.testing.assert_allclose(gh.numpy(), [0.5, 2.0])
    np.testing.assert_allclose(ga.numpy(), np.exp([0.5, 2.0]) * (1 + np.array([0.5, 2.0])))
    np.testing.assert_allclose(gb.numpy(), [0.0, 0.0])     # unconnected: zeros
    with pytest.raises(zyx.ZyxError, match="persistent"):
        tape.gradient(z, a)


def test_tape_dict_sources_persistent_and_none():
    w = zyx.Tensor(np.array([1.0, -2.0]))
    u = zyx.Tensor(np.array([3.0]))
    with zyx.Tape(persistent=True) as tape:
        sq = w * w
        y = sq.sum()
    g = tape.gradient(y, {"w": w})
    np.testing.assert_allclose(g["w"].numpy(), [2.0, -4.0])
    np.testing.assert_allclose(tape.gradient(y, w).numpy(), [2.0, -4.0])
    assert tape.gradient(y, [u], unconnected_gradients="none") == [None]
    # a non-scalar target gets an implicit gradient of ones (TensorFlow semantics)
    np.testing.assert_allclose(tape.gradient(sq, w).numpy(), [2.0, -4.0])


def test_gradient_is_lazy_and_fuses_with_forward():
    x = zyx.Tensor(np.linspace(-1, 1, 8))
    with zyx.Tape() as tape:
        y = (x.tanh() * x).sum()
    g = tape.gradient(y, x)
    assert zyx._RT.graph.get(g._id).op != 0                 # not computed yet
    before = zyx.stats()["realizations"]
    zyx._RT.realize([y._id, g._id])
    assert zyx.stats()["realizations"] - before == 1
    xv = np.linspace(-1, 1, 8)
    np.testing.assert_allclose(g.numpy(), np.tanh(xv) + xv * (1 - np.tanh(xv) ** 2))


def test_second_derivative_nested_tapes():
    a = np.array([-1.5, 0.5, 2.0])
    x = zyx.Tensor(a)
    with zyx.Tape() as outer:
        with zyx.Tape() as inner:
            y = x ** 3
        dy = inner.gradient(y, x)
    d2y = outer.gradient(dy, x)
    np.testing.assert_allclose(dy.numpy(), 3 * a ** 2)
    np.testing.assert_allclose(d2y.numpy(), 6 * a)


def test_third_derivative_create_graph():
    a = np.array([0.3, -0.7])
    x = zyx.Tensor(a)
    with zyx.Tape(persistent=True) as tape:
        y = x.sin() * x
    g1 = tape.gradient(y, x, create_graph=True)
    g2 = tape.gradient(g1, x, create_graph=True)
    g3 = tape.gradient(g2, x)
    np.testing.assert_allclose(g1.numpy(), np.cos(a) * a + np.sin(a))
    np.testing.assert_allclose(g2.numpy(), -np.sin(a) * a + 2 * np.cos(a))
    np.testing.assert_allclose(g3.numpy(), -np.cos(a) * a - 3 * np.sin(a))


def test_double_backward_matches_torch():
    """Hessian-vector products through softmax, tanh, matmul and amax."""
    if torch is None:
        pytest.skip("torch not installed")
    xa, wa, va = rnd(3, 4), rnd(4, 5), rnd(3, 4)

    def zf(x, w):
        return ((x @ w).tanh().softmax(axis=1) * (x @ w).amax(axis=1, keepdim=True)).sum()

    def tf(x, w):
        return ((x @ w).tanh().softmax(dim=1) * (x @ w).amax(dim=1, keepdim=True)).sum()

    x, w = zyx.Tensor(xa, requires_grad=True), zyx.Tensor(wa, requires_grad=True)
    gx = zyx.autograd.grad(zf(x, w), x, create_graph=True)
    (gx * zyx.Tensor(va)).sum().backward()
    tx, tw = torch.tensor(xa, requires_grad=True), torch.tensor(wa, requires_grad=True)
    (tgx,) = torch.autograd.grad(tf(tx, tw), tx, create_graph=True)
    (tgx * torch.tensor(va)).sum().backward()
    np.testing.assert_allclose(gx.numpy(), tgx.detach().numpy(), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(w.grad.numpy(), tw.grad.numpy(), rtol=1e-6, atol=1e-8)


def test_backward_create_graph_torch_style():
    x = zyx.Tensor(np.array([1.0, 2.0]), requires_grad=True)
    (x ** 3).sum().backward(create_graph=True)
    g = x.grad
    x.grad = None
    g.sum().backward()
    np.testing.assert_allclose(g.numpy(), [3.0, 12.0])
    np.testing.assert_allclose(x.grad.numpy(), [6.0, 12.0])


def test_no_grad_and_detach():
    x = zyx.Tensor(np.array([1.0, 2.0]), requires_grad=True)
    with zyx.no_grad():
        y = x * 2
        assert not zyx.is_grad_enabled()
        with zyx.enable_grad():
            z = x * 3
    assert zyx.is_grad_enabled()
    assert y._ctx is None and not y.requires_grad and y.is_leaf
    assert z.requires_grad and not z.is_leaf
    with zyx.Tape() as tape:
        a = x.detach()
        b = (a * x).sum()
    np.testing.assert_allclose(tape.gradient(b, x).numpy(), [1.0, 2.0])  # a is a constant

    @zyx.no_grad()
    def f(t):
        return t * t

    @zyx.no_grad
    def f2(t):
        return t * t
    assert not f(x).requires_grad and not f2(x).requires_grad and f2.__name__ == "f2"
    with zyx.set_grad_enabled(False):
        assert not (x + 1).requires_grad
    assert (x + 1).requires_grad


def test_requires_grad_flags_and_retain_grad():
    x = zyx.Tensor(np.array([1.0, 2.0]))
    assert not x.requires_grad and (x * 2)._ctx is None      # nothing recorded
    assert x.requires_grad_() is x and x.requires_grad
    h = x * 3
    h.retain_grad()
    (h * h).sum().backward()
    np.testing.assert_allclose(h.grad.numpy(), [6.0, 12.0])
    np.testing.assert_allclose(x.grad.numpy(), [18.0, 36.0])
    i = zyx.Tensor(np.array([1, 2]), requires_grad=True)
    assert (i * 2)._ctx is None                               # ints carry no gradient


def test_graph_memory_is_freed_in_a_loop():
    """A training-style loop keeps no history: graph nodes and pool bytes stay flat."""
    w = zyx.Tensor(np.random.randn(4, 3), requires_grad=True)
    x = zyx.Tensor(np.random.randn(5, 4))
    counts = []
    for step in range(12):
        loss = ((x @ w).tanh() ** 2).mean()
        loss.backward()
        with zyx.no_grad():
            new = w - w.grad * 0.1
        new.realize()
        w = new.detach().requires_grad_()
        del new, loss
        if step >= 2:
            counts.append((len(zyx._RT.graph), zyx._RT.pool_bytes()))
    assert len(set(counts)) == 1, counts

    v = zyx.Tensor(np.random.randn(3))
    counts = []
    for step in range(8):
        with zyx.Tape() as tape:
            loss = (v.exp() * v).sum()
        g = tape.gradient(loss, v)
        v = zyx.Tensor((v - g * 0.01).numpy())
        del g, loss, tape
        if step >= 2:
            counts.append(len(zyx._RT.graph))
    assert len(set(counts)) == 1, counts


@pytest.mark.parametrize("fn", ["softmax", "log_softmax", "logsumexp", "cross_entropy"])
def test_max_shift_of_softmax_family_has_no_gradient(fn):
    """softmax, log_softmax, logsumexp and cross_entropy subtract the row maximum for
    stability; their value does not depend on it, so it is detached: the backward has no
    max rule (no x == max compare spreading a zero gradient over tied maxima), and the
    gradient is the analytic one, ties included."""
    from zyx._core import kernel as K
    from zyx._core.kernelizer import kernelize
    import zyx.nn.functional as F
    xn = np.array([[1.0, 3.0, 3.0, -2.0], [0.5, 0.5, 0.5, 0.5], [2.0, -1.0, 0.0, 2.0]],
                  np.float32)
    yn = np.array([1, 2, 0])
    x = zyx.tensor(xn, requires_grad=True)
    x64 = xn.astype(np.float64)
    s = np.exp(x64 - x64.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    w = np.arange(12, dtype=np.float64).reshape(3, 4) / 7
    if fn == "softmax":
        out = (x.softmax(-1) * zyx.tensor(w.astype(np.float32))).sum()
        want = s * (w - (w * s).sum(-1, keepdims=True))
    elif fn == "log_softmax":
        out = (x.log_softmax(-1) * zyx.tensor(w.astype(np.float32))).sum()
        want = w - s * w.sum(-1, keepdims=True)
    elif fn == "logsumexp":
        out = x.logsumexp(-1).sum()
        want = s
    else:
        out = F.cross_entropy(x, zyx.tensor(yn))
        want = (s - np.eye(4)[yn]) / 3
    out.backward()
    g = zyx._RT.graph
    order, _ = g.collect([x.grad._id])
    steps, _ = kernelize(g, order, [x.grad._id], 64)
    # x == max compares two computed values (logsumexp's isinf(max) compares with a
    # constant; cross_entropy's one-hot compares integer class indices)
    eqs = [op for st in steps if st.kernel is not None for op in st.kernel.ops
           if op[0] == K.BINARY and op[2] == K.B_EQ and st.kernel.ops[op[3]][1].is_float
           and st.kernel.ops[op[3]][0] != K.CONST and st.kernel.ops[op[4]][0] != K.CONST]
    assert not eqs
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5, atol=1e-6)
