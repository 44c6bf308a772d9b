"""Issue 31's recipes as they are written there, zyx on its default device next to PyTorch
in the same process.

Run:  python -m pytest benches/bench_recipes.py --benchmark-only -s
GPU:  ZYX_DEVICE=cuda python -m pytest benches/bench_recipes.py --benchmark-only -s

zyx runs on its default device (ZYX_DEVICE picks the backend); PyTorch on CUDA when zyx's
device is a CUDA one and torch sees a GPU, else on the CPU. Each recipe has a zyx test and
a torch test in one benchmark group; the torch test prints zyx's median over torch's (the
ratio the issue's targets are written in) when both ran.

- MNIST convnet step (bench_conv.py's model: conv 1->32 k5, 32->32 k5, maxpool 2,
  32->64 k3, maxpool 2, linear to 10; batch 128; Adam), one fixed batch.
- Transformer LM step (recipe_lm.py: 2 layers, d 128, 4 heads, B 32, T 64, dropout 0.1,
  AdamW, gradients clipped to norm 1), one fixed batch.
- The same LM as a PyTorch script with only its import changed (recipe_lm.train: batches
  by `stack` of slices at random starts), 10 steps per round.
- Sampling 200 characters from that LM with nanoGPT's loop (`idx = cat([idx, nxt], 1)`,
  context cropped to 64, greedy so both libraries write the same text, checked); plans
  built per run in extra_info (bounds.py: one per power of two of the length, not one
  per length).

These share their models with bench_conv.py and recipe_lm.py instead of copying them;
bench_transformer.py (no dropout, no clipping) and bench_sampling.py (positions up to 256,
a fresh tensor per step) stay as they are."""
import numpy as np
import pytest

import zyx
import zyx.nn.functional as F
import recipe_lm as R
from bench_conv import _convnet, _mnist_batch
from conftest import need_torch

SAMPLE_TOKENS = 200
SCRIPT_STEPS = 10
_medians = {}


def _torch_device(torch):
    name = zyx.get_default_device().type
    return "cuda" if name == "cuda" and torch.cuda.is_available() else "cpu"


def _record(benchmark, recipe, lib):
    """Keep this run's median; after torch's, print zyx / torch."""
    if benchmark.stats is None:         # --benchmark-disable: a smoke run, nothing timed
        return
    _medians[(recipe, lib)] = benchmark.stats.stats.median
    z, t = _medians.get((recipe, "zyx")), _medians.get((recipe, "torch"))
    if z is not None and t is not None:
        benchmark.extra_info["zyx_over_torch"] = z / t
        print(f"\n{recipe}: zyx {z * 1e3:.2f} ms, torch {t * 1e3:.2f} ms, "
              f"zyx/torch {z / t:.2f} (zyx on {zyx.get_default_device()})")


# -- MNIST convnet ---------------------------------------------------------------------------
def _convnet_step(lib, cross_entropy, device):
    model = _convnet(lib.nn).to(device)
    opt = lib.optim.Adam(model.parameters(), 1e-3)
    xn, yn = _mnist_batch()
    x = lib.tensor(xn, device=device)
    y = lib.tensor(yn, device=device)

    def step():
        loss = cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()
    return step


@pytest.mark.benchmark(group="recipe: MNIST convnet step (batch 128, Adam)")
def test_convnet_zyx(benchmark):
    zyx.manual_seed(0)
    step = _convnet_step(zyx, F.cross_entropy, zyx.get_default_device())
    for _ in range(3):          # the first compiles
        step()
    benchmark.pedantic(step, rounds=30, iterations=1, warmup_rounds=1)
    _record(benchmark, "convnet", "zyx")


@pytest.mark.benchmark(group="recipe: MNIST convnet step (batch 128, Adam)")
def test_convnet_torch(benchmark):
    torch = need_torch()
    torch.manual_seed(0)
    step = _convnet_step(torch, torch.nn.functional.cross_entropy, _torch_device(torch))
    for _ in range(3):
        step()
    benchmark.pedantic(step, rounds=30, iterations=1, warmup_rounds=1)
    _record(benchmark, "convnet", "torch")


# -- transformer LM step, fixed batch ---------------------------------------------------------
def _lm_fixed(lib, device):
    lib.manual_seed(0)
    model = R.make_model(lib, device)
    model.train()
    step = R.make_step(lib, model)
    rng = np.random.default_rng(0)
    codes = R.text_codes()
    ix = rng.integers(0, len(codes) - R.T - 1, R.B)
    x = lib.tensor(np.stack([codes[i:i + R.T] for i in ix]), device=device)
    y = lib.tensor(np.stack([codes[i + 1:i + R.T + 1] for i in ix]), device=device)
    return lambda: step(x, y).item()


@pytest.mark.benchmark(group="recipe: transformer LM step (B32 T64 d128, dropout, AdamW, clip)")
def test_lm_step_zyx(benchmark):
    run = _lm_fixed(zyx, zyx.get_default_device())
    losses = [run() for _ in range(3)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] + 0.5, losses
    benchmark.pedantic(run, rounds=20, iterations=1, warmup_rounds=1)
    _record(benchmark, "LM step", "zyx")


@pytest.mark.benchmark(group="recipe: transformer LM step (B32 T64 d128, dropout, AdamW, clip)")
def test_lm_step_torch(benchmark):
    torch = need_torch()
    run = _lm_fixed(torch, _torch_device(torch))
    for _ in range(3):
        run()
    benchmark.pedantic(run, rounds=20, iterations=1, warmup_rounds=1)
    _record(benchmark, "LM step", "torch")


# -- the LM as a PyTorch script, import changed -----------------------------------------------
@pytest.mark.benchmark(group="recipe: LM script, import changed (stack of slices), per step")
def test_lm_script_zyx(benchmark):
    dev = zyx.get_default_device()
    R.train(zyx, dev, 3)                            # plans and kernels built
    res = {}

    def run():
        times, res["loss"] = R.train(zyx, dev, SCRIPT_STEPS)
        return times
    benchmark.pedantic(lambda: res.setdefault("t", []).extend(run()[1:]), rounds=3,
                       iterations=1)
    assert np.isfinite(res["loss"])
    benchmark.extra_info["median_step_ms"] = float(np.median(res["t"]) * 1e3)
    _medians[("LM script step", "zyx")] = float(np.median(res["t"]))
    print(f"\nzyx LM script: median step {np.median(res['t']) * 1e3:.2f} ms")


@pytest.mark.benchmark(group="recipe: LM script, import changed (stack of slices), per step")
def test_lm_script_torch(benchmark):
    torch = need_torch()
    dev = _torch_device(torch)
    R.train(torch, dev, 3)
    res = {"t": []}
    benchmark.pedantic(lambda: res["t"].extend(R.train(torch, dev, SCRIPT_STEPS)[0][1:]),
                       rounds=3, iterations=1)
    t = float(np.median(res["t"]))
    benchmark.extra_info["median_step_ms"] = t * 1e3
    z = _medians.get(("LM script step", "zyx"))
    print(f"\ntorch LM script: median step {t * 1e3:.2f} ms"
          + (f", zyx/torch {z / t:.2f}" if z else ""))


# -- sampling 200 characters ------------------------------------------------------------------
def _sampler(lib, device, state=None):
    lib.manual_seed(0)
    model = R.make_model(lib, device)
    if state is not None:
        model.load_state_dict(state)
    start = lib.tensor(np.zeros((1, 1), np.int64), device=device)
    return model, lambda n=SAMPLE_TOKENS: R.generate(lib, model, start, n)[0].tolist()


@pytest.mark.benchmark(group="recipe: sampling 200 characters (cat loop, context cropped to 64)")
def test_sample_zyx(benchmark):
    _, sample = _sampler(zyx, zyx.get_default_device())
    before = zyx.stats()["plans_built"]
    sample()                        # plans for every bound built once
    first = zyx.stats()["plans_built"] - before
    benchmark.extra_info["plans_built_first_run"] = first
    print(f"\nzyx sampling: {first} plans built for the first 200 tokens")
    before = zyx.stats()["plans_built"]
    benchmark.pedantic(sample, rounds=3, iterations=1)
    per_run = (zyx.stats()["plans_built"] - before) / 3
    benchmark.extra_info["plans_built_per_run"] = per_run
    print(f"\nzyx sampling: plans_built per 200 tokens once warm: {per_run:g}")
    _record(benchmark, "sampling", "zyx")


@pytest.mark.benchmark(group="recipe: sampling 200 characters (cat loop, context cropped to 64)")
def test_sample_torch(benchmark):
    torch = need_torch()
    zm, zsample = _sampler(zyx, zyx.get_default_device())
    state = {k: torch.from_numpy(v.numpy().copy()) for k, v in zm.state_dict().items()}
    _, sample = _sampler(torch, _torch_device(torch), state)
    assert sample(80) == zsample(80)                # the same weights write the same text
    benchmark.pedantic(sample, rounds=3, iterations=1)
    _record(benchmark, "sampling", "torch")
