"""Issue 10, smaller trust defects: thread-local grad mode and thread-safe realization,
cleanup after an interrupted realization, lazily loaded files changed on disk, atomic
load_state_dict, errors that name their cause."""
from __future__ import annotations

import gc
import sys
import threading

import numpy as np
import pytest

import zyx
from zyx import nn
from zyx.runtime import RT


# ---------------------------------------------------------------------------------------
# helpers

def pool_bytes():
    gc.collect()
    return RT.pool_bytes()


def run_threads(fns):
    """Run every fn in its own thread, started together; re-raise the first failure."""
    start = threading.Barrier(len(fns))
    errors = []

    def body(fn):
        try:
            start.wait()
            fn()
        except BaseException as e:  # noqa: BLE001 (reported to the test below)
            errors.append(e)

    threads = [threading.Thread(target=body, args=(fn,)) for fn in fns]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)     # switch threads often: interleave op by op
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(old)
    assert not any(t.is_alive() for t in threads), "a thread hangs"
    if errors:
        raise errors[0]


# ---------------------------------------------------------------------------------------
# 1. grad mode is per thread; realization is safe under threads

def make_mlp(seed):
    zyx.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))


def mlp_data(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((32, 6)).astype(np.float32)
    y = (x[:, :1] * 0.5 - x[:, 1:2] + 0.25).astype(np.float32)
    return x, y


def train(model, x, y, steps=12):
    """SGD steps on a mean squared error; (losses, gradients of every step)."""
    opt = zyx.optim.SGD(model.parameters(), lr=0.05)
    xt, yt = zyx.tensor(x), zyx.tensor(y)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(xt) - yt) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        grads.append([p.grad.numpy() for p in model.parameters()])
    return losses, grads


def numpy_forward(model, x):
    w1, b1, w2, b2 = [p.numpy() for p in model.parameters()]
    return np.maximum(x @ w1.T + b1, 0) @ w2.T + b2


def test_grad_mode_is_per_thread():
    inside = threading.Event()
    leave = threading.Event()
    seen = {}

    def evaluator():
        with zyx.no_grad():
            inside.set()
            leave.wait(30)
            seen["evaluator"] = zyx.is_grad_enabled()

    t = threading.Thread(target=evaluator)
    t.start()
    try:
        assert inside.wait(30)
        w = zyx.tensor([1.0, 2.0], requires_grad=True)
        seen["main"] = zyx.is_grad_enabled()
        (w * w).sum().backward()
        np.testing.assert_allclose(w.grad.numpy(), [2.0, 4.0])
    finally:
        leave.set()
        t.join(30)
    assert seen == {"main": True, "evaluator": False}


def test_tape_records_only_its_own_thread():
    opened = threading.Event()
    done = threading.Event()
    out = {}

    def other():
        opened.wait(30)
        a = zyx.tensor([1.0, 2.0])
        out["other"] = (a * 3).requires_grad    # no tape in this thread: not recorded
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with zyx.Tape() as tape:
        x = zyx.tensor([3.0])
        tape_out = x * x
        opened.set()
        done.wait(30)
    t.join(30)
    assert out == {"other": False}
    np.testing.assert_allclose(tape.gradient(tape_out, x).numpy(), [6.0])


def test_backward_template_trace_sees_only_its_own_thread():
    """While one thread traces a backward pass for a template, nodes another thread builds
    must not land in the trace (the template would replay them)."""
    graph = RT.graph
    graph.trace = mine = []
    try:
        seen = {}

        def other():
            seen["trace"] = graph.trace
            (zyx.tensor([1.0, 2.0]) * 3.0).sum()

        t = threading.Thread(target=other)
        t.start()
        t.join(30)
        assert mine == [] and seen == {"trace": None}
        built = zyx.ones(2) + 1.0
        assert len(mine) >= 1 and built.shape == (2,)    # this thread's nodes are traced
    finally:
        graph.trace = None


def test_four_threads_train_while_one_evaluates():
    """Four threads train their own MLP while a fifth evaluates a model under no_grad in a
    loop: every trainer's losses and gradients equal a single-threaded run."""
    seeds = [11, 12, 13, 14]
    expected = [train(make_mlp(s), *mlp_data(s)) for s in seeds]
    base = pool_bytes()

    models = [make_mlp(s) for s in seeds]
    eval_model = make_mlp(99)
    ex, _ = mlp_data(99)
    got = [None] * len(seeds)
    trainers_done = threading.Event()
    evals = []

    def trainer(i):
        def fn():
            got[i] = train(models[i], *mlp_data(seeds[i]))
        return fn

    def evaluator():
        want = numpy_forward(eval_model, ex)
        xt = zyx.tensor(ex)
        with zyx.no_grad():
            while not trainers_done.is_set() or len(evals) < 3:
                out = eval_model(xt)
                assert not out.requires_grad
                evals.append(np.abs(out.numpy() - want).max())

    trainer_fns = [trainer(i) for i in range(len(seeds))]

    def trainers_then_signal(fns):
        def fn():
            run_threads(fns)
            trainers_done.set()
        return fn

    run_threads([trainers_then_signal(trainer_fns), evaluator])
    assert max(evals) < 1e-5
    for (losses, grads), (want_losses, want_grads) in zip(got, expected):
        assert losses[-1] < losses[0] * 0.9          # it trains
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
        for step, want_step in zip(grads, want_grads):
            for g, w in zip(step, want_step):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    del models, eval_model, trainer_fns
    assert pool_bytes() == base       # every thread's parameters and states are freed


def test_one_lazy_tensor_realized_by_four_threads_does_not_leak():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((512, 256)).astype(np.float32)
    b = rng.standard_normal((256, 512)).astype(np.float32)
    want = a @ b
    ta, tb = zyx.tensor(a), zyx.tensor(b)
    (ta @ tb + 1.0).numpy()         # compile the plan outside the measurement
    base = pool_bytes()
    for _ in range(3):
        lazy = ta @ tb + 1.0
        results = [None] * 4

        def reader(i, lazy=lazy, results=results):
            def fn():
                results[i] = lazy.numpy()
            return fn

        run_threads([reader(i) for i in range(4)])
        for r in results:
            np.testing.assert_allclose(r, want + 1.0, rtol=1e-4, atol=1e-3)
        del lazy, results, reader     # reader keeps the last tensor as a default
    assert pool_bytes() == base


# ---------------------------------------------------------------------------------------
# 2. an interrupted or failed realization releases what it allocated

def chain(ta, tb, tc):
    """Two matmuls: a temporary in the plan's arena and a target of its own."""
    return (ta @ tb).relu() @ tc


@pytest.fixture
def chain_inputs():
    rng = np.random.default_rng(1)
    arrs = [rng.standard_normal((384, 384)).astype(np.float32) for _ in range(3)]
    want = np.maximum(arrs[0] @ arrs[1], 0) @ arrs[2]
    return [zyx.tensor(a) for a in arrs], want


def test_keyboard_interrupt_during_run_frees_the_plan_buffers(on_cpu, monkeypatch, chain_inputs):
    ts, want = chain_inputs
    chain(*ts).numpy()                       # compiled outside the measurement
    base = pool_bytes()
    dev = RT.device()
    run_plan = type(dev).run_plan

    def interrupted(self, program, table, parallel=True):
        run_plan(self, program, table, parallel)
        raise KeyboardInterrupt              # Ctrl-C while the program ran

    monkeypatch.setattr(type(dev), "run_plan", interrupted)
    for _ in range(3):
        lazy = chain(*ts)
        with pytest.raises(KeyboardInterrupt):
            lazy.realize()
        assert pool_bytes() == base           # nothing of the aborted run stays allocated
    monkeypatch.undo()
    np.testing.assert_allclose(lazy.numpy(), want, rtol=1e-3, atol=1e-2)   # still works
    del lazy
    assert pool_bytes() == base


def test_failed_allocation_frees_what_was_allocated(monkeypatch, chain_inputs):
    ts, want = chain_inputs
    chain(*ts).numpy()
    base = pool_bytes()
    pool = RT.device().pool
    allocate = type(pool).allocate
    calls = []

    def second_fails(self, nbytes):
        calls.append(nbytes)
        if len(calls) == 2:
            raise zyx.AllocationError(f"test: no room for {nbytes} bytes")
        return allocate(self, nbytes)

    monkeypatch.setattr(type(pool), "allocate", second_fails)
    lazy = chain(*ts)
    with pytest.raises(zyx.AllocationError):
        lazy.realize()
    assert len(calls) == 2
    monkeypatch.undo()
    assert pool_bytes() == base
    np.testing.assert_allclose(lazy.numpy(), want, rtol=1e-3, atol=1e-2)


# ---------------------------------------------------------------------------------------
# 3. lazily loaded safetensors files that change on disk; hostile headers

def saved_file(tmp_path):
    """A safetensors file whose modification time lies in the past, so a rewrite is seen
    even within the file system's timestamp granularity."""
    path = tmp_path / "model.safetensors"
    w = np.arange(4096, dtype=np.float32).reshape(64, 64)
    zyx.save({"w": w, "b": np.ones(64, np.float32)}, path)
    past = 1_000_000_000 * 10**9
    import os
    os.utime(path, ns=(past, past))
    return path, w


def test_truncated_file_raises_instead_of_sigbus(tmp_path):
    """Run in a child process: on a file truncated under the mapping a read used to kill
    the process with SIGBUS."""
    import subprocess
    import textwrap
    path, _ = saved_file(tmp_path)
    script = textwrap.dedent(f"""
        import os, zyx
        t = zyx.load({str(path)!r})
        os.truncate({str(path)!r}, 100)
        try:
            t["w"].numpy()
        except zyx.ZyxError as e:
            print("raised:", e)
        """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, f"child died with {r.returncode}: {r.stderr}"
    assert "raised:" in r.stdout and str(path) in r.stdout and "truncated" in r.stdout


def test_file_rewritten_in_place_raises(tmp_path):
    path, w = saved_file(tmp_path)
    t = zyx.load(path)
    data = bytearray(path.read_bytes())
    data[-64 * 4:] = np.full(64, 7.0, np.float32).tobytes()     # same size, other values
    with open(path, "r+b") as f:
        f.write(data)
    with pytest.raises(zyx.ZyxError, match="rewritten in place") as e:
        t["w"].numpy()
    assert str(path) in str(e.value)
    with pytest.raises(zyx.ZyxError, match="model.safetensors"):
        (t["b"] + 1).numpy()          # a kernel reading the leaf checks too


def test_file_replaced_by_save_keeps_old_values(tmp_path):
    path, w = saved_file(tmp_path)
    t = zyx.load(path)
    zyx.save({"w": np.zeros((64, 64), np.float32)}, path)      # new file, renamed over
    np.testing.assert_array_equal(t["w"].numpy(), w)


@pytest.mark.parametrize("depth", [5_000, 200_000])
def test_deeply_nested_header_is_a_clear_error(tmp_path, depth):
    import struct
    header = b"[" * depth + b"]" * depth
    path = tmp_path / "nested.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(zyx.io.SafetensorsError, match="nests") as e:
        zyx.load(path)
    assert isinstance(e.value, zyx.ZyxError) and str(path) in str(e.value)
    nested_entry = b'{"w": {"dtype": "F32", "shape": ' + b"[" * depth + b"]" * depth + b"}}"
    path.write_bytes(struct.pack("<Q", len(nested_entry)) + nested_entry)
    with pytest.raises(zyx.io.SafetensorsError):
        zyx.load(path)


# ---------------------------------------------------------------------------------------
# 4. load_state_dict checks every value before it assigns any

def two_layers():
    zyx.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def values_of(model):
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("bad, cause", [
    (np.array([["a"] * 4] * 2), "dtype <U1"),
    (np.array([[object()] * 4] * 2, dtype=object), "dtype object"),
    (np.ones((2, 4), np.complex64), "dtype complex64"),
    ([[1.0, 2.0], [3.0]], "not an array"),
    (np.ones((4, 2), np.float32), "size mismatch"),
])
def test_load_state_dict_with_a_bad_value_changes_nothing(bad, cause):
    model = two_layers()
    before = values_of(model)
    new = {k: v + 1 for k, v in before.items()}
    new["1.weight"] = bad                     # the third of four values, after two good ones
    with pytest.raises(zyx.ZyxError, match="1.weight") as e:
        model.load_state_dict(new)
    assert cause in str(e.value)
    after = values_of(model)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])


@pytest.mark.parametrize("change", ["missing", "unexpected"])
def test_strict_load_state_dict_with_wrong_keys_changes_nothing(change):
    model = two_layers()
    before = values_of(model)
    new = {k: v + 1 for k, v in before.items()}
    if change == "missing":
        del new["1.bias"]
    else:
        new["2.weight"] = np.ones((2, 2), np.float32)
    with pytest.raises(zyx.ZyxError, match=change):
        model.load_state_dict(new)
    for k, v in values_of(model).items():
        np.testing.assert_array_equal(v, before[k])
    model.load_state_dict(new, strict=False)     # the good values load without strict
    np.testing.assert_array_equal(model.state_dict()["0.weight"].numpy(),
                                  before["0.weight"] + 1)


def test_load_state_dict_casts_numeric_values_like_torch():
    model = two_layers()
    new = {k: np.ones(v.shape, np.int64) for k, v in values_of(model).items()}
    model.load_state_dict(new)
    for v in model.state_dict().values():
        assert v.dtype is zyx.float32
        np.testing.assert_array_equal(v.numpy(), 1.0)


# ---------------------------------------------------------------------------------------
# 5. errors that name their cause (torch's exception types where torch raises)

@pytest.mark.parametrize("op", ["max", "min", "amax", "amin", "sum", "prod", "argmax",
                                "argmin", "mean", "var", "std"])
@pytest.mark.parametrize("axis", [0, -1])
@pytest.mark.filterwarnings("ignore:.*degrees of freedom")   # torch's var/std of one value
def test_reductions_of_a_0d_tensor_over_axis_0_like_torch(op, axis):
    torch = pytest.importorskip("torch")
    got = getattr(zyx.tensor(2.5), op)(axis)
    want = getattr(torch.tensor(2.5), op)(axis)
    if op in ("max", "min"):           # (values, indices) in both
        assert got.indices.numpy() == want.indices.numpy()
        got, want = got.values, want.values
    got, want = got.numpy(), want.numpy()
    np.testing.assert_array_equal(got, want)
    assert got.shape == ()


@pytest.mark.parametrize("op", ["max", "min", "sum", "argmax", "argmin", "mean", "var",
                                "std"])
@pytest.mark.parametrize("shape, axis", [((), 1), ((), -2), ((3,), 1), ((2, 3), -3)])
def test_reduction_over_a_missing_axis_is_an_index_error_like_torch(op, shape, axis):
    torch = pytest.importorskip("torch")
    with pytest.raises(IndexError) as want:
        getattr(torch.zeros(shape), op)(axis)
    with pytest.raises(IndexError) as got:
        getattr(zyx.zeros(*shape), op)(axis)
    assert isinstance(got.value, zyx.ShapeError)      # still a zyx error
    assert str(want.value) in str(got.value)          # "Dimension out of range (...)"


def test_tensor_too_large_to_address_is_an_allocation_error():
    with pytest.raises(zyx.AllocationError, match=r"\(4611686018427387904, 4\).*bytes"):
        zyx.zeros(2**62, 4).realize()
    with pytest.raises(zyx.AllocationError, match="bytes"):
        zyx.ones(2**62, 4).sum().realize()
    np.testing.assert_array_equal(zyx.zeros(2, 4).numpy(), np.zeros((2, 4)))   # still works


@pytest.mark.parametrize("chunks", [0, -1])
def test_chunk_needs_a_positive_count(chunks):
    with pytest.raises(zyx.ZyxError, match="greater than 0"):
        zyx.ones(4).chunk(chunks)
    with pytest.raises(zyx.ZyxError, match="greater than 0"):
        zyx.chunk(zyx.ones(4), chunks)


@pytest.mark.parametrize("cond", [np.array([1.0, 0.0, 0.5], np.float32),
                                  np.array([1.0, 0.0, np.nan])])
def test_where_refuses_a_float_condition(cond):
    a, b = zyx.ones(3), zyx.zeros(3)
    for c in (zyx.tensor(cond), cond):
        with pytest.raises(zyx.DTypeError, match="bool condition"):
            zyx.where(c, a, b)
        with pytest.raises(zyx.DTypeError, match="bool condition"):
            a.where(c, b)
    got = zyx.where(zyx.tensor(cond) != 0, a, b).numpy()
    np.testing.assert_array_equal(got, np.where(cond != 0, 1.0, 0.0))


@pytest.mark.parametrize("args", [(0, 2), ((0, 2),), ([1],), (-1, 0)])
def test_flip_takes_axes_as_varargs_like_torch(args):
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    axes = args[0] if len(args) == 1 else args
    np.testing.assert_array_equal(zyx.tensor(x).flip(*args).numpy(), np.flip(x, axes))
    np.testing.assert_array_equal(zyx.tensor(x).flip(dims=axes).numpy(), np.flip(x, axes))


def test_realize_several_tensors_in_one_plan():
    """zyx.realize(a, b, ...) computes them in one realization: the forward they share
    runs once (one plan, not one per tensor); None is skipped, other values raise."""
    import zyx.nn.functional as F
    rng = np.random.default_rng(1)
    xn = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    wn = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    x = zyx.tensor(xn, requires_grad=True)
    w = zyx.tensor(wn, requires_grad=True)
    y = F.conv2d(x, w, padding=1)
    loss = (y * y).sum()
    loss.backward()
    before = zyx.stats()["realizations"]
    out = zyx.realize(loss, x.grad, None, w.grad)
    assert zyx.stats()["realizations"] == before + 1
    assert out[0] is loss and out[2] is None and out[3] is w.grad
    x2 = zyx.tensor(xn, requires_grad=True)
    w2 = zyx.tensor(wn, requires_grad=True)
    l2 = (F.conv2d(x2, w2, padding=1) ** 2).sum()
    l2.backward()
    np.testing.assert_allclose(x.grad.numpy(), x2.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(w.grad.numpy(), w2.grad.numpy(), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(loss.item(), l2.item(), rtol=1e-5)
    assert zyx.realize(loss) is loss
    with pytest.raises(TypeError, match="tensors"):
        zyx.realize(loss, 3.0)
