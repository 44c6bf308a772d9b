"""zyx.save / zyx.load of nested checkpoints, optimizer state round trips (training resumes
bit-identically), plain safetensors compatibility, and the error for PyTorch .pt files."""
from __future__ import annotations

import json
import pickle
import struct
import zipfile

import numpy as np
import pytest

import zyx
from zyx import nn
import zyx.nn.functional as F
from zyx.io import SafetensorsError

try:
    import torch
except ImportError:
    torch = None
try:
    import safetensors.numpy as stnp
except ImportError:
    stnp = None


def _model():
    zyx.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


_X = np.random.default_rng(1).standard_normal((16, 5)).astype(np.float32)
_Y = (np.arange(16) % 3).astype(np.int64)


def _train(model, opt, steps):
    for _ in range(steps):
        loss = F.cross_entropy(model(zyx.tensor(_X)), zyx.tensor(_Y))
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_nested_state_round_trips(tmp_path):
    m = _model()
    state = {"model": m.state_dict(), "epoch": 3, "lr": 0.1, "name": "run-1", "done": False,
             "none": None, "hist": [1.5, 2, {"a": np.arange(3, dtype=np.int32)}],
             "betas": (0.9, 0.999), "by_index": {0: zyx.tensor([1.0, 2.0]), 7: "x"},
             "tricky": {"a.b": zyx.tensor([1.0]), "a": {"b": zyx.tensor([2.0])}},
             "inf": float("inf")}
    path = tmp_path / "ck.safetensors"
    zyx.save(state, path)
    back = zyx.load(path)
    assert back["epoch"] == 3 and back["lr"] == 0.1 and back["name"] == "run-1"
    assert back["done"] is False and back["none"] is None and back["inf"] == float("inf")
    assert back["betas"] == (0.9, 0.999) and isinstance(back["betas"], tuple)
    assert back["hist"][:2] == [1.5, 2]
    np.testing.assert_array_equal(back["hist"][2]["a"].numpy(), np.arange(3))
    assert back["hist"][2]["a"].dtype == zyx.int32
    assert set(back["by_index"]) == {0, 7} and back["by_index"][7] == "x"
    assert back["tricky"]["a.b"].item() == 1.0 and back["tricky"]["a"]["b"].item() == 2.0
    assert list(back["model"]) == list(m.state_dict())
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(back["model"][k].numpy(), v.numpy())


def test_tensors_live_in_the_safetensors_data_with_flat_keys(tmp_path):
    path = tmp_path / "ck.safetensors"
    zyx.save({"model": _model().state_dict(), "epoch": 1}, path)
    entries, meta = zyx.io.read_header(path)
    assert "model.0.weight" in entries and entries["model.2.bias"][1] == (3,)
    tree = json.loads(meta["zyx.structure"])
    assert tree["epoch"] == 1 and tree["model"]["0.weight"] == {"__zyx_tensor__": "model.0.weight"}


def test_flat_dict_is_plain_safetensors(tmp_path):
    path = tmp_path / "flat.safetensors"
    sd = _model().state_dict()
    zyx.save(sd, path)
    _, meta = zyx.io.read_header(path)
    assert meta == {}
    back = zyx.load(path)
    assert list(back) == list(sd)
    if stnp is not None:
        ref = stnp.load_file(str(path))
        for k, v in sd.items():
            np.testing.assert_array_equal(ref[k], v.numpy())


@pytest.mark.skipif(stnp is None, reason="safetensors is not installed")
def test_files_written_by_safetensors_still_load(tmp_path):
    path = tmp_path / "ext.safetensors"
    stnp.save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, str(path),
                   metadata={"format": "pt"})
    back = zyx.load(path)
    assert list(back) == ["w"]
    np.testing.assert_array_equal(back["w"].numpy(), np.arange(6).reshape(2, 3))


def test_unsavable_values_raise_type_error(tmp_path):
    with pytest.raises(TypeError, match="cannot store a object"):
        zyx.save({"x": object()}, tmp_path / "bad.safetensors")
    with pytest.raises(SafetensorsError, match="reserved"):
        zyx.save({"e": 1}, tmp_path / "bad.safetensors", metadata={"zyx.structure": "{}"})


@pytest.mark.parametrize("make_opt", [
    lambda ps: zyx.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    lambda ps: zyx.optim.Adam(ps, lr=0.01),
    lambda ps: zyx.optim.AdamW(ps, lr=0.01, weight_decay=0.1, amsgrad=True),
    lambda ps: zyx.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True),
], ids=["sgd", "adam", "adamw", "rmsprop"])
def test_training_resumes_bit_identically(tmp_path, make_opt):
    ref = _model()
    ref_opt = make_opt(ref.parameters())
    _train(ref, ref_opt, 6)

    m = _model()
    opt = make_opt(m.parameters())
    _train(m, opt, 3)
    path = tmp_path / "ck.safetensors"
    zyx.save({"model": m.state_dict(), "optim": opt.state_dict(), "epoch": 3}, path)
    del m, opt

    ck = zyx.load(path)
    fresh = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    fresh_opt = make_opt(fresh.parameters())
    fresh.load_state_dict(ck["model"])
    fresh_opt.load_state_dict(ck["optim"])
    assert ck["epoch"] == 3
    _train(fresh, fresh_opt, 3)
    for (k, a), b in zip(ref.state_dict().items(), fresh.state_dict().values()):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=k)


def test_optimizer_state_dict_layout_and_torch_style_step():
    m = _model()
    opt = zyx.optim.Adam(m.parameters(), lr=0.01)
    _train(m, opt, 2)
    sd = opt.state_dict()
    assert sd["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert sd["state"][0]["step"] == 2 and set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    sd["state"][0]["step"] = zyx.tensor(2.0)          # torch keeps the count as a tensor
    opt2 = zyx.optim.Adam(_model().parameters(), lr=0.01)
    opt2.load_state_dict(sd)
    assert opt2.state_dict()["state"][0]["step"] == 2


def test_pytorch_zip_checkpoint_raises_a_clear_error(tmp_path):
    path = tmp_path / "model.pt"
    if torch is not None:
        torch.save({"w": torch.zeros(3)}, path)
    else:       # the layout torch.save writes: <name>/data.pkl in a zip
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("model/data.pkl", pickle.dumps({"w": [0.0] * 3}))
    with pytest.raises(SafetensorsError, match=r"PyTorch checkpoint.*safetensors.torch.save_file"):
        zyx.load(path)


def test_legacy_pickle_raises_a_clear_error(tmp_path):
    path = tmp_path / "model.pth"
    path.write_bytes(pickle.dumps({"w": list(range(100))}, protocol=2))
    with pytest.raises(SafetensorsError, match="pickle.*torch.load"):
        zyx.load(path)


def test_other_corrupt_files_keep_the_header_length_error(tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(SafetensorsError, match="header length"):
        zyx.load(path)
