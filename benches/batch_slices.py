"""Batches sliced from one tensor at random starts, the PyTorch way (issue 12: values that
change must not recompile): `stack([data[i:i + T] for i in ix])`, zyx next to PyTorch.

Run:  python benches/batch_slices.py

Prints the first three batches' times and kernels compiled (only the first compiles: its
slice starts are read at launch from the first graph on), then the medians of 60 batches
alternating between zyx and PyTorch."""
import time, numpy as np, torch, zyx
from zyx.examples.char_lstm import load_text
text = load_text("os"); chars = sorted(set(text)); stoi = {c: i for i, c in enumerate(chars)}
codes = np.array([stoi[c] for c in text], np.int64)
B, T = 32, 64
zd = zyx.tensor(codes).realize(); td = torch.from_numpy(codes)
rng = np.random.default_rng(0)
def zb():
    ix = rng.integers(0, len(codes) - T - 1, B)
    return zyx.stack([zd[int(i):int(i) + T] for i in ix]).numpy()
def tb():
    ix = rng.integers(0, len(codes) - T - 1, B)
    return torch.stack([td[int(i):int(i) + T] for i in ix]).numpy()
c0 = zyx.stats()["kernels_compiled"]
first = []
for _ in range(3):
    t0 = time.perf_counter(); zb(); first.append(time.perf_counter() - t0)
c1 = zyx.stats()["kernels_compiled"]
zt, tt = [], []
for _ in range(60):
    t0 = time.perf_counter(); zb(); zt.append(time.perf_counter() - t0)
    t0 = time.perf_counter(); tb(); tt.append(time.perf_counter() - t0)
print("first three batches ms", [round(f * 1e3, 1) for f in first], "kernels compiled", c1 - c0,
      "then", zyx.stats()["kernels_compiled"] - c1, "| median zyx", round(np.median(zt) * 1e3, 3), "ms torch", round(np.median(tt) * 1e3, 3), "ms")
