"""Movement ops against numpy: reshape/view/flatten/squeeze/unsqueeze/permute/transpose/T/
expand/broadcast_to/flip/repeat/roll/contiguous, cat/stack/split/chunk, tril/triu and
Tensor.pad, on contiguous and non-contiguous inputs, 0-d and empty tensors."""
from __future__ import annotations

import numpy as np
import pytest

import zyx
from conftest import assert_close, ids, sample

pytestmark = pytest.mark.usefixtures("device")


@pytest.fixture
def a():
    return np.random.randn(2, 3, 4).astype(np.float32)


def test_reshape_view_flatten(a):
    x = zyx.Tensor(a)
    assert_close(x.reshape(6, 4), a.reshape(6, 4), dtype=zyx.float32)
    assert_close(x.reshape((4, -1)), a.reshape(4, -1), dtype=zyx.float32)
    assert_close(x.view(-1), a.reshape(-1), dtype=zyx.float32)
    assert_close(x.view(3, 2, 4) * 2, a.reshape(3, 2, 4) * 2, dtype=zyx.float32)
    assert_close(x.flatten(), a.reshape(-1), dtype=zyx.float32)
    assert_close(x.flatten(1), a.reshape(2, 12), dtype=zyx.float32)
    assert_close(x.flatten(0, 1), a.reshape(6, 4), dtype=zyx.float32)
    assert_close(x.flatten(start_dim=-2, end_dim=-1), a.reshape(2, 12), dtype=zyx.float32)
    assert_close(zyx.flatten(x), a.reshape(-1), dtype=zyx.float32)
    assert_close(zyx.reshape(x, (24,)), a.reshape(24), dtype=zyx.float32)
    assert x.reshape(2, 3, 4) is x     # no-op reshapes build nothing
    assert zyx.Tensor(1.0).flatten().shape == (1,)


def test_reshape_errors_name_shapes(a):
    x = zyx.Tensor(a)
    with pytest.raises(zyx.ShapeError, match=r"\(2, 3, 4\).*\(5, 5\)"):
        x.reshape(5, 5)
    with pytest.raises(zyx.ShapeError):
        x.reshape(-1, -1)
    with pytest.raises(zyx.ShapeError):
        x.reshape(5, -1)


def test_squeeze_unsqueeze():
    b = np.random.randn(1, 3, 1, 2).astype(np.float32)
    x = zyx.Tensor(b)
    assert_close(x.squeeze(), b.squeeze(), dtype=zyx.float32)
    assert_close(x.squeeze(0), b.squeeze(0), dtype=zyx.float32)
    assert_close(x.squeeze(-2), b.squeeze(-2), dtype=zyx.float32)
    assert_close(x.squeeze(dim=1), b, dtype=zyx.float32)      # size 3: unchanged (torch)
    assert_close(x.squeeze((0, 2)), b.squeeze((0, 2)), dtype=zyx.float32)
    assert_close(x.unsqueeze(0), b[None], dtype=zyx.float32)
    assert_close(x.unsqueeze(-1), b[..., None], dtype=zyx.float32)
    assert_close(x.unsqueeze(dim=2), np.expand_dims(b, 2), dtype=zyx.float32)
    assert_close(zyx.unsqueeze(zyx.squeeze(x), 1), b.squeeze()[:, None], dtype=zyx.float32)
    assert zyx.Tensor(2.0).unsqueeze(0).shape == (1,)


def test_permute_transpose_T(a):
    x = zyx.Tensor(a)
    assert_close(x.permute(2, 0, 1), a.transpose(2, 0, 1), dtype=zyx.float32)
    assert_close(x.permute((1, 2, 0)), a.transpose(1, 2, 0), dtype=zyx.float32)
    assert_close(x.permute(-1, 0, 1), a.transpose(2, 0, 1), dtype=zyx.float32)
    assert_close(x.transpose(0, 2), a.swapaxes(0, 2), dtype=zyx.float32)
    assert_close(x.transpose(dim0=-1, dim1=1), a.swapaxes(-1, 1), dtype=zyx.float32)
    assert_close(x.transpose(), a.swapaxes(-2, -1), dtype=zyx.float32)
    assert_close(x.T, a.transpose(2, 1, 0), dtype=zyx.float32)
    assert_close(x.mT, a.swapaxes(-2, -1), dtype=zyx.float32)
    assert_close(zyx.permute(x, (0, 2, 1)), a.transpose(0, 2, 1), dtype=zyx.float32)
    assert_close(zyx.transpose(x, 0, 1), a.swapaxes(0, 1), dtype=zyx.float32)
    with pytest.raises(zyx.ShapeError):
        x.permute(0, 1)
    with pytest.raises(zyx.ShapeError):
        x.permute(0, 1, 1)


def test_expand_broadcast_to():
    b = np.random.randn(3, 1).astype(np.float32)
    x = zyx.Tensor(b)
    assert_close(x.expand(3, 4), np.broadcast_to(b, (3, 4)), dtype=zyx.float32)
    assert_close(x.expand(2, -1, 5), np.broadcast_to(b, (2, 3, 5)), dtype=zyx.float32)
    assert_close(x.broadcast_to((2, 3, 4)), np.broadcast_to(b, (2, 3, 4)), dtype=zyx.float32)
    assert_close(zyx.broadcast_to(x, (3, 2)), np.broadcast_to(b, (3, 2)), dtype=zyx.float32)
    assert_close(x.expand_as(zyx.zeros(3, 6)), np.broadcast_to(b, (3, 6)), dtype=zyx.float32)
    assert_close(zyx.Tensor(1.5).expand(2, 2), np.full((2, 2), 1.5, np.float32),
                 dtype=zyx.float32)
    with pytest.raises(zyx.ShapeError, match=r"\(3, 1\)"):
        x.expand(4, 4)
    with pytest.raises(zyx.ShapeError):
        x.expand(3)


def test_flip(a):
    x = zyx.Tensor(a)
    assert_close(x.flip(0), a[::-1], dtype=zyx.float32)
    assert_close(x.flip(-1), a[:, :, ::-1], dtype=zyx.float32)
    assert_close(x.flip((0, 2)), a[::-1, :, ::-1], dtype=zyx.float32)
    assert_close(x.flip(dims=[1]), a[:, ::-1], dtype=zyx.float32)
    assert_close(x.flip(), a[::-1, ::-1, ::-1], dtype=zyx.float32)
    assert_close(zyx.flip(x, 1).flip(1), a, dtype=zyx.float32)


def test_repeat():
    b = np.random.randn(2, 3).astype(np.float32)
    x = zyx.Tensor(b)
    assert_close(x.repeat(2, 2), np.tile(b, (2, 2)), dtype=zyx.float32)
    assert_close(x.repeat(1, 3), np.tile(b, (1, 3)), dtype=zyx.float32)
    assert_close(x.repeat((3, 1, 2)), np.tile(b, (3, 1, 2)), dtype=zyx.float32)
    assert_close(x.T.repeat(2, 1), np.tile(b.T, (2, 1)), dtype=zyx.float32)
    with pytest.raises(zyx.ShapeError):
        x.repeat(2)


def test_roll(a):
    x = zyx.Tensor(a)
    assert_close(x.roll(1, 0), np.roll(a, 1, 0), dtype=zyx.float32)
    assert_close(x.roll(-1, dims=2), np.roll(a, -1, 2), dtype=zyx.float32)
    assert_close(x.roll(5, 2), np.roll(a, 5, 2), dtype=zyx.float32)
    assert_close(x.roll((1, 2), (1, 2)), np.roll(a, (1, 2), (1, 2)), dtype=zyx.float32)
    assert_close(x.roll(3), np.roll(a, 3), dtype=zyx.float32)        # flattened
    assert_close(zyx.roll(x, 4, 2), a, dtype=zyx.float32)


def test_contiguous_clone_detach(a):
    x = zyx.Tensor(a)
    assert_close(x.T.contiguous(), a.transpose(2, 1, 0), dtype=zyx.float32)
    assert_close(x.clone(), a, dtype=zyx.float32)
    assert_close(x.detach() * 1, a, dtype=zyx.float32)
    b = zyx.Tensor(np.array([True, False]))
    assert_close(b.clone(), np.array([True, False]), dtype=zyx.bool)


# ---------------------------------------------------------------------------------------
# cat / stack / split / chunk

@pytest.mark.parametrize("d", (zyx.float32, zyx.int32, zyx.bool, zyx.float16, zyx.uint8,
                               zyx.int64),
                         ids=ids((zyx.float32, zyx.int32, zyx.bool, zyx.float16, zyx.uint8,
                                  zyx.int64)))
def test_cat_stack_dtypes(d):
    p, q = sample((2, 3), d, -9, 9), sample((2, 3), d, -9, 9)
    x, y = zyx.Tensor(p, dtype=d), zyx.Tensor(q, dtype=d)
    assert_close(zyx.cat([x, y]), np.concatenate([p, q]), dtype=d)
    assert_close(zyx.cat([x, y, x], dim=1), np.concatenate([p, q, p], 1), dtype=d)
    assert_close(zyx.stack([x, y]), np.stack([p, q]), dtype=d)
    assert_close(zyx.stack([x, y], axis=-1), np.stack([p, q], -1), dtype=d)


def test_cat_special_values_and_promotion():
    p = np.array([np.nan, -0.0, np.inf], dtype=np.float32)
    q = np.array([-np.inf, 1.0], dtype=np.float32)
    got = zyx.cat([zyx.Tensor(p), zyx.Tensor(q)])
    assert_close(got, np.concatenate([p, q]), dtype=zyx.float32)
    assert np.signbit(got.numpy()[1])                 # -0.0 keeps its sign
    lazy = zyx.cat([zyx.Tensor(p) * 1, zyx.Tensor(q) + 0, zyx.Tensor(-p)])   # in a kernel
    out, ref = lazy.numpy(), np.concatenate([p, q, -p])
    assert np.array_equal(np.isnan(out), np.isnan(ref))
    # the sign of zeros and infinities (a NaN's sign bit is not kept by GPU arithmetic,
    # which returns the canonical NaN, as IEEE 754 allows)
    real = ~np.isnan(ref)
    assert np.array_equal(np.signbit(out[real]), np.signbit(ref[real]))
    i = np.array([1, 2], dtype=np.int32)
    got = zyx.concatenate([zyx.Tensor(i), zyx.Tensor(q)])
    assert_close(got, np.concatenate([i.astype(np.float32), q]), dtype=zyx.float32)


@pytest.mark.parametrize("d", [zyx.float32, zyx.int32, zyx.bool, zyx.float16],
                         ids=ids((zyx.float32, zyx.int32, zyx.bool, zyx.float16)))
def test_cat_of_many_parts_through_stored_groups(d, kernel_counter):
    """More than 2 * CAT_GROUP parts into a large result: groups of CAT_GROUP are stored
    first (one kernel each, then the cat of the groups); values exact, NaN kept, mixed
    part sizes and dtypes promoted, gradients flow to every part."""
    from zyx.tensor import CAT_GROUP, CAT_GROUP_NUMEL
    rng = np.random.RandomState(0)
    n = 2 * CAT_GROUP + 5
    rows = -(-CAT_GROUP_NUMEL // (n * 64))
    parts = [sample((rows, 64 + (i % 3)), d, -9, 9, rng) for i in range(n)]
    if d is zyx.float32:
        parts[3][0, :2] = [-0.0, np.nan]
    ts = [zyx.Tensor(p, dtype=d) for p in parts]
    out = zyx.cat(ts, 1)
    launched, _ = kernel_counter(lambda: out.numpy())
    assert launched == -(-n // CAT_GROUP) + 1
    want = np.concatenate(parts, 1)
    assert_close(out, want, dtype=d)
    if d is zyx.float32:
        got = out.numpy()
        at = sum(p.shape[1] for p in parts[:3])
        # (the stored groups add their one value to 0.0: the sign of -0.0 is lost there)
        assert got[0, at] == 0 and np.isnan(got[0, at + 1])
        st = zyx.stack([t[:, :64] for t in ts], 0)
        assert_close(st, np.stack([p[:, :64] for p in parts]), dtype=d)
        ws = [zyx.Tensor(p, requires_grad=True) for p in parts]
        g = rng.standard_normal(want.shape).astype(np.float32)
        (zyx.cat(ws, 1) * zyx.Tensor(g)).sum().backward()
        off = 0
        for w, p in zip(ws, parts):
            assert_close(w.grad, g[:, off:off + p.shape[1]], dtype=d)
            off += p.shape[1]
    mixed = zyx.cat(ts[:CAT_GROUP * 2] + [zyx.Tensor(np.ones((rows, 64), np.float64))], 1)
    assert mixed.dtype == zyx.float64


def test_cat_noncontiguous_and_mixed_sizes(a):
    x = zyx.Tensor(a)
    b = np.random.randn(2, 5, 4).astype(np.float32)
    got = zyx.cat([x.flip(1), zyx.Tensor(b)[:, ::2], x[:, :1]], dim=-2)
    assert_close(got, np.concatenate([a[:, ::-1], b[:, ::2], a[:, :1]], -2), dtype=zyx.float32)
    e = zyx.cat([x, zyx.Tensor(np.zeros((2, 0, 4), np.float32))], 1)
    assert_close(e, a, dtype=zyx.float32)
    with pytest.raises(zyx.ShapeError, match=r"\(2, 3, 4\).*\(2, 5, 3\)"):
        zyx.cat([x, zyx.zeros(2, 5, 3)], 1)
    with pytest.raises(zyx.ShapeError):
        zyx.cat([])
    with pytest.raises(zyx.ShapeError):
        zyx.stack([x, zyx.zeros(2, 3, 5)])


# cat and pad on the C backend: loops split at the parts' ranges (codegen/cpu/rangesplit.py)

@pytest.fixture
def split_log(monkeypatch, device):
    """The piece counts of every kernel the C backend's index-set split looked at while
    the test ran (plans cleared first so its kernels are compiled), and whether the
    test's device is the C backend (elsewhere the list stays empty)."""
    from zyx.codegen.cpu import rangesplit
    log = []
    split = rangesplit.split_ranges

    def logged(kernel):
        pieces = split(kernel)
        log.append(len(pieces) if pieces else 1)
        return pieces
    monkeypatch.setattr(rangesplit, "split_ranges", logged)
    zyx._RT.plans.clear()
    return log, device.type == "cpu"


def _was_split(split_log, pieces=2):
    log, cpu = split_log
    assert not cpu or max(log, default=1) >= pieces, log


def test_cat_of_odd_1d_parts_splits_exactly(split_log):
    """Parts of odd lengths, one of a single element and one shorter than a split piece
    (it stays guarded inside its neighbour's piece), with NaN, infinities and -0.0 at
    the ends of the parts: every element exact, the signs of zeros kept, the ranges'
    first and last elements included."""
    rng = np.random.default_rng(5)
    lens = (1001, 1, 2047, 3, 777, 130)
    parts = [rng.standard_normal(n).astype(np.float32) for n in lens]
    for p in parts:
        p[0], p[-1] = -0.0, np.nan if len(p) > 2 else -np.inf
    parts[2][1], parts[2][-2] = np.inf, -0.0
    got = zyx.cat([zyx.Tensor(p) * 1 for p in parts]).numpy()
    want = np.concatenate(parts)
    assert got.shape == want.shape
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(np.signbit(got[~np.isnan(want)]), np.signbit(want[~np.isnan(want)]))
    _was_split(split_log, 4)


@pytest.mark.parametrize("shape,axis", [((3, 40, 50), 0), ((40, 3, 50), 1), ((20, 30, 7), 2),
                                        ((37, 41), 0), ((41, 37), 1)],
                         ids=["3d-axis0", "3d-middle", "3d-last", "2d-axis0", "2d-axis1"])
def test_cat_along_each_axis_splits(split_log, shape, axis):
    """cat of three parts of different lengths along the first, a middle and the last
    axis: values exact against numpy."""
    rng = np.random.default_rng(axis)
    parts = []
    for n in (shape[axis], 1 + shape[axis] // 3, 2 * shape[axis] + 1):
        s = list(shape)
        s[axis] = n
        parts.append(rng.standard_normal(s).astype(np.float32))
    got = zyx.cat([zyx.Tensor(p) + 0 for p in parts], dim=axis)
    assert_close(got, np.concatenate(parts, axis), dtype=zyx.float32, rtol=0, atol=0)
    _was_split(split_log, 3)


def test_cat_fused_with_elementwise_work_splits(split_log):
    """Elementwise work on the parts (exp, a cast, a product of two parts) and after the
    cat (a scale and shift), all in the cat's kernel: values against numpy."""
    rng = np.random.default_rng(7)
    a = rng.standard_normal((64, 30)).astype(np.float32)
    b = rng.standard_normal((64, 17)).astype(np.float32)
    i = rng.integers(-5, 5, (64, 9)).astype(np.int32)
    x, y, k = zyx.Tensor(a), zyx.Tensor(b), zyx.Tensor(i)
    got = zyx.cat([x.exp(), y * y - 1, k.float(), x[:, :4] * y[:, :4]], dim=1) * 0.5 + 2
    want = np.concatenate([np.exp(a), b * b - 1, i.astype(np.float32), a[:, :4] * b[:, :4]],
                          1) * 0.5 + 2
    assert_close(got, want, dtype=zyx.float32)
    _was_split(split_log, 4)


def test_pad_with_a_value_splits_on_both_axes(split_log):
    """A 2-D pad with a nonzero value on every side: the pieces that are all padding
    store the value, the middle one copies; values exact, also fused with work after."""
    b = np.random.default_rng(8).standard_normal((50, 61)).astype(np.float32)
    x = zyx.Tensor(b)
    want = np.pad(b, ((3, 2), (1, 4)), constant_values=1.5)
    assert_close(x.pad((1, 4, 3, 2), value=1.5), want, dtype=zyx.float32, rtol=0, atol=0)
    _was_split(split_log, 4)
    assert_close((x * 2).pad((1, 4, 3, 2), value=-7.0) - 1,
                 np.pad(b * 2, ((3, 2), (1, 4)), constant_values=-7.0) - 1, dtype=zyx.float32)
    i = np.arange(3000, dtype=np.int64)
    assert_close(zyx.Tensor(i).pad((70, 90), value=7), np.pad(i, (70, 90), constant_values=7),
                 dtype=zyx.int64)


def test_cat_with_an_empty_part_splits(split_log):
    """A zero-length part between two others (and at the end) adds no piece and no
    element."""
    rng = np.random.default_rng(9)
    p = rng.standard_normal((33, 70)).astype(np.float32)
    q = rng.standard_normal((33, 50)).astype(np.float32)
    e = np.zeros((33, 0), np.float32)
    parts = [p, e, q, e]
    got = zyx.cat([zyx.Tensor(t) * 1 for t in parts], dim=1)
    assert_close(got, np.concatenate(parts, 1), dtype=zyx.float32, rtol=0, atol=0)
    _was_split(split_log, 2)


def test_cat_kernel_is_one_plain_loop_per_part(monkeypatch, device):
    """The C source of a cat of four flattened parts has one loop per part, each a plain
    copy: no guarded load, no select, and the pieces after the first `nowait` but the
    last; without the split it is one loop with a guarded load per part."""
    from zyx._core.kernelizer import kernelize
    from zyx.codegen.cpu import rangesplit
    if device.type != "cpu":
        pytest.skip("the C backend's rendering")
    dev = zyx._RT.device()
    rng = np.random.default_rng(10)
    shapes = [(40, 30), (70,), (64, 33), (7, 20)]
    parts = [zyx.Tensor(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    t = zyx.cat([(p * 1.0).reshape(-1) for p in parts])
    g = zyx._RT.graph
    order, _ = g.collect([t._id])
    steps, _ = kernelize(g, order, [t._id], dev.info().preferred_vector_size)
    kernel, = [s.kernel for s in steps if s.kernel is not None]
    split = dev.render(kernel, "k")
    assert split.count("for (") == len(shapes), split
    assert " ? " not in split and "%" not in split, split
    assert split.count("nowait") == (len(shapes) - 1 if "omp for" in split else 0), split
    monkeypatch.setattr(rangesplit, "ENABLED", False)
    whole = dev.render(kernel, "k")
    assert whole.count("for (") == 1 and whole.count(" ? ") >= len(shapes), whole


def test_unbind_matches_torch_and_stays_a_view():
    """unbind along each dim (negative too) against numpy's slices; the parts are views:
    writing one writes the base, as torch's do; gradients reach every part's rows."""
    b = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    x = zyx.tensor(b)
    for dim in (0, 1, 2, -1):
        parts = zyx.unbind(x, dim)
        assert len(parts) == b.shape[dim]
        for i, p in enumerate(parts):
            assert np.array_equal(p.numpy(), np.take(b, i, axis=dim)), (dim, i)
    with pytest.raises(Exception):
        x.unbind(3)
    q, k, v = x.unbind(1)
    k += 100
    assert np.array_equal(x.numpy()[:, 1], b[:, 1] + 100)
    w = zyx.tensor(b, requires_grad=True)
    sum(p.sum() * (i + 1) for i, p in enumerate(w.unbind(2))).backward()
    assert np.array_equal(w.grad.numpy(), np.broadcast_to(np.arange(1, 5, dtype=np.float32), b.shape))


def test_split_chunk():
    b = np.random.randn(7, 4).astype(np.float32)
    x = zyx.Tensor(b)
    parts = x.split(3)
    ref = np.split(b, [3, 6])
    assert len(parts) == 3
    for p, r in zip(parts, ref):
        assert_close(p, r, dtype=zyx.float32)
    parts = zyx.split(x, [2, 5], dim=0)
    for p, r in zip(parts, np.split(b, [2])):
        assert_close(p, r, dtype=zyx.float32)
    parts = x.split(2, dim=1)
    for p, r in zip(parts, np.split(b, 2, axis=1)):
        assert_close(p, r, dtype=zyx.float32)
    chunks = x.chunk(3)
    assert [c.shape for c in chunks] == [(3, 4), (3, 4), (1, 4)]     # torch sizes
    assert_close(zyx.cat(chunks), b, dtype=zyx.float32)
    chunks = zyx.chunk(x, 2, dim=-1)
    for c, r in zip(chunks, np.split(b, 2, axis=1)):
        assert_close(c, r, dtype=zyx.float32)
    with pytest.raises(zyx.ShapeError):
        x.split([3, 3])


# ---------------------------------------------------------------------------------------
# tril / triu / pad

@pytest.mark.parametrize("k", [0, 1, -1, 3, -4])
def test_tril_triu(k):
    b = np.random.randn(2, 4, 5).astype(np.float32)
    x = zyx.Tensor(b)
    assert_close(x.tril(k), np.tril(b, k), dtype=zyx.float32)
    assert_close(x.triu(k), np.triu(b, k), dtype=zyx.float32)
    assert_close(zyx.tril(x, diagonal=k), np.tril(b, k), dtype=zyx.float32)
    assert_close(zyx.triu(x, diagonal=k), np.triu(b, k), dtype=zyx.float32)


def test_tril_triu_ints_and_views():
    b = np.arange(12, dtype=np.int32).reshape(3, 4)
    x = zyx.Tensor(b)
    assert_close(x.tril(), np.tril(b), dtype=zyx.int32)
    assert_close(x.T.triu(), np.triu(b.T), dtype=zyx.int32)
    m = np.array([[True, True], [True, True]])
    assert_close(zyx.Tensor(m).tril(), np.tril(m), dtype=zyx.bool)
    with pytest.raises(zyx.ShapeError):
        zyx.ones(3).tril()


def test_tensor_pad():
    b = np.random.randn(2, 3).astype(np.float32)
    x = zyx.Tensor(b)
    assert_close(x.pad((1, 2)), np.pad(b, ((0, 0), (1, 2))), dtype=zyx.float32)
    assert_close(x.pad((1, 0, 0, 2), value=-1.5),
                 np.pad(b, ((0, 2), (1, 0)), constant_values=-1.5), dtype=zyx.float32)
    assert_close(x.pad((-1, 1)), np.pad(b, ((0, 0), (0, 1)))[:, 1:], dtype=zyx.float32)
    assert_close(x.T.pad((2, 2, 1, 1)), np.pad(b.T, ((1, 1), (2, 2))), dtype=zyx.float32)
    i = np.arange(4, dtype=np.int64)
    assert_close(zyx.Tensor(i).pad((3, 1), value=7), np.pad(i, (3, 1), constant_values=7),
                 dtype=zyx.int64)
    with pytest.raises(zyx.ShapeError):
        x.pad((1, 1, 1, 1, 1, 1))
    with pytest.raises(NotImplementedError):
        x.pad((1, 1), mode="reflect")


def test_pad_then_reduce_and_chains(a):
    """Padding inside fused kernels: padded values must read as the fill value."""
    x = zyx.Tensor(a)
    p = np.pad(a, ((0, 0), (1, 1), (2, 0)), constant_values=-np.inf)
    got = x.pad((2, 0, 1, 1), value=float("-inf"))
    assert_close(got.amax(-1), p.max(-1), dtype=zyx.float32)
    assert_close(got.exp().sum(1), np.exp(p).sum(1), dtype=zyx.float32, scale=2)


# ---------------------------------------------------------------------------------------
# deep chains of movement ops (index arithmetic must compose correctly)

def test_movement_chain_compositions():
    b = np.random.randn(4, 6, 5).astype(np.float32)
    x = zyx.Tensor(b)
    got = x.permute(2, 0, 1).reshape(5, 24)[:, 3:21].reshape(5, 3, 6).flip(1).transpose(0, 2)
    ref = b.transpose(2, 0, 1).reshape(5, 24)[:, 3:21].reshape(5, 3, 6)[:, ::-1].swapaxes(0, 2)
    assert_close(got, ref, dtype=zyx.float32)
    got = x[::-1, 1::2].reshape(-1)[::3].reshape(4, 5).T.expand(2, 5, 4)
    ref = np.broadcast_to(b[::-1, 1::2].reshape(-1)[::3].reshape(4, 5).T, (2, 5, 4))
    assert_close(got, ref, dtype=zyx.float32)
    got = x.flip(2).reshape(4, 30).roll(7, 1).reshape(4, 6, 5).permute(1, 2, 0) + 1
    ref = np.roll(b[:, :, ::-1].reshape(4, 30), 7, 1).reshape(4, 6, 5).transpose(1, 2, 0) + 1
    assert_close(got, ref, dtype=zyx.float32)
    got = x.reshape(120).flip(0).reshape(6, 20)[1:5].reshape(8, 10).flip(0)
    ref = b.reshape(120)[::-1].reshape(6, 20)[1:5].reshape(8, 10)[::-1]
    assert_close(got, ref, dtype=zyx.float32)


@pytest.mark.parametrize("shape", [(5, 7), (3, 4, 5), (12,)])
def test_reshape_flip_reshape_every_split(shape):
    """Reshape -> flip -> reshape for every factorization: stresses floor vs truncation in
    the symbolic index division."""
    n = int(np.prod(shape))
    b = np.arange(n, dtype=np.int32).reshape(shape)
    x = zyx.Tensor(b)
    for rows in [r for r in range(1, n + 1) if n % r == 0]:
        got = x.reshape(rows, n // rows).flip(0).T.reshape(shape).flip(-1) - x
        ref = b.reshape(rows, n // rows)[::-1].T.reshape(shape)[..., ::-1] - b
        assert_close(got, ref, dtype=zyx.int32, msg=f"rows={rows}")


def test_movement_zero_dim_and_empty():
    s = zyx.Tensor(3.0)
    assert_close(s.reshape(1, 1), np.full((1, 1), 3.0, np.float32), dtype=zyx.float32)
    assert_close(s.expand(3), np.full(3, 3.0, np.float32), dtype=zyx.float32)
    assert s.flip().item() == 3.0 and s.T.item() == 3.0 and s.permute().item() == 3.0
    e = zyx.Tensor(np.zeros((0, 4), np.float32))
    assert e.reshape(4, 0).shape == (4, 0)
    assert e.T.numpy().shape == (4, 0)
    assert e.flip(0).numpy().shape == (0, 4)
    assert e.expand(2, 0, 4).numpy().shape == (2, 0, 4)
    assert zyx.cat([e, e]).numpy().shape == (0, 4)
    assert e.reshape(-1, 2).shape == (0, 2)
