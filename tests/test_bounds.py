"""A size that grows between otherwise equal graphs (autoregressive sampling's context)
becomes a symbolic size within a bound (zyx/bounds.py): one plan per power of two serves
every length. Results are checked against numpy at every length on every device (the
conftest `device` fixture); plan counts with zyx.stats()."""
import numpy as np
import pytest

import zyx
import zyx.nn.functional as F
from zyx import nn

from conftest import assert_close


def _stats():
    s = zyx.stats()
    return s["plans_built"], s["bound_runs"]


def _realize(*ts):
    zyx._RT.realize([t._id for t in ts])
    return [t.numpy() for t in ts]


def _softmax(a, axis=-1):
    e = np.exp(a - a.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _attention_np(x, wq, wk, wv):
    q, k, v = x @ wq, x @ wk, x @ wv
    s = q @ k.T / np.sqrt(q.shape[-1])
    n = x.shape[0]
    s = np.where(np.triu(np.ones((n, n), bool), 1), -np.inf, s)
    return _softmax(s) @ v


def test_growing_attention_shares_plans(device):
    """Causal self-attention on a context one longer each step: the whole output (a
    result with the growing size), its last row (a slice from the end) and its mean over
    positions (a reduction over the growing axis, 1/n read at launch)."""
    rng = np.random.default_rng(0)
    D = 8
    w = [rng.standard_normal((D, D)).astype(np.float32) for _ in range(3)]
    wq, wk, wv = [zyx.tensor(a) for a in w]
    seq = rng.standard_normal((40, D)).astype(np.float32)
    before = _stats()
    for n in range(1, 41):
        x = zyx.tensor(seq[:n])
        mask = zyx.tensor(np.triu(np.ones((n, n), bool), 1))
        q, k, v = x @ wq, x @ wk, x @ wv
        att = ((q @ k.T) / np.sqrt(D)).masked_fill(mask, float("-inf")).softmax(-1) @ v
        full, last, mean = _realize(att, att[-1], att.mean(0))
        ref = _attention_np(seq[:n], *w)
        assert full.shape == (n, D)
        assert_close(full, ref, atol=1e-4)
        assert_close(last, ref[-1], atol=1e-4)
        assert_close(mean, ref.mean(0), atol=1e-4)
    plans, runs = (a - b for a, b in zip(_stats(), before))
    # the first length (its own skeleton: no causal mask to apply at n = 1), then the first
    # graph of the family, then one plan per bound (16, 32, 64): not one per length
    assert runs >= 36, runs
    assert plans <= 6, plans


def test_reductions_over_the_growing_axis(device):
    rng = np.random.default_rng(1)
    data = rng.standard_normal((70, 3)).astype(np.float32)
    ints = rng.integers(-50, 50, (70, 3)).astype(np.int32)
    before = _stats()
    for n in (5, 6, 9, 17, 3, 33, 64, 65, 2):
        x, xi = zyx.tensor(data[:n]), zyx.tensor(ints[:n])
        got = _realize(x.sum(0), x.max(0).values, x.min(0).values, x.prod(0), x.mean(0),
                       x.var(0), xi.sum(0), xi.max(0).values, xi.min(0).values,
                       x.argmax(0), (x > 0).any(0), (x > -3).all(0), x.logsumexp(0))
        a, ai = data[:n], ints[:n]
        ref = (a.sum(0), a.max(0), a.min(0), a.prod(0), a.mean(0), a.var(0, ddof=1),
               ai.sum(0), ai.max(0), ai.min(0), a.argmax(0), (a > 0).any(0),
               (a > -3).all(0), np.log(np.exp(a).sum(0)))
        for g, r in zip(got, ref):
            if r.dtype.kind in "iub":
                assert np.array_equal(g, r), (n, g, r)
            else:
                assert_close(g, r, atol=1e-4, rtol=1e-4)
    plans, runs = (a - b for a, b in zip(_stats(), before))
    assert runs >= 6 and plans <= 6, (plans, runs)


def test_slices_pads_and_reshapes_of_the_growing_axis(device):
    rng = np.random.default_rng(2)
    data = rng.standard_normal((40, 4)).astype(np.float32)
    before = _stats()
    for n in (4, 7, 12, 30, 5, 19):
        x = zyx.tensor(data[:n])
        a = data[:n]
        y = x * 2 + 1
        got = _realize(y[1:], y[:-2], y[-3:], y[-1], y[2:-1].sum(0),
                       F.pad(y, (0, 0, 1, 2), value=7.0), F.pad(y, (0, 0, 0, 3)).sum(0),
                       y.reshape(-1).sum(), y.reshape(n, 2, 2).sum((0, 2)),
                       y.T @ y, y.unsqueeze(0).expand(3, n, 4).sum(1))
        b = a * 2 + 1
        ref = (b[1:], b[:-2], b[-3:], b[-1], b[2:-1].sum(0),
               np.pad(b, ((1, 2), (0, 0)), constant_values=7.0), b.sum(0), b.sum(),
               b.reshape(n, 2, 2).sum((0, 2)), b.T @ b, np.broadcast_to(b.sum(0), (3, 4)))
        for g, r in zip(got, ref):
            assert g.shape == r.shape, (n, g.shape, r.shape)
            assert_close(g, r, atol=1e-4, rtol=1e-4)
    plans, runs = (a - b for a, b in zip(_stats(), before))
    assert runs >= 3 and plans <= 5, (plans, runs)


def test_graphs_outside_the_rules_still_compute_right(device):
    """A flip of the growing axis and a reshape that merges it with an outer axis fall
    back to a plan per length: the values stay exact."""
    rng = np.random.default_rng(3)
    data = rng.standard_normal((2, 30)).astype(np.float32)
    for n in (3, 4, 9, 5):
        x, a = zyx.tensor(data[:, :n]), data[:, :n]
        got = _realize(x.flip(1) * 3, x.reshape(-1).cumsum(0))
        ref = (a[:, ::-1] * 3, a.reshape(-1).cumsum(0))
        for g, r in zip(got, ref):
            assert_close(g, r, atol=1e-4, rtol=1e-4)


def test_pads_whose_amount_before_grows(device):
    """Parts placed after a growing axis (a cat along it: the amount before the later
    parts grows with n), a growing part between fixed ones (its garbage past the real
    size masked), and a growing cut of a fixed tensor (`cache[:, :n]`, the end moving),
    also past the fixed tensor's size at the bound: one plan per bound, values exact."""
    rng = np.random.default_rng(3)
    data = rng.standard_normal((2, 60)).astype(np.float32)
    tail = rng.standard_normal((2, 3)).astype(np.float32)
    fixed = rng.standard_normal((2, 45)).astype(np.float32)   # never cut whole
    ints = rng.integers(-9, 9, (2, 60)).astype(np.int32)
    f = zyx.tensor(fixed)
    t = zyx.tensor(tail) * 1      # lazy parts: one realization (no cat done at once)
    before = _stats()
    for n in (3, 4, 9, 5, 17, 30, 33, 40, 2):
        x, a = zyx.tensor(data[:, :n]) * 1, data[:, :n]
        xi, ai = zyx.tensor(ints[:, :n]) * 1, ints[:, :n]
        y = x * 2
        got = _realize(zyx.cat([x, t], 1), zyx.cat([x, t], 1).sum(1),
                       zyx.cat([t, y, t], 1), zyx.cat([y, x, t], 1).amax(1),
                       (f[:, :n] + y).sum(1), f[:, :n] * 3, zyx.cat([xi, xi + 1], 1))
        b = a * 2
        ref = (np.concatenate([a, tail], 1), np.concatenate([a, tail], 1).sum(1),
               np.concatenate([tail, b, tail], 1), np.concatenate([b, a, tail], 1).max(1),
               (fixed[:, :n] + b).sum(1), fixed[:, :n] * 3,
               np.concatenate([ai, ai + 1], 1))
        for g, r in zip(got, ref):
            assert g.shape == r.shape, (n, g.shape, r.shape)
            if r.dtype.kind == "i":
                assert np.array_equal(g, r), (n, g, r)
            else:
                assert_close(g, r, atol=1e-4, rtol=1e-4)
    plans, runs = (a - b for a, b in zip(_stats(), before))
    # n = 3 and 4 exact, then bounds 16, 32 and 64: not one plan per length
    assert runs >= 6 and plans <= 5, (plans, runs)


@pytest.mark.parametrize("spelling", ["realize idx", "read nxt", "read at the end"])
def test_cat_loop_shares_plans(device, spelling):
    """nanoGPT's generate, `idx = cat([idx, nxt], 1)` with nxt computed on the device,
    on every device: with idx realized each step, with only nxt read each step (idx's
    cat would otherwise stay lazy, a chain one cat deeper every step), and with nothing
    read until the end (the loop as PyTorch users write it). A small append to a realized
    tensor is realized at once (tensor.cat), so each step's graph is the model on a
    longer idx: a plan per power of two of the length, the text equal to numpy's."""
    zyx.manual_seed(0)
    V, D = 11, 8
    emb, head = nn.Embedding(V, D), nn.Linear(D, V)
    E, W, b = emb.weight.numpy(), head.weight.numpy(), head.bias.numpy()
    idx = zyx.tensor(np.array([[3]]))
    before = _stats()
    with zyx.no_grad():
        for _ in range(40):
            h = emb(idx).mean(1)                      # (1, D): a reduce over the context
            nxt = F.softmax(head(h), dim=-1).argmax(-1, keepdim=True)
            idx = zyx.cat([idx, nxt], 1)
            if spelling == "realize idx":
                idx.realize()
            elif spelling == "read nxt":
                nxt.item()
            assert zyx._RT.graph.get(idx._id).op == 0      # a realized leaf
    codes = idx.numpy()[0]
    assert codes.shape == (41,)
    for n in range(1, 41):                           # every step's choice, from numpy
        assert (E[codes[:n]].mean(0) @ W.T + b).argmax() == codes[n], n
    plans, runs = (a - b for a, b in zip(_stats(), before))
    assert runs >= 30 and plans <= 8, (plans, runs)   # (exact plans of earlier runs hit)


def key_value_cache_steps(steps=40):
    """Attention over a preallocated key/value cache written at step t (`cache[:, :, t] =
    k`, reading `cache[:, :, :t + 1]`): yields (t, caches) after each step, whose result
    was checked against numpy; the key cache's first 40 rows are checked at the end."""
    B, H, TM, Dh, D = 1, 2, 48, 4, 8
    rng = np.random.default_rng(7)
    xs = rng.standard_normal((TM, B, D)).astype(np.float32)
    W = [rng.standard_normal((D, H * Dh)).astype(np.float32) * 0.3 for _ in range(3)]
    wq, wk, wv = [zyx.tensor(w) for w in W]
    ck = zyx.zeros((B, H, TM, Dh)).realize()
    cv = zyx.zeros((B, H, TM, Dh)).realize()
    with zyx.no_grad():
        for t in range(steps):
            x = zyx.tensor(xs[t])
            q, k, v = [(x @ w).reshape(B, H, Dh) for w in (wq, wk, wv)]
            ck[:, :, t] = k
            cv[:, :, t] = v
            s = (q.unsqueeze(2) @ ck[:, :, :t + 1].transpose(-1, -2)) / np.sqrt(Dh)
            got = (s.softmax(-1) @ cv[:, :, :t + 1]).numpy()
            kn, vn = [np.stack([(xs[i] @ W[j]).reshape(B, H, Dh) for i in range(t + 1)], 2)
                      for j in (1, 2)]
            sn = (xs[t] @ W[0]).reshape(B, H, 1, Dh) @ kn.transpose(0, 1, 3, 2) / np.sqrt(Dh)
            assert_close(got, _softmax(sn) @ vn, atol=1e-4, rtol=1e-4)
            yield t, (ck, cv)
    assert_close(ck.numpy()[:, :, :steps], np.stack([(xs[i] @ W[1]).reshape(B, H, Dh)
                                                     for i in range(steps)], 2), atol=1e-5)
    assert not ck.numpy()[:, :, steps:].any()


def test_key_value_cache_written_in_place_shares_plans(device):
    """key_value_cache_steps: the write builds the same graph at every t (the position is
    data), the attention runs at bounds on t; the kernels each step launches stay the
    same number; values against numpy at every step."""
    before = _stats()
    launched = [zyx.stats()["kernels_launched"] for _ in key_value_cache_steps()]
    plans, runs = (a - b for a, b in zip(_stats(), before))
    assert runs >= 35 and plans <= 7, (plans, runs)
    per_step = np.diff(launched[17:])               # steps at bounds 32 and 64
    assert (per_step == per_step[0]).all(), per_step


def test_integer_inputs_and_embeddings_grow(device):
    """Token ids as the growing input (staged into a zero-filled bound buffer), an
    embedding lookup, positions from arange(n), a linear head; the last position's
    softmax, as a sampling loop reads it."""
    zyx.manual_seed(0)
    emb, pos, head = nn.Embedding(11, 6), nn.Embedding(64, 6), nn.Linear(6, 11)
    E, P = emb.weight.numpy(), pos.weight.numpy()
    W, b = head.weight.numpy(), head.bias.numpy()
    rng = np.random.default_rng(4)
    codes = rng.integers(0, 11, 50)
    before = _stats()
    with zyx.no_grad():
        for n in range(1, 50, 3):
            idx = zyx.tensor(codes[None, :n])
            h = emb(idx) + pos(zyx.arange(n))
            probs = F.softmax(head(h)[:, -1, :], dim=-1)
            ref = _softmax((E[codes[:n]] + P[:n]) @ W.T + b)[-1]
            assert_close(probs.numpy()[0], ref, atol=1e-5)
    plans, runs = (a - b for a, b in zip(_stats(), before))
    assert runs >= 12 and plans <= 6, (plans, runs)


def test_varying_batch_training_step_gradients(device):
    """A last batch of another size (a DataLoader without drop_last): the step's loss and
    gradients at each batch size against numpy."""
    rng = np.random.default_rng(5)
    w_np = rng.standard_normal((5, 3)).astype(np.float32)
    X = rng.standard_normal((40, 5)).astype(np.float32)
    Y = rng.standard_normal((40, 3)).astype(np.float32)
    w = zyx.tensor(w_np, requires_grad=True)
    before = _stats()
    for n in (16, 16, 7, 16, 3, 12, 7):
        x, y = zyx.tensor(X[:n]), zyx.tensor(Y[:n])
        loss = ((x @ w - y) ** 2).mean()
        w.grad = None
        loss.backward()
        got_loss, got_grad = _realize(loss, w.grad)
        r = X[:n] @ w_np - Y[:n]
        assert_close(got_loss, (r ** 2).mean(), atol=1e-5, rtol=1e-5)
        assert_close(got_grad, 2 * X[:n].T @ r / r.size, atol=1e-5, rtol=1e-5)
    # 16 and 7 are planned exactly; 3 and 12 run at bounds 16
    assert _stats()[1] - before[1] == 2


def test_sampling_a_transformer_builds_a_handful_of_plans(device):
    """The issue's figure: sampling with a growing context (no crop) builds a plan per
    power of two, not one per token; the probabilities match the same model computed
    with every plan built afresh."""
    zyx.manual_seed(0)
    V, D = 13, 16
    layer = nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=True)
    emb, head = nn.Embedding(V, D), nn.Linear(D, V)
    rng = np.random.default_rng(6)
    codes = list(rng.integers(0, V, 3))

    def probs_of(codes):
        idx = zyx.tensor(np.array([codes]))
        n = len(codes)
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        out = head(layer(emb(idx), src_mask=mask, is_causal=True))
        return F.softmax(out[0, -1], dim=-1).numpy()

    before = _stats()
    seen = []
    with zyx.no_grad():
        for _ in range(30):
            p = probs_of(codes)
            seen.append(p)
            codes.append(int(np.argmax(p)))
        plans, runs = (a - b for a, b in zip(_stats(), before))
        assert runs >= 27 and plans <= 5, (plans, runs)
        # the same lengths again with bound plans switched off: identical probabilities
        for n in (3, 7, 18, 32):
            zyx._RT._bound_families.clear()
            zyx._RT.plans.clear()
            assert_close(probs_of(codes[:n]), seen[n - 3], atol=1e-5)


def test_two_sizes_are_planned_exactly_and_the_switch_turns_bounds_off(device, monkeypatch):
    """A size seen with two values (a training loop's last, smaller batch) keeps exact
    plans; a third value runs at a bound; config "growing_sizes": false plans every size."""
    data = np.arange(100, dtype=np.float32)
    before = _stats()
    for n in (40, 30, 40, 30):
        assert_close((zyx.tensor(data[:n]) * 2).sum().numpy(), data[:n].sum() * 2)
    assert _stats()[1] == before[1]
    assert_close((zyx.tensor(data[:20]) * 2).sum().numpy(), data[:20].sum() * 2)
    assert _stats()[1] == before[1] + 1
    monkeypatch.setattr(zyx._RT, "growing_sizes", False)
    assert_close((zyx.tensor(data[:21]) * 2).sum().numpy(), data[:21].sum() * 2)
    assert _stats()[1] == before[1] + 1


def test_growing_sizes_config_is_checked():
    from zyx.runtime import _growing_sizes
    assert _growing_sizes({}) is True
    assert _growing_sizes({"growing_sizes": False}) is False
    with pytest.warns(RuntimeWarning, match="growing_sizes"):
        assert _growing_sizes({"growing_sizes": "no"}) is True


def test_inputs_too_large_to_stage_keep_a_plan_per_size(device, monkeypatch):
    import zyx.bounds
    monkeypatch.setattr(zyx.bounds, "STAGE_LIMIT", 1000)
    data = np.arange(1000, dtype=np.float32)
    before = _stats()
    for n in (300, 200, 250, 260):     # 250 floats staged at bound 256: 1024 bytes
        assert_close((zyx.tensor(data[:n]) + 1).max().numpy(), n)
    assert _stats()[1] == before[1]


def test_remembered_skeletons_are_bounded(device, monkeypatch):
    import zyx.bounds
    monkeypatch.setattr(zyx.bounds, "MAX_FAMILIES", 3)
    x = zyx.tensor(np.arange(10, dtype=np.float32))
    y = x
    for k in range(8):                 # eight skeletons: one more op each
        y = y * 2
        assert_close(y.numpy(), np.arange(10) * 2.0 ** (k + 1))
        assert len(zyx._RT._bound_families) <= 3


def test_sampling_with_cat_shares_plans(on_cpu):
    """nanoGPT's generate: `idx = cat([idx, nxt], 1)` every step. Small realized parts on
    the CPU are concatenated at once (Runtime.concat_copy), so idx stays a realized tensor
    whose length grows, and the model's graphs share bound plans."""
    zyx.manual_seed(0)
    V, D = 11, 8
    emb, head = nn.Embedding(V, D), nn.Linear(D, V)
    E, W, b = emb.weight.numpy(), head.weight.numpy(), head.bias.numpy()
    idx = zyx.tensor(np.array([[3]]))
    before = _stats()
    with zyx.no_grad():
        for _ in range(40):
            h = emb(idx).mean(1)                     # (1, D): a reduce over the context
            probs = F.softmax(head(h), dim=-1)
            nxt = zyx.tensor(np.array([[int(np.argmax(probs.numpy()))]]))
            idx = zyx.cat([idx, nxt], 1)
            assert zyx._RT.graph.get(idx._id).op == 0      # a realized leaf
    codes = idx.numpy()[0]
    for n in (1, 7, 20, 40):                        # every step's choice, from numpy
        p = (E[codes[:n]].mean(0) @ W.T + b).argmax()
        assert p == codes[n]
    plans, runs = (a - b for a, b in zip(_stats(), before))
    assert runs >= 35 and plans <= 6, (plans, runs)


def test_concat_copy_keeps_dtypes_and_gradients(device):
    """Realized parts are joined at once (a realized leaf comes out): along the first
    axis, and along a later one behind axes of length 1 (a batch of one); on the CPU
    along any axis."""
    _copies_leaves(device)
    align = _region_align()
    for d in (zyx.float32, zyx.int64, zyx.int32, zyx.bool, zyx.bfloat16, zyx.float16):
        if not _has_dtype(d):
            continue
        for shape_a, shape_b, axis in (((2, 3), (1, 3), 0), ((1, 3), (1, 2), 1),
                                       ((1, 1, 3), (1, 1, 2), 2), ((1, 4), (1, 8), 1)):
            a = zyx.tensor(np.arange(np.prod(shape_a)).reshape(shape_a) % 2, dtype=d)
            b = zyx.tensor(np.ones(shape_b), dtype=d)
            out = zyx.cat([a, b, a], axis)
            # (a pool copying whole words only (WebGPU) keeps parts of other sizes lazy)
            whole = all(np.prod(s) * d.itemsize % align == 0 for s in (shape_a, shape_b))
            assert (zyx._RT.graph.get(out._id).op == 0) == whole and out.dtype == d
            want = np.concatenate([a.numpy(), b.numpy(), a.numpy()], axis)
            assert np.array_equal(out.numpy(), want)
    a = zyx.tensor(np.arange(6, dtype=np.int32).reshape(2, 3))
    out = zyx.cat([a, a[:, :1]], 1)         # rows of two: on a device, a lazy cat
    assert np.array_equal(out.numpy(), np.concatenate([a.numpy(), a.numpy()[:, :1]], 1))
    # a part that needs a gradient keeps cat lazy and differentiable
    w = zyx.tensor(np.ones((2, 2), np.float32), requires_grad=True)
    y = zyx.cat([w, zyx.tensor(np.zeros((2, 1), np.float32))], 1)
    (y * 3).sum().backward()
    assert np.array_equal(w.grad.numpy(), np.full((2, 2), 3.0, np.float32))


def _region_align():
    """The default device's copy alignment in bytes (1 in host memory)."""
    probe = zyx.tensor(np.zeros(4, np.float32)).realize()
    return getattr(zyx._RT.graph.get(probe._id).buffer.pool, "region_align", 1)


def _has_dtype(d):
    try:
        zyx.zeros(2, dtype=d).realize()
    except zyx.errors.UnsupportedDTypeError:
        return False
    return True


def _copies_leaves(device):
    """Skip unless the default device's tensors are copied at once when cut or appended to
    (Runtime.copies_leaf: host memory, or a pool that copies regions on its device)."""
    probe = zyx.tensor(np.zeros(4, np.float32)).realize()
    if not zyx._RT.copies_leaf(probe._id):
        pytest.skip(f"{device}: its memory pool does not copy regions on the device "
                    "(windows and appends stay lazy there)")


def test_cropped_context_needs_no_growing_plan(device):
    """nanoGPT's generate with its context cropped (`idx[:, -T:]`) and the next token still
    lazy when appended: the small window is copied at once (Runtime.window_copy: on the
    host, or by a device copy) and the lazy token realized before the cat joins the two
    realized parts (Runtime.concat_copy), so once the context is full every step's graph
    is the same and no realization has a size that grows (no bound runs, no new
    plans)."""
    _copies_leaves(device)
    zyx.manual_seed(0)
    V, D, T = 11, 8, 6
    emb, head = nn.Embedding(V, D), nn.Linear(D, V)
    E, W, b = emb.weight.numpy(), head.weight.numpy(), head.bias.numpy()
    idx = zyx.tensor(np.array([[3]]))
    with zyx.no_grad():
        for step in range(30):
            if step == T + 2:
                before = _stats()
            ctx = idx[:, -T:]
            probs = F.softmax(head(emb(ctx).mean(1)), dim=-1)
            idx = zyx.cat([idx, zyx.argmax(probs, dim=-1, keepdim=True)], 1)
            assert zyx._RT.graph.get(idx._id).op == 0      # a realized leaf
    plans, runs = (a - b for a, b in zip(_stats(), before))
    assert plans == 0 and runs == 0, (plans, runs)
    codes = idx.numpy()[0]
    for n in (1, 5, 6, 7, 20, 30):                  # every step's choice, from numpy
        p = (E[codes[max(0, n - T):n]].mean(0) @ W.T + b).argmax()
        assert p == codes[n]


def test_small_windows_of_realized_tensors_are_views(device):
    """A small window of a realized tensor is copied at once, and still behaves as a
    view: writes through it reach the base, writes to the base reach it."""
    _copies_leaves(device)
    a = np.arange(24, dtype=np.int32).reshape(2, 12)
    z = zyx.tensor(a)
    for key in [(slice(None), slice(-5, None)), (1, slice(2, 7)), (0,), (slice(0, 1), 3)]:
        assert np.array_equal(z[key].numpy(), a[key]), key
    w = z[:, 3:6]
    w[0, 1] = 100
    a[:, 3:6][0, 1] = 100
    assert np.array_equal(z.numpy(), a)
    v = z[1, 2:5]
    z[1, 3] = -7
    a[1, 3] = -7
    assert np.array_equal(v.numpy(), a[1, 2:5])
    z += 1
    assert np.array_equal(v.numpy(), a[1, 2:5] + 1)
