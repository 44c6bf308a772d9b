# cython: language_level=3, boundscheck=False, wraparound=False
"""The lazy tensor graph: an arena of nodes with reference counts.

A node is a primitive op on its source nodes, or a LEAF holding a device buffer. Tensors
hold one reference to their node; every node holds one reference to each source. When a
count drops to zero the node is removed, its sources are released and its buffer (if any)
goes back to its memory pool through `free_buffer`.

Realization turns a computed node into a LEAF in place (`set_buffer`), which drops the
references to its sources, so graphs never grow without bound in a training loop.
"""
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


cdef class Node:
    def __cinit__(self, int op, object arg, tuple srcs, tuple shape, object dtype):
        self.op = op
        self.arg = arg
        self.srcs = srcs
        self.shape = shape
        self.dtype = dtype
        self.rc = 0
        self.buffer = None

    def __repr__(self):
        return (f"Node({OP_NAMES[self.op]}, arg={self.arg!r}, srcs={self.srcs}, "
                f"shape={self.shape}, dtype={self.dtype}, rc={self.rc})")


cdef class Graph:
    def __cinit__(self):
        self.nodes = Slab()
        self.free_buffer = None

    cpdef Py_ssize_t add(self, int op, object arg, tuple srcs, tuple shape, object dtype):
        """Add a node; it starts with one reference (owned by the caller's Tensor)."""
        cdef Node n = Node(op, arg, srcs, shape, dtype)
        cdef Py_ssize_t s
        for s in srcs:
            (<Node>self.nodes.items[s]).rc += 1
        n.rc = 1
        return self.nodes.push(n)

    cpdef Py_ssize_t leaf(self, object buffer, tuple shape, object dtype):
        cdef Node n = Node(LEAF, None, (), shape, dtype)
        n.buffer = buffer
        n.rc = 1
        return self.nodes.push(n)

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

    def collect(self, list targets):
        """Topologically ordered ids of the unrealized subgraph feeding `targets`, with the
        realized leaves and constants it reads, plus its structural key.

        The key names ops, args, shapes, dtypes and how nodes connect, never buffer
        identities, so a training loop that rebuilds the same graph on new buffers hits the
        same cached plan. It is one flat tuple (op, [arg,] shape, dtype code, source
        positions... per node; an op's arity is fixed), cheaper to build and hash than a
        tuple per node: this runs on every realization."""
        cdef list order = []
        cdef dict pos = {}
        cdef list stack = []
        cdef list key = []
        cdef list items = self.nodes.items
        cdef Node n
        cdef Py_ssize_t t, i, s
        for t in targets:
            if t in pos:
                continue
            stack.append(t)
            while stack:
                i = stack.pop()
                if i < 0:              # all sources placed: place the node
                    i = ~i
                    if i in pos:
                        continue
                    n = <Node>items[i]
                    pos[i] = len(order)
                    order.append(i)
                    key.append(n.op)
                    key.append(n.arg)
                    key.append(n.shape)
                    key.append(n.dtype.code)
                    for s in n.srcs:
                        key.append(pos[s])
                    continue
                if i in pos:
                    continue
                n = <Node?>items[i]    # checked: a dead id raises, never crashes
                if n.op == LEAF or not n.srcs:
                    pos[i] = len(order)
                    order.append(i)
                    key.append(n.op)
                    if n.op == CONST:
                        # float.hex tells 0.0 from -0.0 and makes NaN equal to itself
                        key.append(n.arg.hex() if type(n.arg) is float else n.arg)
                    key.append(n.shape)
                    key.append(n.dtype.code)
                    continue
                stack.append(~i)
                for s in reversed(n.srcs):
                    if s not in pos:
                        stack.append(s)
        key.append(tuple([pos[t] for t in targets]))
        return order, tuple(key)
