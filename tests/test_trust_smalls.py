"""Small trust items (issue 29, "Trust II"), each against torch: the sign of -0.0 through
max/min, sort and the index ops; bernoulli's probability tensor check; slices with huge
steps and bounds; boolean-mask getitem; is_contiguous of views; deeply nested checkpoint
metadata."""
import struct

import numpy as np
import pytest
import torch

import zyx
from zyx.errors import InvalidArgumentError
from zyx.io import checkpoint, safetensors
from conftest import skip_without_signed_zeros


def _signs(t):
    """signbit of a zyx or torch tensor's values, as a list (tells -0.0 from 0.0)."""
    if isinstance(t, torch.Tensor):
        return torch.signbit(t.detach()).reshape(-1).tolist()
    return torch.signbit(torch.from_numpy(np.array(t.numpy(), dtype=np.float64))).reshape(-1).tolist()


def _values(t):
    a = t.detach().numpy() if isinstance(t, torch.Tensor) else t.numpy()
    return np.asarray(a, dtype=np.float64)


def _same(z, t):
    """Same shape, values (NaN where NaN) and signs of zero."""
    assert tuple(z.shape) == tuple(t.shape)
    np.testing.assert_array_equal(_values(z), _values(t))
    assert _signs(z) == _signs(t)


# ---------------------------------------------------------------------------------------
# 1. signed zero
ZEROS = [[-0.0, 0.0], [0.0, -0.0], [-0.0, 0.0, -0.0], [0.0, -0.0, 0.0], [-0.0, -0.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_maximum_minimum_tie_keeps_first_operand(device, dtype):
    # torch's elementwise maximum/minimum keep the first operand on a tie (-0.0 vs 0.0)
    a = [-0.0, 0.0, -0.0, 0.0, 1.0, float("nan"), 2.0]
    b = [0.0, -0.0, -0.0, 0.0, float("nan"), 1.0, -3.0]
    zd = zyx.float32 if dtype is torch.float32 else zyx.float64
    za, zb = zyx.tensor(a, dtype=zd), zyx.tensor(b, dtype=zd)
    ta, tb = torch.tensor(a, dtype=dtype), torch.tensor(b, dtype=dtype)
    _same(zyx.maximum(za, zb), torch.maximum(ta, tb))
    _same(zyx.minimum(za, zb), torch.minimum(ta, tb))
    _same(zyx.maximum(zb, za), torch.maximum(tb, ta))
    _same(za.max(zb), ta.max(tb))
    _same(za.min(zb), ta.min(tb))


@pytest.mark.parametrize("vals", ZEROS)
def test_reductions_over_signed_zeros(device, vals):
    z, t = zyx.tensor(vals), torch.tensor(vals)
    _same(z.amax(), t.amax())
    _same(z.amin(), t.amin())
    for fn in ("max", "min"):
        zr, tr = getattr(z, fn)(0), getattr(t, fn)(0)
        _same(zr.values, tr.values)        # the value at the first index of the extreme
        assert zr.indices.numpy().tolist() == tr.indices.tolist()
        zr, tr = getattr(z.reshape(1, -1), fn)(1, keepdim=True), \
            getattr(t.reshape(1, -1), fn)(1, keepdim=True)
        _same(zr.values, tr.values)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_sort_keeps_negative_zero(device, requires_grad):
    if requires_grad:
        skip_without_signed_zeros("-0.0 comes back through 1 / x < 0 and -(0 - x)")
    vals = [-0.0, 0.0, -0.0, 1.0, -1.0, 0.0]
    z = zyx.tensor(vals, requires_grad=requires_grad)
    t = torch.tensor(vals, requires_grad=requires_grad)
    for desc in (False, True):
        zs, ts = z.sort(stable=True, descending=desc), t.sort(stable=True, descending=desc)
        _same(zs.values, ts.values)
        assert zs.indices.numpy().tolist() == ts.indices.tolist()
        assert z.argsort(stable=True, descending=desc).numpy().tolist() == \
            t.argsort(stable=True, descending=desc).tolist()
    # torch's topk orders ties as its partial sort leaves them: compare against its input
    zt = z.topk(3)
    _same(zt.values, t[torch.tensor(zt.indices.numpy())])
    _same(z.reshape(2, 3).sort(0, stable=True).values,
          t.reshape(2, 3).sort(dim=0, stable=True).values)
    if requires_grad:
        w = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        (z.sort(stable=True).values * zyx.tensor(w)).sum().backward()
        (t.sort(stable=True).values * torch.tensor(w)).sum().backward()
        np.testing.assert_array_equal(z.grad.numpy(), t.grad.numpy())


@pytest.mark.parametrize("requires_grad", [False, True])
def test_gather_and_index_select_keep_negative_zero(device, requires_grad):
    if requires_grad:
        skip_without_signed_zeros("-0.0 comes back through 1 / x < 0 and -(0 - x)")
    vals = [[-0.0, 0.0, 5.0], [float("-inf"), -0.0, float("nan")]]
    z = zyx.tensor(vals, requires_grad=requires_grad)
    t = torch.tensor(vals, requires_grad=requires_grad)
    gi = [[0, 0, 1, 2], [1, 0, 2, 1]]
    zg, tg = z.gather(1, zyx.tensor(gi)), t.gather(1, torch.tensor(gi))
    _same(zg, tg)
    zi, ti = z.index_select(1, zyx.tensor([1, 0, 0])), t.index_select(1, torch.tensor([1, 0, 0]))
    _same(zi, ti)
    _same(z.index_select(0, zyx.tensor([1, 1, 0])), t.index_select(0, torch.tensor([1, 1, 0])))
    if requires_grad:
        w = np.arange(1.0, 9.0, dtype=np.float32).reshape(2, 4)
        (zg * zyx.tensor(w)).sum().backward()
        (tg * torch.tensor(w)).sum().backward()
        np.testing.assert_array_equal(z.grad.numpy(), t.grad.numpy())


# ---------------------------------------------------------------------------------------
# 2. bernoulli's probability tensor
@pytest.mark.parametrize("p", [[0.5, 2.0], [-0.1, 0.5], [float("nan")]])
def test_bernoulli_rejects_probabilities_outside_unit_interval(device, p):
    with pytest.raises(RuntimeError, match="p_in >= 0"):
        torch.tensor(p).bernoulli()
    with pytest.raises(InvalidArgumentError, match="p_in >= 0"):
        zyx.tensor(p).bernoulli().numpy()
    with pytest.raises(RuntimeError):           # torch code catches it unchanged
        zyx.bernoulli(zyx.zeros(len(p)), p=zyx.tensor(p)).numpy()


def test_bernoulli_probability_tensor_in_range(device):
    p = zyx.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    np.testing.assert_array_equal(p.bernoulli().numpy(), p.numpy())
    out = zyx.bernoulli(zyx.zeros(2, 3), p=p)
    np.testing.assert_array_equal(out.numpy(), p.numpy())
    draws = zyx.full((4000,), 0.25).bernoulli().numpy()
    assert set(np.unique(draws)) <= {0.0, 1.0} and 0.2 < draws.mean() < 0.3
    with pytest.raises(ValueError):
        zyx.zeros(2).bernoulli(1.5)


# ---------------------------------------------------------------------------------------
# 3. huge slice steps and bounds
HUGE = [slice(None, None, 2 ** 62), slice(3, None, 2 ** 62), slice(2 ** 62, None),
        slice(None, 2 ** 62, 3), slice(-2 ** 62, 2 ** 62, 2 ** 61), slice(-2 ** 62, 2),
        slice(9, None, 2 ** 40), slice(10, None, 2 ** 62), slice(None, None, 9)]


@pytest.mark.parametrize("s", HUGE, ids=str)
def test_huge_slice_steps_and_bounds(device, s):
    # a 1-D tensor against torch; a 2-D one against numpy (torch overflows computing the
    # strides of a huge step over a strided axis, x[::2**62] of a (10, 2) tensor)
    v = np.arange(10, dtype=np.float32)
    np.testing.assert_array_equal(zyx.tensor(v)[s].numpy(), torch.tensor(v)[s].numpy())
    a = np.arange(20, dtype=np.float32).reshape(10, 2)
    z = zyx.tensor(a)
    np.testing.assert_array_equal(z[s].numpy(), a[s])
    np.testing.assert_array_equal(z[:, s].numpy(), a[:, s])
    zw, tw = zyx.tensor(v), torch.tensor(v)
    zw[s] = -1.0
    tw[s] = -1.0
    np.testing.assert_array_equal(zw.numpy(), tw.numpy())
    zw, b = zyx.tensor(a), a.copy()
    zw[:, s] = -1.0
    b[:, s] = -1.0
    np.testing.assert_array_equal(zw.numpy(), b)


def test_huge_negative_slice_steps(device):
    # torch refuses negative steps; numpy's result is the reference
    a = np.arange(10, dtype=np.float32)
    z = zyx.tensor(a)
    for s in (slice(None, None, -2 ** 62), slice(5, None, -2 ** 62), slice(None, None, -9)):
        np.testing.assert_array_equal(z[s].numpy(), a[s])
        w = zyx.tensor(a)
        w[s] = -1.0
        b = a.copy()
        b[s] = -1.0
        np.testing.assert_array_equal(w.numpy(), b)


# ---------------------------------------------------------------------------------------
# 4. boolean-mask getitem
_A = np.random.default_rng(29).standard_normal((3, 4, 5)).astype(np.float32)
MASK_CASES = {
    "full": lambda x, M: x[M(_A > 0)],
    "lead2": lambda x, M: x[M(_A[:, :, 0] > 0)],
    "lead1": lambda x, M: x[M(np.array([True, False, True]))],
    "mask_then_slice": lambda x, M: x[M(_A[:, :, 0] > 0), 1:],
    "mask_slice_int": lambda x, M: x[M(np.array([True, False, True])), :, 2],
    "middle": lambda x, M: x[:, M(_A[0, :, 0] > 0)],
    "ellipsis": lambda x, M: x[..., M(_A[0, 0] > 0)],
    "int_then_mask": lambda x, M: x[1, M(_A[0] > 0)],
    "none_then_mask": lambda x, M: x[None, M(_A[:, :, 0] > 0)],
    "all_false": lambda x, M: x[M(np.zeros((3, 4), bool))],
    "bool_list": lambda x, M: x[[True, False, True]],
    "mask_and_index": lambda x, M: x[M(np.array([True, False, True])), [0, 3]],
}


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("case", sorted(MASK_CASES))
def test_bool_mask_getitem(device, case, requires_grad):
    f = MASK_CASES[case]
    z = zyx.tensor(_A, requires_grad=requires_grad)
    t = torch.tensor(_A, requires_grad=requires_grad)
    zr, tr = f(z, zyx.tensor), f(t, torch.tensor)
    assert tuple(zr.shape) == tuple(tr.shape)
    np.testing.assert_array_equal(zr.numpy(), tr.detach().numpy())
    if requires_grad:
        w = np.arange(tr.numel(), dtype=np.float32).reshape(tuple(tr.shape))
        (zr * zyx.tensor(w)).sum().backward()
        (tr * torch.tensor(w)).sum().backward()
        np.testing.assert_array_equal(z.grad.numpy(), t.grad.numpy())


def test_bool_mask_getitem_shape_mismatch(device):
    z, t = zyx.tensor(_A), torch.tensor(_A)
    with pytest.raises(IndexError):
        t[torch.tensor([True, False])]
    with pytest.raises(IndexError, match="shape of the mask"):
        z[zyx.tensor([True, False])]
    with pytest.raises(IndexError, match="shape of the mask"):
        z[:, zyx.tensor(np.ones((4, 4), bool))]


def test_bool_mask_setitem_stays_lazy(device):
    mask = np.array([[True, False, True], [False, True, False]])
    z = zyx.zeros(2, 3)
    z[zyx.tensor(mask)] = 7.0
    assert zyx._RT.graph.get(z._id).op != 0       # a lazy node (not a LEAF): nothing realized
    t = torch.zeros(2, 3)
    t[torch.tensor(mask)] = 7.0
    np.testing.assert_array_equal(z.numpy(), t.numpy())


# ---------------------------------------------------------------------------------------
# 5. is_contiguous of views
VIEWS = {
    "base": lambda x: x,
    "transpose": lambda x: x.transpose(0, 1),
    "permute": lambda x: x.permute(2, 0, 1),
    "twice_transposed": lambda x: x.transpose(0, 1).transpose(0, 1),
    "rows": lambda x: x[1:],
    "cols": lambda x: x[:, 1:],
    "last_axis": lambda x: x[..., 1:3],
    "int_first": lambda x: x[1],
    "int_middle": lambda x: x[:, 1],
    "step_middle": lambda x: x[:, ::2],
    "step_first": lambda x: x[::2],
    "step_last": lambda x: x[:, :, ::3],
    "huge_step": lambda x: x[:, ::2 ** 62],
    "expand": lambda x: x[:, :1].expand(2, 5, 4),
    "expand_size1": lambda x: x.unsqueeze(0).expand(1, 2, 3, 4),
    "unsqueeze": lambda x: x.unsqueeze(1),
    "squeezed_slice": lambda x: x[:, :1].squeeze(1),
    "mT": lambda x: x.mT,
    "transpose_reshape": lambda x: x.transpose(1, 2).reshape(2, 12),
    "flatten": lambda x: x.reshape(-1),
    "rows_flat": lambda x: x[1:].reshape(12),
    "cols_flat": lambda x: x[:, 1:].reshape(-1),
    "transposed_contiguous": lambda x: x.transpose(0, 2).contiguous(),
    "int_then_t": lambda x: x[0].t(),
    "empty": lambda x: x[:, 3:],
    "flip": lambda x: x.flip(0),
    "computed_t": lambda x: (x + 1).transpose(0, 1),
}


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_is_contiguous_matches_torch(name):
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    z, t = VIEWS[name](zyx.tensor(a)), VIEWS[name](torch.tensor(a))
    assert z.is_contiguous() == t.is_contiguous()
    np.testing.assert_array_equal(z.numpy(), t.numpy())


def test_contiguous_copies_only_views(device):
    a = zyx.tensor(np.arange(12, dtype=np.float32).reshape(3, 4), requires_grad=True)
    assert a.contiguous() is a and a[1:].contiguous() is not None
    v = a.t()
    assert not v.is_contiguous()
    c = v.contiguous()
    assert c.is_contiguous() and c.shape == (4, 3)
    np.testing.assert_array_equal(c.numpy(), a.numpy().T)
    (c * zyx.tensor(np.arange(12, dtype=np.float32).reshape(4, 3))).sum().backward()
    np.testing.assert_array_equal(a.grad.numpy(), np.arange(12, dtype=np.float32).reshape(4, 3).T)
    neg = zyx.tensor([[-0.0, 1.0], [2.0, -0.0]]).t().contiguous()
    assert _signs(neg) == [True, False, False, True]


# ---------------------------------------------------------------------------------------
# 6. deeply nested checkpoint metadata
@pytest.mark.parametrize("depth", [100_000, 900])
def test_checkpoint_structure_nested_too_deeply(tmp_path, depth):
    path = tmp_path / "deep.safetensors"
    safetensors.save({"a": zyx.ones(2)}, str(path),
                     {checkpoint.STRUCTURE_KEY: "[" * depth + "]" * (depth if depth < 1000 else 0)})
    with pytest.raises(safetensors.SafetensorsError, match="nest"):
        checkpoint.load(str(path))


def test_safetensors_metadata_nested_too_deeply(tmp_path):
    path = tmp_path / "deep_meta.safetensors"
    header = ('{"__metadata__": ' + "[" * 100_000 + "]" * 100_000 +
              ', "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}').encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(safetensors.SafetensorsError):
        safetensors.load(str(path))
    with pytest.raises(safetensors.SafetensorsError):
        checkpoint.load(str(path))
