"""Decoding with a preallocated key/value cache (issue 31: "a preallocated key/value cache
written in place (`cache[:, :, t] = k`) works without copies"), zyx with the write going
into the cache's memory (forced, whatever the size thresholds say), zyx with the
functional update (the cache rewritten every step), and PyTorch eager, in one run.

Run:  python -m pytest benches/bench_kv_cache.py --benchmark-only -s
      (ZYX_DEVICE=cuda for the GPU; KV_TOKENS, KV_LAYERS, KV_CONTEXT resize it)

The model: LAYERS blocks of attention (d 256, 4 heads, a fused qkv projection, an output
projection) and a 4x MLP, pre-norm, an embedding and a head of 256 tokens. Each step feeds
one token, writes its keys and values at position t of caches of CONTEXT positions
(1 MiB per cache per layer at the defaults), attends over the whole cache with positions
past t masked (fixed shapes: one plan for every step, as a static cache is written for
torch.compile) and appends the argmax. Both libraries produce the same tokens (checked).
extra_info: the cache bytes rewritten per token by the functional update, and zyx's
in-place time over the functional one and over torch's."""
import os

import numpy as np
import pytest

import zyx
from conftest import need_torch

D, HEADS, VOCAB = 256, 4, 256
LAYERS = int(os.environ.get("KV_LAYERS", "4"))
CONTEXT = int(os.environ.get("KV_CONTEXT", "1024"))
TOKENS = int(os.environ.get("KV_TOKENS", "64"))
DH = D // HEADS

_times = {}


def _weights():
    rng = np.random.default_rng(0)

    def w(*shape, scale=0.05):
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    layers = [dict(qkv=w(D, 3 * D), proj=w(D, D), fc=w(D, 4 * D), out=w(4 * D, D))
              for _ in range(LAYERS)]
    return dict(emb=w(VOCAB, D, scale=1.0), head=w(D, VOCAB), layers=layers)


def _decode(lib, tensor, weights, zeros, arange, where, no_grad, item):
    """Greedy decoding of TOKENS tokens from token 1, with caches written at step t."""
    emb, head = tensor(weights["emb"]), tensor(weights["head"])
    layers = [{k: tensor(v) for k, v in lw.items()} for lw in weights["layers"]]
    caches = [(zeros((1, HEADS, CONTEXT, DH)), zeros((1, HEADS, CONTEXT, DH)))
              for _ in range(LAYERS)]
    positions = arange(CONTEXT)
    tokens = [1]
    with no_grad():
        for t in range(TOKENS):
            x = emb[tokens[-1]].reshape(1, D)
            past = (positions > t).reshape(1, 1, 1, CONTEXT)
            for lw, (ck, cv) in zip(layers, caches):
                h = lib.nn.functional.layer_norm(x, (D,))
                q, k, v = (h @ lw["qkv"]).reshape(1, 3, HEADS, DH).unbind(1)
                ck[:, :, t] = k
                cv[:, :, t] = v
                s = (q.reshape(1, HEADS, 1, DH) @ ck.transpose(-1, -2)) / DH ** 0.5
                s = where(past, float("-inf"), s)
                a = (s.softmax(-1) @ cv).reshape(1, D)
                x = x + a @ lw["proj"]
                h = lib.nn.functional.layer_norm(x, (D,))
                x = x + lib.nn.functional.gelu(h @ lw["fc"]) @ lw["out"]
            tokens.append(item((lib.nn.functional.layer_norm(x, (D,)) @ head).argmax()))
    return tokens


def _zyx_decode(weights):
    return _decode(zyx, zyx.tensor, weights, lambda s: zyx.zeros(s).realize(), zyx.arange,
                   zyx.where, zyx.no_grad, lambda t: int(t.item()))


def _torch_decode(weights):
    torch = need_torch()
    dev = "cuda" if os.environ.get("ZYX_DEVICE", "").startswith("cuda") else "cpu"

    def sync(t):
        return int(t.item())
    return _decode(torch, lambda a: torch.tensor(a, device=dev), weights,
                   lambda s: torch.zeros(s, device=dev), lambda n: torch.arange(n, device=dev),
                   torch.where, torch.no_grad, sync)


@pytest.fixture(scope="module")
def weights():
    return _weights()


def _record(benchmark, name):
    _times[name] = benchmark.stats.stats.median
    benchmark.extra_info["cache_bytes_rewritten_per_token"] = 2 * LAYERS * HEADS * CONTEXT * DH * 4
    if "in place" in _times and "functional" in _times:
        benchmark.extra_info["in_place_over_functional"] = _times["in place"] / _times["functional"]
    if "in place" in _times and "torch" in _times:
        benchmark.extra_info["in_place_over_torch"] = _times["in place"] / _times["torch"]


@pytest.mark.parametrize("mode", ["functional", "in place"])
def test_kv_cache_decode_zyx(benchmark, weights, mode):
    zyx.zeros(1).realize()                      # (the runtime reads its settings at start)
    rt = zyx._RT
    before = rt.inplace_region_bytes, rt.inplace_region_device_bytes
    # (both forced: the defaults take GPUs' caches in place only from 64 MiB)
    rt.inplace_region_bytes = rt.inplace_region_device_bytes = \
        1 << 62 if mode == "functional" else 0
    try:
        tokens = _zyx_decode(weights)
        benchmark.pedantic(_zyx_decode, args=(weights,), rounds=5, iterations=1,
                           warmup_rounds=1)
    finally:
        rt.inplace_region_bytes, rt.inplace_region_device_bytes = before
    _record(benchmark, mode)
    _times["tokens"] = tokens


def test_kv_cache_decode_torch(benchmark, weights):
    need_torch()
    tokens = _torch_decode(weights)
    benchmark.pedantic(_torch_decode, args=(weights,), rounds=5, iterations=1,
                       warmup_rounds=1)
    _record(benchmark, "torch")
    if "tokens" in _times:
        assert tokens == _times["tokens"]
