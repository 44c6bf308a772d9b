"""C source of a whole plan for the C backend: `zyx_plan(void** table, int par)` calling
every kernel of one realization in order, their parallel loops sharing OpenMP regions,
split into several translation units when the source is big (compiled side by side).

The kernels come from `render.render_kernel` (orphaned: their parallel loops are `omp
for` inside the plan's region); what the compiler and CPU allow comes in a
`render.CTarget`. Nothing here runs a compiler.
"""
from __future__ import annotations

from .render import prelude, render_kernel

DIRECT_CALLS = 256   # plans with more kernel calls run them from a table (plan_source)
# A plan's kernel functions: static in a one-unit plan, hidden (library-internal) when
# the plan is compiled as several units; never inlined into the plan function.
_PLAN_FN = "static __attribute__((noinline)) void "
_PART_FN = '__attribute__((noinline, visibility("hidden"))) void '
PART_MIN_CHARS = 150_000   # a plan source below this compiles as one unit
PART_MAX = 4               # most units (and compilers run at once) per plan


def plan_source(items, target):
    """(source, parallel) of one function running a whole plan: `items` are (kernel, arg
    locations) in order, a location being ("t", i) = pointer table entry i or ("a", off)
    = arena + off (table entry 0 is the arena). Consecutive kernels share one OpenMP
    parallel region: the thread team starts once per realization, kernels are separated
    by the barrier that ends each `omp for` / `omp single`, and Python makes one call
    instead of one per kernel. `source` is a string, or a list of translation units for a
    big plan; `parallel`: some kernel would use the thread team."""
    bodies, funcs = {}, []
    for k, _ in items:
        if k not in bodies:
            name = f"zyx_b{len(bodies)}"
            src, kind = render_kernel(k, name, target, True, True)
            bodies[k] = (name, kind)
            funcs.append(src)
    calls = [bodies[k][1] for k, _ in items]
    direct = len(items) <= DIRECT_CALLS
    # Past DIRECT_CALLS calls, the calls are data, not code: one row of `zyx_calls` per
    # kernel call (function, first argument), argument locations in `zyx_locs`, and the
    # program below runs ranges of rows. A statement per call with its own argument
    # array made gcc's alias analysis quadratic in the number of calls (4000 calls: 3 s
    # of 3.1); below that, direct calls with constant arguments are a little cheaper
    # to run (a training step's plan has tens of calls).
    table = "" if direct else _call_table(items, bodies)

    def run(i, j):
        if not direct:
            return f"zyx_run(s, arena, {i}, {j});"
        stmts = []
        for k, locs in items[i:j]:
            args = ", ".join(f"s[{v}]" if where == "t" else f"(void*)(arena + {v}LL)"
                             for where, v in locs)
            stmts.append(f"{{ void* a[] = {{{args}}}; {bodies[k][0]}(a); }}")
        return stmts[0] if len(stmts) == 1 else "{ " + " ".join(stmts) + " }"
    # `par` = 0 runs every kernel on the calling thread: for small plans, waking the
    # thread team and the barriers between kernels can cost more than they save (the
    # scheduler measures both and keeps the faster, see scheduler.ThreadChoice)
    plan = (table + "\nvoid zyx_plan(void** restrict s, int par) {\n"
            "  char* arena = (char*)s[0];\n  (void)arena;\n  zyx_par = par;\n" +
            "\n".join(_plan_lines(calls, run, target)) + "\n}\n")
    parallel = target.openmp and any(kind != "serial" for kind in calls)
    parts = _plan_parts(funcs, target.team)
    if len(parts) == 1:
        return (prelude(target) + "static int zyx_par = 1;\n" +
                "".join(f.replace("void ", _PLAN_FN, 1) for f in funcs) + plan), parallel
    # a big plan in several translation units, compiled side by side (gcc runs on one
    # core): the first holds the plan function, the kernels are shared between them
    # (hidden: nothing outside the library sees them)
    decls = "".join(f"void zyx_b{i}(void** restrict args);\n" for i in range(len(funcs)))
    return [prelude(target) + ("int zyx_par = 1;\n" if n == 0 else "extern int zyx_par;\n") +
            decls + "".join(f.replace("void ", _PART_FN, 1) for f in part) +
            (plan if n == 0 else "")
            for n, part in enumerate(parts)], parallel


def _plan_lines(calls, run, target):
    """The body of `zyx_plan`: the calls (`run(i, j)` writes calls i..j-1) of kernels of
    kind `calls[i]` grouped into parallel regions: "for" kernels called by every thread,
    runs of "serial" ones by one (`omp single`), "region" ones alone between regions."""
    lines = []
    i = 0
    if calls and not target.openmp:
        lines.append("  " + run(0, len(calls)))
        i = len(calls)
    while i < len(calls):
        if calls[i] == "region":
            lines.append("  " + run(i, i + 1))
            i += 1
            continue
        j = i
        while j < len(calls) and calls[j] != "region":
            j += 1
        if "for" in calls[i:j]:
            lines.append(f"  #pragma omp parallel if(par){target.team_clause}\n  {{")
            n = i
            while n < j:
                m = n
                kind = calls[n]
                while m < j and calls[m] == kind:
                    m += 1
                if kind == "for":       # every thread calls them, in order
                    lines.append("    " + run(n, m))
                else:   # a run of small kernels: one thread does them all, one barrier after
                    lines.append("    #pragma omp single\n    " + run(n, m))
                n = m
            lines.append("  }")
        else:   # nothing parallel: do not wake the thread team
            lines.append("  " + run(i, j))
        i = j
    return lines


def _call_table(items, bodies):
    """`zyx_calls` (function, first argument of each call), `zyx_locs` (argument
    locations) and `zyx_run`, which runs a range of calls from them."""
    fn_rows, loc_rows, nargs = [], [], 1
    for k, locs in items:
        fn_rows.append(f"{{{bodies[k][0]}, {len(loc_rows)}}}")
        loc_rows.extend(str(v) if where == "t" else str(-1 - v) for where, v in locs)
        nargs = max(nargs, len(locs))
    fn_rows.append(f"{{0, {len(loc_rows)}}}")
    return ("\nstatic const struct { void (*fn)(void**); int first; } zyx_calls[] = {\n  " +
            ",\n  ".join(fn_rows) + "};\n"
            "static const long long zyx_locs[] = {" + (", ".join(loc_rows) or "0") + "};\n"
            # a location >= 0 is pointer table entry s[v], below 0 arena offset -1 - v
            "static void zyx_run(void** restrict s, char* arena, int from, int to) {\n"
            f"  void* a[{nargs}];\n"
            "  for (int c = from; c < to; c++) {\n"
            "    for (int k = zyx_calls[c].first; k < zyx_calls[c + 1].first; k++) {\n"
            "      const long long v = zyx_locs[k];\n"
            "      a[k - zyx_calls[c].first] = v >= 0 ? s[v] : (void*)(arena + (-1 - v));\n"
            "    }\n"
            "    zyx_calls[c].fn(a);\n"
            "  }\n}\n")


def _plan_parts(funcs, cores):
    """The plan's kernel functions in groups of about equal source size, one group per
    translation unit: one group for a small plan or one core; else as many as the cores
    (at most PART_MAX), each at least PART_MIN_CHARS / 2 of source."""
    total = sum(len(f) for f in funcs)
    n = min(cores, PART_MAX, len(funcs), max(total * 2 // PART_MIN_CHARS, 1))
    if total < PART_MIN_CHARS or n < 2:
        return [funcs]
    parts, sizes = [[] for _ in range(n)], [0] * n
    for f in funcs:             # in order, each part a run of consecutive kernels
        k = min(sum(sizes) * n // total, n - 1)
        parts[k].append(f)
        sizes[k] += len(f)
    return [p for p in parts if p]
