"""Which SPIR-V strategy a kernel gets (writer.py writes them): the choice is the C-family
GPU lowering's (`gpu.reduce.choose_strategy`, made from `gpu.analysis` facts), mapped to
what the SPIR-V writer has.

- no loops: "elementwise" (elementwise.py): tiles of consecutive outputs per workgroup,
  `vec` consecutive outputs per step of an invocation read and written as vectors;
- reduce kernels the analysis splits over a group ("group": softmax-like rows, a long
  sum per output): one workgroup per output, lanes split each reduce nest, a tree in
  workgroup memory combines;
- one reduce nest with few outputs and much work ("split": a whole-tensor sum): two
  passes, the first over `splits` groups per output storing each group's partial
  accumulators in scratch buffers, the second combining them;
- the rest (many outputs with short reductions, and the "columns" case): "serial", each
  invocation loops over its output's reduction.
"""
from __future__ import annotations

import os

from ..._core import kernel as K
from ..gpu.analysis import output_size, reduce_nests
from ..gpu.program import read_variant
from ..gpu.reduce import choose_strategy
from .elementwise import plan as elementwise_plan

ELEMENTWISE_LOCAL = 256
GROUP_LOCAL = 256
SPLIT_WORK = 64           # fewest elements per lane of a split group
MAX_SPLITS = 4096

# The reduce kernels' knobs (ZYX_VK_REDUCE="cache=1,subgroup=1,ilp=4,vec=4", read at every
# lowering so that one machine can compare them):
# cache: the group strategy keeps a row's elements in registers for the row's later
#   loops (gpu.reduce.RowCache: softmax reads its row once, not three times);
# subgroup: combine lanes' partials with subgroup operations where the device has them
#   (VkPhysicalDeviceSubgroupProperties), one value per subgroup through workgroup memory;
# ilp: the split strategy's first pass runs this many iterations of the nest's outer
#   loop at once per lane (independent loads in flight; 1: one at a time);
# vec: ... and reads them as vectors of `vec` elements where the loads are contiguous
#   (each lane the vec consecutive elements of a run of vec blocks: 16-byte loads of
#   float32; 1: scalar loads, each lane one element of each block).
REDUCE_ENV = "ZYX_VK_REDUCE"
# (H200, NVIDIA's Vulkan driver, benches/gpu_vk_bandwidth_sweep.py: the subgroup combine
# took softmax 16384x4096 from 0.282 to 0.24 ms; the row cache gained nothing there, 0.242
# against 0.231 ms without it, so it is off; the split sum's ilp/vec did not move it)
REDUCE_DEFAULT = {"cache": 0, "subgroup": 1, "ilp": 4, "vec": 4}
REDUCE_LIMITS = {"ilp": 16, "vec": 4}


def reduce_tuning(info, spec=None):
    """{cache, subgroup, ilp, vec} for the SPIR-V writer on the device `info` describes:
    REDUCE_DEFAULT updated by `spec` (default: ZYX_VK_REDUCE); `subgroup` becomes the
    device's subgroup size where it is on and the device has the operations the combine
    needs (info.extra["subgroup"]: vulkan.py's query), else 0."""
    out = read_variant(REDUCE_ENV, REDUCE_DEFAULT, REDUCE_LIMITS, spec)
    for key in ("cache", "subgroup"):
        if out[key] not in (0, 1):
            raise ValueError(f"{REDUCE_ENV}={spec!r}: {key} is 0 or 1")
    sg = info.extra.get("subgroup") or {}
    size = sg.get("size", 0)
    usable = sg.get("arithmetic") and sg.get("shuffle_relative") and sg.get("compute") \
        and size >= 2 and not size & (size - 1)
    out["subgroup"] = size if out["subgroup"] and usable else 0
    return out


def candidates(kernel, info):
    """[(label, schedule)] the autotuner may time for `kernel` (`choose`'s `schedule`),
    the default (None) first: outputs per invocation and workgroup sizes of elementwise
    kernels, the workgroup size of group and split kernels; only the default for the
    serial reduce kernels."""
    out = [("default", None)]
    strategy = choose(kernel, info)[0]
    limit = max(info.max_local_threads, 1)
    if strategy == "elementwise":
        out += [(f"ew:items={i},vec={v},local={l}", {"items": i, "vec": v, "local": l})
                for i, v, l in ((1, 4, 256), (2, 4, 256), (8, 4, 128), (4, 1, 256),
                                (4, 4, 512)) if l <= limit]
    elif strategy in ("group", "split"):
        out += [(f"group:local={l}", {"group": l}) for l in (64, 128, 512) if l <= limit]
    return out


def choose(kernel, info, schedule=None):
    """(strategy, local size, items per invocation, nests) for `kernel` on a device
    described by `info` (DeviceInfo); for "split", `splits(...)` gives the groups per
    output; for "elementwise" the third item is its `EwLayout`. `schedule` (the
    autotuner's choice, `candidates`) overrides the knobs: {"items", "vec", "local"} for
    elementwise kernels, {"group": n} for group and split ones. Environment knobs for
    benchmark sweeps: ZYX_VK_EW (elementwise.py), ZYX_VK_GROUP (group and split
    workgroup size), ZYX_VK_SPLITS (most groups per output of a split)."""
    ops = kernel.ops
    limit = max(info.max_local_threads, 1)
    if not any(op[0] == K.LOOP for op in ops):
        lay = elementwise_plan(kernel, info, schedule)
        return "elementwise", lay.local, lay, None
    nests = reduce_nests(ops)
    limit_iters = info.extra.get("loop_limit")
    over = limit_iters is not None and iterations(ops) > limit_iters
    if (choose_strategy(ops, nests, info) == "group" or (over and nests is not None)) \
            and _barrier_free(ops):
        local = int(os.environ.get("ZYX_VK_GROUP", GROUP_LOCAL))
        if schedule:
            local = schedule.get("group", local)
        local = min(local, _pow2_floor(limit))
        if splits(ops, nests, local, info) > 1:
            return "split", local, 1, nests
        return "group", local, 1, nests
    return "serial", min(ELEMENTWISE_LOCAL, limit), 1, None


def splits(ops, nests, local, info):
    """Groups per output of the two-pass "split" strategy (1: not split). A kernel of
    one reduce nest with few outputs and much work per output (a whole-tensor sum) is
    spread over enough groups to fill the device, each taking SPLIT_WORK elements per
    lane or more. (lavapipe also needs it: llvmpipe stops an invocation's loops after
    65535 iterations in all, so a long reduction must be spread over many invocations.)"""
    if len(nests) != 1 or nests[0].stores or not nests[0].results or nests[0].reads_earlier:
        return 1
    nest = nests[0]
    if any(op[0] == K.STORE and ops[op[2]][2] == K.SCOPE_GLOBAL for op in ops[:nest.end]):
        return 1
    n_out = output_size(ops)
    if n_out >= max(info.num_cores, 1) * 4:
        return 1
    outer = ops[nest.root][2] if nest.run[0] != nest.root else nest.flat
    work = nest.flat * (ops[nest.root][2] if nest.run[0] != nest.root else 1)
    want = min(int(os.environ.get("ZYX_VK_SPLITS", MAX_SPLITS)), work // (local * SPLIT_WORK),
               outer)
    return want if want >= 2 else 1


def iterations(ops):
    """Loop iterations one invocation of the serial strategy runs (all loops, each
    counted with its enclosing trip counts)."""
    total, mult, stack = 0, 1, []
    for op in ops:
        if op[0] == K.LOOP:
            stack.append(mult)
            mult *= op[2]
            total += mult
        elif op[0] == K.ENDLOOP:
            mult = stack.pop()
    return total


def _barrier_free(ops):
    return not any(op[0] in (K.BARRIER, K.IF_OP) or (op[0] == K.DEFINE and
                                                     op[2] == K.SCOPE_LOCAL) for op in ops)


def _pow2_floor(n):
    p = 1
    while p * 2 <= n:
        p *= 2
    return p
