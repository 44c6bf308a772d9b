from .slab cimport Slab

cdef class Node:
    cdef public int op
    cdef public object arg
    cdef public tuple srcs
    cdef public tuple shape
    cdef public object dtype
    cdef public Py_ssize_t rc
    cdef public object buffer
    cdef Py_ssize_t cstamp    # Graph.collect: epoch of the last collect that placed it
    cdef Py_ssize_t cpos      # and its position in that order
    cdef Py_ssize_t kstamp    # replay.backward_key: epoch of the last key that numbered it
    cdef Py_ssize_t kindex    # and its number in that key

cdef class Graph:
    cdef public Slab nodes
    cdef public object free_buffer
    cdef dict _traces          # thread ident -> the list `trace` gives that thread
    cpdef Py_ssize_t add(self, int op, object arg, tuple srcs, tuple shape, object dtype)
    cpdef Py_ssize_t leaf(self, object buffer, tuple shape, object dtype)
    cpdef void retain(self, Py_ssize_t nid)
    cpdef void release(self, Py_ssize_t nid)
    cpdef Node get(self, Py_ssize_t nid)
    cdef void _trace_append(self, object rec) except *
