"""GPU strategies for kernels with reduce loops (see `dispatch` for when each is chosen):
"serial" (one work-item per output), "group" (a group splits each output's reduce and
combines partials through local memory or warp shuffles; row kernels keep what they load
in registers, `row_cache`), "group+partials" (few outputs: each output also split over
groups, a second launch combines) and "columns" (outputs contiguous along memory but too
few to fill the device). Knobs: ZYX_GPU_GROUP (`group_variant`)."""
from __future__ import annotations

import numpy as np

from ... import dtype as dt
from ..._core import kernel as K
from ..cstyle import INDEX32, Frame, alu, render_body
from .analysis import (child_loops, contiguous_along, ends_of, eval_index, loop_ends, narrow_index,
                       output_size, register_defines)
from .program import (GPUKernel, Launch, decode_indices, device_threads, entry_source,
                      kernel_params, local_size_for, read_variant)


ELEMENTWISE_GROUP = 256   # work-items per group of one-item-per-output kernels (serial, columns)


REDUCE_GROUP = 256    # most work-items splitting one reduce (16 loads each of a 4096 block)


MIN_SPLIT = 32        # shortest flat reduce loop worth splitting over a group


ITEMS_PER_THREAD = 8  # a group splits a reduce of n into about n / 8 work-items (pow2)


GROUPS_PER_CORE = 8   # resident groups of 256 per compute unit (2048 threads on an SM)


MIN_PER_ITEM = 4      # fewest flat iterations per work-item when a loop is grid-strided


MIN_COLUMN_ITERATIONS = 16   # fewest outer-loop iterations per group in "columns"


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
            f"  if (zyx_gid >= {n}) return;"] + decode_indices(ops, itype, "zyx_gid")
    src = entry_source(dl, name, kernel_params(kernel, dl, r), head, r.lines)
    args = [("arg", i) for i in range(len(kernel.args))]
    return GPUKernel(dl.prelude + src, [Launch(name, groups, local, args)], (),
                     strategy, 32 if frame.narrow else 64)


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
    return head + decode_indices(ops, itype, "zyx_out")


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
    out = read_variant(GROUP_ENV, GROUP_DEFAULT, GROUP_LIMITS, spec)
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
                a = eval_index(ops, op[3], {**loops, **sample})
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
    params = kernel_params(kernel, dl, r)
    if splits == 1:
        head = _group_head(dl, ops, regs, results, local, itype, "zyx_grp", warp, cache)
        src = entry_source(dl, name, params, head, r.lines)
        g = GPUKernel(dl.prelude + src, [Launch(name, groups, local, args)], (),
                      "group", 32 if narrow else 64)
        g.variant = dict(var, local=local, cached_loads=len(cache.uses) if cache else 0)
        return g
    scratch_params = [f"{dl.global_qualifier}{_local_type(dl, regs[a][0])}* {dl.restrict} "
                      f"zyx_s{j}" for j, a in enumerate(results)]
    head = _group_head(dl, ops, regs, results, local, itype, f"zyx_grp / {splits}", warp)
    head.append(f"  const {itype} zyx_part = zyx_grp % {splits};")
    p1 = entry_source(dl, name, params + scratch_params, head, r.lines)
    local2 = local_size_for(info, min(splits, REDUCE_GROUP))
    frame2 = CombineFrame(dl, nests, regs, local2, splits, narrow, warp)
    r2, _ = render_body(kernel, dl, frame=frame2)
    head2 = _group_head(dl, ops, regs, results, local2, itype, "zyx_grp", warp)
    p2 = entry_source(dl, name + "_combine", params + scratch_params, head2, r2.lines)
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
    params = kernel_params(kernel, dl, r) + [
        f"{dl.global_qualifier}{_local_type(dl, regs[a][0])}* {dl.restrict} zyx_s{j}"
        for j, a in enumerate(results)]
    head = [f"  const {itype} zyx_grp = ({itype}){dl.group_id(0)};",
            f"  const {itype} zyx_part = zyx_grp % {splits};",
            f"  const {itype} zyx_out = (zyx_grp / {splits}) * {local} + ({itype}){dl.local_id(0)};",
            f"  if (zyx_out >= {n_out}) return;"] + decode_indices(ops, itype, "zyx_out")
    p1 = entry_source(dl, name, params, head, r.lines)
    r2, _ = render_body(kernel, dl, frame=ColumnCombineFrame(dl, nests, regs, splits, n_out,
                                                            narrow, itype))
    head2 = [f"  const {itype} zyx_out = ({itype}){dl.group_id(0)} * {local} + "
             f"({itype}){dl.local_id(0)};",
             f"  if (zyx_out >= {n_out}) return;"] + decode_indices(ops, itype, "zyx_out")
    p2 = entry_source(dl, name + "_combine", params, head2, r2.lines)
    args = [("arg", i) for i in range(len(kernel.args))] + [
        ("scratch", j) for j in range(len(results))]
    scratch = [n_out * splits * regs[a][0].itemsize for a in results]
    launches = [Launch(name, groups, local, args),
                Launch(name + "_combine", out_groups, local, args)]
    return GPUKernel(dl.prelude + p1 + p2, launches, scratch, "columns",
                     32 if narrow else 64)
