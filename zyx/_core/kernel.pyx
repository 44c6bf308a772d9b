# cython: language_level=3
"""The kernel IR: a linear list of SSA ops, the one interface between the kernelizer,
the optimization passes and every backend's code generator.

Each op is a tuple `(opcode, dtype, *args)`; an SSA value is named by its position in
the list. Arguments that are SSA references are ints; op-specific fields (unary/binary op
codes, constants, lengths) are plain values. Scopes of `Define`: GLOBAL buffers (kernel
arguments), LOCAL (shared memory) and REGISTER (accumulators).

    CONST      dtype, value
    DEFINE     dtype, scope, argno (GLOBAL) or init value (REGISTER), read_only, length, reduce_op
    INDEX      idx,   axis, length           global thread/loop index over one output axis
    LOOP       idx,   length                 sequential loop; value is the loop variable
    ENDLOOP    None,  loop_ref
    LOAD       dtype, define_ref, index_ref, guard_ref   (index -1 for registers, guard -1 none)
    STORE      None,  define_ref, index_ref, value_ref
    CAST       dtype, x
    UNARY      dtype, uop, x
    BINARY     dtype, bop, a, b
    WHERE      dtype, cond, a, b
    MAD        dtype, a, b, c               a * b + c
    IF_OP         None,  cond_ref
    END_IF      None
    BARRIER    None,  scope
"""
from zyx import dtype as _dt

CONST, DEFINE, INDEX, LOOP, ENDLOOP, LOAD, STORE, CAST, UNARY, BINARY, WHERE, MAD, IF_OP, END_IF, \
    BARRIER = range(15)
IR_NAMES = ("Const", "Define", "Index", "Loop", "EndLoop", "Load", "Store", "Cast", "Unary",
            "Binary", "Where", "Mad", "If", "EndIf", "Barrier")
SCOPE_GLOBAL, SCOPE_LOCAL, SCOPE_REGISTER = range(3)
SCOPE_NAMES = ("Global", "Local", "Register")

# Unary ops (design.md set, plus Exp, Log, Tanh, Erf which every target has natively and
# which are more accurate and faster than their exp2/log2 compositions).
U_NEG, U_EXP2, U_LOG2, U_RECIP, U_SQRT, U_SIN, U_COS, U_FLOOR, U_TRUNC, U_ABS, U_BITNOT, \
    U_EXP, U_LOG, U_TANH, U_ERF = range(15)
UNARY_NAMES = ("Neg", "Exp2", "Log2", "Reciprocal", "Sqrt", "Sin", "Cos", "Floor", "Trunc",
               "Abs", "BitNot", "Exp", "Log", "Tanh", "Erf")

B_ADD, B_SUB, B_MUL, B_DIV, B_POW, B_MOD, B_CMPLT, B_CMPGT, B_MAX, B_OR, B_AND, B_BITXOR, \
    B_BITOR, B_BITAND, B_SHL, B_SHR, B_NOTEQ, B_EQ, B_MIN = range(19)
BINARY_NAMES = ("Add", "Sub", "Mul", "Div", "Pow", "Mod", "Cmplt", "Cmpgt", "Max", "Or", "And",
                "BitXor", "BitOr", "BitAnd", "BitShiftLeft", "BitShiftRight", "NotEq", "Eq",
                "Min")
COMPARISONS = frozenset((B_CMPLT, B_CMPGT, B_NOTEQ, B_EQ, B_OR, B_AND))

# Reduce ops (graph REDUCE arg and accumulator hints)
R_SUM, R_MAX, R_MIN, R_PROD = range(4)
REDUCE_NAMES = ("sum", "max", "min", "prod")
REDUCE_BINARY = (B_ADD, B_MAX, B_MIN, B_MUL)

IDX = _dt.int64   # dtype of index arithmetic


def reduce_identity(int rop, dt):
    if rop == R_SUM:
        return False if dt.is_bool else (0.0 if dt.is_float else 0)
    if rop == R_PROD:
        return True if dt.is_bool else (1.0 if dt.is_float else 1)
    if dt.is_bool:
        return rop == R_MIN
    if dt.is_float:
        return float("-inf") if rop == R_MAX else float("inf")
    bits = dt.itemsize * 8
    if dt.kind == "u":
        return 0 if rop == R_MAX else (1 << bits) - 1
    return -(1 << (bits - 1)) if rop == R_MAX else (1 << (bits - 1)) - 1


class Kernel:
    """A compiled unit of work: the op list plus the description of its buffer arguments.

    `args` lists (dtype, length, read_only) per kernel argument, in argument order.
    Kernels compare and hash by content, so equal kernels share one compiled program."""
    __slots__ = ("ops", "args", "name", "_key", "_hash")

    def __init__(self, list ops, list args, str name="k"):
        self.ops = ops
        self.args = args
        self.name = name
        self._key = None
        self._hash = None

    @property
    def key(self):
        if self._key is None:
            # float constants by their exact bits: 0.0 == -0.0 but they compile differently
            ops = tuple([(op[0], op[1], op[2].hex()) if op[0] == CONST and type(op[2]) is float
                         else op for op in self.ops])
            self._key = (ops, tuple([(d.code, n, ro) for d, n, ro in self.args]))
        return self._key

    def __hash__(self):
        if self._hash is None:
            self._hash = hash(self.key)
        return self._hash

    def __eq__(self, other):
        return isinstance(other, Kernel) and self.key == other.key

    def flops(self):
        """Arithmetic ops executed, counting loop trip counts (for perf reporting)."""
        cdef long long mult = 1, total = 0
        stack = []
        for op in self.ops:
            c = op[0]
            if c == INDEX or c == LOOP:
                stack.append(mult)
                mult *= op[-1]
            elif c == ENDLOOP:
                mult = stack.pop()
            elif c in (UNARY, BINARY, MAD, WHERE) and op[1] is not IDX:
                total += mult * (2 if c == MAD else 1)
        return total

    def __repr__(self):
        return format_kernel(self)


def format_op(int i, tuple op):
    c = op[0]
    name = IR_NAMES[c]
    dt = op[1].name if op[1] is not None else ""
    if c == UNARY:
        body = f"{UNARY_NAMES[op[2]]} %{op[3]}"
    elif c == BINARY:
        body = f"{BINARY_NAMES[op[2]]} %{op[3]}, %{op[4]}"
    elif c == DEFINE:
        body = f"{SCOPE_NAMES[op[2]]} {op[3]!r} ro={op[4]} len={op[5]}"
    elif c == CONST:
        body = repr(op[2])
    elif c in (INDEX, LOOP):
        body = " ".join(str(x) for x in op[2:])
    else:
        body = ", ".join(("%" + str(x)) if isinstance(x, int) and x >= 0 else str(x)
                         for x in op[2:])
    return f"%{i:<4} {name:<8} {dt:<8} {body}"


def format_kernel(k):
    lines = [f"kernel {k.name} args=" + ", ".join(
        f"{d.name}[{n}]{' ro' if ro else ''}" for d, n, ro in k.args)]
    depth = 0
    for i, op in enumerate(k.ops):
        if op[0] in (ENDLOOP, END_IF):
            depth -= 1
        lines.append("  " * (depth + 1) + format_op(i, op))
        if op[0] in (LOOP, IF_OP):
            depth += 1
    return "\n".join(lines)
