# cython: language_level=3
"""Scheduler: turns a realization request into a plan and runs it.

A plan is the kernels of a subgraph (already compiled for the chosen device), the bytes
each stored node needs and when each temporary can be freed. Plans are cached by the
subgraph's structural key (graph.collect), so a training loop that rebuilds the same graph
every step skips kernelization, optimization and compilation entirely."""
import sys
import time

from .graph import LEAF
from .kernelizer import kernelize
from .kernel import format_kernel
from .passes import optimize


class Plan:
    __slots__ = ("steps", "nbytes", "free_after", "targets", "leaves", "device", "stored")

    def __init__(self, steps, nbytes, free_after, targets, leaves, device, stored):
        self.steps = steps
        self.nbytes = nbytes
        self.free_after = free_after
        self.targets = targets
        self.leaves = leaves
        self.device = device
        self.stored = stored


def build_plan(graph, list order, list target_ids, device, int debug=0):
    t0 = time.perf_counter()
    steps, stored = kernelize(graph, order, target_ids)
    pos = {nid: p for p, nid in enumerate(order)}
    targets = [pos[t] for t in target_ids]
    nbytes = {}
    for p, s in enumerate(stored):
        if s:
            node = graph.get(order[p])
            n = node.dtype.itemsize
            for d in node.shape:
                n *= d
            nbytes[p] = n
    # last step that reads each temporary (targets are kept)
    last = {}
    for si, st in enumerate(steps):
        for a in st.args[1:]:
            if stored[a]:
                last[a] = si
    keep = set(targets)
    free_after = [[] for _ in steps]
    for p, si in last.items():
        if p not in keep:
            free_after[si].append(p)
    live = [st for st in steps if st.kernel is not None]
    for st in live:
        st.kernel = optimize(st.kernel)
        if debug & 4:
            print(format_kernel(st.kernel), file=sys.stderr)
    if hasattr(device, "compile_many"):
        programs = device.compile_many([st.kernel for st in live])
    else:
        programs = [device.compile(st.kernel) for st in live]
    for st, prog in zip(live, programs):
        st.program = prog
    leaves = [p for p in range(len(order)) if graph.get(order[p]).op == LEAF]
    if debug & 2:
        print(f"zyx: plan of {len(steps)} kernel(s) for {len(order)} nodes in "
              f"{(time.perf_counter() - t0) * 1e3:.2f} ms", file=sys.stderr)
    return Plan(steps, nbytes, free_after, targets, leaves, device, stored)


def execute(plan, graph, list order, pool, move_to_pool, stats):
    """Run `plan` on the subgraph `order`; realized targets become LEAF nodes."""
    cdef dict bufs = {}
    cdef Py_ssize_t p, si
    device = plan.device
    for p in plan.leaves:
        node = graph.get(order[p])
        b = node.buffer
        if b.pool is not pool:
            b = move_to_pool(node, pool)
        bufs[p] = b
    nbytes = plan.nbytes
    free_after = plan.free_after
    launched = 0
    free = graph.free_buffer
    for si, st in enumerate(plan.steps):
        out = st.args[0]
        if st.alias:   # a contiguous reshape of a buffer: share it, copy nothing
            buf = bufs[st.args[1]]
            buf.refs += 1
            bufs[out] = buf
            for p in free_after[si]:
                free(bufs.pop(p))
            continue
        buf, ev = pool.allocate(nbytes[out])
        bufs[out] = buf
        if st.program is not None and nbytes[out]:
            buf.event = device.launch(st.program, pool, [bufs[a] for a in st.args],
                                      [bufs[a].event for a in st.args[1:] if bufs[a].event is not None])
            launched += 1
        for p in free_after[si]:
            free(bufs.pop(p))
    stats["kernels_launched"] += launched
    seen = set()
    for p in plan.targets:
        if p in seen or not plan.stored[p]:
            continue
        seen.add(p)
        graph.set_buffer(order[p], bufs[p])
