"""The training demo (`python -m zyx.examples.train`), in short versions."""
import io
import subprocess
import sys

import numpy as np
import pytest

import zyx
from zyx.datasets import write_idx, MNIST_FILES
from zyx.examples import train as demo


def test_progress_bar_text():
    s = io.StringIO()
    bar = demo.ProgressBar(4, "epoch 1/1", s, width=8)
    for _ in range(4):
        bar.update(1, loss="0.5000")
    assert s.getvalue() == ""                  # not a terminal: only the finished line
    bar.close(loss="0.2500", acc="90.0%")
    line = s.getvalue()
    assert line.startswith("epoch 1/1 [########] 4/4") and line.endswith("loss 0.2500  acc 90.0%\n")


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_redraws_in_place_on_a_terminal():
    s = _Tty()
    bar = demo.ProgressBar(3, "train", s, width=6, interval=0.0)
    bar.update(1, loss="1.0")
    bar.update(1, loss="0.5")
    bar.close(loss="0.4")
    frames = s.getvalue().split("\r")[1:]
    assert len(frames) == 3 and s.getvalue().endswith("\n")
    assert frames[0].startswith("train [##....] 1/3") and "loss 1.0" in frames[0]
    assert frames[2].startswith("train [####..] 2/3") and "loss 0.4" in frames[2]


def test_short_digits_run_learns():
    pytest.importorskip("sklearn")
    log = io.StringIO()
    x, y, xt, yt = zyx.datasets.load_digits()
    res = demo.train(x[:512], y[:512], xt, yt, epochs=1, batch_size=32, log=log)
    assert res["test_acc"] > 0.5, res["history"]           # chance is 0.1
    h = res["history"][0]
    assert np.isfinite(h["loss"]) and h["loss"] < np.log(10)
    assert "epoch  1/1" in log.getvalue() and "test_acc" in log.getvalue()


def _synthetic_mnist(directory, n_train=480, n_test=120, size=8, seed=0):
    """Write a small learnable MNIST look-alike as IDX files (gzip for the training images,
    raw for the rest: both paths of the loader): ten random uint8 template images, each
    sample a template shifted by up to one pixel plus noise. 8x8 keeps the kernels those of
    the digits test, so they are compiled once; needs no scikit-learn."""
    rng = np.random.default_rng(seed)
    templates = rng.integers(0, 256, (10, size + 2, size + 2))
    n = n_train + n_test
    lab = rng.integers(0, 10, n).astype(np.uint8)
    dy, dx = rng.integers(0, 3, n), rng.integers(0, 3, n)
    img = np.stack([templates[c, i:i + size, j:j + size] for c, i, j in zip(lab, dy, dx)])
    img = np.clip(img + rng.normal(0, 25, img.shape), 0, 255).astype(np.uint8)
    parts = {"train_images": img[:n_train], "train_labels": lab[:n_train],
             "test_images": img[n_train:], "test_labels": lab[n_train:]}
    for key, base in MNIST_FILES.items():
        write_idx(directory / (base + (".gz" if key == "train_images" else "")), parts[key])


def test_mnist_path_on_generated_idx_files(tmp_path, capsys):
    _synthetic_mnist(tmp_path)
    res = demo.main(["--mnist", str(tmp_path), "--epochs", "2", "--batch-size", "32", "--tape",
                     "--save", str(tmp_path / "w.safetensors")])
    out = capsys.readouterr()
    assert "test accuracy" in out.out and "MNIST" in out.err
    assert res["test_acc"] > 0.5, res["history"]
    # the saved weights load back (lazily) into the same architecture and predict the same
    model = res["model"]
    loaded = zyx.load(tmp_path / "w.safetensors")
    assert set(loaded) == set(model.state_dict())
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(loaded[k].numpy(), v.numpy())
    # a fresh model given the lazily loaded weights makes the same predictions
    x, y, xt, yt = zyx.datasets.load_mnist(tmp_path, normalize=True)
    mean, std = res["normalize"]
    xt = ((xt[:, None] - mean) / std).astype(np.float32)
    fresh = demo.ConvNet(1, (8, 8))
    fresh.load_state_dict(zyx.load(tmp_path / "w.safetensors"))
    assert demo.evaluate(fresh, xt, yt) == demo.evaluate(model, xt, yt) == res["test_acc"]


def test_mnist_missing_directory_is_a_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "zyx.examples.train", "--mnist",
                        str(tmp_path / "nope"), "--epochs", "1"], capture_output=True, text=True)
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_char_lstm_example_trains_a_few_steps():
    """The char-level LSTM example (`python -m zyx.examples.char_lstm`), a few short steps:
    the loss falls from ~log(vocab) and every step's time is printed."""
    from zyx.examples import char_lstm
    text = char_lstm.load_text("os")[:6000]
    log = io.StringIO()
    res = char_lstm.train(text, steps=12, batch_size=8, seq_len=12, hidden=32, lr=1e-2,
                          log_every=4, out=log)
    vocab = len(res["itos"])
    assert len(res["losses"]) == 12 and all(np.isfinite(res["losses"]))
    assert abs(res["losses"][0] - np.log(vocab)) < 0.5            # starts near uniform
    assert np.mean(res["losses"][-3:]) < res["losses"][0] - 0.3    # and learns
    out = log.getvalue()
    assert "step     4  loss" in out and "ms (median" in out
    text_out = char_lstm.sample(res["model"], res["stoi"], res["itos"], "def ", 10)
    assert text_out.startswith("def ") and len(text_out) == 14


def test_char_lstm_command_line(tmp_path):
    ck = tmp_path / "ck.safetensors"
    r = subprocess.run([sys.executable, "-m", "zyx.examples.char_lstm", "--steps", "3",
                        "--batch-size", "4", "--seq-len", "8", "--hidden", "16",
                        "--log-every", "1", "--sample", "5", "--save", str(ck)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "step     3  loss" in r.stdout and "---- sample ----" in r.stdout
    state = zyx.load(ck)
    assert state["steps"] == 3 and "lstm.weight_hh_l0" in state["model"]
