# cython: language_level=3, boundscheck=False, wraparound=False
"""The host side of zyx's value checks (Runtime._execute_checked): one pass over the
memory of a realized integer tensor (a batch of labels, an index, a divisor), called on
every training step that reads one, where numpy's min() and max() cost ~10x more."""
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_ANY_CONTIGUOUS
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t


cdef inline bint _bad_signed(int64_t v, int64_t clo, int64_t chi, bint lo_open,
                             bint hi_open, bint has_exempt, int64_t exempt, bint inside):
    cdef bint within = (lo_open or v >= clo) and (hi_open or v < chi)
    if inside:
        return within
    return not within and not (has_exempt and v == exempt)


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
                if itemsize == 8:
                    v = (<int64_t*>p)[i]
                elif itemsize == 4:
                    v = (<int32_t*>p)[i]
                elif itemsize == 2:
                    v = (<int16_t*>p)[i]
                else:
                    v = (<int8_t*>p)[i]
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
                if itemsize == 8:
                    u = (<uint64_t*>p)[i]
                elif itemsize == 4:
                    u = (<uint32_t*>p)[i]
                elif itemsize == 2:
                    u = (<uint16_t*>p)[i]
                else:
                    u = (<uint8_t*>p)[i]
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
