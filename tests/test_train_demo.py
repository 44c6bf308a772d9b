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


def test_short_digits_run_learns():
    pytest.importorskip("sklearn")
    log = io.StringIO()
    x, y, xt, yt = zyx.datasets.load_digits()
    res = demo.train(x[:512], y[:512], xt, yt, epochs=1, batch_size=32, lr=3e-3, log=log)
    assert res["test_acc"] > 0.5, res["history"]           # chance is 0.1
    h = res["history"][0]
    assert np.isfinite(h["loss"]) and h["loss"] < np.log(10)
    assert "epoch  1/1" in log.getvalue() and "test_acc" in log.getvalue()


def _digits_as_mnist(directory, n_train=400, n_test=100):
    """Write sklearn's 8x8 digits, upscaled to 16x16 uint8 images, as MNIST IDX files
    (gzip for the training images, raw for the rest: both paths of the loader)."""
    from sklearn.datasets import load_digits
    b = load_digits()
    img = (b.images * (255 / 16)).round().astype(np.uint8).repeat(2, 1).repeat(2, 2)
    lab = b.target.astype(np.uint8)
    parts = {"train_images": img[:n_train], "train_labels": lab[:n_train],
             "test_images": img[n_train:n_train + n_test], "test_labels": lab[n_train:n_train + n_test]}
    for key, base in MNIST_FILES.items():
        write_idx(directory / (base + (".gz" if key == "train_images" else "")), parts[key])


def test_mnist_path_on_generated_idx_files(tmp_path, capsys):
    pytest.importorskip("sklearn")
    _digits_as_mnist(tmp_path)
    res = demo.main(["--mnist", str(tmp_path), "--epochs", "2", "--batch-size", "32",
                     "--lr", "3e-3", "--save", str(tmp_path / "w.safetensors")])
    out = capsys.readouterr()
    assert "test accuracy" in out.out and "MNIST" in out.err
    assert res["test_acc"] > 0.5, res["history"]
    # the saved weights load back (lazily) into the same architecture and predict the same
    model = res["model"]
    loaded = zyx.load(tmp_path / "w.safetensors")
    assert set(loaded) == set(model.state_dict())
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(loaded[k].numpy(), v.numpy())


def test_mnist_missing_directory_is_a_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "zyx.examples.train", "--mnist",
                        str(tmp_path / "nope"), "--epochs", "1"], capture_output=True, text=True)
    assert r.returncode == 2 and "does not exist" in r.stderr
