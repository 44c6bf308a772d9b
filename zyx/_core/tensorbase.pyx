# cython: language_level=3, boundscheck=False, wraparound=False
"""The per-node hot path of the Tensor object, compiled.

A training step writes a hundred-odd graph nodes and walks them for autograd; in plain
Python the object bookkeeping (creating the tensor object, reference counting its node,
recording its inputs for autograd, reading shape/dtype) cost more than the kernels. Here:

- `TensorBase`: the fields every Tensor has (`_id` of its graph node, `requires_grad`,
  `grad`, `_ctx` = how autograd recorded it) with C storage; the node reference is dropped
  in `__dealloc__`. `zyx.tensor.Tensor` subclasses it and adds the API.
- `wrap` / `TensorBase._make`: the only ways a node gets its tensor object; `_make` also
  runs the autograd recording when it is switched on (`set_recording`).
- `walk`: autograd's depth-first search over recorded inputs.
"""
from .graph cimport Graph, Node

cdef Graph _G = None
cdef type _cls = None          # zyx.tensor.Tensor
cdef list _tapes = None        # autograd's stack of active tapes (shared list object)
cdef bint _recording = False
cdef object _FREED = None      # autograd's marker for a released recording


def setup(Graph graph, type cls, list tapes, freed):
    """Called once by zyx.tensor / zyx.autograd at import."""
    global _G, _cls, _tapes, _FREED
    if graph is not None:
        _G = graph
    if cls is not None:
        _cls = cls
    if tapes is not None:
        _tapes = tapes
    if freed is not None:
        _FREED = freed


def set_recording(bint on):
    """Switch autograd recording in `_make`; returns the previous state."""
    global _recording
    cdef bint prev = _recording
    _recording = on
    return prev


def is_recording():
    return _recording


cdef class TensorBase:      # fields: tensorbase.pxd
    def __cinit__(self, *args, **kwargs):
        self._id = -1

    def __dealloc__(self):
        if self._id >= 0 and _G is not None:
            _G.release(self._id)

    @property
    def shape(self):
        return (<Node>_G.nodes.items[self._id]).shape

    @property
    def dtype(self):
        return (<Node>_G.nodes.items[self._id]).dtype

    @property
    def ndim(self):
        return len((<Node>_G.nodes.items[self._id]).shape)

    def _make(self, int op, object arg, srcs, tuple shape, object dtype):
        """The one node constructor: add the node, wrap it, record it for autograd."""
        return make(op, arg, tuple(srcs), shape, dtype)


cpdef TensorBase wrap(Py_ssize_t nid):
    """A new tensor object owning the (already counted) reference to node `nid`."""
    cdef TensorBase t = TensorBase.__new__(_cls)
    t._id = nid
    t.grad = None
    t._ctx = None
    return t


cpdef TensorBase make(int op, object arg, tuple srcs, tuple shape, object dtype):
    cdef Py_ssize_t n = len(srcs), i
    cdef tuple ids
    if n == 1:
        ids = ((<TensorBase>srcs[0])._id,)
    elif n == 2:
        ids = ((<TensorBase>srcs[0])._id, (<TensorBase>srcs[1])._id)
    else:
        ids = tuple([(<TensorBase>s)._id for s in srcs])
    cdef TensorBase out = wrap(_G.add(op, arg, ids, shape, dtype))
    if _recording:
        record(out, op, arg, srcs)
    return out


cdef void record(TensorBase out, int op, object arg, tuple srcs):
    """Store how `out` was made when someone may want its gradient."""
    cdef bint need = len(_tapes) > 0
    if not need:
        for s in srcs:
            if (<TensorBase>s).requires_grad:
                need = True
                break
        if not need:
            return          # the common case when nothing needs grad: one loop, no work
    if not (<Node>_G.nodes.items[out._id]).dtype.is_float:
        return              # ints and bools have no gradient
    out._ctx = (op, arg, srcs)
    out.requires_grad = True


cdef Py_ssize_t _walk_epoch = 0


def walk(list targets, is_source):
    """Depth-first over recorded inputs. Returns (post-order of tensors a source is
    reachable from, every visited tensor). Each visited tensor's mark (`needs_of`) says
    2 for a source, 1 when a source is reachable from it, else 0; the marks live on the
    tensors (stamped with the walk's epoch) instead of in dicts keyed by id()."""
    global _walk_epoch
    _walk_epoch += 1
    cdef Py_ssize_t ep = _walk_epoch
    cdef list order = []
    cdef list visited = []
    cdef list stack = []
    cdef list phase = []
    cdef TensorBase t, s
    cdef object ctx
    cdef int n
    for root in targets:
        t = <TensorBase?>root
        if t._wstamp == ep:
            continue
        stack.append(t)
        phase.append(False)
        while stack:
            t = <TensorBase>stack.pop()
            ctx = t._ctx
            if phase.pop():          # every input done: mark t
                n = 2 if is_source(t) else 0
                if ctx is _FREED:
                    n = n or 1         # it had inputs once; reaching it is an error later
                elif ctx is not None and not n:
                    for x in (<tuple>ctx)[2]:
                        if (<TensorBase>x)._wneed > 0:
                            n = 1
                            break
                t._wneed = n
                if n:
                    order.append(t)
                continue
            if t._wstamp == ep:        # done, or on the current path
                continue
            t._wstamp = ep
            t._wneed = -1
            visited.append(t)
            stack.append(t)
            phase.append(True)
            if ctx is not None and ctx is not _FREED:
                for x in (<tuple>ctx)[2]:
                    s = <TensorBase?>x
                    if s._wstamp != ep:
                        stack.append(s)
                        phase.append(False)
    return order, visited


def needs_of(list visited):
    """{id(tensor): mark} of the last walk over `visited` (see `walk`)."""
    cdef TensorBase t
    return {id(t): t._wneed for t in visited}
