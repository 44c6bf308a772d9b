"""Long graphs (issue 10, crashes and hangs): chains of 100,000 ops realize, backward runs
through 20,000-op chains, dropping them does not crash, and code stays linear in the graph:
long inlined chains are cut into kernels of bounded size, and an expensive elementwise node
read by several kernels is stored once instead of re-inlined into each (`x = x - x.mean()`
repeated). Every value is checked against numpy.

The chains run in a fresh interpreter: a C stack overflow there must fail one test, not
kill the test session."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import zyx
from zyx._core.kernelizer import CHAIN_LIMIT
from zyx.runtime import RT

pytestmark = pytest.mark.usefixtures("device")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(zyx.__file__)))


def run_isolated(code, timeout=180):
    """Run `code` in a new interpreter importing this checkout's zyx; its stdout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    prelude = "import numpy as np\nimport zyx\nfrom zyx.runtime import RT\n"
    try:
        r = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"did not finish in {timeout} s")
    assert r.returncode == 0, f"exit status {r.returncode}\n{r.stderr[-4000:]}"
    return r.stdout


def plan_ir_ops(plan):
    """IR ops over every kernel of a plan (after the always-on passes)."""
    return sum(len(st.kernel.ops) for st in plan.steps if st.kernel is not None)


def last_plan():
    return next(reversed(RT.plans.values()))


def test_chain_of_100000_adds_realizes_and_matches_numpy():
    """numpy's rounding after every add, except on WebGPU and Vulkan: WGSL cannot forbid
    reassociation, nor can SPIR-V without SPV_KHR_float_controls2, and NVIDIA's drivers
    sum a kernel's constants first (0.04% off after 100,000 adds of 1e-3)."""
    out = run_isolated("""
        a = np.random.default_rng(0).standard_normal(8).astype(np.float32)
        x = zyx.Tensor(a)
        ref = a.copy()
        for _ in range(100_000):
            x = x + 1e-3
            ref = ref + np.float32(1e-3)
        rtol = 1e-3 if zyx.get_default_device().type in ("wgpu", "vulkan") else 1e-6
        np.testing.assert_allclose(x.numpy(), ref, rtol=rtol)
        plan = next(reversed(RT.plans.values()))
        print(max(len(st.kernel.ops) for st in plan.steps if st.kernel is not None))
    """)
    assert int(out) < 1000      # cut into kernels of bounded size, not one 100k-op function


def test_chain_of_100000_ops_affine_matches_numpy():
    """t = t * 1.0001 + 0.0001, 50,000 times (100,000 nodes). The compiler may contract
    the multiply-add (one rounding instead of two); growth by e^5 amplifies that, hence
    rtol 1e-3 against numpy's two roundings."""
    run_isolated("""
        t = zyx.ones(5)
        ref = np.ones(5, np.float32)
        for _ in range(50_000):
            t = t * 1.0001 + 0.0001
            ref = ref * np.float32(1.0001) + np.float32(0.0001)
        np.testing.assert_allclose(t.numpy(), ref, rtol=1e-3)
    """)


def test_total_plus_loss_over_20000_steps():
    """An epoch's `total = total + loss`, each loss a realized scalar."""
    run_isolated("""
        vals = np.random.default_rng(1).random(20_000).astype(np.float32)
        total = zyx.zeros(())
        for v in vals:
            loss = zyx.Tensor(v)
            total = total + loss
        np.testing.assert_allclose(total.item(), vals.astype(np.float64).sum(), rtol=1e-4)
    """)


def test_backward_through_sum_of_20000_losses():
    """total = sum of 20,000 lazy losses (w * c_i).sum() of one requires_grad tensor:
    d total / dw = sum of the c_i."""
    run_isolated("""
        c = np.random.default_rng(2).standard_normal((20_000, 4)).astype(np.float32)
        w = zyx.Tensor(np.full(4, 0.5, np.float32), requires_grad=True)
        total = zyx.zeros(())
        for i in range(len(c)):
            total = total + (w * zyx.Tensor(c[i])).sum()
        total.backward()
        g = c.astype(np.float64).sum(0)
        np.testing.assert_allclose(w.grad.numpy(), g, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(total.item(), 0.5 * g.sum(), rtol=1e-4, atol=1e-3)
    """)


def test_backward_through_20000_op_chain_equals_analytic_gradient():
    """y = w; y = y * a + b 10,000 times (20,000 ops): dy/dw = a^n."""
    run_isolated("""
        a, b, n = 1.0001, 0.001, 10_000
        w0 = np.array([0.5, -1.0, 2.0], np.float32)
        w = zyx.Tensor(w0, requires_grad=True)
        y = w
        for _ in range(n):
            y = y * a + b
        y.sum().backward()
        np.testing.assert_allclose(w.grad.numpy(), np.full(3, a ** n), rtol=1e-3)
        expect = w0 * a ** n + b * (a ** n - 1) / (a - 1)
        np.testing.assert_allclose(y.numpy(), expect, rtol=1e-3, atol=1e-3)
    """)


def test_dropping_long_chains_does_not_crash():
    """A 100,000-node chain's tensors (with and without autograd records) dropped at once;
    the graph is back to its size before."""
    out = run_isolated("""
        before = len(RT.graph)
        w = zyx.Tensor(np.ones(4, np.float32), requires_grad=True)
        x = w
        for _ in range(100_000):
            x = x * 1.0
        y = zyx.ones(4)
        for _ in range(100_000):
            y = y + 1.0
        z = y * 2             # the chain also dropped after part of it was realized
        assert z.numpy()[0] == 2 * 100_001
        del x, y, z, w
        print(len(RT.graph) - before)
    """)
    assert int(out) == 0


def test_repeated_centering_2000_times_matches_numpy():
    """x = x - x.mean(), 2,000 times: every step stored once, not re-inlined into each later
    mean (was n^2 code: minutes for 2,000)."""
    run_isolated("""
        a = np.random.default_rng(3).standard_normal(1000).astype(np.float32) + 3
        x = zyx.Tensor(a)
        ref = a.astype(np.float64)
        for _ in range(2000):
            x = x - x.mean()
            ref = ref - ref.mean()
        np.testing.assert_allclose(x.numpy(), ref, rtol=0, atol=1e-5)
        assert abs(float(x.mean().item())) < 1e-6
    """)


def _centering_ir_ops(n, data):
    x = zyx.Tensor(data)
    for _ in range(n):
        x = x - x.mean()
    out = x.numpy()
    ref = data.astype(np.float64)
    for _ in range(n):
        ref = ref - ref.mean()
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5)
    return plan_ir_ops(last_plan())


def test_repeated_centering_code_grows_linearly():
    """Twice the iterations, about twice the IR (re-inlining every step made it 4x)."""
    data = np.random.default_rng(4).standard_normal(64).astype(np.float32)
    ops = [_centering_ir_ops(n, data) for n in (40, 80, 160)]
    assert ops[1] < 2.3 * ops[0], ops
    assert ops[2] < 2.3 * ops[1], ops


def test_short_chains_stay_one_kernel_long_ones_are_cut():
    """A 60-op chain is one kernel; a 2,000-op chain a few, each bounded, same values."""
    a = np.random.default_rng(5).standard_normal(32).astype(np.float32)
    for n, most in ((30, 1), (1000, 2 * 1000 // CHAIN_LIMIT + 1)):
        x = zyx.Tensor(a)
        ref = a.copy()
        for i in range(n):
            x = x * 0.999 + i * 1e-4
            ref = ref * np.float32(0.999) + np.float32(i * 1e-4)
        before = zyx.stats()["kernels_launched"]
        np.testing.assert_allclose(x.numpy(), ref, rtol=1e-4, atol=1e-5)
        launched = zyx.stats()["kernels_launched"] - before
        assert 1 <= launched <= most, (n, launched)
        assert max(len(st.kernel.ops) for st in last_plan().steps if st.kernel) < 1000


def test_repeated_index_shuffles_stay_linear():
    """Steps that re-read their input at other indices (a roll, x + x.flip) or regroup a
    transposed view (reshape / .T / reshape) doubled the inlined code per step: 20 of them
    took minutes. 300 of each now, against numpy."""
    run_isolated("""
        a = np.random.default_rng(6).standard_normal(15).astype(np.float32)
        x, r, f = zyx.Tensor(a), zyx.Tensor(a), zyx.Tensor(a)
        xa, ra, fa = a.copy(), a.copy(), a.copy()
        for _ in range(300):
            x = x.reshape(3, 5).T.reshape(15)
            xa = xa.reshape(3, 5).T.reshape(15)
            r = r.roll(2, 0)
            ra = np.roll(ra, 2)
            f = (f + f.flip(0)) * 0.5 + 0.25
            fa = (fa + fa[::-1]) * np.float32(0.5) + np.float32(0.25)
        np.testing.assert_array_equal(x.numpy(), xa)
        np.testing.assert_array_equal(r.numpy(), ra)
        np.testing.assert_allclose(f.numpy(), fa, rtol=1e-5)
    """, timeout=120)
