"""Scheduler, plan cache and backend dispatch, checked on the dummy device (no compiler)
and on the real default device."""
import json

import numpy as np
import pytest

import zyx
from zyx.backends import initialize_backends, load_config
from zyx.errors import NoBackendAvailable


def test_dummy_backend_counts_kernels_and_bytes():
    pools, devices = initialize_backends({"dummy": {"enabled": True}}, only=["dummy"])
    dev = devices[0]
    from zyx._core.graph import Graph
    from zyx._core import scheduler
    from zyx import dtype as dt
    g = Graph()
    g.free_buffer = lambda buf: buf.pool.deallocate(buf)
    a = g.leaf(pools[0].allocate(16)[0], (4,), dt.float32)
    b = g.add(zyx._core.graph.UNARY, zyx._core.kernel.U_EXP, (a,), (4,), dt.float32)
    c = g.add(zyx._core.graph.REDUCE, (zyx._core.kernel.R_SUM, (0,)), (b,), (1,), dt.float32)
    order, key = g.collect([c])
    plan = scheduler.build_plan(g, order, [c], dev)
    assert len(plan.steps) == 1            # exp fused into the reduce
    stats = {"kernels_launched": 0}
    scheduler.execute(plan, g, order, pools[0], None, stats)
    assert dev.launched == 1 and stats["kernels_launched"] == 1
    assert dev.compiled == 1 and len(dev.kernels) == 1     # a count, as zyx.stats() sums
    assert pools[0].used_bytes == 16 + 4   # input + realized output
    g.release(c)
    g.release(b)
    g.release(a)
    assert pools[0].used_bytes == 0


def test_structural_key_ignores_buffers_but_not_structure():
    x1 = zyx.Tensor(np.ones(5, np.float32))
    x2 = zyx.Tensor(np.zeros(5, np.float32))
    g = zyx._RT.graph
    ts = [(x1 * 2).exp(), (x2 * 2).exp(), (x2 * 3).exp(), (x2 * 2).log()]  # kept alive
    k1, k2, k3, k4 = (g.collect([t._id])[1] for t in ts)
    assert k1 == k2
    assert k1 != k3 and k1 != k4


def test_plan_cache_reuses_compiled_plan():
    a = zyx.Tensor(np.arange(10, dtype=np.float32))
    (a * 3 - 1).numpy()
    built = zyx.stats()["plans_built"]
    b = zyx.Tensor(np.arange(10, 20, dtype=np.float32))
    np.testing.assert_allclose((b * 3 - 1).numpy(), np.arange(10, 20) * 3 - 1)
    assert zyx.stats()["plans_built"] == built


def test_malformed_config_gives_defaults(tmp_path, monkeypatch):
    p = tmp_path / "zyx" / "config.json"
    p.parent.mkdir()
    p.write_text("{not json")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    with pytest.warns(RuntimeWarning, match="ignoring malformed config"):
        assert load_config() == {}
    p.write_text(json.dumps({"c": {"threads": 1}}))
    assert load_config() == {"c": {"threads": 1}}


def test_all_backends_disabled_raises():
    cfg = {name: {"enabled": False} for name in ("c", "opencl", "cuda", "vulkan", "wgpu", "dummy")}
    with pytest.raises(NoBackendAvailable):
        initialize_backends(cfg)


def test_devices_lists_c_backend():
    names = zyx.devices()
    assert names and any(n.name.startswith("C ") and str(n) == "cpu" for n in names)
