cdef class Slab:
    cdef public list items
    cdef list _free
    cdef public Py_ssize_t count
    cpdef Py_ssize_t push(self, object item)
    cpdef object pop(self, Py_ssize_t i)
