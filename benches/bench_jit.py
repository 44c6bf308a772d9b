"""Training steps with and without zyx.jit, PyTorch beside, on one device (issue 31's
recipes): the classic MNIST convnet step (conv 1->32 k5, 32->32 k5, pool, 32->64 k3,
pool, linear; batch 128, Adam) and the 2-layer transformer LM step (d 128, 4 heads,
B 32, T 64, dropout 0.1, AdamW, gradient clipping at 1.0; a fixed batch).

    python benches/bench_jit.py [device] [--steps N] [--only mlp|mnist|lm] [--compile]

(`mlp`, a 784-128-10 MLP step, shows the host time jit removes where kernels are small.)

`device`: a zyx device name (default: the default device; `cuda` on the GPU machine);
PyTorch runs on the matching torch device (cuda for cuda, else cpu). `--compile` adds
torch.compile(mode="reduce-overhead") (CUDA graphs; on a GPU). Prints the median step
time of each variant (synchronized per step) and checks that the jitted zyx step's
losses equal the eager zyx step's on the same seed."""
import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zyx  # noqa: E402
import zyx.nn.functional as F  # noqa: E402

VOCAB, D, HEADS, FF, LAYERS, B_LM, T = 65, 128, 4, 512, 2, 32, 64
B_MNIST = 128


def convnet(lib):
    nn = lib.nn
    return nn.Sequential(nn.Conv2d(1, 32, 5), nn.ReLU(), nn.Conv2d(32, 32, 5), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * 4 * 4, 10))


def language_model(lib):
    lnn = lib.nn

    class LM(lnn.Module):
        def __init__(self):
            super().__init__()
            self.tok = lnn.Embedding(VOCAB, D)
            self.pos = lnn.Embedding(T, D)
            layer = lnn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.1, activation="gelu",
                                                batch_first=True, norm_first=True)
            self.blocks = lnn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
            self.norm = lnn.LayerNorm(D)
            self.head = lnn.Linear(D, VOCAB)

        def forward(self, idx, mask):
            x = self.tok(idx) + self.pos(lib.arange(T, device=idx.device))
            return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))
    return LM()


def _mnist_data(rng):
    return (rng.standard_normal((B_MNIST, 1, 28, 28), dtype=np.float32),
            rng.integers(0, 10, B_MNIST))


def _lm_data(rng):
    text = rng.integers(0, VOCAB, 20000)
    ix = rng.integers(0, len(text) - T - 1, B_LM)
    return (np.stack([text[i:i + T] for i in ix]), np.stack([text[i + 1:i + T + 1] for i in ix]))


def zyx_step(which, jitted):
    """(step(x, y) -> loss, x, y) for zyx."""
    zyx.manual_seed(0)
    if which == "mlp":
        model = zyx.nn.Sequential(zyx.nn.Linear(784, 128), zyx.nn.ReLU(), zyx.nn.Linear(128, 10))
        opt = zyx.optim.Adam(model.parameters(), lr=1e-3)
        xn, yn = _mnist_data(np.random.default_rng(0))
        xn = xn.reshape(B_MNIST, 784)

        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss
    elif which == "mnist":
        model = convnet(zyx)
        opt = zyx.optim.Adam(model.parameters(), lr=1e-3)
        xn, yn = _mnist_data(np.random.default_rng(0))

        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss
    else:
        model = language_model(zyx)
        opt = zyx.optim.AdamW(model.parameters(), lr=1e-3)
        xn, yn = _lm_data(np.random.default_rng(0))
        mask = zyx.tensor(np.triu(np.ones((T, T), bool), 1))

        def step(x, y):
            logits = model(x, mask)
            loss = F.cross_entropy(logits.reshape(B_LM * T, VOCAB), y.reshape(B_LM * T))
            opt.zero_grad()
            loss.backward()
            zyx.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            return loss
    return (zyx.jit(step) if jitted else step), zyx.tensor(xn), zyx.tensor(yn)


def torch_step(which, device, compiled):
    import torch
    torch.manual_seed(0)
    dev = torch.device(device)
    if which == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 10)).to(dev)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=compiled)
        xn, yn = _mnist_data(np.random.default_rng(0))
        xn = xn.reshape(B_MNIST, 784)

        def step(x, y):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss
    elif which == "mnist":
        model = convnet(torch).to(dev)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=compiled)
        xn, yn = _mnist_data(np.random.default_rng(0))

        def step(x, y):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss
    else:
        model = language_model(torch).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=compiled)
        xn, yn = _lm_data(np.random.default_rng(0))
        mask = torch.from_numpy(np.triu(np.ones((T, T), bool), 1)).to(dev)

        def step(x, y):
            logits = model(x, mask)
            loss = torch.nn.functional.cross_entropy(logits.reshape(B_LM * T, VOCAB),
                                                     y.reshape(B_LM * T))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            return loss
    if compiled:
        step = torch.compile(step, mode="reduce-overhead")
    return step, torch.from_numpy(xn).to(dev), torch.from_numpy(yn).to(dev)


def median_ms(step, x, y, sync, steps, warmup=5):
    for _ in range(warmup):
        step(x, y)
    sync()
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(x, y)
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("device", nargs="?", default=None)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--only", choices=("mlp", "mnist", "lm"))
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    if a.device:
        zyx.set_default_device(a.device)
    name = str(zyx.get_default_device())
    sync = lambda: zyx.synchronize(name)      # noqa: E731
    for which in ("mlp", "mnist", "lm"):
        if a.only and which != a.only:
            continue
        # same seed, same batch: the jitted step's losses are the eager step's
        eager, x, y = zyx_step(which, False)
        want = [eager(x, y).item() for _ in range(4)]
        jitted, x, y = zyx_step(which, True)
        got = [jitted(x, y).item() for _ in range(4)]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        rows = [("zyx", median_ms(eager, x, y, sync, a.steps)),
                ("zyx + zyx.jit", median_ms(jitted, x, y, sync, a.steps))]
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None:
            tdev = "cuda" if name.startswith("cuda") and torch.cuda.is_available() else "cpu"
            tsync = torch.cuda.synchronize if tdev == "cuda" else (lambda: None)
            step, tx, ty = torch_step(which, tdev, False)
            rows.append((f"torch eager ({tdev})", median_ms(step, tx, ty, tsync, a.steps)))
            if a.compile:
                step, tx, ty = torch_step(which, tdev, True)
                rows.append((f"torch.compile reduce-overhead ({tdev})",
                             median_ms(step, tx, ty, tsync, a.steps, warmup=10)))
        title = {"mlp": "MLP step (784-128-10, batch 128, Adam: host-bound)",
                 "mnist": "MNIST convnet step (batch 128, Adam)",
                 "lm": "transformer LM step (B 32, T 64, dropout 0.1, AdamW, clipping)"}[which]
        print(f"{title} on {name}, median of {a.steps}:")
        for label, ms in rows:
            print(f"  {label:42s} {ms:9.3f} ms")


if __name__ == "__main__":
    main()
