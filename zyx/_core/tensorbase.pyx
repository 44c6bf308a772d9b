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
cdef object _FREED = None      # autograd's marker for a released recording

# Grad mode and the count of active tapes are per thread, as torch's grad mode is: a thread
# inside `no_grad()` (an evaluation loop) must not switch recording off for a thread that
# is training. C thread-local variables keep the per-op test one load and a compare.
cdef extern from *:
    """
    #if defined(_MSC_VER)
    #define ZYX_THREAD_LOCAL __declspec(thread)
    #else
    #define ZYX_THREAD_LOCAL __thread
    #endif
    static ZYX_THREAD_LOCAL int zyx_recording = 1;   /* every thread starts with grad on */
    static ZYX_THREAD_LOCAL int zyx_tape_depth = 0;  /* this thread's active tapes */
    """
    int zyx_recording
    int zyx_tape_depth


def setup(Graph graph, type cls, freed):
    """Called once by zyx.tensor / zyx.autograd at import."""
    global _G, _cls, _FREED
    if graph is not None:
        _G = graph
    if cls is not None:
        _cls = cls
    if freed is not None:
        _FREED = freed


def set_recording(bint on):
    """Switch autograd recording in `_make` for the calling thread; returns the previous
    state."""
    global zyx_recording
    cdef bint prev = zyx_recording != 0
    zyx_recording = 1 if on else 0
    return prev


def is_recording():
    """Whether `_make` records in the calling thread."""
    return zyx_recording != 0


def tape_entered(Py_ssize_t delta):
    """A tape of the calling thread opened (+1) or closed (-1): while this thread has one
    open, `_make` records every floating-point op. Returns the new count."""
    global zyx_tape_depth
    zyx_tape_depth += delta
    return zyx_tape_depth


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
    if zyx_recording:
        record(out, op, arg, srcs)
    return out


cdef void record(TensorBase out, int op, object arg, tuple srcs):
    """Store how `out` was made when someone may want its gradient."""
    cdef bint need = zyx_tape_depth > 0
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
