cdef class TensorBase:
    cdef public Py_ssize_t _id
    cdef public bint requires_grad
    cdef public object grad
    cdef public object _ctx
    cdef object __weakref__
    # scratch of the autograd walk and the backward key (valid right after them)
    cdef Py_ssize_t _wstamp    # epoch of the last walk that entered this tensor
    cdef int _wneed            # 2 a source, 1 reaches a source, 0 neither, -1 on the path
    cdef Py_ssize_t _kstamp    # epoch of the last backward key that numbered this tensor
    cdef Py_ssize_t _kindex    # its number in that key
