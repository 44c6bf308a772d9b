"""A small transformer's training step on the CPU, zyx next to PyTorch in one run (issue 13's
figure: "a small transformer training step ... at or below PyTorch").

Run:  python -m pytest benches/bench_transformer.py --benchmark-only

The model is a character-level language model as a user writes it in both libraries:
Embedding(65, 128) + learned positions, 2 TransformerEncoderLayer(128, 4 heads, 512
feed-forward, GELU, batch_first, norm_first, dropout 0) under a causal mask, LayerNorm,
Linear(128, 65); batch 32, context 64, cross-entropy over every position, AdamW.
Both libraries start from the same weights (zyx's state_dict loaded into torch), and the
test checks that one step gives the same loss before timing.

`test_first_step_cold` times the first step in a fresh process with an empty kernel cache
(the issue's compile-time figure: under 2 s), reported in the benchmark's extra_info."""
import os
import subprocess
import sys
import tempfile

import numpy as np

import zyx
import zyx.nn.functional as F
from conftest import need_torch

VOCAB, D, HEADS, FF, LAYERS, B, T = 65, 128, 4, 512, 2, 32, 64


def char_transformer(lib):
    """The model in library `lib` (zyx or torch: the same nn names and arguments)."""
    lnn = lib.nn

    class CharTransformer(lnn.Module):
        def __init__(self):
            super().__init__()
            self.tok = lnn.Embedding(VOCAB, D)
            self.pos = lnn.Embedding(T, D)
            layer = lnn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, activation="gelu",
                                                batch_first=True, norm_first=True)
            self.blocks = lnn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
            self.norm = lnn.LayerNorm(D)
            self.head = lnn.Linear(D, VOCAB)

        def forward(self, idx, mask):
            x = self.tok(idx) + self.pos(lib.arange(T))
            return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))
    return CharTransformer()


def _batches(n=8):
    rng = np.random.default_rng(0)
    text = rng.integers(0, VOCAB, 20000)
    out = []
    for _ in range(n):
        ix = rng.integers(0, len(text) - T - 1, B)
        out.append((np.stack([text[i:i + T] for i in ix]),
                    np.stack([text[i + 1:i + T + 1] for i in ix])))
    return out


def _zyx_step(model, opt, mask):
    def step(x, y):
        logits = model(x, mask)
        loss = F.cross_entropy(logits.reshape(B * T, VOCAB), y.reshape(B * T))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss
    return step


def _causal_mask_numpy():
    return np.triu(np.ones((T, T), bool), 1)        # True = excluded, as torch's bool masks


def test_transformer_step_zyx(benchmark):
    benchmark.group = "char transformer LM step (B32 T64 d128, 2 layers, AdamW)"
    zyx.manual_seed(0)
    model = char_transformer(zyx)
    opt = zyx.optim.AdamW(model.parameters(), lr=1e-3)
    mask = zyx.tensor(_causal_mask_numpy())
    data = [(zyx.tensor(x), zyx.tensor(y)) for x, y in _batches()]
    torch = need_torch()
    # same weights, same batch: the first step's loss matches torch's
    tm = char_transformer(torch)
    tm.load_state_dict({k: torch.from_numpy(v.numpy().copy())
                        for k, v in model.state_dict().items()})
    tx, ty = (torch.from_numpy(a) for a in _batches()[0])
    tloss = torch.nn.functional.cross_entropy(
        tm(tx, torch.from_numpy(_causal_mask_numpy())).reshape(B * T, VOCAB), ty.reshape(-1))
    step = _zyx_step(model, opt, mask)
    loss = step(*data[0])
    np.testing.assert_allclose(loss.item(), tloss.item(), rtol=1e-4)
    it = iter(range(1 << 30))

    def run():
        x, y = data[next(it) % len(data)]
        step(x, y).realize()
    for _ in range(2):
        run()
    benchmark.pedantic(run, rounds=15, iterations=1, warmup_rounds=1)


def test_transformer_step_torch(benchmark):
    benchmark.group = "char transformer LM step (B32 T64 d128, 2 layers, AdamW)"
    torch = need_torch()
    torch.manual_seed(0)
    model = char_transformer(torch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mask = torch.from_numpy(_causal_mask_numpy())
    data = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in _batches()]
    it = iter(range(1 << 30))

    def run():
        x, y = data[next(it) % len(data)]
        loss = torch.nn.functional.cross_entropy(model(x, mask).reshape(B * T, VOCAB),
                                                 y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    for _ in range(2):
        run()
    benchmark.pedantic(run, rounds=15, iterations=1, warmup_rounds=1)


# (torch is kept out of the cold process: benches/conftest.py would import it, a second
# of the process's time that is not zyx's)
_COLD = f"""
import sys, time
t_start = time.perf_counter()
sys.modules["torch"] = None
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import bench_transformer as bt, zyx
zyx.manual_seed(0)
m = bt.char_transformer(zyx)
opt = zyx.optim.AdamW(m.parameters(), lr=1e-3)
mask = zyx.tensor(bt._causal_mask_numpy())
(x, y), = bt._batches(1)
step = bt._zyx_step(m, opt, mask)
t0 = time.perf_counter()
step(zyx.tensor(x), zyx.tensor(y)).item()
t1 = time.perf_counter()
print("SETUP", t0 - t_start, "FIRST", t1 - t0)
"""


def test_first_step_cold(benchmark):
    """The first training step in a fresh process with an empty kernel cache."""
    benchmark.group = "char transformer LM: first step, empty kernel cache"

    def cold():
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, XDG_CACHE_HOME=cache)
            out = subprocess.run([sys.executable, "-c", _COLD], env=env, check=True,
                                 capture_output=True, text=True, timeout=600).stdout
        words = out.split()
        return float(words[words.index("SETUP") + 1]), float(words[words.index("FIRST") + 1])
    times = []
    benchmark.pedantic(lambda: times.append(cold()), rounds=1, iterations=1)
    setup, first = times[0]
    benchmark.extra_info["first_step_s"] = first
    benchmark.extra_info["setup_s"] = setup
    # (the benchmark's own time is the whole process: interpreter start, imports, the C
    # compiler's one-time capability probe, the model's initialization, the first step)
    print(f"\nfirst step with an empty kernel cache: {first:.2f} s (before it, imports, "
          f"compiler probe and model set-up: {setup:.2f} s)")
