"""Autoregressive sampling with a growing context (issue 12's figure: "sampling 200 tokens
compiles a handful of kernels, not 200 plans"), zyx next to PyTorch in one run.

Run:  python -m pytest benches/bench_sampling.py --benchmark-only -s

The model is bench_transformer's character-level transformer (Embedding(65, 128), learned
positions, 2 TransformerEncoderLayer(128, 4 heads, 512, GELU, norm_first), LayerNorm,
Linear(128, 65)) with positions up to 256, fed the whole context each step (no crop, no
cache), as a first sampling loop is written: the context grows from 1 to 200 tokens. Each
step reads the last position's softmax and appends its argmax (greedy, so both libraries
produce the same text; the test checks they do).

- `test_sample_*`: 200 tokens in a process that has sampled before (its plans cached).
- `test_first_sampling_*`: 200 tokens in a fresh process, once with the kernel cache of the
  earlier runs (warm) and once with an empty one (cold); plans built and kernels compiled
  are in extra_info."""
import os
import subprocess
import sys
import tempfile

import numpy as np

import zyx
from conftest import need_torch

VOCAB, D, HEADS, FF, LAYERS, CONTEXT, TOKENS = 65, 128, 4, 512, 2, 256, 200


def sampler_model(lib):
    """The model in library `lib` (zyx or torch: the same nn names and arguments)."""
    lnn = lib.nn

    class Sampler(lnn.Module):
        def __init__(self):
            super().__init__()
            self.tok = lnn.Embedding(VOCAB, D)
            self.pos = lnn.Embedding(CONTEXT, D)
            layer = lnn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, activation="gelu",
                                                batch_first=True, norm_first=True)
            self.blocks = lnn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
            self.norm = lnn.LayerNorm(D)
            self.head = lnn.Linear(D, VOCAB)

        def forward(self, idx):
            n = idx.shape[1]
            mask = lnn.Transformer.generate_square_subsequent_mask(n)
            x = self.tok(idx) + self.pos(lib.arange(n))
            return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))
    return Sampler()


def sample(lib, model, tokens=TOKENS):
    """Greedy continuation of token 0 by `tokens` tokens; the codes."""
    codes = [0]
    F = lib.nn.functional
    with lib.no_grad():
        for _ in range(tokens):
            idx = lib.tensor(np.array([codes], np.int64))
            p = F.softmax(model(idx)[0, -1], dim=-1).numpy()
            codes.append(int(np.argmax(p)))
    return codes


def _models():
    zyx.manual_seed(0)
    zm = sampler_model(zyx)
    zm.eval()
    return zm


def test_sample_zyx(benchmark):
    benchmark.group = "greedy sampling, 200 tokens, growing context (char transformer d128)"
    model = _models()
    sample(zyx, model)          # plans for every bound built once
    before = zyx.stats()
    benchmark.pedantic(lambda: sample(zyx, model), rounds=3, iterations=1)
    after = zyx.stats()
    benchmark.extra_info["plans_built_per_run"] = (after["plans_built"]
                                                   - before["plans_built"]) / 4


def test_sample_torch(benchmark):
    benchmark.group = "greedy sampling, 200 tokens, growing context (char transformer d128)"
    torch = need_torch()
    zm = _models()
    tm = sampler_model(torch)
    tm.load_state_dict({k: torch.from_numpy(v.numpy()) for k, v in zm.state_dict().items()})
    tm.eval()
    assert sample(torch, tm, 40) == sample(zyx, zm, 40)   # the same text
    benchmark.pedantic(lambda: sample(torch, tm), rounds=3, iterations=1)


_FIRST = f"""
import sys, time
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import bench_sampling as bs, zyx
m = bs._models()
t0 = time.perf_counter()
bs.sample(zyx, m)
s = zyx.stats()
print("FIRST", time.perf_counter() - t0, s["plans_built"], s["kernels_compiled"],
      s["compiler_runs"])
"""


def _first(cache=None):
    env = dict(os.environ)
    if cache is not None:
        env["XDG_CACHE_HOME"] = cache
    out = subprocess.run([sys.executable, "-c", _FIRST], env=env, check=True,
                         capture_output=True, text=True, timeout=1200).stdout
    secs, plans, kernels, runs = out.split("FIRST")[1].split()
    return float(secs), int(plans), int(kernels), int(runs)


def test_first_sampling_fresh_process(benchmark):
    """200 tokens in a fresh process: with the kernel cache warm, and with it empty."""
    benchmark.group = "greedy sampling, 200 tokens: first run in a fresh process"
    res = {}

    def both():
        _first()                                    # fills the default cache
        res["warm"] = _first()
        with tempfile.TemporaryDirectory() as cache:
            res["cold"] = _first(cache)
    benchmark.pedantic(both, rounds=1, iterations=1)
    for k, (secs, plans, kernels, runs) in res.items():
        benchmark.extra_info[f"{k}_s"] = secs
        benchmark.extra_info[f"{k}_plans"] = plans
        benchmark.extra_info[f"{k}_kernels_compiled"] = kernels
        print(f"\n{k} kernel cache: 200 tokens in {secs:.2f} s, {plans} plans, "
              f"{kernels} kernels, {runs} compiler runs")
