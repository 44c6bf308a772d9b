# cython: language_level=3, boundscheck=False, wraparound=False
"""zyx's value checks (zyx.set_checks; the registry is runtime.Checks): the Check record,
the per-realization bookkeeping and the host side, one pass over the memory of a realized
integer tensor (a batch of labels, an index, a divisor). Compiled: a training step runs
this once per step, where numpy's min() and max() alone cost ~10x more."""
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_ANY_CONTIGUOUS
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t

import weakref

import numpy as np

from .graph cimport Node
from .graph import LEAF as _LEAF_OP

cdef int LEAF = _LEAF_OP


cdef inline bint _bad_signed(int64_t v, int64_t clo, int64_t chi, bint lo_open,
                             bint hi_open, bint has_exempt, int64_t exempt, bint inside):
    cdef bint within = (lo_open or v >= clo) and (hi_open or v < chi)
    if inside:
        return within
    return not within and not (has_exempt and v == exempt)


cdef inline int64_t _signed_at(char* p, Py_ssize_t i, int itemsize):
    """Value i of signed integer memory of `itemsize` bytes per value."""
    if itemsize == 8:
        return (<int64_t*>p)[i]
    if itemsize == 4:
        return (<int32_t*>p)[i]
    if itemsize == 2:
        return (<int16_t*>p)[i]
    return (<int8_t*>p)[i]


cdef inline uint64_t _unsigned_at(char* p, Py_ssize_t i, int itemsize):
    """Value i of unsigned integer memory of `itemsize` bytes per value."""
    if itemsize == 8:
        return (<uint64_t*>p)[i]
    if itemsize == 4:
        return (<uint32_t*>p)[i]
    if itemsize == 2:
        return (<uint16_t*>p)[i]
    return (<uint8_t*>p)[i]


def first_bad(obj, int itemsize, bint signed, lo, hi, exempt=None, bint inside=False):
    """Flat position of the first value of the integer array memory `obj` (itemsize bytes
    per value, signed or not) that is bad, or -1. Bad: outside [lo, hi) and not equal to
    `exempt` (an index or label check), or with `inside`, inside [lo, hi) (a zero
    divisor: lo=0, hi=1). Bounds beyond the dtype's range are treated as open."""
    cdef Py_buffer view
    PyObject_GetBuffer(obj, &view, PyBUF_ANY_CONTIGUOUS)
    cdef Py_ssize_t n = view.len // itemsize, i
    cdef char* p = <char*>view.buf
    cdef int64_t clo = 0, chi = 0, cex = 0, v
    cdef uint64_t u, ulo = 0, uhi = 0, uex = 0
    cdef bint lo_open, hi_open, has_exempt = exempt is not None, within, bad, hi_empty = False
    cdef Py_ssize_t found = -1
    try:
        if signed:
            lo_open = lo < -(1 << 63)
            hi_open = hi > (1 << 63) - 1
            clo = lo if not lo_open else 0
            chi = hi if not hi_open else 0
            if has_exempt:
                has_exempt = -(1 << 63) <= exempt < (1 << 63)
                cex = exempt if has_exempt else 0
            for i in range(n):
                v = _signed_at(p, i, itemsize)
                if _bad_signed(v, clo, chi, lo_open, hi_open, has_exempt, cex, inside):
                    found = i
                    break
        else:
            lo_open = lo <= 0
            hi_open = hi > (1 << 64) - 1
            ulo = lo if not lo_open else 0
            uhi = hi if (not hi_open and hi > 0) else 0
            hi_empty = hi <= 0
            if has_exempt:
                has_exempt = 0 <= exempt < (1 << 64)
                uex = exempt if has_exempt else 0
            for i in range(n):
                u = _unsigned_at(p, i, itemsize)
                within = (lo_open or u >= ulo) and (hi_open or (not hi_empty and u < uhi))
                if inside:
                    bad = within
                else:
                    bad = not within and not (has_exempt and u == uex)
                if bad:
                    found = i
                    break
    finally:
        PyBuffer_Release(&view)
    return found


cdef class Check:
    """What the values of an operand (an integer index, label or divisor tensor: graph
    node `opid`) must satisfy, watched through graph node `nid` (the first node computed
    from those values, e.g. the one-hot compare of a gather): any realization whose
    subgraph holds that node checks them. A value v is bad when it is outside [lo, hi) and
    not `exempt`, or with `inside`, when it is inside [lo, hi) (a zero divisor). A bad
    value raises error(message.format(v, *info)) (`message` may also be a function of v).

    A realized operand is read on the host before the plan runs (`check_leaf`). Any other
    gets a `flag` (runtime.Checks.make_flag: a lazy (1,) bool tensor, true when some value
    is bad) computed by the same plan, made again for each realization (a borrowed numpy
    array may change in between).

    The operand is held by id and Node object, not by a reference count: it feeds the
    watched node, so it lives as long as the check is needed, and a graph nobody realizes
    (backward() after backward()) keeps no extra node alive."""
    cdef public Py_ssize_t nid, opid
    cdef public Node node, opnode
    cdef public object lo, hi, exempt, error, message, info, flag
    cdef public bint inside

    def __init__(self, Py_ssize_t nid, Node node, Py_ssize_t opid, Node opnode, lo, hi,
                 exempt, bint inside, error, message, info):
        self.nid = nid
        self.node = node
        self.opid = opid
        self.opnode = opnode
        self.lo = lo
        self.hi = hi
        self.exempt = exempt
        self.inside = inside
        self.error = error
        self.message = message
        self.info = info
        self.flag = None

    def exception(self, value):
        m = self.message
        return self.error(m(value) if callable(m) else m.format(value, *self.info))

    def first_bad(self, values):
        """The first bad value of the numpy array `values`, or None."""
        d = values.dtype
        i = first_bad(values, d.itemsize, d.kind == "i", self.lo, self.hi, self.exempt,
                      self.inside)
        return None if i < 0 else int(values.reshape(-1)[i])


cdef inline bint _watching(Check c, list items):
    """Its watched node is alive (not released, its id not reused) and unrealized."""
    cdef Py_ssize_t nid = c.nid
    return nid < len(items) and items[nid] is c.node and c.node.op != LEAF


def live(dict watch, list items, make_flag):
    """Checks of `watch` ({watched id: Check}) whose watched node is still unrealized;
    those whose operand is not a realized leaf get a fresh flag (make_flag(check)). The
    others are dropped from `watch`."""
    cdef list out = [], gone = []
    cdef Check c
    for c in watch.values():
        if _watching(c, items):
            if c.opnode.op == LEAF:
                c.flag = None
            elif c.flag is None:
                c.flag = make_flag(c)
            out.append(c)
        else:
            gone.append(c.nid)
    for nid in gone:
        del watch[nid]
    return out


def sweep(dict watch, list items):
    """Drop the checks whose watched node was realized or released."""
    cdef Check c
    for nid in [c.nid for c in watch.values() if not _watching(c, items)]:
        del watch[nid]


# Device buffers (not host memory) whose values passed a check: {buffer: {bounds}}. A
# realized device buffer never changes, so a batch of labels uploaded once and used every
# epoch is read back once, not at every step (each read waits for the device).
_PASSED = weakref.WeakKeyDictionary()


def check_leaf(Check c):
    """Raise for the first bad value of the realized operand (host memory is read in
    place, other pools copied, once per buffer and bounds)."""
    node = c.opnode
    buf, d = node.buffer, node.dtype
    pool = buf.pool
    bounds = None
    if pool.name == "host":
        mem = buf.handle
    else:
        bounds = (c.lo, c.hi, c.exempt, c.inside)
        seen = _PASSED.get(buf)
        if seen is not None and bounds in seen:
            return
        mem = np.empty(node.shape, dtype=d.np)
        if mem.nbytes:
            pool.pool_to_host(buf, mem, [buf.event] if buf.event is not None else [])
    if first_bad(mem, d.itemsize, d.kind == "i", c.lo, c.hi, c.exempt, c.inside) >= 0:
        values = mem.view(d.np) if mem.dtype != d.np else mem
        raise c.exception(c.first_bad(values))
    if bounds is not None:
        _PASSED.setdefault(buf, set()).add(bounds)
