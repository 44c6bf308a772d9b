"""C source of one kernel for the C backend: a function `void name(void** args)` whose
index loops OpenMP splits over threads and whose inner loops are written for the
compiler's vectorizer, and the prelude every translation unit starts with.

Before rendering, the C-only IR rewrites run: rangesplit first (a kernel whose guards
test ranges of an output index becomes pieces, written one loop nest after the other by
`_render_pieces`), then on each kernel or piece rowstash, hoist, nanflag, padtaps; then
`cstyle.render_body` writes the body through `CBackendDialect`, with the pragma of each
loop chosen here (`_LoopPragmas`). The module constants are the rendering knobs
(benches/flag_ab.py flips them for comparisons). What the compiler and CPU allow comes
in a `CTarget`; nothing here runs a compiler or reads the machine.
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import dtype as dt
from ..._core import kernel as K
from ..cstyle import CDialect, alu_operands, render_body
from . import padtaps, rangesplit
from .hoist import hoist_invariants
from .nanflag import NAN_MAX, NAN_MIN, flag_nan_reductions
from .rowstash import stash_row_values

PARALLEL_MIN_WORK = 1 << 15   # below this many iterations threads cost more than they give
SIMD_COLLAPSE = True          # elementwise kernels: one simd loop over the last two index
SHORT_SIMD = 4                # loops when the last is at most this long
UNROLL_ROWS = 16              # lane tiles: rows loops this short or shorter are unrolled
UNROLL_INSIDE = 64            # ... when the reduce loop around them is this short or shorter
STASH_ROWS = True             # row kernels keep a costly value for their next loop (rowstash)
HOIST_INVARIANTS = True       # loop-invariant loads made before their loops (hoist.py)
FLAG_NAN = True               # long max/min reductions keep NaN in a flag (nanflag.py)
_SIMD_FUNCS = ("exp", "exp2", "log", "log2", "sin", "cos", "tanh", "erf", "pow")

_PRELUDE = r"""
#include <string.h>
#include <math.h>
#if defined(__clang__)
#define ZYX_ASSOC_FN
#define ZYX_REASSOC _Pragma("clang fp reassociate(on)")
#elif defined(__GNUC__)
#define ZYX_ASSOC_FN __attribute__((optimize("associative-math", "no-signed-zeros", "no-trapping-math")))
#define ZYX_REASSOC
#else
#define ZYX_ASSOC_FN
#define ZYX_REASSOC
#endif
/* float16 / bfloat16 are stored as 16 bits and computed in float: zyx_h2f / zyx_bf2f read
   them, zyx_f2h / zyx_f2bf write them (round to nearest even, NaN kept quiet), zyx_rh /
   zyx_rbf round a float to the nearest such value (each op's result, cstyle.half_rounds).
   All are integer bit operations that gcc vectorizes (its _Float16 conversions are scalar
   instructions: a float16 chain on 16M elements ran 3-4x slower through them), bit for bit
   the hardware's conversions for every float and every half (checked exhaustively).
   Selects are written as masks from the sign of a difference (ZYX_LT): from comparisons
   gcc turns them into branches and stops vectorizing. */
#define ZYX_LT(a, b) ((unsigned int)((int)((a) - (b)) >> 31))
#define ZYX_BLEND(m, x, y) (((m) & (x)) | (~(m) & (y)))
static inline float zyx_h2f(unsigned short h) {
  const unsigned int em = h & 0x7fffu, s = ((unsigned int)h & 0x8000u) << 16;
  const unsigned int mb = 0x3f000000u | em; float mf; memcpy(&mf, &mb, 4);
  const float sub = mf - 0.5f;   /* a subnormal m: 0.5 + m 2^-24 - 0.5, exact */
  unsigned int sb; memcpy(&sb, &sub, 4);
  const unsigned int fin = ZYX_LT(em, 0x7c00u), den = ZYX_LT(em, 0x400u), nan = ZYX_LT(0x7c00u, em);
  const unsigned int n = (em << 13) + 0x38000000u;
  const unsigned int sp = (em << 13) | 0x7f800000u | (nan & 0x400000u);
  const unsigned int u = ZYX_BLEND(fin, ZYX_BLEND(den, sb, n), sp) | s;
  float f; memcpy(&f, &u, 4); return f; }
static inline unsigned short zyx_f2h(float x) {
  unsigned int u; memcpy(&u, &x, 4);
  const unsigned int a = u & 0x7fffffffu, s = (u >> 16) & 0x8000u;
  float f; memcpy(&f, &a, 4); f += 0.5f;   /* below 2^-14: |x| to a multiple of 2^-24 */
  unsigned int fb; memcpy(&fb, &f, 4);
  const unsigned int nrm = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
  const unsigned int small = ZYX_LT(a, 0x38800000u), big = ~ZYX_LT(a, 0x477ff000u), nan = ZYX_LT(0x7f800000u, a);
  const unsigned int r = ZYX_BLEND(big, 0x7c00u | (nan & (0x200u | ((a >> 13) & 0x3ffu))),
                                   ZYX_BLEND(small, fb - 0x3f000000u, nrm));
  return (unsigned short)(r | s); }
static inline float zyx_rh(float x) {
  unsigned int u; memcpy(&u, &x, 4);
  const unsigned int a = u & 0x7fffffffu, s = u & 0x80000000u;
  float f; memcpy(&f, &a, 4); f += 0.5f;
  unsigned int fb; memcpy(&fb, &f, 4);
  const float sf = (float)(int)(fb - 0x3f000000u) * 5.9604644775390625e-8f;
  unsigned int sb; memcpy(&sb, &sf, 4);
  const unsigned int nrm = (a + 0xfffu + ((a >> 13) & 1u)) & 0xffffe000u;
  const unsigned int small = ZYX_LT(a, 0x38800000u), big = ~ZYX_LT(a, 0x477ff000u), nan = ZYX_LT(0x7f800000u, a);
  const unsigned int r = ZYX_BLEND(big, 0x7f800000u | (nan & ((a & 0x7fe000u) | 0x400000u)),
                                   ZYX_BLEND(small, sb, nrm)) | s;
  float y; memcpy(&y, &r, 4); return y; }
static inline float zyx_bf2f(unsigned short h) { unsigned int u = ((unsigned int)h) << 16; float f; memcpy(&f, &u, 4); return f; }
static inline unsigned short zyx_f2bf(float x) {
  unsigned int u; memcpy(&u, &x, 4);
  const unsigned int nan = ZYX_LT(0x7f800000u, u & 0x7fffffffu);
  return (unsigned short)(ZYX_BLEND(nan, (u >> 16) | 64u, (u + 0x7fffu + ((u >> 16) & 1u)) >> 16)); }
static inline float zyx_rbf(float x) {
  unsigned int u; memcpy(&u, &x, 4);
  const unsigned int nan = ZYX_LT(0x7f800000u, u & 0x7fffffffu);
  const unsigned int r = ZYX_BLEND(nan, (u & 0xffff0000u) | 0x400000u, (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
  float y; memcpy(&y, &r, 4); return y; }
/* expf without glibc libmvec's slow path: a vector with a lane below about -87 (a
   masked softmax's -inf) goes through scalar calls, 5-7x slower. Arguments below -80
   are shifted into range and scaled back (exp(x) = exp(x + 64) e^-64), below -150 the
   result is 0 anyway; NaN stays NaN. The shift and scale are chosen with integer bit
   masks: written as float selects, gcc computed both exps or did not vectorize. */
static inline float zyx_expf(float x) {
  const unsigned int low = (unsigned int)-(int)(x < -80.0f);
  const unsigned int sb = low & 0x42800000u;                       /* 64.0f or 0 */
  const unsigned int cb = (low & 0x114b4ea4u) | (~low & 0x3f800000u);   /* e^-64 or 1 */
  float shift, scale;
  memcpy(&shift, &sb, 4); memcpy(&scale, &cb, 4);
  return expf((x < -150.0f ? -150.0f : x) + shift) * scale; }
/* float exp inlined where the kernel runs (INLINE_EXP): x = n ln2 + r with |r| <= ln2/2,
   e^r by a degree-7 polynomial (Cephes' expf coefficients), 2^n applied as two
   power-of-two factors so that results down to the denormals round once and results past
   FLT_MAX become inf. Under 1 ulp from the exact exp for every float (checked over a
   stride through all of them), exp(-inf) = 0, exp(inf) = inf, NaN stays NaN; every
   operation vectorizes, so no lane ever takes a scalar path. */
static inline float zyx_exp_inline(float x) {
  const float c = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);
  const float n = __builtin_rintf(c * 1.44269504088896341f);
  float r = c - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int e = (int)n, e1 = e >> 1, e2 = e - e1;
  const int b1 = (e1 + 127) << 23, b2 = (e2 + 127) << 23;
  float s1, s2;
  memcpy(&s1, &b1, 4); memcpy(&s2, &b2, 4);
  const float out = p * s1 * s2;
  return x != x ? x : out; }
static inline long long zyx_ipow(long long b, long long e) {
  if (e < 0) return b == 1 ? 1 : (b == -1 ? ((e & 1) ? -1 : 1) : 0);
  unsigned long long r = 1, ub = (unsigned long long)b;
  while (e) { if (e & 1) r *= ub; ub *= ub; e >>= 1; } return (long long)r; }
"""


EXP_LOW = -80.0     # a constant at or below this reaching an exp: zyx_expf (_PRELUDE)
INLINE_EXP = True   # float exps through zyx_exp_inline (_PRELUDE) instead of expf


class CBackendDialect(CDialect):
    """C99 for this backend's prelude. A float exp calls `zyx_exp_inline` (INLINE_EXP): a
    polynomial gcc vectorizes in the kernel's loop, under 1 ulp like libmvec's expf, which
    is a call per vector (benches/flag_ab.py, softmax 4096x1024: 1.40 -> 1.27 ms; a causal
    softmax 32x4x64x64 0.60 -> 0.31 ms). Without it,
    an exp whose argument is computed from a constant at or below EXP_LOW (a masked
    softmax's -inf) calls `zyx_expf`, which keeps such lanes off libmvec's scalar slow
    path (3-4x faster exp, 1.5 -> 1.0 ms for a causal softmax of 32x4x64x64); other exps
    stay `expf` (zyx_expf costs 30% on them)."""

    def unary_fn(self, ops, op, name, d):
        if name == "exp" and d is not dt.float64:
            if INLINE_EXP:
                return "zyx_exp_inline"
            if _reaches_low_constant(ops, op[3]):
                return "zyx_expf"
        return self.math_fn(name, d)


def _reaches_low_constant(ops, root):
    """True when the value `root` of `ops` is computed (through ALU ops) from a float
    constant at or below EXP_LOW."""
    seen, stack = set(), [root]
    while stack:
        j = stack.pop()
        if j in seen or j < 0:
            continue
        seen.add(j)
        o = ops[j]
        if o[0] == K.CONST:
            if o[1].is_float and o[2] <= EXP_LOW:
                return True
        else:
            stack.extend(alu_operands(o))
    return False


def simd_decls():
    """`omp declare simd` declarations of the math functions glibc's libmvec has vector
    variants of: put before <math.h>, gcc may call those without -ffast-math (which would
    break isnan/isinf semantics). The C toolchain's probe links them to see if it can."""
    out = []
    for f in _SIMD_FUNCS:
        args = "float, float" if f == "pow" else "float"
        dargs = "double, double" if f == "pow" else "double"
        out.append(f"#pragma omp declare simd notinbranch\nfloat {f}f({args});")
        out.append(f"#pragma omp declare simd notinbranch\ndouble {f}({dargs});")
    return "\n".join(out) + "\n"

@dataclass(frozen=True)
class CTarget:
    """What the C written for a kernel or a plan depends on besides the kernel: what the
    compiler accepts and the CPU it runs on (the C backend makes one per compile from
    its toolchain's probe and its DeviceInfo)."""
    openmp: bool = False      # the compiler takes -fopenmp: pragmas, parallel loops
    mvec: bool = False        # glibc's vector math links: its declarations in the prelude
    vector_bytes: int = 16    # vector register width (DeviceInfo.preferred_vector_size)
    team: int = 1             # threads a parallel loop is split over (column blocks, units)
    num_threads: int = 0      # written into every parallel region (0: the runtime's choice)

    @property
    def team_clause(self):
        """` num_threads(n)` for every parallel pragma: an OpenMP runtime another library
        (torch's libgomp) loaded first has read OMP_NUM_THREADS already."""
        return f" num_threads({self.num_threads})" if self.openmp and self.num_threads else ""


def prelude(target):
    """What every translation unit starts with: libmvec's vector declarations (before
    <math.h>), the helpers kernels call, OpenMP's NaN-keeping reductions."""
    return (("" if not target.mvec else simd_decls()) + _PRELUDE + padtaps.HELPERS +
            ("int omp_get_num_threads(void);\n" + _NAN_REDUCTIONS if target.openmp else ""))


_DIALECT = CBackendDialect()     # (no state: one serves every kernel)


def render_kernel(kernel, name, target, orphan=False, par_if=False):
    """(source, kind) of `kernel` as a function `void name(void** args)`. With `orphan`,
    parallel index loops use `omp for` so the function must be called by every thread of
    an enclosing parallel region (kind "for"); kind "serial" kernels run on one thread and
    kind "region" ones (a parallel reduction into a scalar, whose accumulator must be
    shared) open their own region, which with `par_if` runs in parallel only when the
    plan's `zyx_par` says so."""
    pieces = rangesplit.split_ranges(kernel) if rangesplit.ENABLED else None
    if pieces:
        out = _render_pieces(kernel, pieces, name, target, orphan)
        if out is not None:
            return out
    kernel, bounds = _rewrite(kernel)
    ops = kernel.ops
    has_loops = any(op[0] == K.LOOP for op in ops)
    pragmas = _LoopPragmas(target, ops, par_if)
    frame = padtaps.BoundsFrame(bounds, pragmas, ops) if bounds else None
    r, _ = render_body(kernel, _DIALECT, pragmas, frame)
    kinds = pragmas.kinds
    idx = r.indices
    work = pragmas.idx_work
    for op in ops:
        if op[0] == K.LOOP:
            work *= op[2]
    par = target.openmp and work >= PARALLEL_MIN_WORK and idx
    if par:
        kinds.add("for")
    if orphan and "region" in kinds:
        return render_kernel(kernel, name, target, False, par_if)
    pfor = "#pragma omp for" if orphan else f"#pragma omp parallel for{target.team_clause}"
    if (orphan and par and has_loops and "assoc" in kinds and len(idx) == 2
            and idx[1][2] > idx[0][2] and idx[1][2] >= 4 * target.team):
        head = _column_block_loops(idx, pfor)
    else:
        # a kernel whose reduce loop runs in parallel ("region") has only size-1 index
        # loops: a parallel pragma there would nest the reduce's region
        head = _index_loops(idx, pfor, par, has_loops,
                            target.openmp and "region" not in kinds)
    body = ["  " + ln for ln in r.lines] if idx else r.lines
    kind = "region" if "region" in kinds else ("for" if "for" in kinds else "serial")
    return (_function_head(name, kinds, sorted(r.params)) + "\n".join(head) + "\n" +
            "\n".join(body) + "\n" + "}" * len(idx) + "\n}\n"), kind


def _function_head(name, kinds, params):
    """A kernel function's opening: `void name(void** args) {` (reassociating float sums,
    ZYX_ASSOC_FN, where `kinds` has "assoc") and a typed pointer per argument of `params`,
    (argno, dtype, read-only) in argument order."""
    lines = []
    for argno, d, ro in params:
        const = "const " if ro else ""
        lines.append(f"  {const}{_DIALECT.storage_type(d)}* restrict g{argno} = "
                     f"({const}{_DIALECT.storage_type(d)}*)args[{argno}];")
    attr = "ZYX_ASSOC_FN " if "assoc" in kinds else ""
    return f"\n{attr}void {name}(void** restrict args) {{\n" + "\n".join(lines) + "\n"


def _render_pieces(kernel, pieces, name, target, orphan):
    """(source, kind) of `kernel` written as its range-split `pieces` (rangesplit.py), one
    loop nest after the other in one function; None when a piece would open a parallel
    region of its own (then the kernel is written whole). Whether the loops run over
    threads is the whole kernel's decision (its work against PARALLEL_MIN_WORK): every
    piece is then its own `omp for` over all its index loops, with `nowait` but the last
    (the pieces write different elements, and a static schedule gives each thread a
    share of each piece), and written whole (not orphaned) they share one region."""
    work, idx_work = 1, 1
    for op in kernel.ops:
        if op[0] == K.LOOP:
            work *= op[2]
        elif op[0] == K.INDEX:
            idx_work *= op[3]
    par = target.openmp and idx_work * work >= PARALLEL_MIN_WORK
    assoc = _sums_products_only(kernel.ops)
    kinds, params, nests = set(), {}, []
    for n, piece in enumerate(pieces):
        piece, bounds = _rewrite(piece)
        ops = piece.ops
        pragmas = _LoopPragmas(target, ops, False)
        pragmas.idx_work = idx_work    # (the kernel's: no piece's reduce loop opens a region)
        # float sums reassociate (ZYX_ASSOC_FN, on the whole function) only where the whole
        # kernel allows it: a piece of mere sums must not bring it to a piece with an exp
        pragmas.assoc = assoc
        frame = padtaps.BoundsFrame(bounds, pragmas, ops) if bounds else None
        r, _ = render_body(piece, _DIALECT, pragmas, frame)
        kinds |= pragmas.kinds
        for argno, d, ro in r.params:
            params[argno] = (d, ro)
        tail = " nowait" if par and n < len(pieces) - 1 else ""
        head = _index_loops(r.indices, "#pragma omp for", par,
                            any(op[0] == K.LOOP for op in ops), target.openmp, tail)
        nests.append("\n".join(head) + "\n" + "\n".join("  " + ln for ln in r.lines) +
                     "\n  " + "}" * len(r.indices))
    if "region" in kinds:
        return None
    body = "\n".join(nests)
    if par and not orphan:
        body = f"  #pragma omp parallel{target.team_clause}\n  {{\n{body}\n  }}"
    head = _function_head(name, kinds, [(a, *params[a]) for a in sorted(params)])
    return head + body + "\n}\n", ("for" if par else "serial")


def _rewrite(kernel):
    """(kernel, narrowed loop bounds) after the C-only IR rewrites, in their order."""
    if STASH_ROWS:
        kernel = stash_row_values(kernel)
    if HOIST_INVARIANTS:   # (after the stash, which compares the loops as written)
        kernel = hoist_invariants(kernel)
    if FLAG_NAN:
        kernel = flag_nan_reductions(kernel)
    bounds = {}
    if padtaps.ENABLED:
        kernel, bounds = padtaps.narrow_padding_taps(kernel)
    return kernel, bounds


def _column_block_loops(idx, pfor):
    """The index loops of a register-tiled product whose column operand is the bigger one
    (x @ W.T with more weight rows than batch rows): each thread takes a contiguous block
    of columns, so it reads its part of W and all of x instead of all of W and part of x,
    and the part of W it reads is the part the same thread wrote in the previous step's
    elementwise update (same static split of W's rows), still in its own core's cache
    (MLP x @ W1.T inside the step: 78 -> 65 us)."""
    (s0, _, n0), (s1, _, n1) = idx
    return ["  const long long zyx_nt = omp_get_num_threads();", "  " + pfor,
            "  for (long long c = 0; c < zyx_nt; c++)",
            f"  for (long long i{s0} = 0; i{s0} < {n0}LL; i{s0}++) {{",
            f"  for (long long i{s1} = {n1}LL * c / zyx_nt; "
            f"i{s1} < {n1}LL * (c + 1) / zyx_nt; i{s1}++) {{"]


def _index_loops(idx, pfor, par, has_loops, omp, tail=""):
    """The index loops opening the kernel, each after its pragma: the outer ones split
    over threads when `par` (collapsed), the innermost `omp simd` in an elementwise
    kernel. `omp`: pragmas at all; `tail`: clauses ending the pragma that splits the
    loops over threads (a range-split piece's `nowait`)."""
    head = []
    # an elementwise kernel whose innermost index loop is a few elements long (an axis
    # split at a pooling window: 2) vectorizes the last two loops as one
    short_last = (SIMD_COLLAPSE and not has_loops and len(idx) >= 3
                  and idx[-1][2] <= SHORT_SIMD)
    for n, (ssa, axis, length) in enumerate(idx):
        pragma = ""
        if omp:
            last = n == len(idx) - 1
            if has_loops:
                if n == 0 and par:
                    pragma = f"{pfor} collapse({len(idx)})" if len(idx) > 1 else pfor
            elif len(idx) == 1:
                pragma = f"{pfor} simd" if par else "#pragma omp simd"
            elif n == 0 and par:
                outer = len(idx) - (2 if short_last else 1)
                pragma = f"{pfor} collapse({outer})" if outer > 1 else pfor
            elif short_last and n == len(idx) - 2:
                pragma = "#pragma omp simd collapse(2)"
            elif last and not short_last:
                pragma = "#pragma omp simd"
        if pragma:
            head.append("  " + pragma + (tail if pragma.startswith(pfor) else ""))
        head.append(f"  for (long long i{ssa} = 0; i{ssa} < {length}LL; i{ssa}++) {{")
    return head


class _LoopPragmas:
    """render_body's `loop_pragma` hook for one kernel: the pragma before each reduce
    loop. `kinds` collects what the kernel became: "region" (a loop running in parallel
    opens its own region), "assoc" (float sums reassociated)."""

    def __init__(self, target, ops, par_if):
        self.target = target
        self.par_if = par_if
        self.assoc = True        # float sums may reassociate where the kernel's ops allow
        self.kinds = set()
        self.idx_work = 1
        for op in ops:
            if op[0] == K.INDEX:
                self.idx_work *= op[3]

    def __call__(self, i, ops):
        scan = _LoopScan(ops, i)
        red = " ".join(f"reduction({r}:{','.join(a)})" for r, a in scan.accs.items())
        parallel = (self.target.openmp and self.idx_work == 1 and _is_top(ops, i)
                    and _loop_work(ops, i) >= PARALLEL_MIN_WORK
                    and not any(r.startswith("zyx_nan") for r in scan.arrays))
        if not parallel and _unrolls_rows(ops, i, scan, self.target.vector_bytes):
            return f"#pragma GCC unroll {ops[i][2]}"
        if not self.target.openmp:
            return ""
        if parallel:
            return self._parallel(scan, red)
        return self._serial(ops, i, scan, red)

    def _parallel(self, scan, red):
        # threads split the loop, each with private copies of the accumulators defined
        # before it (per-lane arrays too), combined at its end
        red = " ".join([red] + [f"reduction({r}:{','.join(a)})"
                                for r, a in scan.arrays.items()]).strip()
        self.kinds.add("region")
        cond = " if(parallel: zyx_par)" if self.par_if else ""
        return (f"#pragma omp parallel for{'' if scan.inner else ' simd'}{cond}"
                f"{self.target.team_clause} {red}").rstrip()

    def _serial(self, ops, i, scan, red):
        if scan.inner:
            return ""
        if list(scan.accs) == ["+"] and self.assoc and _sums_products_only(ops) and all(
                ops[o[2]][1].is_float for o in ops[i + 1:scan.end] if o[0] == K.STORE
                and ops[o[2]][2] == K.SCOPE_REGISTER):
            # Float sums into scalar accumulators (a matmul's 4x4 tile): gcc turns
            # `omp simd reduction` into a serial lane-by-lane epilogue per accumulator
            # that costs as much as the loop; allowing reassociation in this kernel
            # vectorizes the same loop with a tree epilogue (matmul 148 -> 124 us).
            self.kinds.add("assoc")
            return ("", "ZYX_REASSOC")
        if scan.accs:
            return f"#pragma omp simd {red}"
        if scan.lanes:
            return "#pragma omp simd"
        if scan.stores and not scan.tile:
            # a row kernel's store loop: element j of the row from the row's registers
            # and loads, stored at a distinct address per iteration (a vector of exp)
            return "#pragma omp simd"
        return ""


class _LoopScan:
    """What the body of the loop opened at op `i` holds, read in one pass up to its
    ENDLOOP (`end`)."""

    def __init__(self, ops, i):
        depth = 0
        j = i + 1
        self.inner = False       # a loop inside this one
        self.lanes = False       # adds into per-lane accumulator arrays
        self.accs = {}           # reduction op -> scalar accumulators: OpenMP reductions
        self.arrays = {}         # per-lane accumulators: OpenMP array-section reductions
        self.stores = False      # stores to memory (a row kernel's loop writing the row)
        self.tile = False        # reads per-lane accumulators (a lane tile's epilogue)
        self.nested = 0          # loops inside this one
        self.lane_len = 0        # the (last) loop inside: its length
        self.lane_item = 0       # ... and its lanes' bytes
        self.tile_len = 0        # longest per-lane accumulator array (rows x lanes of a tile)
        while True:
            o = ops[j]
            if o[0] == K.STORE and ops[o[2]][2] == K.SCOPE_GLOBAL:
                self.stores = True
            elif (o[0] == K.LOAD and ops[o[2]][2] == K.SCOPE_REGISTER and o[3] != -1
                  and ops[o[2]][6] >= 0):
                self.tile = True
            if o[0] == K.LOOP:
                self.inner = True
                self.nested += 1
                depth += 1
                self.lane_len = o[2]
            elif o[0] == K.ENDLOOP:
                if depth == 0:
                    break
                depth -= 1
            elif (o[0] == K.STORE and ops[o[2]][2] == K.SCOPE_REGISTER and o[2] < i
                  and ops[o[2]][6] >= 0):
                # (a scratch row buffer, reduce op -1, is no accumulator: rowstash.py)
                # (an accumulator defined inside the loop, a reduce block's, is private
                # to each iteration already)
                self._accumulator(ops[o[2]], f"acc{o[2]}")
            j += 1
        self.end = j

    def _accumulator(self, d, name):
        op_name = _OMP_RED[d[6]]
        if d[1].is_float and d[6] in (K.R_MAX, K.R_MIN):
            op_name = "zyx_nan" + op_name   # NaN-propagating combiner
        # (NAN_MAX / NAN_MIN: NaN kept by a flag beside it, nanflag.py)
        if d[5] == 1:   # scalar accumulator: an OpenMP reduction
            self.accs.setdefault(op_name, []).append(name)
        else:           # one accumulator per lane: plain SIMD loop
            self.lanes = True
            self.lane_item = max(self.lane_item, d[1].itemsize)
            self.tile_len = max(self.tile_len, d[5])
            self.arrays.setdefault(op_name, {})[f"{name}[:{d[5]}]"] = None


def _unrolls_rows(ops, i, scan, vector_bytes):
    """True for the rows loop of a lane tile around its one-vector loop, inside a short
    reduce loop: gcc leaves such a rows loop rolled, and every multiply-add then loads and
    stores its accumulator (a transformer's weight gradient over (T, B) in nested loops of
    32: 1.2 -> 0.7 ms unrolled, the tile in vector registers). Inside a long loop gcc
    unrolls it itself, with one address register where the pragma gives one per row (a
    4096-long weight gradient: 2.4 vs 2.7 ms); rows of two vectors it keeps in registers
    itself (forced, a conv's channel tile ran 25% slower). tile_len: the loop is a tile's
    rows, each with accumulators of its own, not a reduce loop around one set of per-lane
    partial sums (unrolled, those only compiled slower)."""
    return bool(UNROLL_ROWS and scan.nested == 1 and scan.lanes
                and ops[i][2] <= UNROLL_ROWS and scan.lane_len * scan.lane_item <= vector_bytes
                and scan.tile_len >= ops[i][2] * scan.lane_len
                and _enclosing_loop_length(ops, i) <= UNROLL_INSIDE)


_OMP_RED = {K.R_SUM: "+", K.R_MAX: "max", K.R_MIN: "min", K.R_PROD: "*",
            NAN_MAX: "max", NAN_MIN: "min"}
# OpenMP's built-in max/min combiners drop NaN lanes; these keep NaN like numpy/torch do
# (gcc still vectorizes loops using them).
_NAN_REDUCTIONS = "".join(
    f"#pragma omp declare reduction(zyx_nan{op} : {t} : omp_out = (omp_in {cmp} omp_out || "
    f"omp_in != omp_in) ? omp_in : omp_out) initializer(omp_priv = {init})\n"
    for t in ("float", "double")
    for op, cmp, init in (("max", ">", "-INFINITY"), ("min", "<", "INFINITY")))


def _enclosing_loop_length(ops, i):
    """Trip count of the LOOP directly around op i (0 when none is)."""
    depth = 0
    for j in range(i - 1, -1, -1):
        c = ops[j][0]
        if c == K.ENDLOOP:
            depth += 1
        elif c == K.LOOP:
            if depth == 0:
                return ops[j][2]
            depth -= 1
    return 0


def _sums_products_only(ops):
    """True when the kernel's float arithmetic is only + - * (a plain matmul, maybe with a
    bias): reassociating it reorders sums and nothing else. Kernels with exp, division or
    selects keep strict evaluation (an LSTM's fused gates gave NaN gradients with gcc's
    associative-math)."""
    for op in ops:
        c = op[0]
        if c in (K.CONST, K.DEFINE, K.INDEX, K.LOOP, K.ENDLOOP, K.LOAD, K.STORE, K.IF_OP,
                 K.END_IF, K.BARRIER) or not op[1].is_float:
            continue
        if c == K.MAD or (c == K.BINARY and op[2] in (K.B_ADD, K.B_SUB, K.B_MUL)):
            continue
        if c == K.CAST and ops[op[2]][1].is_float:
            continue   # float to float (a reduce block's sum into its float64 total and
                       # back): reassociation moves no operation across a conversion
        return False
    return True


def _is_top(ops, i):
    depth = 0
    for o in ops[:i]:
        if o[0] == K.LOOP:
            depth += 1
        elif o[0] == K.ENDLOOP:
            depth -= 1
    return depth == 0


def _loop_work(ops, i):
    """Innermost iterations run by the loop opened at op `i`: its length times the work
    of its body, where loops one after the other add (a reduce block's loop and the loop
    folding the block into the totals) and nested ones multiply."""
    stack = [[ops[i][2], 0]]   # per open loop: its length, work of the loops in its body
    for o in ops[i + 1:]:
        if o[0] == K.LOOP:
            stack.append([o[2], 0])
        elif o[0] == K.ENDLOOP:
            n, body = stack.pop()
            if not stack:
                return n * max(body, 1)
            stack[-1][1] += n * max(body, 1)
    return stack[0][0]
