"""Lowering a zyx kernel to a GPU program: the part every GPU backend (OpenCL, CUDA, HIP)
shares, and its entry point `lower`. The C-family dialect (cstyle.OpenCLDialect,
CUDADialect...) says how things are spelled; `lower` decides how the kernel's work is
spread over work-groups and work-items and returns a `program.GPUKernel`: one source with
one or more entry points and the launches that run them in order.

A backend's part is then small: compile `GPUKernel.source` once, allocate the scratch
buffers a program asks for, and enqueue each `Launch` with its arguments.

Launch arguments name either one of the zyx kernel's buffers (`("arg", i)`, i.e. the
buffers `Device.launch` receives, output first) or a scratch buffer of the program
(`("scratch", j)`, `GPUKernel.scratch[j]` bytes, contents undefined at entry).

The strategies live in their own modules: `elementwise`, `transpose`, `reduce` (serial,
group, group+partials, columns) and `gemm` (shared-memory product tiles, which first
offer the product to the device's own `DeviceInfo.product_lowerings`); `analysis` holds
the facts about the IR they decide with, `program` the records they return.

Strategies (`GPUKernel.strategy`, chosen by `lower` from the kernel and the DeviceInfo):
- "elementwise": no loops; each group takes a tile of consecutive outputs, each work-item
  several steps of several elements, loaded and stored as vectors where every access
  allows it (`lower_elementwise`; the variant comes from ZYX_GPU_EW), a guarded scalar
  loop for the ragged last tile.
- "transpose": no loops, a load contiguous along another output axis than the store
  (a permuted copy): each group stages a 32 x 32 block through local memory so that the
  load and the store are both coalesced (transpose.py).
- "serial": one work-item per output, its reduce loops run inside it as the C backend
  writes them. Used when there are enough outputs to fill the device and the loads are
  contiguous along the outputs (a column sum, a matmul with a row-major right operand:
  neighbouring work-items read neighbouring elements), for short reductions, and as the
  fallback for kernel shapes the group strategy does not take (see `reduce_nests`).
- "group": one work-group per output; the work-items split each reduce loop nest (its
  innermost perfectly nested loops collapsed into one flat loop, strided by the group size
  so neighbouring work-items read neighbouring elements), then combine their partial
  accumulators with a tree in local memory; one work-item runs the epilogue and stores.
  A row kernel (kernelizer `build_rows`: softmax) ends with a store loop (`store_nest`):
  its work-items split it as well, every one reading the row's combined results, and
  each stores the elements it computed. Where every work-item gets a fixed few elements
  of the row, the first loop keeps what it loads in registers and the later loops read
  them there (`row_cache`): softmax reads its input once, not three times. The knobs
  (local size, row cache, warp-shuffle combines on CUDA/HIP) come from ZYX_GPU_GROUP
  (`group_variant`) or `lower`'s `schedule`.
- "columns": outputs whose loads are contiguous along the output (a column sum) but too
  few to fill the device: one work-item per output as in "serial" (neighbouring
  work-items read neighbouring memory), each nest's outer loop also split over groups;
  pass 1 writes per-work-item partials to scratch, pass 2 (one work-item per output)
  combines them and runs the epilogue.
- "group+partials": as "group", but with few outputs each output is also split over
  several groups (the nest's outer loop, e.g. a blocked sum's block loop, or the flat
  loop grid-strided): pass 1 writes one partial per group and accumulator to a scratch
  buffer, pass 2 (a second launch, one group per output) combines them and runs the
  epilogue (mean's division, the final cast and store).

Partial accumulators are combined with the accumulator's own reduce op and dtype, so a
blocked float sum keeps its float64 totals (blocks of at most SUM_BLOCK float32 adds per
work-item, float64 from there on), as accurate as the CPU's.

Index arithmetic is 32-bit (`int`) when interval arithmetic over the kernel's index ops
and the launch geometry shows every value fits, 64-bit otherwise (`index_ranges`).
"""
from __future__ import annotations

import os

from ..._core import kernel as K
from ..target import DeviceInfo
from . import gemm, transpose
from .analysis import reduce_nests
from .elementwise import elementwise_variant, lower_elementwise
from .reduce import choose_strategy, group_variant, lower_columns, lower_group, lower_one_per_output


# Iterations per float32 block of a float sum on GPU devices (DeviceInfo.sum_block; the
# CPU's SUM_BLOCK is 4096 because SIMD lanes split a block 16 ways): a work-item of the
# serial and columns strategies adds its block in sequence, and 256 sequential adds are
# what the CPU's accuracy rests on.
GPU_SUM_BLOCK = 256


WORK_GROUP = 64       # fewest work-items a device must allow in a group (opencl.initialize)


TILES_ENV = "ZYX_GPU_TILES"


TILE_OUTPUTS_PER_CORE = 1024   # a tile of ~16 outputs per work-item: 64 per compute unit


def register_tiles():
    """DeviceInfo.register_tiles of GPU devices: whether kernelize gives reduce kernels
    with many outputs (tile_min_outputs) the CPU's matmul register tiles ("lanes"/"unroll":
    each work-item computes a tile of outputs, reusing each load across it) before
    gpu.lower spreads work-items. On unless ZYX_GPU_TILES=0 (H100, 4096^2 matmul: float32
    38.1 -> 34.7 ms, bfloat16 46.1 -> 19.9 ms)."""
    return os.environ.get(TILES_ENV, "1") != "0"


def own_tiles(info):
    """DeviceInfo.own_tiles of a GPU device described by `info`: the kernels `lower`
    gives shared-memory gemm tiles (gemm.wanted), which kernelize leaves untiled."""
    return lambda ops: gemm.wanted(ops, info)


def product_parts(info):
    """DeviceInfo.product_parts of a GPU device described by `info` (gemm.parts), None
    where gemm tiles are off."""
    if not gemm.enabled():
        return None
    return lambda rows, cols, k, most: gemm.parts(info, rows, cols, k, most)


def tile_min_outputs(num_cores):
    """DeviceInfo.tile_min_outputs of a GPU with `num_cores` compute units: kernels with
    fewer outputs keep one output per work-item (or a group per output)."""
    return max(num_cores, 1) * TILE_OUTPUTS_PER_CORE


# The autotuner's search space (zyx/tuning.py): knob settings tried besides the
# defaults, per strategy. Kept short: each is one compile and a few launches.
EW_CANDIDATES = ({"items": 1, "vec": 4}, {"items": 2, "vec": 4}, {"items": 8, "vec": 4},
                 {"items": 4, "vec": 1}, {"items": 4, "vec": 2}, {"local": 128},
                 {"local": 512}, {"waves": 4})


GROUP_CANDIDATES = ({"local": 64}, {"local": 128}, {"local": 256}, {"local": 512},
                    {"local": 1024}, {"cache": 0}, {"warp": 0})


def schedule_candidates(kernel, info=None):
    """[(label, schedule)] worth timing for `kernel` (`lower`'s `schedule`), the default
    (None) first; just the default for the strategies without knobs (serial, columns)."""
    info = info if info is not None else DeviceInfo()
    ops = kernel.ops
    out = [("default", None)]
    if not any(op[0] == K.LOOP for op in ops):
        base = elementwise_variant()
        out += [("ew:" + ",".join(f"{k}={v}" for k, v in sorted(c.items())),
                 {"elementwise": c}) for c in EW_CANDIDATES
                if any(base[k] != v for k, v in c.items())]
        return out
    p = gemm.plan(ops) if gemm.enabled() else None
    tile = gemm.choose_tile(p, info) if p is not None else None
    if tile is not None:
        return out + [(f"gemm:{br}x{bc}", {"gemm": (br, bc)}) for br, bc, _ in gemm.TILES
                      if (br, bc) != tile[:2] and gemm.choose_tile(p, info, (br, bc))]
    nests = reduce_nests(ops)
    if choose_strategy(ops, nests, info) != "group":
        return out
    base = group_variant()
    limit = info.max_local_threads or 1024
    out += [("group:" + ",".join(f"{k}={v}" for k, v in sorted(c.items())), {"group": c})
            for c in GROUP_CANDIDATES
            if c.get("local", 1) <= limit and any(base[k] != v for k, v in c.items())]
    return out


def lower(kernel, dl, info=None, name="zyx_k", schedule=None):
    """`GPUKernel` of `kernel` in dialect `dl` for a device described by `info`
    (DeviceInfo; None for defaults). The strategy is chosen as the module docstring says;
    `schedule` may fix its knobs: {"elementwise": {...}, "group": {...}} with the keys of
    `elementwise_variant` / `group_variant` (missing: the environment's or the defaults),
    {"gemm": (rows, cols)} a gemm tile of gemm.TILES, {"gemm": None} no gemm tiles,
    {"gemm_knobs": {...}} knobs of gemm.variant over the environment's (the driver
    lowers {"tma": 0} for buffers a tensor map cannot start at)."""
    info = info if info is not None else DeviceInfo()
    schedule = schedule or {}
    ops = kernel.ops
    if not any(op[0] == K.LOOP for op in ops):
        ew = schedule.get("elementwise")
        tp = transpose.plan(ops) if ew is None else None
        if tp is not None:       # a permuted copy (the autotuner may time elementwise too)
            return transpose.lower_transpose(kernel, dl, info, name, tp)
        return lower_elementwise(kernel, dl, info, name,
                                 None if ew is None else dict(elementwise_variant(), **ew))
    if gemm.enabled() and schedule.get("gemm", True) is not None:
        p = gemm.plan(ops)
        want = schedule.get("gemm")
        tile = gemm.choose_tile(p, info, want if isinstance(want, (tuple, list)) else None) \
            if p is not None else None
        if tile is not None:
            knobs = schedule.get("gemm_knobs")
            return gemm.lower_gemm(kernel, dl, info, name, p, tile,
                                   dict(gemm.variant(), **knobs) if knobs else None)
    nests = reduce_nests(ops)
    strategy = choose_strategy(ops, nests, info)
    if strategy == "columns":
        root_nests = reduce_nests(ops, split_root=True)
        if root_nests is not None:
            return lower_columns(kernel, dl, info, name, root_nests)
        strategy = "serial"
    if strategy == "serial":
        return lower_one_per_output(kernel, dl, info, name, "serial")
    grp = schedule.get("group")
    return lower_group(kernel, dl, info, name, nests,
                       None if grp is None else dict(group_variant(), **grp))
