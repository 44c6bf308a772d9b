# cython: language_level=3
"""Symbolic integer index expressions used to turn movement ops into index arithmetic.

An expression is an affine `Sum` of atoms (loop variables, floor-divisions and modulos of
other sums) with integer coefficients plus a constant. Every atom knows its value range,
which is what lets reshapes collapse: `(i // 4) * 4 + i % 4` becomes `i`, `(4*i + j) // 4`
becomes `i` when `0 <= j < 4`. Indices are non-negative wherever a load really happens
(out-of-range positions of pads are masked), so floor and C truncation division agree.
"""


class Var:
    """A loop or thread index with inclusive range [lo, hi]."""
    __slots__ = ("id", "lo", "hi", "key")

    def __init__(self, int id, lo, hi):
        self.id = id
        self.lo = lo
        self.hi = hi
        self.key = ("v", id)

    def __eq__(self, other):
        return type(other) is Var and other.id == self.id

    def __hash__(self):
        return hash(self.key)

    def __repr__(self):
        return f"i{self.id}"


class Div:
    """num // d (floor division by a positive constant)."""
    __slots__ = ("num", "d", "lo", "hi", "key")

    def __init__(self, num, d):
        self.num = num
        self.d = d
        self.lo = num.lo // d
        self.hi = num.hi // d
        self.key = ("d", num.key, d)

    def __eq__(self, other):
        return type(other) is type(self) and other.key == self.key

    def __hash__(self):
        return hash(self.key)

    def __repr__(self):
        return f"({self.num!r} // {self.d})"


class Mod(Div):
    """num % d (a positive constant d): Div's equality and hash, its own range."""
    __slots__ = ()

    def __init__(self, num, d):
        self.num = num
        self.d = d
        self.lo = 0
        self.hi = d - 1
        self.key = ("m", num.key, d)

    def __repr__(self):
        return f"({self.num!r} % {self.d})"


class Sum:
    """sum(coef * atom) + offset, terms kept in a canonical order so equal sums compare equal."""
    __slots__ = ("terms", "offset", "lo", "hi", "key")

    def __init__(self, terms, offset):
        # terms: tuple of (atom, coef) with coef != 0, sorted by atom key
        self.terms = terms
        self.offset = offset
        lo = hi = offset
        for a, c in terms:
            if c > 0:
                lo += c * a.lo
                hi += c * a.hi
            else:
                lo += c * a.hi
                hi += c * a.lo
        self.lo = lo
        self.hi = hi
        self.key = ("s", tuple([(a.key, c) for a, c in terms]), offset)

    def __eq__(self, other):
        return type(other) is Sum and other.key == self.key

    def __hash__(self):
        return hash(self.key)

    def is_const(self):
        return not self.terms

    def __repr__(self):
        parts = [(f"{c}*{a!r}" if c != 1 else repr(a)) for a, c in self.terms]
        if self.offset or not parts:
            parts.append(str(self.offset))
        return " + ".join(parts)


def constant(c):
    return Sum((), c)


def var(v):
    if v.lo == v.hi:
        return Sum((), v.lo)
    return Sum(((v, 1),), 0)


def _make(dict coefs, offset):
    # Recombine c*(e // d)*d + c*(e % d) into c*e: this is what makes reshapes of
    # contiguous data collapse back to a plain linear index.
    cdef bint changed = True
    while changed:
        changed = False
        for a in list(coefs):
            if type(a) is Mod and a in coefs:
                c = coefs[a]
                dv = Div(a.num, a.d)
                if coefs.get(dv) == c * a.d:
                    del coefs[a]
                    del coefs[dv]
                    for b, cb in a.num.terms:
                        coefs[b] = coefs.get(b, 0) + c * cb
                        if coefs[b] == 0:
                            del coefs[b]
                    offset += c * a.num.offset
                    changed = True
                    break
    terms = tuple(sorted(((a, c) for a, c in coefs.items() if c != 0), key=_atom_order))
    return Sum(terms, offset)


def _atom_order(t):
    return repr(t[0].key)


def add(a, b):
    if type(b) is int:
        if b == 0:
            return a
        return Sum(a.terms, a.offset + b)
    if not b.terms:
        return Sum(a.terms, a.offset + b.offset)
    if not a.terms:
        return Sum(b.terms, a.offset + b.offset)
    cdef dict coefs = {}
    for t, c in a.terms:
        coefs[t] = c
    for t, c in b.terms:
        coefs[t] = coefs.get(t, 0) + c
    return _make(coefs, a.offset + b.offset)


def mul(a, c):
    if c == 0:
        return Sum((), 0)
    if c == 1:
        return a
    return Sum(tuple([(t, k * c) for t, k in a.terms]), a.offset * c)


def div(a, d):
    """floor(a / d) for a positive integer d."""
    if d == 1:
        return a
    if a.lo >= 0 and a.hi < d:
        return Sum((), 0)
    cdef dict q = {}
    cdef list rest = []
    for t, c in a.terms:
        if c % d == 0:
            q[t] = c // d
        else:
            rest.append((t, c))
    # Move the largest multiple of d out of the offset that keeps the remainder expression
    # non-negative: backends divide with C truncation, which equals floor division only on
    # non-negative values (a plain divmod of the offset can leave `rest` negative, e.g. the
    # flip of a reshape: (i - 4*j + 12) // 8 must not become (i - 4*j + 4) // 8 + 1).
    tr = Sum(tuple(rest), 0)
    qc = (a.offset + tr.lo) // d
    rc = a.offset - qc * d
    r = Sum(tr.terms, rc)
    if r.lo >= 0 and r.hi < d:
        return _make(q, qc)
    if len(q) == 0 and qc == 0 and r is not None:
        return Sum(((Div(r, d), 1),), 0) if r.terms else Sum((), r.offset // d)
    q[Div(r, d)] = q.get(Div(r, d), 0) + 1
    return _make(q, qc)


def mod(a, d):
    """a mod d for a positive integer d (a assumed non-negative where it matters)."""
    if d == 1:
        return Sum((), 0)
    if a.lo >= 0 and a.hi < d:
        return a
    terms = tuple([(t, c % d) for t, c in a.terms if c % d != 0])
    r = Sum(terms, a.offset % d)
    if r.lo >= 0 and r.hi < d:
        return r
    if not r.terms:
        return Sum((), r.offset % d)
    return Sum(((Mod(r, d), 1),), 0)


def linearize(tuple idx, tuple shape):
    """Row-major linear index of per-dim indices `idx` in `shape`."""
    out = Sum((), 0)
    cdef long long stride = 1
    cdef Py_ssize_t d
    for d in range(len(shape) - 1, -1, -1):
        if shape[d] != 1:
            out = add(out, mul(idx[d], stride))
        stride *= shape[d]
    return out


def unravel(lin, tuple shape):
    """Per-dim indices of row-major linear index `lin` in `shape`."""
    cdef list out = [None] * len(shape)
    cdef long long stride = 1
    cdef Py_ssize_t d
    for d in range(len(shape) - 1, -1, -1):
        if shape[d] == 1:
            out[d] = Sum((), 0)
        else:
            out[d] = mod(div(lin, stride), shape[d])
        stride *= shape[d]
    return tuple(out)


def var_of(s):
    """The Var when `s` is exactly one loop variable, else None."""
    if s.offset == 0 and len(s.terms) == 1 and s.terms[0][1] == 1 and type(s.terms[0][0]) is Var:
        return s.terms[0][0]
    return None
