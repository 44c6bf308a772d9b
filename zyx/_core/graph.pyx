# cython: language_level=3, boundscheck=False, wraparound=False
"""The lazy tensor graph: an arena of nodes with reference counts.

A node is a primitive op on its source nodes, or a LEAF holding a device buffer. Tensors
hold one reference to their node; every node holds one reference to each source. When a
count drops to zero the node is removed, its sources are released and its buffer (if any)
goes back to its memory pool through `free_buffer`.

Realization turns a computed node into a LEAF in place (`set_buffer`), which drops the
references to its sources, so graphs never grow without bound in a training loop.
"""
cimport cython
from libc.stdlib cimport realloc
from cpython.pythread cimport PyThread_get_thread_ident

from .slab cimport Slab

# Primitive graph ops. Everything in the Tensor API is built from these.
LEAF = 0      # arg None, buffer set
CONST = 1     # arg: python scalar; any shape (a broadcast constant needs no memory)
CAST = 2      # arg: target DType
UNARY = 3     # arg: unary op code (kernel.U_*)
BINARY = 4    # arg: binary op code (kernel.B_*)
WHERE = 5     # srcs: cond, a, b
REDUCE = 6    # arg: (reduce op code, axes tuple); output keeps reduced dims as size 1
RESHAPE = 7   # arg: new shape (== node shape)
PERMUTE = 8   # arg: axes order
EXPAND = 9    # arg: new shape (== node shape)
PAD = 10      # arg: ((before, after), ...) per dim, negative values shrink
FLIP = 11     # arg: axes tuple

OP_NAMES = ("LEAF", "CONST", "CAST", "UNARY", "BINARY", "WHERE", "REDUCE", "RESHAPE",
            "PERMUTE", "EXPAND", "PAD", "FLIP")
MOVEMENT = frozenset((RESHAPE, PERMUTE, EXPAND, PAD, FLIP))


def mask_cuts(arg):
    """A PAD arg with None in place of each axis that is only cut (its start may become a
    parameter), the real pads and the fill kept."""
    return (tuple([None if b <= 0 and a <= 0 else (b, a) for b, a in arg[0]]), arg[1])


def shrinks(arg):
    """True when a PAD arg has an axis that is only cut (before <= 0, after <= 0, not
    both 0): the axes whose start a kernel may read as a parameter."""
    for before, after in arg[0]:
        if before <= 0 and after <= 0 and (before or after):
            return True
    return False


cdef inline object _hashable(object v):
    # float.hex tells 0.0 from -0.0 and makes NaN equal to itself
    return v.hex() if type(v) is float else v


@cython.no_gc
cdef class Node:
    # made only by _node (no __init__ argument parsing: a training step makes hundreds)
    # Not tracked by Python's cyclic garbage collector: a node is referenced only by the
    # graph's slab (and briefly by code reading it), so it is never part of a reference
    # cycle, and freed by its count. Tracked, the thousands a training step makes (and
    # keeps alive across the step) set off most of the young-generation collections and
    # were traversed in each (py-spy, the recipe LM step: 11% of its host time in gc).

    def __repr__(self):
        return (f"Node({OP_NAMES[self.op]}, arg={self.arg!r}, srcs={self.srcs}, "
                f"shape={self.shape}, dtype={self.dtype}, rc={self.rc})")


cdef Py_ssize_t _collect_epoch = 0
cdef Py_ssize_t* _stack = NULL      # collect's depth-first stack (grown, never shrunk)
cdef Py_ssize_t _stack_cap = 0


cdef void _stack_reserve(Py_ssize_t n) except *:
    global _stack, _stack_cap
    if n <= _stack_cap:
        return
    cdef Py_ssize_t cap = max(n, 2 * _stack_cap, 256)
    cdef Py_ssize_t* p = <Py_ssize_t*>realloc(_stack, cap * sizeof(Py_ssize_t))
    if p == NULL:
        raise MemoryError()
    _stack = p
    _stack_cap = cap


cdef inline Node _live(list items, Py_ssize_t i):
    """Node `i`; an id that is dead or was never made raises instead of crashing."""
    if i < 0 or i >= len(items) or items[i] is None:
        raise KeyError(f"graph node {i} does not exist (released?)")
    return <Node>items[i]


cdef inline Node _node(int op, object arg, tuple srcs, tuple shape, object dtype):
    cdef Node n = Node.__new__(Node)
    n.op = op
    n.arg = arg
    n.srcs = srcs
    n.shape = shape
    n.dtype = dtype
    n.rc = 1
    return n


cdef class Graph:
    def __cinit__(self):
        self.nodes = Slab()
        self.free_buffer = None
        self._traces = {}      # see the `trace` property

    cpdef Py_ssize_t add(self, int op, object arg, tuple srcs, tuple shape, object dtype):
        """Add a node; it starts with one reference (owned by the caller's Tensor)."""
        cdef Node n = _node(op, arg, srcs, shape, dtype)
        cdef Py_ssize_t s
        for s in srcs:
            (<Node>self.nodes.items[s]).rc += 1
        cdef Py_ssize_t nid = self.nodes.push(n)
        if self._traces:
            self._trace_append((op, arg, srcs, shape, dtype, nid))
        return nid

    cpdef Py_ssize_t leaf(self, object buffer, tuple shape, object dtype):
        cdef Node n = _node(LEAF, None, (), shape, dtype)
        n.buffer = buffer
        if self._traces:
            self._trace_append(None)    # a new buffer cannot be replayed from a template
        return self.nodes.push(n)

    @property
    def trace(self):
        """A list while autograd records a backward template in the calling thread (every
        node this thread adds is appended), else None. Per thread: nodes another thread
        builds meanwhile belong to no template."""
        return self._traces.get(PyThread_get_thread_ident())

    @trace.setter
    def trace(self, list value):
        cdef unsigned long me = PyThread_get_thread_ident()
        if value is None:
            self._traces.pop(me, None)
        else:
            self._traces[me] = value

    cdef void _trace_append(self, object rec) except *:
        cdef list t = self._traces.get(PyThread_get_thread_ident())
        if t is not None:
            t.append(rec)

    cpdef Node get(self, Py_ssize_t nid):
        return <Node>self.nodes.items[nid]

    cpdef void retain(self, Py_ssize_t nid):
        (<Node>self.nodes.items[nid]).rc += 1

    cpdef void release(self, Py_ssize_t nid):
        cdef list stack = [nid]
        cdef Node n
        cdef Py_ssize_t i, s
        while stack:
            i = stack.pop()
            n = <Node>self.nodes.items[i]
            n.rc -= 1
            if n.rc > 0:
                continue
            self.nodes.pop(i)
            if n.buffer is not None and self.free_buffer is not None:
                self.free_buffer(n.buffer)
            n.buffer = None
            for s in n.srcs:
                stack.append(s)

    def set_buffer(self, Py_ssize_t nid, object buffer):
        """Turn node `nid` into a realized LEAF holding `buffer`; its sources are released."""
        cdef Node n = <Node>self.nodes.items[nid]
        cdef tuple srcs = n.srcs
        n.op = LEAF
        n.arg = None
        n.srcs = ()
        n.buffer = buffer
        for s in srcs:
            self.release(s)

    def __len__(self):
        return self.nodes.count

    def collect(self, list targets, list values=None, list sizes=None):
        """Topologically ordered ids of the unrealized subgraph feeding `targets`, with the
        realized leaves and constants it reads, plus its structural key.

        `values` (a list, on a plan-cache miss only): filled with (key index, position) of
        every key entry that is a value a kernel could take as a parameter instead of
        baking it into its source (runtime `_values_plan`): a CONST's scalar and the arg of
        a PAD that shrinks some axis on both sides (a slice `x[i:i + n]`). The key returned
        is then the skeleton: those entries masked (None; `mask_cuts` for PADs).

        The key names ops, args, shapes, dtypes and how nodes connect, never buffer
        identities, so a training loop that rebuilds the same graph on new buffers hits the
        same cached plan. It is one flat tuple (op, [arg,] shape, dtype code, source
        positions... per node; an op's arity is fixed), cheaper to build and hash than a
        tuple per node: this runs on every realization. Visited nodes are marked on the
        nodes themselves (an epoch stamp and their position), and the depth-first stack
        is a C array, so the walk allocates nothing per node.

        `sizes` (a list, for bounds.py on a plan-cache miss; not with `values`): filled
        with every node's shape, and the key returned is the shape skeleton: each shape
        replaced by its rank, and what follows from sizes masked (constants' scalars,
        RESHAPE/EXPAND shapes, PAD amounts: a PAD keeps its rank and fill)."""
        global _collect_epoch
        _collect_epoch += 1
        cdef Py_ssize_t ep = _collect_epoch
        cdef list order = []
        cdef list key = []
        cdef list items = self.nodes.items
        cdef Node n
        cdef Py_ssize_t i, s, sp = 0, k
        cdef tuple srcs
        for t in targets:
            n = _live(items, t)
            if n.cstamp == ep:
                continue
            _stack_reserve(1)
            _stack[0] = t
            sp = 1
            while sp:
                sp -= 1
                i = _stack[sp]
                if i < 0:              # all sources placed: place the node
                    i = ~i
                    n = <Node>items[i]
                    if n.cstamp == ep:
                        continue
                    n.cstamp = ep
                    n.cpos = len(order)
                    order.append(i)
                    key.append(n.op)
                    if sizes is not None:
                        if n.op == PAD:
                            key.append((len(n.shape), _hashable(n.arg[1])))
                        elif n.op == RESHAPE or n.op == EXPAND:
                            key.append(None)
                        else:
                            key.append(n.arg)
                        key.append(len(n.shape))
                        sizes.append(n.shape)
                    else:
                        if values is not None and n.op == PAD and shrinks(n.arg):
                            values.append((len(key), n.cpos))
                            key.append(mask_cuts(n.arg))
                        else:
                            key.append(n.arg)
                        key.append(n.shape)
                    key.append(n.dtype.code)
                    for s in n.srcs:
                        key.append((<Node>items[s]).cpos)
                    continue
                n = _live(items, i)
                if n.cstamp == ep:
                    continue
                srcs = n.srcs
                if n.op == LEAF or not srcs:
                    n.cstamp = ep
                    n.cpos = len(order)
                    order.append(i)
                    key.append(n.op)
                    if n.op == CONST:
                        if values is not None:
                            values.append((len(key), n.cpos))
                            key.append(None)
                        elif sizes is not None:
                            key.append(None)
                        else:
                            key.append(_hashable(n.arg))
                    if sizes is not None:
                        key.append(len(n.shape))
                        sizes.append(n.shape)
                    else:
                        key.append(n.shape)
                    key.append(n.dtype.code)
                    continue
                _stack_reserve(sp + 1 + len(srcs))
                _stack[sp] = ~i
                sp += 1
                for k in range(len(srcs) - 1, -1, -1):
                    s = srcs[k]
                    if (<Node>items[s]).cstamp != ep:
                        _stack[sp] = s
                        sp += 1
        key.append(tuple([(<Node>items[t]).cpos for t in targets]))
        return order, tuple(key)
