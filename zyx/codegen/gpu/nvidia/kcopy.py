"""K-major copies of MN-major float32 operands for TF32 warpgroup products (wgmma.py).

wgmma reads TF32 operands K-major only (the instruction has no transpose bits for
them), so `a @ b` with b stored (K, N) row-major could multiply on TF32 tensor cores
only through mma.sync (mma.py: 0.29x of cuBLAS on an H200). Here the lowering gets a
first launch that copies such an operand into a scratch buffer of the program, K
fastest, through 32 x 32 tiles in shared memory (reads and writes both along
contiguous addresses), and the product's tensor map then reads that copy. The copy
moves 8 bytes per value of the operand against 2 x M FLOPs per value of the product,
so it is made only for products of at least MIN_OTHER rows (cols) on the other side.
H200, TF32 `a @ b` 4096: 1.213 ms on mma.sync, 0.445 ms so (torch 0.352).

The copy's rows are padded to a multiple of 4 values (a tensor map's strides are
multiples of 16 bytes); the padding is never read (the map's K extent ends before it).
"""
from __future__ import annotations

from .tma import TensorMap
from ..program import Launch

MIN_OTHER = 512         # rows (cols) of the other side that make the copy worth its cost
TILE = 32               # the copy's square tile (values)
THREADS = 256


def usable(m, n_other):
    """True when `m` (an MN-major map of a float32 operand, tma.operand_map) can be
    copied K-major for a product whose other side has `n_other` rows (cols)."""
    return m.dtype == "float32" and n_other >= MIN_OTHER and m.offset % m.itemsize == 0


def copied(m, coords, box_side, scratch):
    """(TensorMap of the K-major copy of MN-major map `m` in scratch buffer `scratch`,
    its coordinates from the MN-major ones `coords`, bytes of the copy). The copy's
    dims are K, the side, then `m`'s others (batch), contiguous; its boxes are 128
    bytes of K by `box_side`."""
    side, k = m.dims[:2]
    pitch = -(-k // 4) * 4
    size = m.itemsize
    dims = [k, side] + m.dims[2:]
    strides, step = [], pitch * size
    for d in dims[1:]:
        strides.append(step)
        step *= d
    box = [128 // size, box_side] + [1] * (len(dims) - 2)
    out = TensorMap(scratch, 0, m.dtype, size, dims, strides, box, scratch=True)
    return out, [coords[1], coords[0]] + list(coords[2:]), step


def source(name, m):
    """CUDA C of entry `name`(dst, src) copying the operand of MN-major map `m` (its
    buffer `src`) K-major into `dst` (as `copied` lays it out): one group per 32 x 32
    tile of (side, K) per batch position, 256 work-items."""
    side, k = m.dims[:2]
    size = m.itemsize
    pitch = -(-k // 4) * 4
    sk = m.strides[0] // size
    tiles_side, tiles_k = -(-side // TILE), -(-k // TILE)
    lines = [f'extern "C" __global__ void __launch_bounds__({THREADS}) '
             f"{name}(float* __restrict__ zyx_d, const float* __restrict__ zyx_s) {{",
             f"  __shared__ float zyx_t[{TILE}][{TILE + 1}];",
             f"  const int zyx_x = (int)(threadIdx.x % {TILE});",
             f"  const int zyx_y = (int)(threadIdx.x / {TILE});",
             "  long long zyx_g = (long long)blockIdx.x;",
             f"  const long long zyx_n0 = (zyx_g % {tiles_side}) * {TILE};",
             f"  zyx_g /= {tiles_side};",
             f"  const long long zyx_k0 = (zyx_g % {tiles_k}) * {TILE};",
             f"  zyx_g /= {tiles_k};",
             f"  long long zyx_so = {m.offset // size}, zyx_do = 0;"]
    block = pitch * side
    for d, stride in zip(m.dims[2:], m.strides[1:]):
        lines += [f"  zyx_so += (zyx_g % {d}) * {stride // size}ll;",
                  f"  zyx_do += (zyx_g % {d}) * {block}ll;",
                  f"  zyx_g /= {d};"]
        block *= d
    rows = TILE * TILE // THREADS
    lines += ["  #pragma unroll",
              f"  for (int j = 0; j < {rows}; j++) {{",
              f"    const long long n = zyx_n0 + zyx_x, kk = zyx_k0 + zyx_y + j * "
              f"{THREADS // TILE};",
              f"    if (n < {side} && kk < {k}) zyx_t[zyx_y + j * {THREADS // TILE}][zyx_x] = "
              f"zyx_s[zyx_so + kk * {sk}ll + n];",
              "  }",
              "  __syncthreads();",
              "  #pragma unroll",
              f"  for (int j = 0; j < {rows}; j++) {{",
              f"    const long long n = zyx_n0 + zyx_y + j * {THREADS // TILE}, "
              "kk = zyx_k0 + zyx_x;",
              f"    if (n < {side} && kk < {k}) zyx_d[zyx_do + n * {pitch}ll + kk] = "
              f"zyx_t[zyx_x][zyx_y + j * {THREADS // TILE}];",
              "  }",
              "}"]
    return "\n".join(lines) + "\n"


def launch(name, m, scratch):
    """The Launch of `source(name, m)` writing scratch buffer `scratch`."""
    side, k = m.dims[:2]
    groups = -(-side // TILE) * -(-k // TILE)
    for d in m.dims[2:]:
        groups *= d
    return Launch(name, groups, THREADS, [("scratch", scratch), ("arg", m.arg)])
