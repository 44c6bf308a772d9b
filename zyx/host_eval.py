"""Tiny integer graphs evaluated on the host, without a realization.

`int(t)`, `t.item()` and Python's use of a tensor as an index (`data[i:i + T]` with `i` a
0-d tensor from iterating a device tensor of random starts) each realized the tensor's
graph: a plan lookup, a launch and a read back, about 100 us of host time per call on a
GPU, and nanoGPT's batching makes 128 of them per batch. When the graph is a few integer
ops on small realized tensors (an element of `ix`, plus `T`, plus 1), `evaluate` reads
those tensors and computes the value with numpy instead: one read, no kernel.

Only exact integer and bool arithmetic and movement is taken (numpy's int64 / int32
arithmetic wraps as the kernels do); floats, divisions, reductions and anything larger
keep the realization, so a value never differs from what a kernel computes."""
from __future__ import annotations

import math

import numpy as np

from ._core import graph as G
from ._core import kernel as K

MAX_NODES = 24            # unrealized nodes a host evaluation takes
MAX_LEAF_NUMEL = 4096     # elements of each realized tensor it reads

_BINARY = {K.B_ADD: np.add, K.B_SUB: np.subtract, K.B_MUL: np.multiply,
           K.B_MAX: np.maximum, K.B_MIN: np.minimum, K.B_CMPLT: np.less,
           K.B_CMPGT: np.greater, K.B_EQ: np.equal, K.B_NOTEQ: np.not_equal,
           K.B_BITAND: np.bitwise_and, K.B_BITOR: np.bitwise_or,
           K.B_BITXOR: np.bitwise_xor, K.B_AND: np.logical_and, K.B_OR: np.logical_or}
_UNARY = {K.U_NEG: np.negative, K.U_ABS: np.abs, K.U_BITNOT: np.invert}


def _exact(d):
    return d.kind in "iub"     # integers and bool


def evaluate(graph, nid, read_leaf, watched=()):
    """The value of node `nid` as a numpy array, computed on the host, or None when its
    unrealized subgraph is not a few exact integer ops (see the module docstring) or
    reads a node in `watched` (value checks run with a realization). `read_leaf(node)`:
    a realized node's values as numpy."""
    nodes = {}
    stack = [nid]
    while stack:
        i = stack.pop()
        if i in nodes:
            continue
        n = graph.get(i)
        if not _exact(n.dtype) or i in watched:
            return None
        if n.op == G.LEAF:
            if n.buffer is None or math.prod(n.shape) > MAX_LEAF_NUMEL:
                return None
        elif n.op == G.BINARY:
            if n.arg not in _BINARY:
                return None
        elif n.op == G.UNARY:
            if n.arg not in _UNARY:
                return None
        elif n.op == G.CAST:
            if not _exact(graph.get(n.srcs[0]).dtype):
                return None
        elif n.op not in (G.CONST, G.RESHAPE, G.PERMUTE, G.EXPAND, G.PAD, G.FLIP):
            return None
        nodes[i] = n
        if len(nodes) > MAX_NODES:
            return None
        stack.extend(n.srcs)
    values = {}
    for i in _postorder(nodes, nid):
        values[i] = _value(nodes[i], [values[s] for s in nodes[i].srcs], read_leaf)
    return values[nid]


def _postorder(nodes, root):
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        i, done = stack.pop()
        if done:
            order.append(i)
            continue
        if i in seen:
            continue
        seen.add(i)
        stack.append((i, True))
        stack.extend((s, False) for s in nodes[i].srcs)
    return order


def _value(n, srcs, read_leaf):
    d = n.dtype.np
    op = n.op
    if op == G.LEAF:
        return read_leaf(n)
    if op == G.CONST:
        return np.full(n.shape, n.arg, dtype=d)
    if op == G.CAST:
        return srcs[0].astype(d)
    if op == G.UNARY:
        with np.errstate(over="ignore"):
            return _UNARY[n.arg](srcs[0]).astype(d, copy=False)
    if op == G.BINARY:
        a, b = srcs
        with np.errstate(over="ignore"):
            return _BINARY[n.arg](a, b).astype(d, copy=False)
    if op == G.RESHAPE:
        return srcs[0].reshape(n.shape)
    if op == G.PERMUTE:
        return srcs[0].transpose(n.arg)
    if op == G.EXPAND:
        return np.broadcast_to(srcs[0], n.shape)
    if op == G.FLIP:
        return np.flip(srcs[0], n.arg)
    # PAD: negative amounts cut, positive ones add the fill
    pads, fill = n.arg
    x = srcs[0][tuple(slice(max(-b, 0), s - max(-a, 0)) for (b, a), s
                      in zip(pads, srcs[0].shape))]
    grow = [(max(b, 0), max(a, 0)) for b, a in pads]
    if any(b or a for b, a in grow):
        x = np.pad(x, grow, constant_values=fill)
    return x.astype(d, copy=False)


