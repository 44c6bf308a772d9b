"""In-place ops, __setitem__, views written through and autograd across in-place writes
(zyx/inplace.py), against torch: values, dtypes, gradients and errors."""
from __future__ import annotations

import numpy as np
import pytest

import zyx
from zyx.runtime import RT

try:
    import torch
except ImportError:     # pragma: no cover
    torch = None

pytestmark = [pytest.mark.usefixtures("device"),
              pytest.mark.skipif(torch is None, reason="torch is not installed")]

A = np.arange(60, dtype=np.float32).reshape(3, 4, 5) * 0.25 - 6


def both(arr, requires_grad=False):
    """The same values as a zyx and a torch tensor."""
    arr = np.array(arr)
    return (zyx.Tensor(arr.copy(), requires_grad=requires_grad),
            torch.tensor(arr.copy(), requires_grad=requires_grad))


def check(z, t, rtol=1e-5, atol=1e-6):
    t = t.detach()
    assert z.shape == tuple(t.shape)
    assert z.dtype.name == str(t.dtype).replace("torch.", ""), (z.dtype, t.dtype)
    np.testing.assert_allclose(z.numpy().astype(np.float64), t.numpy().astype(np.float64),
                               rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------
# setitem: every index kind, scalar and broadcast tensor values

SETITEM = [
    (1, 7.0),
    (-1, "row"),
    ((0, 2), 3.5),
    ((1, -1, 4), -2.0),
    (slice(None, None, 2), 1.0),
    ((slice(None), slice(3, 0, -2)), "col"),
    ((slice(None, None, -1), 1, slice(1, None, 3)), 9.0),
    ((Ellipsis, 2), "sub"),
    ((1, Ellipsis), 0.5),
    ((None, 0), 4.0),
    ((slice(-2, None), None, slice(None), 0), 8.0),
    ((slice(5, 9),), 1.0),                         # empty region
    ("mask", 0.0),
    ("mask_rows", "sub5"),
    ([0, 2], -1.0),
    ((slice(None), [3, 0, 3]), "idx"),
    (([0, 2], [1, 3]), 11.0),
    (([[0], [2]], slice(None), [1, 4]), 2.0),
    ((1, [0, 3], slice(1, 4)), "idx2"),
    ((slice(1, 3), [2, -1]), 6.0),
]


def _value(kind):
    if not isinstance(kind, str):
        return kind, kind
    v = {"row": np.linspace(-1, 1, 5, dtype=np.float32),
         "col": np.float32([[10.0], [20.0]]),
         "sub": np.arange(4, dtype=np.float32) - 1.5,
         "sub5": np.arange(5, dtype=np.float32),
         "idx": np.arange(45, dtype=np.float32).reshape(3, 3, 5) % 7,
         "idx2": np.float32([1.0, 2.0, 3.0])}[kind]
    return zyx.Tensor(v), v


@pytest.mark.parametrize("idx,val", SETITEM, ids=[repr(i) for i, _ in SETITEM])
def test_setitem_matches_numpy(idx, val):
    """numpy is the reference here: torch refuses negative slice steps; for every other
    index torch's assignment agrees with numpy's (checked in the next test)."""
    z, ref = zyx.Tensor(A), A.copy()
    if idx == "mask":
        zi, ni = zyx.Tensor(A > 2), A > 2
    elif idx == "mask_rows":
        m = np.array([[True, False, True, False], [False] * 4, [True] * 4])
        zi, ni = zyx.Tensor(m), m
    else:
        zi, ni = idx, (tuple(np.array(i) if isinstance(i, list) else i for i in idx)
                       if isinstance(idx, tuple) else idx)
    zv, nv = _value(val)
    before = id(z)
    z[zi] = zv
    ref[ni] = nv
    assert id(z) == before
    np.testing.assert_array_equal(z.numpy(), ref)


def test_setitem_matches_torch():
    z, t = both(A)
    m = A[:, :, 0] > 0
    cases = ((1, 2.0), ((slice(None), slice(1, 4, 2)), -1.0), ("mask", 5.0), ([0, 2], 7.0),
             ((Ellipsis, [4, 0]), 3.0), ((None, 2, 3), 1.5))
    for i, v in cases:
        z[zyx.Tensor(m) if isinstance(i, str) else i] = v
        t[torch.tensor(m) if isinstance(i, str) else i] = v
    check(z, t)


def test_setitem_mask_with_one_row_per_true_element():
    z, t = both(np.arange(6, dtype=np.float32))
    m = np.array([True, False, True, True, False, False])
    z[zyx.Tensor(m)] = zyx.Tensor(np.float32([10, 20, 30]))
    t[torch.tensor(m)] = torch.tensor([10.0, 20.0, 30.0])
    check(z, t)


def test_setitem_duplicate_indices_last_wins_and_index_put_accumulates():
    z, t = both(np.zeros(5, np.float32))
    z[[1, 3, 1]] = zyx.Tensor(np.float32([1, 2, 3]))
    np.testing.assert_array_equal(z.numpy(), [0, 3, 0, 2, 0])
    z, t = both(np.ones(5, np.float32))
    idx = np.array([1, 3, 1])
    z.index_put_((zyx.Tensor(idx),), zyx.Tensor(np.float32([1, 2, 3])), accumulate=True)
    t.index_put_((torch.tensor(idx),), torch.tensor([1.0, 2, 3]), accumulate=True)
    check(z, t)


def test_setitem_overlapping_reads_before_writing():
    z, t = both(np.arange(6, dtype=np.float32))
    z[1:] = z[:-1]
    t[1:] = t[:-1].clone()       # torch warns on the overlap; the intended result
    check(z, t)
    z, t = both(np.arange(6, dtype=np.float32))
    z[::2] = z[1::2] * 10
    t[::2] = t[1::2] * 10
    check(z, t)


def test_setitem_errors_like_torch():
    z, t = both(A)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        z[0] = zyx.Tensor(np.zeros(3, np.float32))
    with pytest.raises(IndexError):
        z[3] = 1.0
    with pytest.raises(IndexError, match="mask"):
        z[zyx.Tensor(np.array([True, False]))] = 1.0
    with pytest.raises(IndexError):
        z[zyx.Tensor(np.float32([0.0]))] = 1.0
    i = zyx.Tensor(np.arange(4, dtype=np.int8))
    with pytest.raises(zyx.ValueOverflowError):
        i[0] = 1000


def test_setitem_index_out_of_range_is_checked():
    z = zyx.Tensor(np.zeros(4, np.float32))
    z[zyx.Tensor(np.array([1, 7]))] = 1.0
    with pytest.raises(zyx.IndexOutOfRangeError):
        z.numpy()


# ---------------------------------------------------------------------------------------
# in-place methods and augmented assignment

X = np.array([[0.5, -1.5, 2.0], [3.0, -0.25, 1.0]], np.float32)
Y = np.array([1.5, 2.0, -0.5], np.float32)

METHODS = [
    ("add_", lambda m, y: (y,)), ("add_", lambda m, y: (2.0,)), ("sub_", lambda m, y: (y,)),
    ("mul_", lambda m, y: (y,)), ("mul_", lambda m, y: (3,)), ("div_", lambda m, y: (y,)),
    ("div_", lambda m, y: (4.0,)), ("pow_", lambda m, y: (2,)),
    ("clamp_", lambda m, y: (-1.0, 1.0)), ("clamp_min_", lambda m, y: (0.0,)),
    ("clamp_max_", lambda m, y: (0.75,)), ("zero_", lambda m, y: ()),
    ("fill_", lambda m, y: (2.5,)), ("copy_", lambda m, y: (y,)),
    ("masked_fill_", lambda m, y: (m.tensor(X > 1), -9.0)),
    ("neg_", lambda m, y: ()), ("abs_", lambda m, y: ()), ("exp_", lambda m, y: ()),
    ("sigmoid_", lambda m, y: ()), ("tanh_", lambda m, y: ()), ("relu_", lambda m, y: ()),
    ("lerp_", lambda m, y: (y, 0.25)), ("addcmul_", lambda m, y: (y, y, {"value": 0.5})),
    ("addcdiv_", lambda m, y: (y, y + 3, {"value": 2.0})), ("fill_diagonal_", lambda m, y: (7.0,)),
]


@pytest.mark.parametrize("name,args", METHODS, ids=[f"{n}{i}" for i, (n, _) in enumerate(METHODS)])
def test_method_matches_torch(name, args):
    z, t = both(X)
    zy, ty = both(Y)
    zm = type("M", (), {"tensor": staticmethod(lambda a: zyx.Tensor(a))})
    za, ta = args(zm, zy), args(torch, ty)
    zk, tk = (za[-1], ta[-1]) if za and isinstance(za[-1], dict) else ({}, {})
    out = getattr(z, name)(*za[:len(za) - bool(zk)], **zk)
    getattr(t, name)(*ta[:len(ta) - bool(tk)], **tk)
    assert out is z
    check(z, t)


@pytest.mark.parametrize("name", ["log_", "sqrt_"])
def test_method_of_positive_values(name):
    z, t = both(np.abs(X) + 0.1)
    getattr(z, name)()
    getattr(t, name)()
    check(z, t)


AUG = ["+=", "-=", "*=", "/=", "**=", "//=", "%="]


@pytest.mark.parametrize("op", AUG)
def test_augmented_assignment_float(op):
    z, t = both(X)
    zy, ty = both(np.abs(Y) + 0.5)
    zid = id(z)
    env = {"z": z, "t": t, "zy": zy, "ty": ty}
    exec(f"z {op} zy\nt {op} ty", env)
    assert id(env["z"]) == zid
    check(env["z"], env["t"], rtol=1e-4)


@pytest.mark.parametrize("op", ["+=", "*=", "//=", "%=", "&=", "|=", "^=", "-="])
def test_augmented_assignment_int(op):
    a = np.array([5, -3, 12, 7], np.int64)
    z, t = both(a)
    zid = id(z)
    env = {"z": z, "t": t}
    exec(f"z {op} 3\nt {op} 3", env)
    assert id(env["z"]) == zid
    check(env["z"], env["t"])


def test_augmented_assignment_bool():
    z, t = both(np.array([True, False, True]))
    m = np.array([False, False, True])
    z |= zyx.Tensor(m)
    t |= torch.tensor(m)
    check(z, t)
    z ^= zyx.Tensor(m)
    t ^= torch.tensor(m)
    check(z, t)


def test_dtype_rules():
    z, t = both(np.array([1, 2, 3], np.int64))
    with pytest.raises(RuntimeError, match="result type Float can't be cast to the desired "
                                           "output type Long"):
        z.mul_(2.5)
    with pytest.raises(RuntimeError, match="can't be cast"):
        z /= 2
    with pytest.raises(RuntimeError, match="can't be cast"):
        z.sqrt_()
    z[0] = 7.9          # assigned values are cast, as in torch
    t[0] = 7.9
    check(z, t)
    h, th = both(np.float32([1, 2]).astype(np.float16))
    h += zyx.Tensor(np.float32([0.5, 0.25]))
    th += torch.tensor([0.5, 0.25])
    check(h, th, rtol=1e-3)
    b = zyx.Tensor(np.array([True, False]))
    with pytest.raises(RuntimeError, match="Long can't be cast to the desired output type Bool"):
        b.add_(zyx.Tensor(np.array([1, 1], np.int64)))
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        zyx.Tensor(Y).add_(zyx.Tensor(X))


def test_random_fills():
    zyx.manual_seed(3)
    z = zyx.Tensor(np.zeros((200, 50), np.float32))
    z.uniform_(-2.0, 3.0)
    a = z.numpy()
    assert a.min() >= -2.0 and a.max() < 3.0 and abs(a.mean() - 0.5) < 0.05
    z.normal_(1.0, 2.0)
    a = z.numpy()
    assert abs(a.mean() - 1.0) < 0.05 and abs(a.std() - 2.0) < 0.05
    with pytest.raises(RuntimeError):
        zyx.Tensor(np.zeros(3, np.int32)).uniform_()


def test_fill_diagonal_wrap_and_cube():
    z, t = both(np.zeros((7, 3), np.float32))
    z.fill_diagonal_(1.0, wrap=True)
    t.fill_diagonal_(1.0, wrap=True)
    check(z, t)
    z, t = both(np.zeros((3, 3, 3), np.float32))
    z.fill_diagonal_(2.0)
    t.fill_diagonal_(2.0)
    check(z, t)


# ---------------------------------------------------------------------------------------
# views

def test_view_written_through_is_visible_in_base():
    z, t = both(A)
    zv, tv = z[1], t[1]
    zv += 1
    tv += 1
    check(z, t)
    z[0][1] = 5.0
    t[0][1] = 5.0
    check(z, t)
    zr, tr = z.reshape(12, 5), t.reshape(12, 5)
    zr[3:5] = -1.0
    tr[3:5] = -1.0
    check(z, t)
    zp, tp = z.permute(2, 0, 1), t.permute(2, 0, 1)
    zp[0].mul_(2)
    tp[0].mul_(2)
    check(z, t)
    zs, ts = z[:, None, 1:3].squeeze(1).transpose(0, 1), t[:, None, 1:3].squeeze(1).transpose(0, 1)
    zs.zero_()
    ts.zero_()
    check(z, t)
    zu, tu = z[2].unsqueeze(0).T, t[2].unsqueeze(0).permute(2, 1, 0)
    zu.add_(100)
    tu.add_(100)
    check(z, t)


def test_base_written_is_visible_in_views():
    z, t = both(A)
    zv, tv = z[1, ::2], t[1, ::2]
    zw, tw = zv.T, tv.T
    z.mul_(-1)
    t.mul_(-1)
    z[1] = 3.0
    t[1] = 3.0
    check(zv, tv)
    check(zw, tw)
    zv[0, 0] = 42.0            # the view of a view, written, reaches the base
    tv[0, 0] = 42.0
    check(z, t)
    check(zw, tw)


def test_advanced_index_is_a_copy():
    z, t = both(A)
    zc, tc = z[[0, 2]], t[[0, 2]]
    zc += 1
    tc += 1
    check(z, t)
    check(zc, tc)


# ---------------------------------------------------------------------------------------
# autograd

def test_gradients_flow_through_inplace_ops():
    zx, tx = both(X, requires_grad=True)
    res = []
    for x in (zx, tx):
        h = x * 2
        h.add_(1)
        h /= 2
        h[0, 1:] = x[1, :2] * 3
        h.exp_()               # saves its output: the last write (torch raises after it)
        (h.sum() + (h * h).sum()).backward()
        res.append(x.grad)
    check(res[0], res[1], rtol=1e-5)


def test_gradient_of_value_assigned_into_constant():
    zx, tx = both(Y, requires_grad=True)
    zb, tb = both(np.zeros((2, 3), np.float32))
    zb[1] = zx.exp()
    tb[1] = tx.exp()
    assert zb.requires_grad and not zb.is_leaf
    (zb * zb).sum().backward()
    (tb * tb).sum().backward()
    check(zx.grad, tx.grad)


def test_ops_recorded_before_a_write_use_the_old_value():
    """torch raises here (sin saved `a`); zyx keeps the old version, so the gradient is the
    gradient of what was computed: torch's gradient of the out-of-place code."""
    zx, tx = both(Y, requires_grad=True)
    a = zx * 2
    b = a.sin()
    c = a + 1
    a.mul_(3)
    (b.sum() + (c * c).sum() + a.sum()).backward()
    ta = tx * 2
    (ta.sin().sum() + ((ta + 1) ** 2).sum() + (ta * 3).sum()).backward()
    check(zx.grad, tx.grad)
    # and torch does raise for the in-place version
    tx2 = torch.tensor(Y, requires_grad=True)
    a2 = tx2 * 2
    b2 = a2.sin()
    a2.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        b2.sum().backward()


def test_exp_output_written_keeps_exp_gradient():
    zx, tx = both(Y, requires_grad=True)
    y = zx.exp()
    y.add_(1)
    y.sum().backward()
    np.testing.assert_allclose(zx.grad.numpy(), np.exp(Y), rtol=1e-6)


def test_leaf_that_requires_grad_refuses_inplace():
    zx, tx = both(Y, requires_grad=True)
    for x in (zx, tx):
        with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being "
                                               "used in an in-place operation"):
            x.add_(1)
        with pytest.raises(RuntimeError, match="leaf Variable"):
            x[0] = 1.0
        with pytest.raises(RuntimeError, match="view of a leaf Variable"):
            x[1:].mul_(2)


def test_leaf_written_under_no_grad_after_use_raises_at_backward():
    zw, tw = both(Y, requires_grad=True)
    x = np.float32([1.0, -2.0, 0.5])
    for w, lib, xx in ((zw, zyx, zyx.Tensor(x, requires_grad=True)),
                       (tw, torch, torch.tensor(x, requires_grad=True))):
        y = (w * xx).sum()
        with lib.no_grad():
            w -= 0.5
        with pytest.raises(RuntimeError, match="one of the variables needed for gradient "
                                               "computation has been modified by an "
                                               "inplace operation"):
            y.backward()


def test_no_grad_parameter_update_and_grad_zero():
    zw, tw = both(Y, requires_grad=True)
    for w, lib in ((zw, zyx), (tw, torch)):
        for _ in range(2):
            (w * w * w).sum().backward()
            with lib.no_grad():
                w -= 0.1 * w.grad
                w.grad.zero_()
    assert zw.is_leaf and zw.requires_grad
    check(zw, tw)
    check(zw.grad, tw.grad)


def _mlp(lib, w):
    if lib is zyx:
        from zyx import nn
    else:
        nn = torch.nn
    m = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    conv = zyx.Tensor if lib is zyx else (lambda a: torch.from_numpy(a.copy()))
    m.load_state_dict({k: conv(v) for k, v in w.items()})
    return m


def test_handwritten_sgd_matches_torch_over_five_steps():
    rng = np.random.default_rng(5)
    w = {"0.weight": rng.standard_normal((8, 6)).astype(np.float32) * 0.4,
         "0.bias": rng.standard_normal(8).astype(np.float32) * 0.1,
         "2.weight": rng.standard_normal((3, 8)).astype(np.float32) * 0.4,
         "2.bias": np.zeros(3, np.float32)}
    data = [(rng.standard_normal((4, 6)).astype(np.float32), rng.integers(0, 3, 4))
            for _ in range(5)]
    results = {}
    for lib in (zyx, torch):
        m = _mlp(lib, w)
        F = zyx.nn.functional if lib is zyx else torch.nn.functional
        mk = zyx.Tensor if lib is zyx else torch.tensor
        losses = []
        for x, y in data:
            loss = F.cross_entropy(m(mk(x)), mk(y))
            loss.backward()
            with lib.no_grad():
                for p in m.parameters():
                    p -= 0.2 * p.grad
                    p.grad.zero_()
            losses.append(loss)
        results[lib] = ([float(v.item()) for v in losses],
                        [p.detach().numpy() if lib is torch else p.numpy()
                         for p in m.parameters()])
    np.testing.assert_allclose(results[zyx][0], results[torch][0], rtol=1e-5)
    for a, b in zip(results[zyx][1], results[torch][1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_handwritten_loop_runs_one_plan_per_step_and_keeps_no_graph():
    """Updates are deferred; the next step's first update realizes them with that step's
    forward and backward, so the graph does not grow and one plan is reused."""
    rng = np.random.default_rng(6)
    w = zyx.Tensor(rng.standard_normal((5, 3)).astype(np.float32), requires_grad=True)
    x = zyx.Tensor(rng.standard_normal((4, 5)).astype(np.float32))
    for _ in range(3):
        ((x @ w) ** 2).mean().backward()
        with zyx.no_grad():
            w -= 0.1 * w.grad
            w.grad = None
    before = RT.stats["realizations"]
    for _ in range(10):
        ((x @ w) ** 2).mean().backward()
        with zyx.no_grad():
            w -= 0.1 * w.grad
            w.grad = None
    assert RT.stats["realizations"] - before == 10
    # w's pending node is one update of a realized leaf: a short graph, not 13 steps deep
    stack, seen = [w._id], set()
    while stack:
        nid = stack.pop()
        if nid not in seen:
            seen.add(nid)
            stack += list(RT.graph.get(nid).srcs)
    assert len(seen) < 60, len(seen)


def test_view_of_parameter_updated_under_no_grad_stays_differentiable():
    zw, tw = both(X, requires_grad=True)
    res = []
    for w, lib in ((zw, zyx), (tw, torch)):
        wt = w.T                     # a view kept across the update, as torch keeps it
        with lib.no_grad():
            w -= 1.0
        (wt * wt).sum().backward()
        res.append((wt, w.grad))
    check(res[0][0], res[1][0])
    check(res[0][1], res[1][1])


def test_data_writes_change_the_tensor_unrecorded():
    zw, tw = both(X, requires_grad=True)
    for w in (zw, tw):
        (w * w).sum().backward()
        w.data.add_(w.grad, alpha=-0.1)     # outside no_grad: .data is not recorded
        w.data[0, 0] = 9.0
        assert w.is_leaf and w.requires_grad
    check(zw, tw)
    zw.data = zyx.Tensor(Y)
    tw.data = torch.tensor(Y)
    check(zw, tw)
    zw.grad = tw.grad = None
    (zw * 3).sum().backward()
    (tw * 3).sum().backward()
    check(zw.grad, tw.grad)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, np.float16])
def test_setitem_other_dtypes(dtype):
    base = (np.arange(20).reshape(4, 5) % 3).astype(dtype)
    z, ref = zyx.Tensor(base), base.copy()
    one = dtype(1)
    for idx, v in (((1, slice(None, None, 2)), one), ((np.array([0, 3]), np.array([4, 1])), one),
                   ((slice(None), np.array([2])), np.array([[one]] * 4, dtype)),
                   (base > 1, dtype(0))):
        z[idx] = zyx.Tensor(np.asarray(v, dtype)) if isinstance(v, np.ndarray) else v
        ref[idx] = v
    assert z.dtype.name == np.dtype(dtype).name.replace("bool", "bool")
    np.testing.assert_array_equal(z.numpy(), ref)


def test_constant_input_written_after_use_keeps_its_old_value():
    """w * c recorded, then c written: the gradient of w is the old c (torch raises)."""
    zw, tw = both(Y, requires_grad=True)
    c = zyx.Tensor(np.float32([2.0, -1.0, 0.5]))
    y = (zw * c).sum()
    c.add_(10)
    y.backward()
    np.testing.assert_allclose(zw.grad.numpy(), [2.0, -1.0, 0.5])
    np.testing.assert_allclose(c.numpy(), [12.0, 9.0, 10.5])


def test_scalar_writes_in_a_loop_share_one_plan():
    """Positions and values of `y[i] = c` are data (0-d leaves), not constants: the same
    graph for every i, so a second fill of the same size builds no plan."""
    def fill(n):
        y = zyx.zeros(n, 3)
        for i in range(n):
            y[i, 1] = float(i)
        return y.numpy()
    ref = np.zeros((12, 3), np.float32)
    ref[:, 1] = np.arange(12)
    np.testing.assert_array_equal(fill(12), ref)
    plans = RT.stats["plans_built"]
    np.testing.assert_array_equal(fill(12), ref)
    assert RT.stats["plans_built"] == plans


# ---------------------------------------------------------------------------------------
# in-place view ops: only the shape changes

def test_t_then_write_reaches_base_views_like_torch():
    zy, ty = both(np.arange(6.0, dtype=np.float32).reshape(2, 3))
    zv, tv = zy[0], ty[0]
    zy.t_()
    ty.t_()
    zy[0, 1] = 100.0
    ty[0, 1] = 100.0
    check(zy, ty)
    check(zv, tv)


def test_unsqueeze_of_a_view_writes_its_base():
    zz, tz = both(np.arange(6.0, dtype=np.float32).reshape(2, 3))
    zw, tw = zz.view(6), tz.view(6)
    zw.unsqueeze_(0)
    tw.unsqueeze_(0)
    zw[0, 4] = -1.0
    tw[0, 4] = -1.0
    check(zz, tz)
    check(zw, tw)
    zz[0, 0] = 9.0        # and the base's writes reach the re-shaped view
    tz[0, 0] = 9.0
    check(zw, tw)


@pytest.mark.parametrize("op", ["unsqueeze_", "squeeze_", "transpose_", "swapdims_",
                                "swapaxes_", "t_"])
def test_view_ops_in_place_shapes_and_gradients(op):
    args = {"unsqueeze_": (1,), "squeeze_": (), "transpose_": (0, 2), "swapdims_": (2, 0),
            "swapaxes_": (1, 2), "t_": ()}[op]
    shape = (2, 1, 3) if op != "t_" else (2, 3)
    a = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    zx, tx = both(a, requires_grad=True)
    zb, tb = zx * 2, tx * 2
    getattr(zb, op)(*args)
    getattr(tb, op)(*args)
    assert zb.shape == tuple(tb.shape)
    wz = zyx.Tensor(np.arange(np.prod(zb.shape), dtype=np.float32).reshape(zb.shape))
    wt = torch.tensor(wz.numpy())
    (zb * wz).sum().backward()
    (tb * wt).sum().backward()
    check(zx.grad, tx.grad)
    # an op recorded before the in-place view op read the old shape: torch's version
    # counter refuses its backward; zyx keeps the old value (only the shape changed), so
    # the gradient is the right one: d/dx sum((2x)^2) = 8x
    zx2 = zyx.Tensor(a, requires_grad=True)
    zb2 = zx2 * 2
    zr = zb2 * zb2
    getattr(zb2, op)(*args)
    zr.sum().backward()
    np.testing.assert_allclose(zx2.grad.numpy(), 8 * a, rtol=1e-6)


def test_view_ops_in_place_errors_like_torch():
    zx = zyx.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        zx.unsqueeze_(0)
    with pytest.raises(RuntimeError, match="<= 2 dimensions"):
        zyx.ones(2, 2, 2).t_()
    q = zyx.zeros(2, 3)
    assert q.squeeze_() is q and q.shape == (2, 3)        # nothing to remove
    assert q.transpose_(1, 1) is q and q.shape == (2, 3)


def test_writing_into_an_arange_leaves_later_aranges_alone():
    y = zyx.arange(6.0)
    y[1] = 7.0
    z = zyx.arange(6.0).reshape(2, 3)
    z[0, 0] = 5.0
    assert np.array_equal(zyx.arange(6.0).numpy(), np.arange(6.0, dtype=np.float32))
    assert y.numpy()[1] == 7.0 and z.numpy()[0, 0] == 5.0


def test_resize_keeps_row_major_values_like_torch():
    a = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    zx, tx = both(a)
    assert zx.resize_(4, 3) is zx
    tx.resize_(4, 3)
    check(zx, tx)                            # same count: a reshape
    zx.resize_((2, 5))
    tx.resize_((2, 5))
    check(zx, tx)                            # fewer: the first 10, row-major
    zy, ty = both(a)
    zy.resize_(2, 7)
    ty.resize_(2, 7)
    assert zy.shape == tuple(ty.shape) == (2, 7)
    # more: the old values first; torch leaves the rest uninitialized, zyx zeros
    np.testing.assert_array_equal(zy.numpy().reshape(-1)[:12], ty.numpy().reshape(-1)[:12])
    np.testing.assert_array_equal(zy.numpy().reshape(-1)[12:], 0)
    zz = zyx.zeros(5)
    zz.resize_as_(zyx.ones(2, 2))
    assert zz.shape == (2, 2)


def test_resize_refuses_what_torch_refuses():
    w = zyx.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="require grad"):
        w.resize_(4)
    with zyx.no_grad():
        w.resize_(2)                         # allowed outside grad mode, as in torch
    assert w.shape == (2,)
    base = zyx.arange(6)
    view = base[1:]
    for t in (base, view):
        with pytest.raises(RuntimeError, match="view"):
            t.resize_(2)
    with pytest.raises(RuntimeError, match="non-negative"):
        zyx.zeros(2).resize_(-1)
