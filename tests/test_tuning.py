"""The autotuner (zyx/tuning.py): every schedule it may pick computes what the heuristic's
does, on fixed workloads and on random graphs; its results are kept on disk per device and
reused; bad cache files are ignored; the budget and the progress output behave."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

import zyx
from zyx.codegen.target import DeviceInfo
import zyx.nn.functional as F
from zyx import tuning

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

from test_hypothesis import SETTINGS, random_graph  # noqa: E402

pytestmark = pytest.mark.usefixtures("device")
SETTINGS_FEW = settings(SETTINGS, max_examples=25)   # each example plans (and compiles) anew


class Forced:
    """A tuner that picks candidate `k` (the last one when there are fewer) and records
    what it was offered."""

    def __init__(self, device, k):
        self.device = device
        self.k = k
        self.offered = []

    def choose_layout(self, base, labels, kernels):
        self.offered.append(labels)
        return min(self.k, len(labels) - 1)

    def choose_lowering(self, kernel):
        dev = self.device
        if not hasattr(dev, "schedule_candidates"):
            return
        cands = dev.schedule_candidates(kernel)
        self.offered.append([label for label, _ in cands])
        sched = cands[min(self.k, len(cands) - 1)][1]
        if sched is None:
            dev.schedules.pop(kernel, None)
        else:
            dev.schedules[kernel] = sched


@pytest.fixture
def force(monkeypatch):
    """force(k): realizations from now on use candidate k of every kernel."""
    rt = zyx._RT
    tuners = []

    def use(k):
        t = Forced(rt.device(), k)
        tuners.append(t)
        rt.plans.clear()
        rt._families.clear()
        dev = rt.device()
        for prog in list(getattr(dev, "_programs", {}).values()):
            dev.release(prog)       # programs lowered with another schedule
        monkeypatch.setattr(rt, "tuner", lambda d: t)
        return t
    yield use
    rt.plans.clear()
    rt._families.clear()
    dev = rt.device()
    if hasattr(dev, "schedules"):
        dev.schedules.clear()
        for prog in list(dev._programs.values()):
            dev.release(prog)


def _workloads(rng):
    x = rng.standard_normal((2, 3, 12, 12)).astype(np.float32)
    w = rng.standard_normal((8, 3, 3, 3)).astype(np.float32)
    a = rng.standard_normal((32, 48)).astype(np.float32)
    b = rng.standard_normal((48, 64)).astype(np.float32)
    q = rng.standard_normal((4, 16, 32)).astype(np.float32)
    lin = (rng.standard_normal((32, 128)).astype(np.float32),
           rng.standard_normal((48, 128)).astype(np.float32))
    return x, w, a, b, q, lin


def _run_all(x, w, a, b, q, lin):
    """Matmuls both ways round, nn.Linear's x @ W.T, a batched matmul, a conv2d with its
    input and weight gradients, reductions over several axes: the kernels the layouts
    exist for."""
    zx = zyx.Tensor(x, requires_grad=True)
    zw = zyx.Tensor(w, requires_grad=True)
    y = F.conv2d(zx, zw, padding=1)
    (y * y).sum().backward()
    za, zb, zq = zyx.Tensor(a), zyx.Tensor(b), zyx.Tensor(q)
    outs = [y, zx.grad, zw.grad, za @ zb, za @ za.T, (zb.T @ za.T), zq @ zq.transpose(1, 2),
            zq.sum((0, 2)), zq.amax(1), (zq * 2).sum(0),
            F.linear(zyx.Tensor(lin[0]), zyx.Tensor(lin[1]))]
    return [o.numpy() for o in outs]


def test_every_layout_matches_the_heuristic(force):
    rng = np.random.default_rng(0)
    data = _workloads(rng)
    ref = _run_all(*data)
    k = 0
    seen = set()
    while True:
        t = force(k)
        got = _run_all(*data)
        for r, g in zip(ref, got):
            np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-4 * max(1.0, np.abs(r).max()))
        counts = [len(labels) for labels in t.offered]
        seen.update(label for labels in t.offered for label in labels[k:k + 1])
        if not counts or k >= max(counts) - 1:
            break
        k += 1
    dev = zyx._RT.device()
    if dev.info().register_tiles and not dev.info().tile_min_outputs:
        # the C backend offers several layouts per reduce kernel: lanes, unroll, plain
        assert k >= 3 and any(s.startswith("lanes") for s in seen) \
            and any(s.startswith("unroll") for s in seen) and "plain" in seen, seen
    elif hasattr(dev, "schedule_candidates"):
        assert k >= 3 and any(s.startswith("group:") for s in seen) \
            and any(s.startswith("ew:") for s in seen), seen


@SETTINGS_FEW
@given(data=st.data(), shape=st.lists(st.sampled_from([1, 2, 4, 8, 16]), min_size=1,
                                      max_size=3).map(tuple),
       steps=st.integers(1, 6), k=st.integers(0, 12))
def test_random_graphs_with_any_schedule(force, data, shape, steps, k):
    """The hypothesis graphs of test_hypothesis (shapes whose axes the tiles divide) with
    candidate k of every kernel, against numpy."""
    force(k)
    pool, trace = random_graph(data, shape, steps)
    x, a = pool[-1]
    scale = max([1.0] + [float(np.abs(p[1]).max()) for p in pool if p[1].size])
    np.testing.assert_allclose(x.numpy(), a, rtol=2e-4, atol=2e-4 * scale,
                               err_msg=" | ".join(trace))


# -- the real tuner ---------------------------------------------------------------------

@pytest.fixture
def tuned(tmp_path, monkeypatch):
    """zyx.autotune() with a small budget, results in tmp_path; off again afterwards."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rt = zyx._RT
    before = rt.autotune
    stores = []
    real = tuning.ScheduleStore

    def store(identity, directory=None, save=True):
        s = real(identity, str(tmp_path / "schedules"), save)
        stores.append(s)
        return s
    monkeypatch.setattr(tuning, "ScheduleStore", store)
    zyx.autotune(budget=5, launches=2)
    yield stores
    rt.set_autotune(tuning.Settings(enabled=False))
    rt.autotune = before
    dev = rt.device()
    if hasattr(dev, "schedules"):
        dev.schedules.clear()


class _Work:
    """A matmul, a long row sum and an elementwise chain: kernels with schedules to choose
    on every backend (C: the matmul's layouts; GPUs: group and elementwise knobs)."""

    def __init__(self, rng):
        self.a = rng.standard_normal((64, 96)).astype(np.float32)
        self.b = rng.standard_normal((96, 128)).astype(np.float32)
        self.x = rng.standard_normal((16, 16384)).astype(np.float32)

    def check(self):
        a, b, x = zyx.Tensor(self.a), zyx.Tensor(self.b), zyx.Tensor(self.x)
        np.testing.assert_allclose((a @ b).numpy(), self.a @ self.b, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(x.sum(1).numpy(), self.x.sum(1), rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose((x * 2 + 1).numpy(), self.x * 2 + 1, rtol=1e-6)


def test_autotune_searches_once_then_reuses(tuned, capsys):
    work = _Work(np.random.default_rng(1))
    before = zyx.stats()
    work.check()
    mid = zyx.stats()
    assert mid["kernels_tuned"] > before["kernels_tuned"]
    err = capsys.readouterr().err
    assert "zyx autotune: kernel" in err and "heuristic" in err
    files = os.listdir(tuned[0].path.rsplit(os.sep, 1)[0])
    assert len(files) == 1 and files[0].endswith(".json")
    entries = json.load(open(tuned[0].path))["entries"]
    assert entries and all(e["tried"] >= 1 for e in entries.values())

    # a second process: a fresh runtime state (plans dropped, new tuner and store) finds
    # every kernel's schedule in the file and times nothing
    zyx._RT.set_autotune(tuning.Settings(enabled=False))
    zyx.autotune(budget=5, launches=2)
    work.check()
    after = zyx.stats()
    assert after["kernels_tuned"] == mid["kernels_tuned"]
    assert after["schedules_reused"] > mid["schedules_reused"]
    assert "zyx autotune: kernel" not in capsys.readouterr().err


def test_corrupt_and_stale_cache_is_ignored(tuned, tmp_path):
    work = _Work(np.random.default_rng(2))
    work.check()
    path = tuned[0].path
    data = json.load(open(path))
    for e in data["entries"].values():
        e["label"] = "no-such-schedule"          # stale: must be searched again
    json.dump(data, open(path, "w"))
    zyx._RT.set_autotune(tuning.Settings(enabled=False))
    zyx.autotune(budget=5, launches=2)
    n = zyx.stats()["kernels_tuned"]
    work.check()
    assert zyx.stats()["kernels_tuned"] > n
    assert all(e["label"] != "no-such-schedule" for e in json.load(open(path))["entries"].values())

    with open(path, "wb") as f:
        f.write(b"\x00{not json")                  # corrupt: ignored, then rewritten
    zyx._RT.set_autotune(tuning.Settings(enabled=False))
    with pytest.warns(RuntimeWarning, match="malformed autotune schedules"):
        zyx.autotune(budget=5, launches=2)
        work.check()
    assert json.load(open(path))["schema"] == tuning.SCHEMA

    os.remove(path)                                # deleting the cache is safe
    zyx._RT.set_autotune(tuning.Settings(enabled=False))
    zyx.autotune(budget=5, launches=2)
    work.check()


def test_zero_budget_times_only_the_heuristic(tuned):
    zyx.autotune(budget=0)
    work = _Work(np.random.default_rng(3))
    work.check()
    entries = json.load(open(tuned[-1].path))["entries"].values()
    assert entries and all(e["tried"] == 1 for e in entries)


def test_settings_from_config_and_environment():
    s = tuning.Settings.from_config({"autotune": {"enabled": True, "budget_s": 2,
                                                  "launches": 5}}, environ={})
    assert s.enabled and s.budget_s == 2.0 and s.launches == 5
    assert not tuning.Settings.from_config({}, environ={}).enabled
    assert tuning.Settings.from_config({}, environ={"ZYX_AUTOTUNE": "1"}).enabled
    assert not tuning.Settings.from_config({"autotune": {"enabled": True}},
                                           environ={"ZYX_AUTOTUNE": "0"}).enabled
    with pytest.warns(RuntimeWarning, match="autotune"):
        bad = tuning.Settings.from_config({"autotune": {"launches": 0}}, environ={})
    assert bad.launches == tuning.DEFAULT_LAUNCHES
    with pytest.raises(ValueError, match="budget_s"):
        zyx.autotune(budget=-1)


class _StubPool:
    def __init__(self):
        self.live = 0

    def allocate(self, nbytes):
        self.live += 1
        return bytearray(nbytes), None

    def host_to_pool(self, src, dst, wait_events=()):
        dst[:] = src.tobytes()[:len(dst)]

    def deallocate(self, buf, wait_events=()):
        self.live -= 1


class _StubClock:
    """The tuner's clock in the stub test: it moves only when the stub device 'runs' a
    program, so the timings are exact even on a machine busy with other tests (the
    tuner's choice must not depend on preemption)."""
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class _StubDevice:
    """A device whose 'slow' schedule takes longer and whose 'broken' one fails to
    compile, as a driver may refuse a launch configuration."""
    identity = "stub"
    debug = 0

    def __init__(self, clock=None):
        self.pool = _StubPool()
        self.schedules = {}
        self.released = []
        self.clock = clock
        self._info = DeviceInfo(name="stub")

    def info(self):
        return self._info

    def schedule_candidates(self, kernel):
        return [("default", None), ("broken", {"x": 1}), ("fast", {"x": 2}), ("slow", {"x": 3})]

    def compile_variant(self, kernel, schedule):
        if schedule == {"x": 1}:
            raise zyx.BackendError("launch configuration refused")
        return {None: 2e-4, 2: 5e-5, 3: 4e-4}[schedule and schedule["x"]]

    def launch(self, program, pool, args, wait_events=()):
        if self.clock is not None:
            self.clock.now += program
            return
        end = time.perf_counter() + program
        while time.perf_counter() < end:
            pass

    def release(self, program):
        self.released.append(program)


@pytest.mark.parametrize("device", ["stub"], indirect=False)
def test_tuner_skips_a_failing_schedule_and_keeps_the_fastest(tmp_path, device, monkeypatch):
    from zyx._core.kernel import Kernel
    clock = _StubClock()
    monkeypatch.setattr(tuning, "time", clock)
    dev = _StubDevice(clock)
    stats = {"kernels_tuned": 0, "schedules_reused": 0}
    store = tuning.ScheduleStore("stub", str(tmp_path))
    tuner = tuning.Tuner(dev, tuning.Settings(enabled=True, launches=2, progress=False),
                         stats, store)
    k = Kernel([], [(zyx.float32, 16, False)], "k")
    tuner.choose_lowering(k)
    assert dev.schedules[k] == {"x": 2}
    assert stats["kernels_tuned"] == 1 and stats["schedules_failed"] == 1
    assert len(dev.released) == 3 and dev.pool.live == 0      # timed programs released
    entry = json.load(open(store.path))["entries"]
    assert [e["label"] for e in entry.values()] == ["fast"]
    # the same kernel again: from the store, nothing compiled or timed
    dev2 = _StubDevice()
    tuning.Tuner(dev2, tuning.Settings(enabled=True, progress=False), stats,
                 tuning.ScheduleStore("stub", str(tmp_path))).choose_lowering(k)
    assert dev2.schedules[k] == {"x": 2} and not dev2.released
    assert stats["schedules_reused"] == 1


def test_lowering_key_names_the_float32_precision():
    """A GPU lowering chosen under TF32 ("high") is stored apart from the float32 one:
    the fastest schedule of one is not the other's (and "highest" keeps its old name,
    so earlier results stay valid)."""
    from test_cuda import _untiled_kernel
    k = _untiled_kernel(zyx.Tensor(np.ones((64, 32), np.float32)) @
                        zyx.Tensor(np.ones((32, 48), np.float32)))
    plain = tuning.lowering_key(k, DeviceInfo(float32_precision="highest"))
    assert plain == tuning.kernel_key("lowering", k)
    assert tuning.lowering_key(k, DeviceInfo(float32_precision="high")) == plain + ":high"
