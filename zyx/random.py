"""zyx's random numbers: a counter-based generator computed on the device, in the graph.

Every random tensor is Threefry-2x32 (Salmon et al., "Parallel random numbers: as easy as
1, 2, 3", SC 2011; JAX's generator; 16 rounds here, see ROUNDS) of a 64-bit counter under a
64-bit key, composed of uint32 tensor ops (+, ^, <<, >>, |): no host array, no upload, no
new IR op, so every backend computes it and it fuses into the kernel that reads it (a
dropout mask costs no kernel and no memory of its own).

- key: the seed's two 32-bit words (`zyx.manual_seed`; 0 until seeded).
- counter: (flat element index, call number). The element index is built from small cached
  index buffers (at most 64K entries each) and index math; the call number is a scalar
  constant that changes with every call. The runtime turns a constant that varies between
  otherwise equal graphs into a value read at launch (see docs/plan-cache.md), so a
  training loop with dropout builds at most two plans. A call covers at most 2^32 elements;
  after 2^32 calls the call number's high word is folded into the key.

The state (seed, call number) lives in the runtime (`RT.seed`, `RT.rng_calls`): the same
seed gives the same numbers on every device and in every run. A numpy Generator
(`RT.rng`, reseeded by manual_seed) remains for host algorithms only: randperm, orthogonal_
(a QR decomposition), DataLoader shuffling and worker seeds.
"""
from __future__ import annotations

import math
import threading

import numpy as np

from . import dtype as dt
from ._core import graph as G
from ._core import kernel as K
from ._core import replay as _replay
from ._core.tensorbase import make, wrap
from .errors import ShapeError
from .runtime import RT

__all__ = ["seed_state", "set_seed", "next_stream", "reserve", "stream", "call_number",
           "round0_words", "counter", "threefry2x32", "bits",
           "uniform", "normal", "integers", "keep_mask", "gumbel", "MASK32"]

MASK32 = 0xFFFFFFFF
# rotation constants of Threefry-2x32 (Random123's R_32x2) and the key schedule's parity
_ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
_PARITY = 0x1BD11BDA
# Rounds of Threefry-2x32. Random123 (SC 2011, table 2) finds 13 the fewest that pass
# TestU01's BigCrush and uses 20 for a safety margin. Each round deepens the chain of inlined
# ops by 3, and the kernelizer stores a node after CHAIN_LIMIT (64) inlined ops in a chain:
# 20 rounds (65-70 deep with the index math and the float conversion) would store a uint32
# intermediate of the tensor's size and no dropout mask would fuse. 16 (52-57 deep) keeps 3
# rounds over the minimum, as cuRAND's and PyTorch's Philox-4x32-10 does over its 7, and
# leaves room for the ops that read the numbers in the same kernel.
ROUNDS = 16
_INDEX_CHUNK = 1 << 16      # index buffers up to this size are cached per device
_INDEX_CACHE = {}
_LOCK = threading.Lock()


def set_seed(seed: int) -> None:
    """Seed the device generator (and the host one used by randperm and friends): the
    seed (any int, taken mod 2^64) is the key; the call number restarts at 0."""
    s = int(seed) & ((1 << 64) - 1)
    with _LOCK:
        RT.seed = s
        RT.rng_calls = 0
    RT.rng = np.random.Generator(np.random.PCG64(s))


def seed_state():
    """(seed, call number) of the runtime's generator: the next call draws from this."""
    return RT.seed, RT.rng_calls


def next_stream():
    """(k0, k1, c1) for the next random call: key words and counter high word; advances
    the call number."""
    return stream(reserve(1))


def reserve(count):
    """Advance the call number by `count` and return the first of the numbers taken (a
    zyx.jit replay takes the calls its captured draws made)."""
    with _LOCK:     # two threads drawing at once must not get the same call number
        n = RT.rng_calls
        RT.rng_calls = n + count
    return n


def stream(n):
    """(k0, k1, c1) of call number n under the current seed: key words and counter high
    word (the call number's high word is folded into the key)."""
    s = RT.seed
    return s & MASK32, ((s >> 32) ^ (n >> 32)) & MASK32, n & MASK32


def call_number(k1, c1):
    """The call number whose stream has key word k1 and counter word c1 (stream's
    inverse, under the current seed)."""
    return (((k1 ^ (RT.seed >> 32)) & MASK32) << 32) | c1


def round0_words(k0, k1, x1):
    """The two constants threefry2x32's first round takes from a scalar counter word x1:
    x0 + (ks0 + x1 + ks1), then rotl(x1 + ks1) is xor-ed in. These are the only values
    in a draw's graph that depend on the call number."""
    k0, k1 = k0 & MASK32, k1 & MASK32
    w1 = (x1 + k1) & MASK32
    return (k0 + w1) & MASK32, _rotl(w1, _ROTATIONS[0])


def _const(value, shape, d=dt.uint32):
    return wrap(RT.graph.add(G.CONST, value, (), shape, d))


def _index(n, device, scale=1):
    """0, scale, 2 * scale, ... (n values) as a uint32 leaf on `device` (a backend
    device), cached for n <= 64K."""
    key = (n, scale, device)
    nid = _INDEX_CACHE.get(key)
    if nid is None:
        vals = np.arange(n, dtype=np.uint64) * np.uint64(scale)
        nid = RT.from_numpy(vals.astype(np.uint32), dt.uint32, device)
        if n > _INDEX_CHUNK:
            return wrap(nid)
        # the cache holds a node reference, not a tensor object: nothing to free at exit
        _INDEX_CACHE[key] = nid
    RT.graph.retain(nid)
    return wrap(nid)


def _bin(a, b, op):
    n = RT.graph.get(a._id)
    return make(G.BINARY, op, (a, b), n.shape, n.dtype)


def _view(t, shape, full):
    """t reshaped to `shape` and expanded to `full` (index math only)."""
    if shape != RT.graph.get(t._id).shape:
        t = make(G.RESHAPE, shape, (t,), shape, dt.uint32)
    return make(G.EXPAND, full, (t,), full, dt.uint32) if shape != full else t


def counter(shape, device=None):
    """The flat element index of `shape` as a uint32 tensor: index math over small cached
    index buffers (at most 64K entries each), no buffer of the tensor's size. Few ops
    deep, since the generator's chain must stay under the kernelizer's CHAIN_LIMIT."""
    dev = RT.resolve(device) if device is not None else RT.device()
    shape = tuple(shape)
    n = math.prod(shape)
    if n > 1 << 32:
        raise ShapeError(f"a random tensor holds at most 2^32 elements, got {n} ({shape})")
    if n <= _INDEX_CHUNK:
        return _view(_index(n, dev), shape, shape)
    for k in range(1, len(shape)):
        rows, cols = math.prod(shape[:k]), math.prod(shape[k:])
        if rows <= _INDEX_CHUNK and cols <= _INDEX_CHUNK:
            # leading axes x trailing axes: row * cols + col, plain strides, no division
            one = (1,) * len(shape)
            r = _view(_index(rows, dev, cols), shape[:k] + one[k:], shape)
            c = _view(_index(cols, dev), one[:k] + shape[k:], shape)
            return _bin(r, c, K.B_ADD)
    rows = -(-n // _INDEX_CHUNK)
    full = (rows, _INDEX_CHUNK)
    flat = _bin(_view(_index(rows, dev, _INDEX_CHUNK), (rows, 1), full),
                _view(_index(_INDEX_CHUNK, dev), (1, _INDEX_CHUNK), full), K.B_BITOR)
    total = rows * _INDEX_CHUNK
    flat = make(G.RESHAPE, (total,), (flat,), (total,), dt.uint32)
    if total != n:
        flat = make(G.PAD, (((0, n - total),), 0), (flat,), (n,), dt.uint32)
    return make(G.RESHAPE, shape, (flat,), shape, dt.uint32) if shape != (n,) else flat


def _rotl(v, r):
    return ((v << r) | (v >> (32 - r))) & MASK32


_ROUND_TEMPLATES = _replay.ForwardTemplates(64)


def threefry2x32(x0, x1, k0, k1):
    """Threefry-2x32 (ROUNDS rounds) of the counter words (x0, x1) under the key (k0, k1)
    (ints): the two uint32 output words. x0 is a uint32 tensor; x1 a uint32 tensor of its
    shape or an int, whose first round is then computed here (two ops instead of five, and
    a shorter chain: see ROUNDS). Adds wrap mod 2^32 and right shifts are logical because
    the words are uint32 on every backend.

    With an int x1 (every draw: `bits`), the rounds after the first are replayed from a
    template per (shape, key) (`_ROUND_TEMPLATES`): their ~110 nodes depend on nothing
    else, and a dropout layer otherwise spent most of its graph building on them."""
    shape = RT.graph.get(x0._id).shape
    ks = (k0 & MASK32, k1 & MASK32, (k0 ^ k1 ^ _PARITY) & MASK32)
    if not isinstance(x1, int):
        return _rounds(x0, x1, ks, 0)
    # round 0 with a scalar x1: x0 + (ks0 + x1 + ks1), then rotl(x1 + ks1) ^ that
    # (nodes of their own, not shared by value: these change with every call, and a
    # graph whose edges depended on which values coincide would change its structure)
    a, b = round0_words(k0, k1, x1)
    ca, cb = _const(a, shape), _const(b, shape)
    if RT.recorder is not None:     # zyx.jit: its replays give these other values
        RT.recorder.random_words(ca._id, cb._id, k0, k1, x1)

    def build(x0, ca, cb):
        x0 = _bin(x0, ca, K.B_ADD)
        return _rounds(x0, _bin(x0, cb, K.B_BITXOR), ks, 1)
    return tuple(_ROUND_TEMPLATES.run(RT.graph, ("threefry",) + ks, [x0, ca, cb], build, wrap))


def _rounds(x0, x1, ks, first):
    """Threefry's rounds from `first` on, with its key injections (ks: the key words and
    their parity word); from round 0, the key is added to both words first."""
    shape = RT.graph.get(x0._id).shape
    consts = {}

    def c(v):   # one constant node per value and call: fewer nodes to build and key
        t = consts.get(v)
        if t is None:
            t = consts[v] = _const(v, shape)
        return t

    if first == 0:
        x0 = _bin(x0, c(ks[0]), K.B_ADD)
        x1 = _bin(x1, c(ks[1]), K.B_ADD)
    for i in range(first, ROUNDS):
        r = _ROTATIONS[i % 8]
        x0 = _bin(x0, x1, K.B_ADD)
        x1 = _bin(_bin(x1, c(r), K.B_SHL), _bin(x1, c(32 - r), K.B_SHR), K.B_BITOR)
        x1 = _bin(x1, x0, K.B_BITXOR)
        if i % 4 == 3:   # key injection after every 4 rounds
            g = i // 4 + 1
            x0 = _bin(x0, c(ks[g % 3]), K.B_ADD)
            x1 = _bin(x1, c((ks[(g + 1) % 3] + g) & MASK32), K.B_ADD)
    return x0, x1


def bits(shape, device=None):
    """Two independent uint32 words per element of `shape` for the next call."""
    k0, k1, c1 = next_stream()
    return threefry2x32(counter(shape, device), c1, k0, k1)


def _to_float(u, scale, d):
    """u (uint32) as dtype d times `scale`."""
    f = make(G.CAST, d, (u,), RT.graph.get(u._id).shape, d)
    return f * scale


def _unit(w, d, open_low=False):
    """A uniform float in [0, 1) (or (0, 1] with open_low) from uint32 word w: its top 24
    bits, which float32 holds exactly (float16/bfloat16 round the float32 value)."""
    top = w >> 8
    if open_low:
        top = top + 1
    f = _to_float(top, 2.0 ** -24, dt.float32)
    return f if d is dt.float32 else f.cast(d)


def uniform(shape, d=dt.float32, device=None):
    """Uniform [0, 1) of dtype d: 24 random bits (53 for float64, from both words)."""
    w0, w1 = bits(shape, device)
    if d is dt.float64:
        hi = _to_float(w0 >> 5, 2.0 ** -27, dt.float64)
        return hi + _to_float(w1 >> 6, 2.0 ** -53, dt.float64)
    f = _unit(w0, d)
    # float16/bfloat16 rounding can reach 1.0: keep the interval half open
    return f if d is dt.float32 else f.minimum(1.0 - _half_ulp(d))


def _half_ulp(d):
    return 2.0 ** -11 if d is dt.float16 else 2.0 ** -8


def normal(shape, d=dt.float32, device=None):
    """Standard normal of dtype d: Box-Muller on the two words of one counter, radius
    from u in (0, 1] (no log(0)), angle from [0, 1). 32-bit words bound the tail at
    sqrt(-2 ln 2^-32) = 6.66 (float32: 24 bits, 5.77)."""
    w0, w1 = bits(shape, device)
    if d is dt.float64:
        u = _to_float(w0, 2.0 ** -32, dt.float64) + 2.0 ** -32
        a = _to_float(w1, 2.0 ** -32 * 2 * math.pi, dt.float64)
    else:
        u = _unit(w0, dt.float32, open_low=True)
        a = _to_float(w1 >> 8, 2.0 ** -24 * 2 * math.pi, dt.float32)
    z = (u.log() * -2.0).sqrt() * a.cos()
    return z if d in (dt.float32, dt.float64) else z.cast(d)


def _mulhi(u, r):
    """The high 32 bits of u * r for uint32 u and an int 0 < r < 2^32, from 16-bit
    halves (no 64-bit multiply, which WebGPU lacks)."""
    rh, rl = r >> 16, r & 0xFFFF
    uh, ul = u >> 16, u & 0xFFFF
    m1 = uh * rl + ((ul * rl) >> 16)
    if not rh:
        return m1 >> 16
    m2 = (m1 & 0xFFFF) + ul * rh
    return (m1 >> 16) + uh * rh + (m2 >> 16)


def integers(low, high, shape, d, device=None):
    """Integers in [low, high) of dtype d. Ranges up to 2^32: the high word of u * range
    (Lemire's multiply-shift without rejection): a value's probability is off from
    1/range by at most range/2^32 relative (2.3e-8 for range 100, 0.4% at 2^24). Larger
    ranges: two words as a uint64 modulo the range (off by at most range/2^64)."""
    w0, w1 = bits(shape, device)
    r = high - low
    if r > 1 << 32:
        v = ((w0.cast(dt.uint64) << 32) | w1.cast(dt.uint64)) % r
        return (v.cast(dt.int64) + low).cast(d)
    v = w0 if r == 1 << 32 else _mulhi(w0, r)
    work = dt.int32 if r <= 1 << 31 and -2 ** 31 <= low and high <= 2 ** 31 else dt.int64
    v = v.cast(work)
    if low:
        v = v + low
    return v if d is work else v.cast(d)


def keep_mask(shape, p, device=None):
    """A bool tensor that is True with probability 1 - p (0 <= p < 1), from one uint32
    compare: word >= round(p * 2^32), exact to 2^-32."""
    w0, _ = bits(shape, device)
    t = int(round(p * 2.0 ** 32))
    if t <= 0:
        return _const(True, tuple(shape), dt.bool_)
    return w0 >= min(t, MASK32)


def gumbel(shape, device=None):
    """Standard Gumbel noise -log(-log(u)) (float32), u = odd 24-bit k / 2^24: strictly
    inside (0, 1), and one multiply of an exact integer (no add that a compiler could fuse
    into an FMA in one kernel and not in another: argmax compares recomputed values)."""
    w0, _ = bits(shape, device)
    u = _to_float((w0 >> 8) | 1, 2.0 ** -24, dt.float32)
    return -((-u.log()).log())
