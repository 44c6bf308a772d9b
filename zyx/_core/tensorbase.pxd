cdef class TensorBase:
    cdef public Py_ssize_t _id
    cdef public bint requires_grad
    cdef public object grad
    cdef public object _ctx
    cdef object __weakref__
    # views (zyx/inplace.py): on a view, (base, kind, arg) to write through and re-derive it;
    # on a base, weak references to the views made of it. None on ordinary tensors.
    cdef public object _view
    cdef public object _views
    # scratch of the autograd walk and the backward key (valid right after them)
    cdef Py_ssize_t _wstamp    # epoch of the last walk that entered this tensor
    cdef int _wneed            # 2 a source, 1 reaches a source, 0 neither, -1 on the path
    cdef Py_ssize_t _kstamp    # epoch of the last backward key that numbered this tensor
    cdef Py_ssize_t _kindex    # its number in that key
