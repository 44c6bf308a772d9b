"""Tensors on several devices: device names, device=, .to()/.cpu()/.cuda(), Module.to,
mixed-device ops, the default device, copies that round-trip exactly, pools that get their
memory back.

The two-device tests need a second device besides the CPU: OpenCL (PoCL in CI) here, CUDA
on a GPU machine. They skip, saying so, when zyx found only one device."""
from __future__ import annotations

import numpy as np
import pytest

import zyx
import zyx.nn as nn
from zyx.errors import BackendError, UnsupportedDTypeError

from conftest import ALL_DTYPES, ids, round_to, sample

RT = zyx._RT


def _other_device():
    """A device other than the CPU (a GPU if there is one), or None."""
    others = [d for d in zyx.devices() if d.type != "cpu" and d.type != "dummy"]
    others.sort(key=lambda d: d.compute, reverse=True)
    return others[0] if others else None


needs_two = pytest.mark.skipif(
    _other_device() is None or not any(d.type == "cpu" for d in zyx.devices()),
    reason="only one device found (install pyopencl with PoCL, or run on a GPU machine)")


@pytest.fixture
def other():
    before = RT.default
    RT.set_default_device("cpu")      # the tests below start from tensors on the CPU
    yield _other_device()
    RT.default = before


# -- names --------------------------------------------------------------------------------

def test_device_names_parse_and_compare_like_torch():
    assert str(zyx.device("cuda:1")) == "cuda:1"
    assert str(zyx.device("cuda")) == "cuda" and zyx.device("cuda").index is None
    assert zyx.device("opencl", 2) == "opencl:2"
    assert zyx.device("cpu") == zyx.device("cpu") and zyx.device("cpu") != "cuda"
    assert hash(zyx.device("cuda:0")) == hash(zyx.device("cuda", 0))
    assert zyx.device(zyx.device("hip:3")).index == 3


@pytest.mark.parametrize("bad,err", [("gpu", ValueError), ("cuda:x", ValueError),
                                      ("cuda:-1", ValueError), (3, TypeError)])
def test_bad_device_names_are_clear_errors(bad, err):
    with pytest.raises(err):
        zyx.device(bad)


def test_devices_describe_what_was_found():
    devs = zyx.devices()
    assert devs, "at least one device"
    for d in devs:
        assert d.name and d.backend and d.compute > 0
        assert zyx.device(str(d)) == d
    assert zyx.get_default_device() in devs
    assert zyx.tensor([1.0]).device == zyx.get_default_device()


def test_a_missing_device_names_what_exists():
    with pytest.raises(BackendError, match="devices found"):
        zyx.zeros(2, device="hip:0")
    with pytest.raises(BackendError, match="does not exist"):
        zyx.zeros(2, device=f"{zyx.devices()[0].type}:7")


def test_cpu_tensors_report_cpu():
    if not any(d.type == "cpu" for d in zyx.devices()):
        pytest.skip("no C backend")
    x = zyx.tensor([1.0, 2.0], device="cpu")
    assert x.device == "cpu" and x.is_cpu and not x.is_cuda
    assert x.cpu() is x and x.to("cpu") is x


def test_to_dtype_still_casts():
    x = zyx.tensor([1.5, -2.5])
    assert x.to(zyx.int32).dtype is zyx.int32
    assert x.to(zyx.float32) is x
    assert x.to(zyx.float64, copy=True) is not x


# -- two devices --------------------------------------------------------------------------

@needs_two
@pytest.mark.parametrize("d", ALL_DTYPES, ids=ids(ALL_DTYPES))
def test_copies_round_trip_bit_exactly(other, d):
    a = sample((5, 7), d, lo=-1e4, hi=1e4)
    x = zyx.tensor(a, dtype=d)
    y = x.to(other)
    assert y.device == other and y.dtype is d and x.device == "cpu"
    back = y.cpu()
    assert back.device == "cpu"
    np.testing.assert_array_equal(back.numpy().view(np.uint8), x.numpy().view(np.uint8))
    np.testing.assert_array_equal(y.numpy(), round_to(a, d))


@needs_two
def test_creation_functions_take_device(other):
    dev = str(other)
    for t, ref in [(zyx.zeros(2, 3, device=dev), np.zeros((2, 3))),
                   (zyx.ones(4, device=dev), np.ones(4)),
                   (zyx.full((2,), 7, device=dev), np.full(2, 7)),
                   (zyx.arange(5, device=dev), np.arange(5)),
                   (zyx.linspace(0, 1, 5, device=dev), np.linspace(0, 1, 5)),
                   (zyx.eye(3, device=dev), np.eye(3)),
                   (zyx.tensor([[1, 2]], device=dev), np.array([[1, 2]]))]:
        assert t.device == other, t
        np.testing.assert_allclose(t.numpy(), ref, rtol=1e-6)
    zyx.manual_seed(3)
    r = zyx.randn(3, 4, device=dev)
    zyx.manual_seed(3)
    # the same draws on every device: normals (log, cos) to float32 ulps
    np.testing.assert_allclose(r.numpy(), zyx.randn(3, 4, device="cpu").numpy(), rtol=1e-6,
                               atol=1e-7)
    zyx.manual_seed(3)
    u = zyx.rand(3, 4, device=dev)
    zyx.manual_seed(3)
    np.testing.assert_array_equal(u.numpy(), zyx.rand(3, 4, device="cpu").numpy())
    assert r.device == other and zyx.zeros_like(r).device == other
    assert zyx.randint(0, 9, (3,), device=dev).device == other


@needs_two
def test_ops_run_where_their_inputs_live(other, kernel_counter):
    a = np.random.randn(64, 32).astype(np.float32)
    w = np.random.randn(32, 16).astype(np.float32)
    x, m = zyx.tensor(a, device=other), zyx.tensor(w, device=other)
    y = (x @ m).relu().sum(1)
    assert y.device == other
    np.testing.assert_allclose(y.numpy(), np.maximum(a @ w, 0).sum(1), rtol=1e-4, atol=1e-4)
    assert y.device == other


@needs_two
def test_mixed_devices_move_the_smaller_side_once(other, capfd):
    big = np.random.randn(256, 64).astype(np.float32)
    small = np.random.randn(64).astype(np.float32)
    x = zyx.tensor(big, device=other)
    b = zyx.tensor(small, device="cpu")
    old = RT.debug
    RT.debug = old | 16
    try:
        out = (x + b).numpy()
        out2 = (x * b).numpy()
    finally:
        RT.debug = old
    err = capfd.readouterr().err
    np.testing.assert_allclose(out, big + small, rtol=1e-6)
    np.testing.assert_allclose(out2, big * small, rtol=1e-6)
    assert err.count(f"cpu -> {other}") == 1, err       # moved once, then it lives there
    assert b.device == other and x.device == other


@needs_two
def test_a_deferred_write_waits_for_a_realization_on_its_device(other):
    """A write to a realized tensor is deferred to the next realization (RT.defer); one on
    another device must not join it: the CPU read would run on that device (most input
    bytes) and move the CPU tensor there, or the reverse pull the other device's tensor
    to the CPU."""
    big = np.random.randn(256, 64).astype(np.float32)
    small = np.random.randn(8).astype(np.float32)
    w = zyx.tensor(big, device=other).realize()
    w[0] = 5.0                                   # deferred: RT.pending holds w
    assert RT.pending
    c = zyx.tensor(small, device="cpu")
    out = c * 2 + 1
    np.testing.assert_allclose(out.numpy(), small * 2 + 1, rtol=1e-6)
    assert out.device == "cpu" and c.device == "cpu" and w.device == other
    v = zyx.tensor(small, device=other)          # and the reverse: a CPU write waits
    h = zyx.tensor(big, device="cpu").realize()
    h[1] = -3.0
    np.testing.assert_allclose((v * 3).numpy(), small * 3, rtol=1e-6)
    assert v.device == other and h.device == "cpu"
    ref_w, ref_h = big.copy(), big.copy()
    ref_w[0], ref_h[1] = 5.0, -3.0
    np.testing.assert_array_equal(w.numpy(), ref_w)
    np.testing.assert_array_equal(h.numpy(), ref_h)
    assert w.device == other and h.device == "cpu"


@pytest.mark.skipif(not any(d.type == "wgpu" for d in zyx.devices())
                    or not any(d.type == "cpu" for d in zyx.devices()),
                    reason="needs a WebGPU device and the CPU")
def test_a_webgpu_write_refused_mid_way_leaves_cpu_work_on_the_cpu(other):
    """The test-order bug of the device fixture: a WebGPU tensor written (deferred), then a
    write refused (an int64 index: WGSL has none) while the tensor stays alive (as a
    traceback keeps it); the next CPU realization, whose mask write needs int64 positions,
    must run on the CPU and give the right values."""
    a = np.arange(60, dtype=np.float32).reshape(3, 4, 5) * 0.25 - 6
    zyx.set_default_device("wgpu")      # as the device fixture does
    try:
        z = zyx.tensor(a)
        z[1] = 2.0
        with pytest.raises(UnsupportedDTypeError):
            z[[0, 2]] = 7.0
    finally:
        zyx.set_default_device("cpu")
    x = zyx.tensor(np.arange(6, dtype=np.float32))
    m = np.array([True, False, True, True, False, False])
    x[zyx.tensor(m)] = zyx.tensor(np.float32([10, 20, 30]))
    np.testing.assert_array_equal(x.numpy(), [10, 1, 20, 30, 4, 5])
    assert x.device == "cpu"
    ref = a.copy()
    ref[1] = 2.0
    np.testing.assert_array_equal(z.numpy(), ref)
    assert z.device == "wgpu:0"


@needs_two
def test_module_to_moves_parameters_and_training_follows(other):
    zyx.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    ref.load_state_dict(model.state_dict())
    params = list(model.parameters())
    assert model.to(other) is model
    assert all(p.device == other for p in model.parameters())
    assert list(model.parameters())[0] is params[0]       # same objects: optimizers keep them
    xs = np.random.randn(32, 8).astype(np.float32)
    ys = np.random.randint(0, 3, 32)
    for m, dev in ((model, other), (ref, "cpu")):
        opt = zyx.optim.Adam(m.parameters(), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(m(zyx.tensor(xs, device=dev)),
                                               zyx.tensor(ys, device=dev))
            loss.backward()
            opt.step()
        assert all(p.device == dev for p in m.parameters())
    for p, q in zip(model.parameters(), ref.parameters()):
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=1e-4, atol=1e-5)
    model.cpu()
    assert all(p.device == "cpu" for p in model.parameters())


@needs_two
def test_state_dict_of_a_model_on_another_device_saves_and_loads(other, tmp_path):
    model = nn.Linear(4, 2).to(other)
    zyx.save(model.state_dict(), str(tmp_path / "m.safetensors"))
    fresh = nn.Linear(4, 2).to(other)
    fresh.load_state_dict(zyx.load(str(tmp_path / "m.safetensors")))
    x = zyx.randn(3, 4, device=other)
    np.testing.assert_array_equal(fresh(x).numpy(), model(x).numpy())


@needs_two
def test_freed_tensors_return_memory_to_their_device_pool(other):
    dev = RT.resolve(other)
    zyx.randn(1000, device=other).realize()   # the generator's cached index buffer
    before = dev.pool.used_bytes
    x = zyx.randn(1000, device=other).realize()
    y = (x * 2).realize()
    assert dev.pool.used_bytes >= before + 8000
    del x, y
    assert dev.pool.used_bytes == before


@needs_two
def test_default_device_decides_where_new_tensors_go(other):
    zyx.set_default_device(other)
    try:
        assert zyx.get_default_device() == other
        t = zyx.tensor([1.0, 2.0])
        assert t.device == other and (t * 2).device == other
        assert zyx.arange(3).device == other
    finally:
        zyx.set_default_device("cpu")
    assert zyx.tensor([1.0]).device == "cpu"


@needs_two
def test_differentiating_through_a_device_copy_is_refused_clearly(other):
    w = zyx.randn(3, requires_grad=True)
    with pytest.raises(BackendError, match="differentiate"):
        (w * 2).to(other)
    v = zyx.randn(3, device=other, requires_grad=True)     # the supported way
    (v * v).sum().backward()
    np.testing.assert_allclose(v.grad.numpy(), 2 * v.numpy(), rtol=1e-6)
    assert v.grad.device == other


@needs_two
def test_zyx_device_takes_backend_and_device_names(monkeypatch):
    other = _other_device()
    try:
        for spec, want in [("cpu", "cpu"), ("c", "cpu"), (other.type, str(other)),
                           (str(other), str(other))]:
            monkeypatch.setenv("ZYX_DEVICE", spec)
            RT.init()
            assert str(zyx.get_default_device()) == want, spec
            assert zyx.tensor([1.0]).device == want
    finally:
        monkeypatch.undo()       # the suite's own ZYX_DEVICE (if any) comes back, then init
        RT.init()
