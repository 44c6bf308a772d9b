"""float64 exp, log, sin, cos, tanh, pow and erf as SPIR-V instruction sequences.

GLSL.std.450 defines Exp, Log, Sin, Cos, Tanh, Pow, Exp2 and Log2 for 16- and 32-bit
floats only, so float64 kernels get these: argument reduction plus polynomials evaluated
in float64 (Cody-Waite splits of ln 2 and pi/2), within a few ulp for the arguments
machine learning sees (sin/cos lose accuracy past |x| ~ 1e5, where the 3-part pi/2 split
runs out of bits)."""
from __future__ import annotations

import math

LN2_HI = 6.93147180369123816490e-01
LN2_LO = 1.90821492927058770002e-10
PIO2 = (1.5707963267341256e+00, 6.0771005065061922e-11, 2.0222662487959506e-21)


class F64:
    """Small emitter of float64 arithmetic over a writer's module."""

    def __init__(self, w):
        self.w = w
        self.m = w.m
        self.t = self.m.type_float(64)
        self.b = w.boolt()
        self.u64 = self.m.type_int(64, False)
        self.i32 = w.i32()

    def c(self, v):
        return self.m.const(self.t, float(v), 64, True)

    def _op(self, name, a, b):
        return self.m.op(name, self.t, a, b)

    def add(self, a, b):
        return self._op("FAdd", a, b)

    def sub(self, a, b):
        return self._op("FSub", a, b)

    def mul(self, a, b):
        return self._op("FMul", a, b)

    def div(self, a, b):
        return self._op("FDiv", a, b)

    def neg(self, a):
        return self.m.op("FNegate", self.t, a)

    def sel(self, cond, a, b):
        return self.m.op("Select", self.t, cond, a, b)

    def lt(self, a, b):
        return self.m.op("FOrdLessThan", self.b, a, b)

    def gt(self, a, b):
        return self.m.op("FOrdGreaterThan", self.b, a, b)

    def eq(self, a, b):
        return self.m.op("FOrdEqual", self.b, a, b)

    def isnan(self, a):
        return self.m.op("IsNan", self.b, a)

    def glsl(self, inst, *args):
        return self.m.ext(self.w.glsl, self.t, inst, *args)

    def poly(self, x, coeffs):
        """coeffs[0] + coeffs[1] x + ... (Horner)."""
        acc = self.c(coeffs[-1])
        for a in reversed(coeffs[:-1]):
            acc = self.add(self.mul(acc, x), self.c(a))
        return acc

    def ldexp(self, x, n_i32):
        """x * 2^n for |n| <= 2098 (two steps: each power of two is a normal double)."""
        m = self.m
        half = m.op("ShiftRightArithmetic", self.i32, n_i32, self.w.c_i32(1))
        rest = m.op("ISub", self.i32, n_i32, half)
        return self.mul(self.mul(x, self.pow2(half)), self.pow2(rest))

    def pow2(self, n_i32):
        """2^n as a double, n in [-1022, 1023]."""
        m = self.m
        e = m.op("IAdd", self.i32, n_i32, self.w.c_i32(1023))
        e = m.op("SConvert", m.type_int(64, True), e)
        bits = m.op("ShiftLeftLogical", m.type_int(64, True), e,
                    m.const(m.type_int(64, True), 52, 64))
        return m.op("Bitcast", self.t, bits)


def exp(w, x):
    f = F64(w)
    m = f.m
    n = f.glsl(2, f.mul(x, f.c(1.0 / math.log(2.0))))          # RoundEven
    n = f.sel(f.gt(n, f.c(1100.0)), f.c(1100.0), f.sel(f.lt(n, f.c(-1100.0)), f.c(-1100.0), n))
    r = f.sub(f.sub(x, f.mul(n, f.c(LN2_HI))), f.mul(n, f.c(LN2_LO)))
    p = f.poly(r, [1.0 / math.factorial(k) for k in range(14)])
    ni = m.op("ConvertFToS", f.i32, n)
    y = f.ldexp(p, ni)
    y = f.sel(f.gt(x, f.c(709.782712893384)), f.c(float("inf")), y)
    y = f.sel(f.lt(x, f.c(-745.2)), f.c(0.0), y)
    return f.sel(f.isnan(x), x, y)


def log(w, x):
    f = F64(w)
    m = f.m
    i64 = m.type_int(64, True)
    # subnormals: scale into the normal range first
    tiny = f.lt(x, f.c(2.2250738585072014e-308))
    xs = f.sel(tiny, f.mul(x, f.c(2.0 ** 54)), x)
    bits = m.op("Bitcast", i64, xs)
    e = m.op("ISub", i64, m.op("BitwiseAnd", i64, m.op("ShiftRightLogical", i64, bits,
                                                          m.const(i64, 52, 64)),
                               m.const(i64, 0x7FF, 64)), m.const(i64, 1022, 64))
    mant = m.op("BitwiseOr", i64, m.op("BitwiseAnd", i64, bits,
                                       m.const(i64, 0x800FFFFFFFFFFFFF, 64)),
                m.const(i64, 1022 << 52, 64))
    mf = m.op("Bitcast", f.t, mant)                 # in [0.5, 1)
    low = f.lt(mf, f.c(math.sqrt(0.5)))
    mf = f.sel(low, f.mul(mf, f.c(2.0)), mf)
    ef = m.op("ConvertSToF", f.t, e)
    ef = f.sel(low, f.sub(ef, f.c(1.0)), ef)
    ef = f.sel(tiny, f.sub(ef, f.c(54.0)), ef)
    g = f.sub(mf, f.c(1.0))
    s = f.div(g, f.add(g, f.c(2.0)))
    s2 = f.mul(s, s)
    series = f.poly(s2, [2.0 / (2 * k + 1) for k in range(12)])
    y = f.add(f.mul(s, series), f.add(f.mul(ef, f.c(LN2_LO)), f.mul(ef, f.c(LN2_HI))))
    y = f.sel(f.eq(x, f.c(float("inf"))), x, y)
    y = f.sel(f.eq(x, f.c(0.0)), f.c(float("-inf")), y)
    y = f.sel(f.lt(x, f.c(0.0)), f.c(float("nan")), y)
    return f.sel(f.isnan(x), x, y)


def _sincos_kernels(f, r):
    r2 = f.mul(r, r)
    s = f.mul(r, f.poly(r2, [(-1.0) ** k / math.factorial(2 * k + 1) for k in range(11)]))
    c = f.poly(r2, [(-1.0) ** k / math.factorial(2 * k) for k in range(11)])
    return s, c


def sincos(w, x, want_cos):
    f = F64(w)
    m = f.m
    n = f.glsl(2, f.mul(x, f.c(2.0 / math.pi)))
    r = x
    for part in PIO2:
        r = f.sub(r, f.mul(n, f.c(part)))
    s, c = _sincos_kernels(f, r)
    q = m.op("ConvertFToS", m.type_int(64, True), f.sel(f.isnan(n), f.c(0.0), n))
    i64 = m.type_int(64, True)
    if want_cos:
        q = m.op("IAdd", i64, q, m.const(i64, 1, 64))
    q = m.op("BitwiseAnd", i64, q, m.const(i64, 3, 64))
    odd = m.op("IEqual", f.b, m.op("BitwiseAnd", i64, q, m.const(i64, 1, 64)),
               m.const(i64, 1, 64))
    neg = m.op("IEqual", f.b, m.op("BitwiseAnd", i64, q, m.const(i64, 2, 64)),
               m.const(i64, 2, 64))
    v = f.sel(odd, c, s)
    v = f.sel(neg, f.neg(v), v)
    bad = m.op("LogicalOr", f.b, f.isnan(x), f.eq(f.glsl(4, x), f.c(float("inf"))))
    return f.sel(bad, f.c(float("nan")), v)


def tanh(w, x):
    f = F64(w)
    ax = f.glsl(4, x)
    e = exp(w, f.mul(ax, f.c(2.0)))
    r = f.sub(f.c(1.0), f.div(f.c(2.0), f.add(e, f.c(1.0))))
    r = f.sel(f.gt(ax, f.c(20.0)), f.c(1.0), r)
    r = f.sel(f.lt(x, f.c(0.0)), f.neg(r), r)
    x2 = f.mul(x, x)
    small = f.mul(x, f.poly(x2, [1.0, -1.0 / 3, 2.0 / 15, -17.0 / 315, 62.0 / 2835,
                                 -1382.0 / 155925]))
    r = f.sel(f.lt(ax, f.c(0.04)), small, r)
    return f.sel(f.isnan(x), x, r)


def erf(w, x):
    """A Taylor series below 2, erfc's continued fraction above."""
    f = F64(w)
    ax = f.glsl(4, x)
    x2 = f.mul(ax, ax)
    coeffs = [(-1.0) ** n / (math.factorial(n) * (2 * n + 1)) for n in range(40)]
    series = f.mul(f.mul(ax, f.poly(x2, coeffs)), f.c(2.0 / math.sqrt(math.pi)))
    safe = f.sel(f.lt(ax, f.c(2.0)), f.c(2.0), ax)
    k = safe
    for j in range(60, 0, -1):
        k = f.add(safe, f.div(f.c(j / 2.0), k))
    erfc = f.div(exp(w, f.neg(f.mul(safe, safe))), f.mul(k, f.c(math.sqrt(math.pi))))
    big = f.sub(f.c(1.0), erfc)
    r = f.sel(f.lt(ax, f.c(2.0)), series, big)
    r = f.sel(f.gt(ax, f.c(6.0)), f.c(1.0), r)
    r = f.sel(f.lt(x, f.c(0.0)), f.neg(r), r)
    return f.sel(f.isnan(x), x, r)


def pow_abs(w, ax, y):
    """|x|^y for |x| > 0 as exp(y log |x|)."""
    f = F64(w)
    return exp(w, f.mul(y, log(w, ax)))
