"""Lowering a zyx kernel to a GPU program: the part every GPU backend (OpenCL, CUDA, HIP)
shares. The C-family dialect (cfamily.OpenCLDialect, CUDADialect...) says how things are
spelled; this module decides how the kernel's work is spread over work-groups and
work-items, and returns a `GPUKernel`: one source with one or more entry points and the
launches that run them in order.

A backend's part is then small: compile `GPUKernel.source` once, allocate the scratch
buffers a program asks for, and enqueue each `Launch` with its arguments.

Launch arguments name either one of the zyx kernel's buffers (`("arg", i)`, i.e. the
buffers `Device.launch` receives, output first) or a scratch buffer of the program
(`("scratch", j)`, `GPUKernel.scratch[j]` bytes, contents undefined at entry).

Strategies (`GPUKernel.strategy`, chosen by `lower` from the kernel and the DeviceInfo):
- "elementwise": no loops; each group takes a tile of consecutive outputs, each work-item
  several steps of several elements, loaded and stored as vectors where every access
  allows it (`lower_elementwise`; the variant comes from ZYX_GPU_EW), a guarded scalar
  loop for the ragged last tile.
- "transpose": no loops, a load contiguous along another output axis than the store
  (a permuted copy): each group stages a 32 x 32 block through local memory so that the
  load and the store are both coalesced (backends/transpose.py).
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

import numpy as np

from ... import dtype as dt
from ..._core import kernel as K
from ..target import DeviceInfo
from . import gemm, transpose
from ..cstyle import INDEX32, Frame, alu, render_body
from ..cstyle import alu_operands as _operands

# Iterations per float32 block of a float sum on GPU devices (DeviceInfo.sum_block; the
# CPU's SUM_BLOCK is 4096 because SIMD lanes split a block 16 ways): a work-item of the
# serial and columns strategies adds its block in sequence, and 256 sequential adds are
# what the CPU's accuracy rests on.
GPU_SUM_BLOCK = 256
WORK_GROUP = 64       # fewest work-items a device must allow in a group (opencl.initialize)
ELEMENTWISE_GROUP = 256   # work-items per group of one-item-per-output kernels (serial, columns)
REDUCE_GROUP = 256    # most work-items splitting one reduce (16 loads each of a 4096 block)
MIN_SPLIT = 32        # shortest flat reduce loop worth splitting over a group
ITEMS_PER_THREAD = 8  # a group splits a reduce of n into about n / 8 work-items (pow2)
GROUPS_PER_CORE = 8   # resident groups of 256 per compute unit (2048 threads on an SM)
MIN_PER_ITEM = 4      # fewest flat iterations per work-item when a loop is grid-strided
MIN_COLUMN_ITERATIONS = 16   # fewest outer-loop iterations per group in "columns"
INT32_MAX = 2**31 - 1


class Launch:
    """One kernel launch: entry point `entry`, `groups` work-groups of `local_size`
    work-items (1-D), its arguments (see the module docstring), `shared`: bytes of
    dynamic shared memory per group (CUDA only; 0: the kernel declares what it uses), and
    `maps`: tma.TensorMaps passed after the arguments (CUDA only; the driver encodes
    them at launch from the arguments' addresses)."""
    __slots__ = ("entry", "groups", "local_size", "args", "shared", "maps")

    def __init__(self, entry, groups, local_size, args, shared=0, maps=()):
        self.entry = entry
        self.groups = groups
        self.local_size = local_size
        self.args = args
        self.shared = shared
        self.maps = list(maps)

    @property
    def global_size(self):
        return self.groups * self.local_size

    def __repr__(self):
        return f"Launch({self.entry}, {self.groups}x{self.local_size}, {self.args})"


class GPUKernel:
    """The lowered kernel: source text (prelude included), launches in order, scratch
    buffer sizes in bytes, and the strategy's name (for tests and ZYX_DEBUG)."""
    __slots__ = ("source", "launches", "scratch", "strategy", "index_bits", "variant")

    def __init__(self, source, launches, scratch=(), strategy="serial", index_bits=64):
        self.source = source
        self.launches = launches
        self.scratch = list(scratch)
        self.strategy = strategy
        self.index_bits = index_bits
        self.variant = None     # the elementwise or group strategy's knobs, as chosen


# -- facts about the IR ---------------------------------------------------------------------

def loop_ends(ops):
    """LOOP position -> position of its ENDLOOP."""
    return {op[2]: i for i, op in enumerate(ops) if op[0] == K.ENDLOOP}


def top_level_nests(ops, ends):
    """(LOOP, ENDLOOP) positions of the loops outside every loop and IF: the places where
    all work-items of a group run the same code, so a barrier may follow them."""
    nests, depth = [], 0
    for i, op in enumerate(ops):
        c = op[0]
        if c == K.LOOP:
            if depth == 0:
                nests.append((i, ends[i]))
            depth += 1
        elif c == K.IF_OP:
            depth += 1
        elif c == K.ENDLOOP or c == K.END_IF:
            depth -= 1
    return nests


def child_loops(ops, loop, ends):
    """The loops directly inside `loop`."""
    out, j = [], loop + 1
    while j < ends[loop]:
        if ops[j][0] == K.LOOP:
            out.append(j)
            j = ends[j] + 1
        else:
            j += 1
    return out


def only_wraps(ops, loop, child, ends):
    """True when `loop`'s body is `child` and nothing else but constants."""
    body = list(range(loop + 1, child)) + list(range(ends[child] + 1, ends[loop]))
    return all(ops[j][0] == K.CONST for j in body)


def thread_run(ops, root, ends):
    """The loops of the nest at `root` that the work-items of a group split: follow single
    child loops down from the root, then keep the deepest perfectly nested run (collapsed
    into one flat loop, whose innermost variable moves fastest: consecutive work-items
    read consecutive elements when the innermost loop walks memory contiguously)."""
    chain = [root]
    while True:
        kids = child_loops(ops, chain[-1], ends)
        if len(kids) != 1:
            break
        chain.append(kids[0])
    run = [chain[-1]]
    for loop in reversed(chain[:-1]):
        if not only_wraps(ops, loop, run[0], ends):
            break
        run.insert(0, loop)
    return run


def register_defines(ops):
    """REGISTER DEFINE position -> (dtype, reduce op, length)."""
    return {i: (op[1], op[6], op[5]) for i, op in enumerate(ops)
            if op[0] == K.DEFINE and op[2] == K.SCOPE_REGISTER}


def accumulate_loads(ops, regs, lo, hi):
    """Positions of the `LOAD acc` in every `acc = acc <reduce op> x` store in [lo, hi),
    mapped to x; None when a register store there has another form."""
    found = {}
    for j in range(lo, hi):
        op = ops[j]
        if op[0] != K.STORE or op[2] not in regs:
            continue
        acc = op[2]
        rop = regs[acc][1]
        val = ops[op[4]]
        if op[3] != -1 or rop < 0 or val[0] != K.BINARY or val[2] != K.REDUCE_BINARY[rop]:
            return None
        for cur, x in ((val[3], val[4]), (val[4], val[3])):
            c = ops[cur]
            if c[0] == K.LOAD and c[2] == acc and c[3] == -1:
                found[cur] = (acc, x, j)
                break
        else:
            return None
    return found


class Nest:
    """A top-level reduce loop nest the work-items of a group split.

    `run`: the loops collapsed into the split flat loop; `results`: accumulators defined
    before the nest holding per-work-item partials at its end; `reads_earlier`: the nest
    reads results of an earlier nest (then it cannot be split over groups); `stores`: a
    row kernel's store loop (no accumulator, each iteration stores its own elements:
    the work-items split it and each stores what it computed, nothing to combine)."""
    __slots__ = ("root", "end", "run", "results", "reads_earlier", "flat", "stores")

    def __init__(self, root, end, run, results, reads_earlier, flat, stores=False):
        self.root = root
        self.end = end
        self.run = run
        self.results = results
        self.reads_earlier = reads_earlier
        self.flat = flat
        self.stores = stores


def partial_results(ops, regs, root, end, run, ends):
    """The accumulators holding per-work-item partials after the nest when its `run` is
    split over work-items, or None when splitting it would change the result.

    Inside the split loop an accumulator defined outside it may only be updated by
    `acc = acc op x`; after the split loop its partial value may only flow, through casts,
    into `acc2 = acc2 op partial` with the same reduce op (a blocked sum's float64 fold:
    a sum of partial block sums is the sum); any other use would see a partial."""
    split, split_end = run[0], ends[run[0]]
    acc_loads = accumulate_loads(ops, regs, root, end)
    if acc_loads is None:
        return None
    store_of = {j: (acc, x) for acc, x, j in acc_loads.values()}
    combines = {ops[j][4] for j in store_of}      # the `acc op x` of each update
    partial = {acc for acc, _, j in acc_loads.values() if acc < split < j < split_end}
    tainted = {}          # SSA -> reduce op of the partial value it carries
    for j in range(root, end):
        op = ops[j]
        c = op[0]
        if c in (K.IF_OP, K.BARRIER) or (c == K.STORE and op[2] not in regs):
            return None
        inside = split < j < split_end
        if c == K.LOAD and op[2] in partial and j not in acc_loads:
            if inside:
                return None          # a running partial read mid-loop
            tainted[j] = regs[op[2]][1]
        elif c == K.CAST and op[2] in tainted:
            tainted[j] = tainted[op[2]]
        elif c == K.STORE and not inside:
            acc, x = store_of[j]
            if x not in tainted or tainted[x] != regs[acc][1] or acc > split:
                return None          # not a fold of partials: each work-item would add it
            partial.add(acc)
        elif j not in combines and any(a in tainted for a in _operands(op)):
            return None              # a partial used as if it were the whole
    return sorted(a for a in partial if a < root)


def reduce_nests(ops, split_root=False):
    """The kernel's top-level nests as `Nest`s, or None when the group strategy does not
    take this kernel (no loops, register arrays of the CPU's tiled layouts, a loop under
    an IF, a nest storing to memory, an accumulator used in a way a split would change).
    `split_root`: the loop split is each nest's outermost loop (the "columns" strategy
    splits it over groups) instead of its collapsed innermost run."""
    regs = register_defines(ops)
    if not regs or any(length != 1 for _, _, length in regs.values()):
        return None
    ends = loop_ends(ops)
    nests = []
    tops = top_level_nests(ops, ends)
    for k, (root, end) in enumerate(tops):
        run = [root] if split_root else thread_run(ops, root, ends)
        if k == len(tops) - 1 and k > 0 and store_nest(ops, regs, root, end, run, ends):
            flat = 1
            for loop in run:
                flat *= ops[loop][2]
            nests.append(Nest(root, end, run, [], True, flat, True))
            continue
        results = partial_results(ops, regs, root, end, run, ends)
        if not results:
            return None
        written = set(results)
        reads_earlier = any(op[0] == K.LOAD and op[2] in regs and op[2] < root
                            and op[2] not in written for op in ops[root:end])
        flat = 1
        for loop in run:
            flat *= ops[loop][2]
        nests.append(Nest(root, end, run, results, reads_earlier, flat))
    if any(op[0] == K.LOOP for op in ops) and not nests:
        return None
    return nests or None


def store_nest(ops, regs, root, end, run, ends):
    """True when the nest at `root` is a row kernel's store loop (kernelizer.build_rows):
    its perfectly nested `run` is the whole nest, and its body writes no register and
    stores to memory at an index that moves with the run's innermost loop (so every
    iteration writes elements of its own, and work-items splitting the run never write
    the same element)."""
    if run[0] != root or any(ops[j][0] in (K.LOOP, K.IF_OP, K.BARRIER)
                             for j in range(run[-1] + 1, ends[run[-1]])):
        return False
    memo, found = {}, False
    for j in range(root, end):
        op = ops[j]
        if op[0] == K.STORE:
            if op[2] in regs:
                return False
            if _coefficient(ops, op[3], run[-1], memo) in (None, 0):
                return False
            found = True
    return found


def index_math(ops):
    """SSA ids of index arithmetic: INDEX and LOOP variables and the integer BINARY ops
    computed from them and constants only (data never flows into an address here)."""
    idx = set()
    for i, op in enumerate(ops):
        c = op[0]
        if c == K.INDEX or c == K.LOOP:
            idx.add(i)
        elif c == K.BINARY and op[1] is K.IDX and op[2] in _RANGE_OPS:
            a, b = op[3], op[4]
            if (a in idx or b in idx) and all(x in idx or ops[x][0] == K.CONST for x in (a, b)):
                idx.add(i)
    return idx


def _div_range(a, d):
    """Range of a / d, C truncation, for a constant d != 0."""
    vals = [int(x / d) for x in a]
    return min(vals), max(vals)


def _binary_range(bop, a, b, b_const):
    """Range of `a bop b` from the operands' ranges (None: not bounded here)."""
    if bop == K.B_ADD:
        return a[0] + b[0], a[1] + b[1]
    if bop == K.B_SUB:
        return a[0] - b[1], a[1] - b[0]
    if bop == K.B_MUL:
        p = [x * y for x in a for y in b]
        return min(p), max(p)
    if bop == K.B_MAX:
        return max(a[0], b[0]), max(a[1], b[1])
    if bop == K.B_MIN:
        return min(a[0], b[0]), min(a[1], b[1])
    if b_const is None or b_const == 0:
        return None
    if bop == K.B_DIV:
        return _div_range(a, b_const)
    m = abs(b_const) - 1      # B_MOD: C's remainder takes the dividend's sign
    return (-m if a[0] < 0 else 0), (m if a[1] > 0 else 0)


_RANGE_OPS = (K.B_ADD, K.B_SUB, K.B_MUL, K.B_MAX, K.B_MIN, K.B_DIV, K.B_MOD)


def index_ranges(ops, idx):
    """[lo, hi] of every index value, by interval arithmetic (None: unbounded)."""
    rng = {}

    def get(j):
        op = ops[j]
        return (op[2], op[2]) if op[0] == K.CONST else rng.get(j)
    for i in sorted(idx):
        op = ops[i]
        if op[0] == K.INDEX:
            rng[i] = (0, op[3] - 1)
        elif op[0] == K.LOOP:
            rng[i] = (0, op[2] - 1)
        else:
            a, b = get(op[3]), get(op[4])
            bc = ops[op[4]][2] if ops[op[4]][0] == K.CONST else None
            rng[i] = None if a is None or b is None else _binary_range(op[2], a, b, bc)
    return rng


def narrow_index(ops, extents):
    """The SSA ids to render as 32-bit index math: all of them when every index value and
    every launch extent (`extents`: global sizes, scratch lengths) fits in an int32,
    else none."""
    idx = index_math(ops)
    if any(n > INT32_MAX for n in extents):
        return frozenset()
    for r in index_ranges(ops, idx).values():
        if r is None or r[0] < -INT32_MAX - 1 or r[1] > INT32_MAX:
            return frozenset()
    return frozenset(idx)


def output_size(ops):
    """Number of outputs: the product of the INDEX extents."""
    n = 1
    for op in ops:
        if op[0] == K.INDEX:
            n *= op[3]
    return n


def _coefficient(ops, ssa, var, memo):
    """d(index ssa)/d(var) when the index is affine in `var`, else None."""
    if ssa in memo:
        return memo[ssa]
    op = ops[ssa]
    c = op[0]
    if ssa == var:
        r = 1
    elif c in (K.CONST, K.INDEX, K.LOOP):
        r = 0
    elif c == K.BINARY and op[2] in (K.B_ADD, K.B_SUB, K.B_MUL, K.B_DIV, K.B_MOD):
        a = _coefficient(ops, op[3], var, memo)
        b = _coefficient(ops, op[4], var, memo)
        if a is None or b is None:
            r = None
        elif op[2] == K.B_ADD:
            r = a + b
        elif op[2] == K.B_SUB:
            r = a - b
        elif op[2] == K.B_MUL:
            if a and b:
                r = None
            elif a:
                r = a * ops[op[4]][2] if ops[op[4]][0] == K.CONST else None
            elif b:
                r = b * ops[op[3]][2] if ops[op[3]][0] == K.CONST else None
            else:
                r = 0
        else:
            r = 0 if a == 0 and b == 0 else None
    else:
        r = None
    memo[ssa] = r
    return r


def contiguous_along(ops, lo, hi, var):
    """True when every global load in [lo, hi) steps by 0 or 1 element along `var` and at
    least one steps by 1 (neighbouring values of var read neighbouring memory)."""
    return contiguous_loads(ops, range(lo, hi), var)


def contiguous_loads(ops, positions, var):
    """`contiguous_along` for the ops at `positions` (any order)."""
    memo, steps = {}, []
    for j in positions:
        op = ops[j]
        if op[0] == K.LOAD and ops[op[2]][2] == K.SCOPE_GLOBAL:
            steps.append(_coefficient(ops, op[3], var, memo))
    return bool(steps) and all(s in (0, 1) for s in steps) and 1 in steps


# -- launch geometry --------------------------------------------------------------------

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


def tile_min_outputs(num_cores):
    """DeviceInfo.tile_min_outputs of a GPU with `num_cores` compute units: kernels with
    fewer outputs keep one output per work-item (or a group per output)."""
    return max(num_cores, 1) * TILE_OUTPUTS_PER_CORE


def _pow2_floor(n):
    return 1 << (max(int(n), 1).bit_length() - 1)


def _pow2_ceil(n):
    return 1 << (max(int(n), 1) - 1).bit_length()


def local_size_for(info, want):
    """Work-items per group: `want` rounded to a power of two, at most the device's
    limit, at least a warp (32 where the device reports no warp)."""
    top = _pow2_floor(max(info.max_local_threads, 1))
    warp = info.warp_size if info.warp_size > 1 else 32
    return max(min(_pow2_ceil(want), top), min(warp, top))


def device_threads(info):
    """Work-items that keep every compute unit busy (2048 per SM on an H100)."""
    return max(info.num_cores, 1) * max(info.max_local_threads, 1) * 2


def choose_strategy(ops, nests, info):
    """"serial", "columns" or "group" for a kernel with loops (module docstring)."""
    if nests is None or min(n.flat for n in nests) < MIN_SPLIT:
        return "serial"
    n_out = output_size(ops)
    out_vars = [i for i, op in enumerate(ops) if op[0] == K.INDEX]
    # (an output axis merged from parts has one INDEX per part: the last one is innermost)
    last_out = max(out_vars, key=lambda i: (ops[i][2], i)) if out_vars else None
    nests = [n for n in nests if not n.stores]   # (where the data is read decides)
    rows = all(contiguous_along(ops, n.run[-1], ends_of(ops, n.run[-1]), n.run[-1])
               for n in nests)
    columns = last_out is not None and not rows and all(
        contiguous_along(ops, n.run[-1], ends_of(ops, n.run[-1]), last_out) for n in nests)
    fill = device_threads(info)
    if columns and n_out >= fill:
        return "serial"      # neighbouring work-items read neighbouring memory already
    if columns and n_out >= 2 * REDUCE_GROUP:
        return "columns"     # too few outputs to fill the device: split their loops too
    if not rows and n_out >= fill:
        return "serial"      # enough outputs, and a group would read strided memory
    return "group"


def ends_of(ops, loop):
    """Position of LOOP `loop`'s ENDLOOP."""
    for i in range(loop + 1, len(ops)):
        if ops[i][0] == K.ENDLOOP and ops[i][2] == loop:
            return i
    raise AssertionError(f"loop {loop} has no ENDLOOP")


def choose_splits(ops, nests, info, local):
    """Groups per output: enough groups to fill the device when outputs are few, each
    with a fair share of every nest's work; 1 when a nest cannot be split over groups."""
    n_out = output_size(ops)
    wanted = max(info.num_cores, 1) * max(GROUPS_PER_CORE * REDUCE_GROUP // local, 1)
    if n_out >= wanted:
        return 1
    last_end = nests[-1].end
    if any(n.reads_earlier for n in nests) or any(
            op[0] == K.STORE and ops[op[2]][2] == K.SCOPE_GLOBAL for op in ops[:last_end]):
        return 1
    splits = -(-wanted // n_out)
    for n in nests:
        cap = ops[n.root][2] if n.run[0] != n.root else n.flat // (local * MIN_PER_ITEM)
        splits = min(splits, max(cap, 1))
    return max(splits, 1)


# -- source ---------------------------------------------------------------------------------

def _params(kernel, dl, r):
    """Parameter declarations of the zyx kernel's buffers, in argument order."""
    ro = {argno: (d, read_only) for argno, d, read_only in r.params}
    params = []
    for argno in range(len(kernel.args)):
        # an argument no op reads still takes its position in the argument list
        d, read_only = ro.get(argno, (None, True))
        t = dl.storage_type(d) if d is not None else dl.byte_type
        const = "const " if read_only else ""
        params.append(f"{dl.global_qualifier}{const}{t}* {dl.restrict} g{argno}")
    return params


def _decode_indices(ops, itype, flat):
    """Statements giving each INDEX variable its value from the flat output index `flat`
    (row-major: the last index is fastest). Every caller has `flat` below the output
    count, so the outermost index needs no `%` (and a stride of 1 no division)."""
    lines, stride = [], 1
    idx = [i for i, op in enumerate(ops) if op[0] == K.INDEX]
    for ssa in reversed(idx):
        length = ops[ssa][3]
        e = flat if stride == 1 else f"({flat} / {stride})"
        if ssa != idx[0]:
            e = f"{e} % {length}"
        lines.append(f"  const {itype} i{ssa} = {e};")
        stride *= length
    return list(reversed(lines))


def _entry(dl, name, params, head, body):
    """One entry point's source."""
    return (f"{dl.kernel_prefix} {name}({', '.join(params)}) {{\n" + "\n".join(head)
            + "\n" + "\n".join(body) + "\n}\n")


def lower_one_per_output(kernel, dl, info, name, strategy):
    """One work-item per output element (elementwise kernels and the serial strategy)."""
    ops = kernel.ops
    n = output_size(ops)
    local = local_size_for(info, ELEMENTWISE_GROUP)
    groups = max(-(-n // local), 1)
    frame = Frame()
    frame.narrow = narrow_index(ops, [groups * local])
    itype = INDEX32 if frame.narrow else dl.int64
    r, _ = render_body(kernel, dl, frame=frame)
    head = [f"  const {itype} zyx_gid = ({itype}){dl.group_id(0)} * {local} + "
            f"({itype}){dl.local_id(0)};",
            f"  if (zyx_gid >= {n}) return;"] + _decode_indices(ops, itype, "zyx_gid")
    src = _entry(dl, name, _params(kernel, dl, r), head, r.lines)
    args = [("arg", i) for i in range(len(kernel.args))]
    return GPUKernel(dl.prelude + src, [Launch(name, groups, local, args)], (),
                     strategy, 32 if frame.narrow else 64)


# -- the elementwise strategy ----------------------------------------------------------------

EW_ENV = "ZYX_GPU_EW"
# items: vector steps per work-item (a group's tile is local * items * vec elements);
# vec: consecutive elements per step, read and written as vectors of up to 16 bytes when
# every access allows it; local: work-items per group; waves: 0 = one group per tile,
# else a grid of `waves` times the groups the device holds at once, each group striding
# over the tiles.
EW_DEFAULT = {"items": 4, "vec": 4, "local": 256, "waves": 0}
EW_LIMITS = {"items": 16, "vec": 16, "local": 1024}
# The body is written once per element of a step (items * vec copies: lanes of vectors
# are named, not indexed): at most this many IR ops in all, so a big fused kernel does not
# make NVRTC compile thousands of copies (its steps shrink instead).
EW_MAX_OPS = 4096


def _read_variant(env, defaults, limits, spec):
    """`defaults` updated by `spec`, a "key=value,..." string (None: the environment
    variable `env`, read at every lowering so that one machine can compare variants);
    the keys in `limits` must be powers of two up to their limit (0 allowed where the
    default is 0: "automatic")."""
    spec = os.environ.get(env, "") if spec is None else spec
    out = dict(defaults)
    example = ",".join(f"{k}={v}" for k, v in defaults.items())
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        key, sep, val = part.partition("=")
        if key not in out or not sep or not val.isdigit():
            raise ValueError(f"{env}={spec!r}: cannot read {part!r} (keys {', '.join(out)}, "
                             f"e.g. \"{example}\")")
        out[key] = int(val)
    for key, top in limits.items():
        v = out[key]
        if v == 0 and defaults[key] == 0:
            continue
        if v < 1 or v & (v - 1) or v > top:
            raise ValueError(f"{env}={spec!r}: {key} must be a power of two from 1 to {top}")
    return out


def elementwise_variant(spec=None):
    """{items, vec, local, waves} of the elementwise strategy: EW_DEFAULT updated by `spec`
    (default: the ZYX_GPU_EW environment variable, e.g. "items=2,vec=4,local=512,waves=4")."""
    return _read_variant(EW_ENV, EW_DEFAULT, EW_LIMITS, spec)


def _affine(ops, ssa, memo):
    """An index expression as (constant, {INDEX ssa: coefficient}) when it is affine in
    the INDEX variables (+, -, * by a constant; / and % of constants only), else None."""
    if ssa in memo:
        return memo[ssa]
    op = ops[ssa]
    c = op[0]
    r = None
    if c == K.CONST and not op[1].is_float and not op[1].is_bool:
        r = (int(op[2]), {})
    elif c == K.INDEX:
        r = (0, {ssa: 1})
    elif c == K.BINARY and not op[1].is_float and op[2] in (K.B_ADD, K.B_SUB, K.B_MUL,
                                                             K.B_DIV, K.B_MOD):
        a, b = _affine(ops, op[3], memo), _affine(ops, op[4], memo)
        if a is not None and b is not None:
            bop = op[2]
            if bop in (K.B_ADD, K.B_SUB):
                sign = 1 if bop == K.B_ADD else -1
                coef = dict(a[1])
                for k, v in b[1].items():
                    coef[k] = coef.get(k, 0) + sign * v
                r = (a[0] + sign * b[0], {k: v for k, v in coef.items() if v})
            elif bop == K.B_MUL and (not a[1] or not b[1]):
                k, (c0, coef) = (a[0], b) if not a[1] else (b[0], a)
                r = (k * c0, {x: k * v for x, v in coef.items()} if k else {})
            elif not a[1] and not b[1] and b[0] != 0:      # constants: C's / and %
                q = abs(a[0]) // abs(b[0]) * (1 if (a[0] < 0) == (b[0] < 0) else -1)
                r = (q, {}) if bop == K.B_DIV else (a[0] - q * b[0], {})
    memo[ssa] = r
    return r


def elementwise_accesses(ops, lanes):
    """How an elementwise kernel's global loads and stores move along the flat output
    index: (flat, coalesced). `flat` maps each access at `flat index + c` (c a multiple of
    `lanes`, loads unmasked) to c: those are read and written `lanes` elements at a time.
    `coalesced`: every other access reads, along the innermost output axis, the same or
    the next element (a broadcast, a row of a bias), so giving a work-item several
    consecutive elements keeps neighbouring memory together; False for strided, gathered
    or masked-and-strided accesses and for kernels with an IF (a store that may not run)."""
    idx = [(i, op[3]) for i, op in enumerate(ops) if op[0] == K.INDEX]
    strides, stride = {}, 1
    for ssa, length in reversed(idx):
        if length > 1:
            strides[ssa] = stride
        stride *= length
    inner = next((ssa for ssa, length in reversed(idx) if length > 1), None)
    if inner is None or any(op[0] == K.IF_OP for op in ops):
        return {}, False
    flat, coalesced, memo = {}, True, {}
    for i, op in enumerate(ops):
        if op[0] not in (K.LOAD, K.STORE) or ops[op[2]][2] != K.SCOPE_GLOBAL:
            continue
        aff = _affine(ops, op[3], memo)
        if aff is None:
            coalesced = False
            continue
        const, coef = aff
        coef = {k: v for k, v in coef.items() if k in strides}     # unit axes: index 0
        masked = op[0] == K.LOAD and op[4] >= 0
        if not masked and coef == strides and const % lanes == 0:
            flat[i] = const
        elif coef.get(inner, 0) not in (0, 1):
            coalesced = False
    return flat, coalesced


def _chunk(d, lanes):
    """Lanes per vector of dtype d: at most 4 (CUDA's widest vectors) and 16 bytes."""
    return max(min(lanes, 4, 16 // d.itemsize), 1)


class LaneFrame(Frame):
    """One element of an elementwise step: the accesses in `lane` read or write a lane of
    the step's vectors instead of the buffer."""

    def __init__(self, narrow, lane):
        self.narrow = narrow
        self.lane = lane

    def access(self, i, buf, index):
        e = self.lane.get(i)
        return e if e is not None else f"{buf}[{index}]"


def _indented(lines, ind):
    return [ind + x for x in lines]


def lower_elementwise(kernel, dl, info, name, variant=None):
    """The "elementwise" strategy: each group takes a tile of `local * items * vec`
    consecutive outputs; a work-item's step k covers the `vec` elements from
    `(k * local + lid) * vec` of the tile, so each step's accesses are coalesced over the
    group. The loads at the flat index (plus a constant) are issued for every step
    before any arithmetic (as vectors when vec > 1: float4 and the like, 16 bytes at
    most), then each element's body runs with those lanes for operands, and the results
    are stored as vectors. Full tiles whose vector pointers are aligned take this path;
    the ragged last tile and misaligned buffers (a borrowed DLPack view) run one element
    per work-item and iteration, guarded."""
    ops = kernel.ops
    n = output_size(ops)
    var = variant if variant is not None else elementwise_variant()
    local = local_size_for(info, var["local"])
    nops = max(len(ops), 1)
    lanes = var["vec"]
    while lanes > 1 and lanes * nops > EW_MAX_OPS:
        lanes //= 2
    flat, coalesced = elementwise_accesses(ops, lanes)
    if lanes > 1 and not (coalesced and flat):
        lanes = 1
        flat, _ = elementwise_accesses(ops, 1)
    if lanes == 1:     # scalars: only loads are hoisted; stores stay in the body
        flat = {i: c for i, c in flat.items() if ops[i][0] == K.LOAD}
    items = var["items"]
    while items > 1 and items * lanes * nops > EW_MAX_OPS:
        items //= 2
    fill = max(device_threads(info) // local, 1)     # groups the device holds at once
    while items > 1 and -(-n // (local * items * lanes)) < fill:
        items //= 2        # too few tiles to fill the device: smaller ones
    tile = local * items * lanes
    tiles = max(-(-n // tile), 1)
    groups = min(tiles, var["waves"] * fill) if var["waves"] else tiles
    narrow = narrow_index(ops, [groups * local, tiles * tile + tile])
    t = INDEX32 if narrow else dl.int64
    gq = dl.global_qualifier

    r, _ = render_body(kernel, dl, frame=LaneFrame(narrow, {}))
    params = _params(kernel, dl, r)
    arg = {i: ops[ops[i][2]][3] for i in flat}       # access -> its buffer's argument

    def dtype_of(i):
        return ops[i][1] if ops[i][0] == K.LOAD else ops[ops[i][2]][1]

    def offset(i, k, c, cc):
        off = flat[i] + c * cc
        return f"zyx_p{k} + {off}" if off else f"zyx_p{k}"

    fast = []
    for k in range(items):
        first = f"{k * local} + zyx_lid" if k else "zyx_lid"
        if lanes > 1:
            first = f"({first}) * {lanes}"
        fast.append(f"const {t} zyx_p{k} = zyx_base + {first};")
    loads = [i for i in sorted(flat) if ops[i][0] == K.LOAD]
    stores = [i for i in sorted(flat) if ops[i][0] == K.STORE]
    for k in range(items):
        for i in loads:
            d = dtype_of(i)
            cc = _chunk(d, lanes)
            vt = dl.vector_type(d, cc)
            for c in range(lanes // cc):
                at = offset(i, k, c, cc)
                src = (f"*({gq}const {vt}*)(g{arg[i]} + {at})" if lanes > 1
                       else f"g{arg[i]}[{at}]")
                fast.append(f"const {vt} zyx_a{i}_{k}_{c} = {src};")
    for k in range(items):
        for i in stores:
            d = dtype_of(i)
            cc = _chunk(d, lanes)
            fast.append(" ".join(f"{dl.vector_type(d, cc)} zyx_o{i}_{k}_{c};"
                                 for c in range(lanes // cc)))
        for j in range(lanes):
            lane = {}
            for i in flat:
                cc = _chunk(dtype_of(i), lanes)
                comp = "." + "xyzw"[j % cc] if cc > 1 else ""
                lane[i] = f"zyx_{'a' if ops[i][0] == K.LOAD else 'o'}{i}_{k}_{j // cc}{comp}"
            body, _ = render_body(kernel, dl, frame=LaneFrame(narrow, lane))
            fast.append("{")
            fast.append(f"  const {t} zyx_gid = zyx_p{k}" + (f" + {j};" if j else ";"))
            fast += _decode_indices(ops, t, "zyx_gid") + body.lines
            fast.append("}")
        for i in stores:
            d = dtype_of(i)
            cc = _chunk(d, lanes)
            vt = dl.vector_type(d, cc)
            for c in range(lanes // cc):
                fast.append(f"*({gq}{vt}*)(g{arg[i]} + {offset(i, k, c, cc)}) = "
                            f"zyx_o{i}_{k}_{c};")

    conds = [] if n % tile == 0 else [f"zyx_base + {tile} <= {n}"]
    if lanes > 1:
        need = {}
        for i in flat:
            d = dtype_of(i)
            need[arg[i]] = max(need.get(arg[i], 1), _chunk(d, lanes) * d.itemsize)
        conds += [dl.aligned(f"g{a}", b) for a, b in sorted(need.items())]
    lines = []
    if conds:
        plain, _ = render_body(kernel, dl, frame=LaneFrame(narrow, {}))
        lines.append(f"  if ({' && '.join(conds)}) {{")
        lines += _indented(fast, "    ")
        lines.append("  } else {")
        lines.append(f"    const {t} zyx_end = zyx_base + {tile} < {n} ? zyx_base + {tile} : {n};")
        lines.append(f"    for ({t} zyx_gid = zyx_base + zyx_lid; zyx_gid < zyx_end; "
                     f"zyx_gid += {local}) {{")
        lines += _indented(_decode_indices(ops, t, "zyx_gid") + plain.lines, "    ")
        lines.append("    }")
        lines.append("  }")
    else:
        lines += _indented(fast, "  ")
    head = [f"  const {t} zyx_lid = ({t}){dl.local_id(0)};"]
    if var["waves"]:
        head.append(f"  for ({t} zyx_t = ({t}){dl.group_id(0)}; zyx_t < {tiles}; "
                    f"zyx_t += {groups}) {{")
        head.append(f"  const {t} zyx_base = zyx_t * {tile};")
        lines.append("  }")
    else:
        head.append(f"  const {t} zyx_base = ({t}){dl.group_id(0)} * {tile};")
    src = _entry(dl, name, params, head, lines)
    args = [("arg", i) for i in range(len(kernel.args))]
    g = GPUKernel(dl.prelude + src, [Launch(name, groups, local, args)], (), "elementwise",
                  32 if narrow else 64)
    g.variant = {"items": items, "vec": lanes, "local": local, "waves": var["waves"],
                 "tile": tile, "vector_accesses": len(flat) if lanes > 1 else 0}
    return g


def tree_combine(dl, regs, accs, local, ind="  "):
    """Statements combining each work-item's `acc{a}` over the group through the local
    arrays `zyx_l{a}` (a tree of halving steps), leaving the result in every `acc{a}`."""
    if not accs:
        return []
    lines = [f"{ind}zyx_l{a}[zyx_lid] = acc{a};" for a in accs]
    lines.append(f"{ind}{dl.barrier()};")
    lines.append(f"{ind}for (int zyx_h = {local // 2}; zyx_h > 0; zyx_h >>= 1) {{")
    lines.append(f"{ind}  if (zyx_lid < zyx_h) {{")
    for a in accs:
        lines.append(f"{ind}    zyx_l{a}[zyx_lid] = "
                     f"{combine_expr(dl, regs[a], f'zyx_l{a}[zyx_lid]', f'zyx_l{a}[zyx_lid + zyx_h]')};")
    lines.append(f"{ind}  }}")
    lines.append(f"{ind}  {dl.barrier()};")
    lines.append(f"{ind}}}")
    lines += [f"{ind}acc{a} = zyx_l{a}[0];" for a in accs]
    return lines


def shuffles(dl, reg, warp, local):
    """True when the group combines accumulator `reg` through warp shuffles: the
    dialect has one for its type and the group is whole warps, at most a warp of them
    (so one warp's lanes hold every warp's total in the second step)."""
    return (warp > 1 and local % warp == 0 and local // warp <= warp
            and dl.warp_shuffle_xor("x", 1, dl.ctype(reg[0])) is not None)


def _butterfly(dl, reg, a, width, ind):
    """acc{a} combined over aligned runs of `width` lanes (XOR steps, registers only):
    afterwards every lane of a run holds the run's total. The shuffled value is named
    first: a reduce op's expression may read its operand twice, on one branch only, and
    a shuffle must be reached by every lane."""
    sh = dl.warp_shuffle_xor(f"acc{a}", "zyx_o", dl.ctype(reg[0]))
    return [f"{ind}for (int zyx_o = {width // 2}; zyx_o > 0; zyx_o >>= 1) {{",
            f"{ind}  const {dl.ctype(reg[0])} zyx_y = {sh};",
            f"{ind}  acc{a} = {combine_expr(dl, reg, f'acc{a}', 'zyx_y')};",
            f"{ind}}}"]


def group_combine(dl, regs, accs, local, warp, ind="  "):
    """Statements combining each work-item's `acc{a}` over the group, leaving the result
    in every `acc{a}`: through warp shuffles where `shuffles` allows (within each warp,
    then the warps' totals through a local array of one word per warp and one barrier),
    else `tree_combine`."""
    fast = [a for a in accs if shuffles(dl, regs[a], warp, local)]
    lines = tree_combine(dl, regs, [a for a in accs if a not in fast], local, ind)
    if not fast:
        return lines
    n_warps = local // warp
    for a in fast:
        lines += _butterfly(dl, regs[a], a, warp, ind)
    if n_warps == 1:
        return lines
    lines.append(f"{ind}if ((zyx_lid & {warp - 1}) == 0) {{")
    lines += [f"{ind}  zyx_l{a}[zyx_lid / {warp}] = acc{a};" for a in fast]
    lines.append(f"{ind}}}")
    lines.append(f"{ind}{dl.barrier()};")
    for a in fast:
        lines.append(f"{ind}acc{a} = zyx_l{a}[zyx_lid & {n_warps - 1}];")
        lines += _butterfly(dl, regs[a], a, n_warps, ind)
    return lines


def combine_slots(dl, reg, local, warp):
    """Words of the local array `group_combine` needs for accumulator `reg`."""
    return local // warp if shuffles(dl, reg, warp, local) else local


def combine_expr(dl, reg, x, y):
    """x <reduce op> y in the accumulator's dtype, written by the shared renderer (so
    float max/min propagate NaN exactly as the serial code does)."""
    d, rop, _ = reg
    names = {-2: x, -3: y}
    return alu(dl, [], (K.BINARY, d, K.REDUCE_BINARY[rop], -2, -3), names.__getitem__)


def _local_type(dl, d):
    """Type of a local/scratch element holding an accumulator of dtype d."""
    return dl.storage_type(d) if not d.is_bool else dl.storage_type(dt.uint8)


class GroupFrame(Frame):
    """Pass 1 of the group strategy: the nests' run loops split over the work-items (and
    over `splits` groups per output), a tree combine after each nest; with splits > 1 the
    pass ends after the last nest by writing the group's partials to scratch."""

    def __init__(self, dl, ops, nests, regs, local, splits, narrow, warp=1, cache=None):
        self.dl, self.ops, self.nests, self.regs = dl, ops, nests, regs
        self.local, self.splits, self.narrow, self.warp = local, splits, narrow, warp
        self.cache = cache if cache is not None else RowCache()
        self.itype = INDEX32 if narrow else dl.int64
        self.by_root = {n.root: n for n in nests}
        self.by_end = {n.end: n for n in nests}
        self.run_first = {n.run[0]: n for n in nests}
        self.run_inner = {loop for n in nests for loop in n.run[1:]}
        self.run_ends = {}
        for n in nests:
            for loop in n.run:
                self.run_ends[ends_of(ops, loop)] = loop
        self.last_end = nests[-1].end

    def skip(self, i):
        return self.splits > 1 and i > self.last_end

    def open_loop(self, i, op, ind):
        t = self.itype
        if i in self.cache.unrolled:       # a counted nest's leading loop (a block loop)
            t = INDEX32 if i in self.narrow else self.dl.int64
            return [f"{ind}#pragma unroll",
                    f"{ind}for ({t} r{i} = 0; r{i} < {op[2]}; r{i}++) {{"]
        nest = self.by_root.get(i)
        if nest is not None and self.splits > 1 and nest.run[0] != i:
            return [f"{ind}for ({t} r{i} = zyx_part; r{i} < {op[2]}; r{i} += {self.splits}) {{"]
        nest = self.run_first.get(i)
        if nest is not None:
            start, step = "zyx_lid", str(self.local)
            if self.splits > 1 and nest.run[0] == nest.root:     # grid-stride
                start = f"zyx_part * {self.local} + zyx_lid"
                step = str(self.local * self.splits)
            f = f"zyx_f{i}"
            if i in self.cache.counted:
                # a fixed count per work-item, unrolled, so the cached row lives in
                # registers (zyx_k{i} indexes them with constants)
                lines = [f"{ind}#pragma unroll",
                         f"{ind}for (int zyx_k{i} = 0; zyx_k{i} < {nest.flat // self.local}; "
                         f"zyx_k{i}++) {{",
                         f"{ind}  const {t} {f} = zyx_lid + zyx_k{i} * {self.local};"]
            else:
                lines = [f"{ind}for ({t} {f} = {start}; {f} < {nest.flat}; {f} += {step}) {{"]
            inner = nest.flat
            for k, loop in enumerate(nest.run):
                n = self.ops[loop][2]
                inner //= n
                e = f if inner == 1 else f"{f} / {inner}"
                if k > 0:
                    e = f"({e}) % {n}"
                lines.append(f"{ind}  const {t} r{loop} = {e};")
            return lines
        if i in self.run_inner:
            return []
        return None

    def close_loop(self, i, op, ind):
        loop = self.run_ends.get(i)
        if loop is not None and loop in self.run_inner:
            return []
        return None

    def access(self, i, buf, index):
        use = self.cache.uses.get(i)
        if use is None:
            return f"{buf}[{index}]"
        slot, position = use
        return f"zyx_c{slot}[{position}]"

    def after(self, i, ind):
        source = self.cache.sources.get(i)
        if source is not None:
            slot, position = source
            return [f"{ind}zyx_c{slot}[{position}] = v{i};"]
        nest = self.by_end.get(i)
        if nest is None or nest.stores:
            return ()
        lines = group_combine(self.dl, self.regs, nest.results, self.local, self.warp, ind)
        if self.splits > 1 and i == self.last_end:
            lines.append(f"{ind}if (zyx_lid == 0) {{")
            for j, a in enumerate(all_results(self.nests)):
                lines.append(f"{ind}  zyx_s{j}[zyx_grp] = acc{a};")
            lines.append(f"{ind}}}")
        return lines

    def store(self, i, line):
        if any(n.stores and n.root < i < n.end for n in self.nests):
            return line     # a store loop's element, written by the work-item computing it
        return f"{line[:len(line) - len(line.lstrip())]}if (zyx_lid == 0) {line.lstrip()}"


class _SecondPassFrame(Frame):
    """A second-pass frame: what it knows of the reduce nests it replaces (where each
    result's partials sit in scratch, `slot`; the nest ending at each op, `by_end`) and
    the ops inside nests, which it skips (the partials stand for them)."""

    def __init__(self, dl, nests, regs):
        self.dl, self.nests, self.regs = dl, nests, regs
        self.slot = {a: j for j, a in enumerate(all_results(nests))}
        self.by_end = {n.end: n for n in nests}
        self.inside = set()
        for n in nests:
            self.inside.update(range(n.root, n.end + 1))

    def skip(self, i):
        return i in self.inside


class CombineFrame(_SecondPassFrame):
    """Pass 2 of "group+partials": the nests are left out; where each ended, its results
    are combined from the scratch partials of the output's groups."""

    def __init__(self, dl, nests, regs, local, splits, narrow, warp=1):
        super().__init__(dl, nests, regs)
        self.local, self.splits, self.narrow, self.warp = local, splits, narrow, warp

    def after(self, i, ind):
        nest = self.by_end.get(i)
        if nest is None:
            return ()
        t = INDEX32 if self.narrow else self.dl.int64
        lines = []
        for a in nest.results:
            x = f"zyx_s{self.slot[a]}[zyx_out * {self.splits} + zyx_p]"
            lines.append(f"{ind}for ({t} zyx_p = zyx_lid; zyx_p < {self.splits}; "
                         f"zyx_p += {self.local}) acc{a} = "
                         f"{combine_expr(self.dl, self.regs[a], f'acc{a}', x)};")
        return lines + group_combine(self.dl, self.regs, nest.results, self.local, self.warp,
                                     ind)

    def store(self, i, line):
        return f"{line[:len(line) - len(line.lstrip())]}if (zyx_lid == 0) {line.lstrip()}"


def all_results(nests):
    """Every nest's result accumulators, in order (their scratch slots)."""
    return [a for n in nests for a in n.results]


def _group_head(dl, ops, regs, accs, local, itype, out_expr, warp=1, cache=None):
    """Local arrays of the group combine, the row cache's registers, work-item/group ids,
    the output index and the INDEX variables decoded from it."""
    head = [f"  {dl.local_qualifier}{_local_type(dl, regs[a][0])} "
            f"zyx_l{a}[{combine_slots(dl, regs[a], local, warp)}];" for a in accs]
    if cache is not None:
        head += [f"  {dl.ctype(d)} zyx_c{slot}[{n}];" for slot, (d, n) in enumerate(cache.slots)]
    head += [f"  const {itype} zyx_lid = ({itype}){dl.local_id(0)};",
             f"  const {itype} zyx_grp = ({itype}){dl.group_id(0)};",
             f"  const {itype} zyx_out = {out_expr};"]
    return head + _decode_indices(ops, itype, "zyx_out")


GROUP_ENV = "ZYX_GPU_GROUP"
# local: work-items per group (0: chosen from the reduce length, at most REDUCE_GROUP);
# cache: keep a row's elements in registers for the row's later loops (RowCache);
# warp: combine partials through warp shuffles where the dialect has them.
GROUP_DEFAULT = {"local": 0, "cache": 1, "warp": 1}
GROUP_LIMITS = {"local": 1024}
ROW_CACHE_ITEMS = 32    # most elements one work-item keeps in registers for a later loop
ROW_CACHE_SAMPLES = 12  # output indices at which row_cache compares two loads' addresses


def group_variant(spec=None):
    """{local, cache, warp} of the group strategy: GROUP_DEFAULT updated by `spec`
    (default: the ZYX_GPU_GROUP environment variable, e.g. "local=512,cache=0")."""
    out = _read_variant(GROUP_ENV, GROUP_DEFAULT, GROUP_LIMITS, spec)
    for key in ("cache", "warp"):
        if out[key] not in (0, 1):
            raise ValueError(f"{GROUP_ENV}={spec!r}: {key} is 0 or 1")
    return out


class RowCache:
    """Global loads a row kernel repeats in a later loop over the same row (softmax reads
    x for its max, its sum and its output): the first loop keeps what it loads in
    registers, the later ones read them there instead of memory.

    A nest whose loops give every work-item the same fixed number of iterations (its
    leading loops, e.g. a blocked sum's block loop, times its run's share) is "counted":
    its run becomes `zyx_k{run}` = 0.. of the share, everything unrolled, and iteration p
    of a work-item is `position`, a constant once unrolled. Loads are matched by what
    they read: the same buffer element at every (work-item, p) of both nests.

    `sources`: LOAD op -> (slot, position) for the loads whose values are kept; `uses`:
    LOAD op -> (slot, position) for the loads answered from the cache; `counted`: the
    counted nests' run loops; `unrolled`: their leading loops; `slots`: (dtype,
    elements per work-item) of each register array `zyx_c{slot}`."""

    def __init__(self):
        self.sources, self.uses, self.counted, self.unrolled, self.slots = {}, {}, set(), set(), []


def _eval_index(ops, ssa, env):
    """Index math `ssa` evaluated over numpy arrays (`env`: the loop and INDEX variables'
    values), C semantics; None where it is not index math over those variables."""
    if ssa in env:
        return env[ssa]
    op = ops[ssa]
    if op[0] == K.CONST and not op[1].is_float:
        return op[2]
    if op[0] != K.BINARY or op[2] not in _RANGE_OPS:
        return None
    a, b = _eval_index(ops, op[3], env), _eval_index(ops, op[4], env)
    if a is None or b is None:
        return None
    bop = op[2]
    if bop == K.B_ADD:
        out = a + b
    elif bop == K.B_SUB:
        out = a - b
    elif bop == K.B_MUL:
        out = a * b
    elif bop == K.B_MAX:
        out = np.maximum(a, b)
    elif bop == K.B_MIN:
        out = np.minimum(a, b)
    else:
        if np.any(np.asarray(b) == 0):
            return None
        q = np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))     # C truncates
        out = q if bop == K.B_DIV else a - b * q
    env[ssa] = out
    return out


def _leading_loops(ops, nest, ends):
    """The loops from the nest's root down to its run (exclusive), each the only loop
    directly inside the one before; None when the run is not reached that way."""
    chain, loop = [], nest.root
    while loop != nest.run[0]:
        kids = child_loops(ops, loop, ends)
        if len(kids) != 1:
            return None
        chain.append(loop)
        loop = kids[0]
    return chain


def _counted_positions(ops, nest, lead, local):
    """(work-items' loop values, iterations per work-item, position expression) of a
    nest whose run splits evenly over `local` work-items: arrays shaped (local, P) of
    every leading and run loop's value at (work-item, iteration p)."""
    share = nest.flat // local
    per = share
    for loop in lead:
        per *= ops[loop][2]
    lid = np.arange(local, dtype=np.int64)[:, None]
    p = np.arange(per, dtype=np.int64)[None, :]
    env, q = {}, p // share
    for loop in reversed(lead):
        n = ops[loop][2]
        env[loop] = np.broadcast_to(q % n, (local, per))
        q = q // n
    flat = lid + (p % share) * local
    for loop in reversed(nest.run):
        n = ops[loop][2]
        env[loop] = np.broadcast_to(flat % n, (local, per))
        flat = flat // n
    expr = f"zyx_k{nest.run[0]}"
    radix = share
    for loop in reversed(lead):
        expr = f"r{loop} * {radix} + {expr}" if radix > 1 else f"r{loop} + {expr}"
        radix *= ops[loop][2]
    return env, per, expr


def _in_run_body(ops, nest, j):
    """True when op j runs once per iteration of the nest's run (not under an inner
    loop or an IF)."""
    depth = 0
    for op in ops[nest.run[-1] + 1:j]:
        if op[0] in (K.LOOP, K.IF_OP):
            depth += 1
        elif op[0] in (K.ENDLOOP, K.END_IF):
            depth -= 1
    return depth == 0


def row_cache(dl, ops, nests, local):
    """The `RowCache` of a one-group-per-output kernel: loads of a read-only buffer that
    a later nest repeats at the same element at every (work-item, iteration), where
    both nests give every work-item the same fixed count of at most ROW_CACHE_ITEMS
    iterations. Elements are compared by evaluating the addresses for every work-item
    and iteration at a few values of the output indices."""
    cache = RowCache()
    ends = loop_ends(ops)
    read_only = {i for i, op in enumerate(ops)
                 if op[0] == K.DEFINE and op[2] == K.SCOPE_GLOBAL and op[4]}
    # output indices to compare addresses at: the first and last, and scattered ones
    # (an address may depend on an output index through a division or a remainder)
    index_vars = [i for i, op in enumerate(ops) if op[0] == K.INDEX]
    samples = [{i: (0 if k == 0 else ops[i][3] - 1 if k == 1 else
                    (k * 7919 + 104729 * (n + 1)) % ops[i][3])
                for n, i in enumerate(index_vars)} for k in range(ROW_CACHE_SAMPLES)]
    seen = {}          # (buffer, addresses) -> (LOAD op, nest, position) of the first load
    for n in nests:
        lead = _leading_loops(ops, n, ends)
        if lead is None or n.flat % local:
            continue
        loops, per, position = _counted_positions(ops, n, lead, local)
        if per > ROW_CACHE_ITEMS:
            continue
        for j in range(n.run[-1] + 1, n.end):
            op = ops[j]
            if op[0] != K.LOAD or op[2] not in read_only \
                    or dl.load_convert(op[1], "x") != "x":
                continue
            addresses = []
            for sample in samples:
                a = _eval_index(ops, op[3], {**loops, **sample})
                if a is None:
                    break
                addresses.append(np.broadcast_to(a, (local, per)).tobytes())
            else:
                key = (op[2], op[1], per, tuple(addresses))
                first = seen.get(key)
                if first is None:
                    if op[4] < 0 and _in_run_body(ops, n, j):
                        seen[key] = (j, n, position, lead)
                elif first[1] is not n:
                    source, first_nest, first_position, first_lead = first
                    if source not in cache.sources:
                        cache.sources[source] = (len(cache.slots), first_position)
                        cache.slots.append((ops[source][1], per))
                        cache.counted.add(first_nest.run[0])
                        cache.unrolled.update(first_lead)
                    cache.uses[j] = (cache.sources[source][0], position)
                    cache.counted.add(n.run[0])
                    cache.unrolled.update(lead)
    return cache


def lower_group(kernel, dl, info, name, nests, variant=None):
    """The "group" / "group+partials" strategies (module docstring); `variant` as
    `group_variant` returns (default: read from the environment)."""
    var = variant if variant is not None else group_variant()
    ops = kernel.ops
    regs = register_defines(ops)
    n_out = output_size(ops)
    want = var["local"] or min(REDUCE_GROUP, max(n.flat for n in nests) // ITEMS_PER_THREAD)
    local = local_size_for(info, want)
    warp = info.warp_size if var["warp"] else 1
    splits = choose_splits(ops, nests, info, local)
    groups = n_out * splits
    results = all_results(nests)
    narrow = narrow_index(ops, [groups * local, groups, max(n.flat for n in nests) + local * splits])
    itype = INDEX32 if narrow else dl.int64
    args = [("arg", i) for i in range(len(kernel.args))]
    cache = row_cache(dl, ops, nests, local) if var["cache"] and splits == 1 else None
    frame = GroupFrame(dl, ops, nests, regs, local, splits, narrow, warp, cache)
    r, _ = render_body(kernel, dl, frame=frame)
    params = _params(kernel, dl, r)
    if splits == 1:
        head = _group_head(dl, ops, regs, results, local, itype, "zyx_grp", warp, cache)
        src = _entry(dl, name, params, head, r.lines)
        g = GPUKernel(dl.prelude + src, [Launch(name, groups, local, args)], (),
                      "group", 32 if narrow else 64)
        g.variant = dict(var, local=local, cached_loads=len(cache.uses) if cache else 0)
        return g
    scratch_params = [f"{dl.global_qualifier}{_local_type(dl, regs[a][0])}* {dl.restrict} "
                      f"zyx_s{j}" for j, a in enumerate(results)]
    head = _group_head(dl, ops, regs, results, local, itype, f"zyx_grp / {splits}", warp)
    head.append(f"  const {itype} zyx_part = zyx_grp % {splits};")
    p1 = _entry(dl, name, params + scratch_params, head, r.lines)
    local2 = local_size_for(info, min(splits, REDUCE_GROUP))
    frame2 = CombineFrame(dl, nests, regs, local2, splits, narrow, warp)
    r2, _ = render_body(kernel, dl, frame=frame2)
    head2 = _group_head(dl, ops, regs, results, local2, itype, "zyx_grp", warp)
    p2 = _entry(dl, name + "_combine", params + scratch_params, head2, r2.lines)
    scratch = [groups * regs[a][0].itemsize for a in results]
    sargs = args + [("scratch", j) for j in range(len(results))]
    launches = [Launch(name, groups, local, sargs),
                Launch(name + "_combine", n_out, local2, sargs)]
    g = GPUKernel(dl.prelude + p1 + p2, launches, scratch, "group+partials",
                  32 if narrow else 64)
    g.variant = dict(var, local=local, cached_loads=0)
    return g


def column_splits(ops, nests, info, local):
    """Groups each output's reduce is split over in the "columns" strategy: enough
    work-items to fill the device, at least MIN_COLUMN_ITERATIONS of every nest's outer
    loop each; 1 when a nest cannot be split over groups."""
    n_out = output_size(ops)
    if any(n.reads_earlier for n in nests) or any(
            op[0] == K.STORE and ops[op[2]][2] == K.SCOPE_GLOBAL for op in ops[:nests[-1].end]):
        return 1
    out_groups = -(-n_out // local)
    splits = -(-device_threads(info) // (out_groups * local))
    for n in nests:
        splits = min(splits, max(ops[n.root][2] // MIN_COLUMN_ITERATIONS, 1))
    return max(splits, 1)


class ColumnFrame(Frame):
    """Pass 1 of "columns": one work-item per output, each nest's outer loop split over
    `splits` groups; after the last nest each work-item writes its partials to scratch
    (laid out [part][output], so neighbouring work-items write neighbouring words)."""

    def __init__(self, ops, nests, splits, n_out, narrow, itype):
        self.nests, self.splits, self.n_out = nests, splits, n_out
        self.narrow, self.itype = narrow, itype
        self.roots = {n.root for n in nests}
        self.last_end = nests[-1].end

    def skip(self, i):
        return i > self.last_end

    def open_loop(self, i, op, ind):
        if i not in self.roots:
            return None
        t = self.itype
        return [f"{ind}for ({t} r{i} = zyx_part; r{i} < {op[2]}; r{i} += {self.splits}) {{"]

    def after(self, i, ind):
        if i != self.last_end:
            return ()
        return [f"{ind}zyx_s{j}[zyx_part * {self.n_out} + zyx_out] = acc{a};"
                for j, a in enumerate(all_results(self.nests))]


class ColumnCombineFrame(_SecondPassFrame):
    """Pass 2 of "columns": one work-item per output adds up its `splits` partials where
    each nest ended, then runs the epilogue."""

    def __init__(self, dl, nests, regs, splits, n_out, narrow, itype):
        super().__init__(dl, nests, regs)
        self.splits, self.n_out, self.narrow, self.itype = splits, n_out, narrow, itype

    def after(self, i, ind):
        nest = self.by_end.get(i)
        if nest is None:
            return ()
        lines = []
        for a in nest.results:
            x = f"zyx_s{self.slot[a]}[zyx_p * {self.n_out} + zyx_out]"
            lines.append(f"{ind}for ({self.itype} zyx_p = 0; zyx_p < {self.splits}; zyx_p++) "
                         f"acc{a} = {combine_expr(self.dl, self.regs[a], f'acc{a}', x)};")
        return lines


def lower_columns(kernel, dl, info, name, nests):
    """The "columns" strategy (module docstring); plain "serial" when it cannot split."""
    ops = kernel.ops
    n_out = output_size(ops)
    local = local_size_for(info, ELEMENTWISE_GROUP)
    splits = column_splits(ops, nests, info, local)
    if splits == 1:
        return lower_one_per_output(kernel, dl, info, name, "serial")
    regs = register_defines(ops)
    results = all_results(nests)
    out_groups = -(-n_out // local)
    groups = out_groups * splits
    narrow = narrow_index(ops, [groups * local, n_out * splits])
    itype = INDEX32 if narrow else dl.int64
    r, _ = render_body(kernel, dl, frame=ColumnFrame(ops, nests, splits, n_out, narrow, itype))
    params = _params(kernel, dl, r) + [
        f"{dl.global_qualifier}{_local_type(dl, regs[a][0])}* {dl.restrict} zyx_s{j}"
        for j, a in enumerate(results)]
    head = [f"  const {itype} zyx_grp = ({itype}){dl.group_id(0)};",
            f"  const {itype} zyx_part = zyx_grp % {splits};",
            f"  const {itype} zyx_out = (zyx_grp / {splits}) * {local} + ({itype}){dl.local_id(0)};",
            f"  if (zyx_out >= {n_out}) return;"] + _decode_indices(ops, itype, "zyx_out")
    p1 = _entry(dl, name, params, head, r.lines)
    r2, _ = render_body(kernel, dl, frame=ColumnCombineFrame(dl, nests, regs, splits, n_out,
                                                            narrow, itype))
    head2 = [f"  const {itype} zyx_out = ({itype}){dl.group_id(0)} * {local} + "
             f"({itype}){dl.local_id(0)};",
             f"  if (zyx_out >= {n_out}) return;"] + _decode_indices(ops, itype, "zyx_out")
    p2 = _entry(dl, name + "_combine", params, head2, r2.lines)
    args = [("arg", i) for i in range(len(kernel.args))] + [
        ("scratch", j) for j in range(len(results))]
    scratch = [n_out * splits * regs[a][0].itemsize for a in results]
    launches = [Launch(name, groups, local, args),
                Launch(name + "_combine", out_groups, local, args)]
    return GPUKernel(dl.prelude + p1 + p2, launches, scratch, "columns",
                     32 if narrow else 64)


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
