"""Reverse-mode autograd on the graph primitives.

Recording happens at the primitive level: while recording is on, `Tensor._make`
(zyx/_core/tensorbase.pyx) stores `(op, arg, srcs)` on every new Tensor whose inputs need
a gradient (`_ctx`).
A dozen backward rules, one per primitive (`_RULES` below), are enough for the whole
Tensor API, because every higher op (softmax, matmul, getitem, cat, gather ...) is built from
the primitives, and broadcasting is already explicit EXPAND nodes.

Backward rules build graph nodes like any Tensor op, so gradients are lazy tensors: realized
together with the forward pass they fuse into the same kernels, and when recording stays on
during the backward pass (`create_graph=True` or an enclosing Tape) the gradients are
themselves differentiable (any order).

Two ways in, one machinery:

    with zyx.Tape() as tape:                  # zyx / TensorFlow style
        loss = f(w)
    dw = tape.gradient(loss, w)               # lazy; zeros for unconnected sources

    w = zyx.Tensor(data, requires_grad=True)  # PyTorch style
    f(w).backward(); w.grad                   # realized, accumulated

What is recorded: inside an active Tape every floating-point op; outside, an op is recorded
when one of its inputs has `requires_grad` (recorded outputs get `requires_grad=True`, as in
torch). Nothing else costs more than one function call per op.

Memory: the recorded structure lives only on the output tensors, so it dies with them.
`backward()` and a non-persistent tape's `gradient()` free it after use (the walked tensors
forget their inputs and stop requiring grad, so `total = total + loss` after backward keeps
no history) unless `retain_graph=True`; a later backward through a freed tensor raises.

Semantics chosen where torch and TensorFlow differ or are silent:
- `tape.gradient` gives zeros for sources the target does not depend on (TF's
  `unconnected_gradients="zero"`; pass "none" for None) and an implicit gradient of ones
  for non-scalar targets (TF); `backward()` of a non-scalar tensor needs `gradient=` (torch).
- ties: max/min reductions split the gradient equally between equal extremes (torch's
  amax); elementwise maximum/minimum give each side half on ties (torch.maximum), so
  relu(x) = maximum(x, 0) passes 0.5 * g at exactly x == 0 (torch.relu passes 0).
- abs'(0) = 0, floor/trunc/round/sign have zero gradient, integer and bool tensors none.
"""
from __future__ import annotations

import functools
import math
import os
import threading
import weakref

from ._core import graph as G
from ._core import kernel as K
from ._core import replay as _replay
from ._core import tensorbase as _TB
from .dtype import bool_ as _BOOL
from .errors import ShapeError, ZyxError
from .runtime import RT
from .tensor import Tensor, const_tensor

__all__ = ["Tape", "no_grad", "enable_grad", "set_grad_enabled", "is_grad_enabled", "grad"]

_graph = RT.graph
_local = threading.local()   # per thread (grad mode is per thread): .tapes, see _tapes()
_retained = {}       # id(tensor) -> weakref, non-leaves that asked for .grad (retain_grad)


class _Freed:
    """The `_ctx` of a tensor whose recorded inputs were released by an earlier backward."""
    __slots__ = ()

    def __repr__(self):
        return "<freed graph>"


_FREED = _Freed()


# ---------------------------------------------------------------------------------------
# recording (per thread: the flag and the tape count live in C thread-locals, tensorbase.pyx)

def _tapes():
    """The calling thread's active Tape contexts, innermost last."""
    try:
        return _local.tapes
    except AttributeError:
        _local.tapes = tapes = []
        return tapes


def _push_tape(tape):
    _tapes().append(tape)
    _TB.tape_entered(1)


def _pop_tape(tape):
    _tapes().remove(tape)
    _TB.tape_entered(-1)


def _set_hook(on):
    """Switch recording of new nodes (zyx._core.tensorbase does it in Tensor._make);
    returns the previous state."""
    return _TB.set_recording(bool(on))


def is_grad_enabled() -> bool:
    """Whether ops are currently recorded for autograd in the calling thread."""
    return _TB.is_recording()


class set_grad_enabled:
    """Turn recording on or off in the calling thread; usable as a function or a context
    manager."""

    def __init__(self, mode: bool):
        self.prev = _set_hook(bool(mode))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _set_hook(self.prev)
        return False


class _GradMode:
    """Context manager / decorator that sets recording on or off for its body, in the
    calling thread only (`with no_grad():`, `@no_grad()` and `@no_grad` all work)."""
    mode = True

    def __new__(cls, fn=None):
        self = super().__new__(cls)
        return self(fn) if callable(fn) else self

    def __init__(self, fn=None):
        pass

    def __enter__(self):
        self.prev = _set_hook(self.mode)
        return self

    def __exit__(self, *exc):
        _set_hook(self.prev)
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with type(self)():
                return fn(*args, **kwargs)
        return wrapped


class no_grad(_GradMode):
    """Nothing written inside is recorded (inference, optimizer updates)."""
    mode = False


class enable_grad(_GradMode):
    """Recording on again inside a `no_grad` block."""
    mode = True


# ---------------------------------------------------------------------------------------
# backward rules: rule(out, g, arg, srcs, need) -> one gradient (or None) per src.
# `g` has out's shape and dtype; `need[i]` says whether src i wants a gradient, so rules
# skip work nobody asked for (e.g. the gradient of a constant exponent).
#
# Rules build nodes with `_make` directly: shapes and dtypes are known to fit, so the
# Tensor methods' argument checks, promotion and broadcasting would only cost time (the
# backward pass makes about as many nodes as the forward pass).

_get = _graph.get
_LN2 = math.log(2.0)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


def _c(like, value):
    """A constant with `like`'s shape and dtype (folded into kernels, no memory)."""
    n = _get(like._id)
    return Tensor._wrap(_graph.add(G.CONST, float(value), (), n.shape, n.dtype))


def _zero_like(t):
    n = _get(t._id)
    return const_tensor(0, n.dtype, n.shape)


def _un(x, uop):
    n = _get(x._id)
    return x._make(G.UNARY, uop, (x,), n.shape, n.dtype)


def _bin(a, b, bop):
    n = _get(a._id)
    return a._make(G.BINARY, bop, (a, b), n.shape, n.dtype)


def _cmp(a, b, bop):
    return a._make(G.BINARY, bop, (a, b), _get(a._id).shape, _BOOL)


def _where(c, a, b):
    n = _get(a._id)
    return c._make(G.WHERE, None, (c, a, b), n.shape, n.dtype)


def _cast(x, d):
    n = _get(x._id)
    return x if n.dtype is d else x._make(G.CAST, d, (x,), n.shape, d)


def _expand(x, shape):
    n = _get(x._id)
    return x if n.shape == shape else x._make(G.EXPAND, shape, (x,), shape, n.dtype)


def _sum_keep(x, axes):
    n = _get(x._id)
    shape = tuple(1 if i in axes else s for i, s in enumerate(n.shape))
    return x._make(G.REDUCE, (K.R_SUM, axes), (x,), shape, n.dtype)


def _mul(a, b):
    return _bin(a, b, K.B_MUL)


def _unary_rule(out, g, uop, srcs, need):
    x = srcs[0]
    if uop == K.U_NEG:
        return (_un(g, K.U_NEG),)
    if uop == K.U_EXP:
        return (_mul(g, out),)
    if uop == K.U_EXP2:
        return (_mul(_mul(g, out), _c(g, _LN2)),)
    if uop == K.U_LOG:
        return (_bin(g, x, K.B_DIV),)
    if uop == K.U_LOG2:
        return (_bin(g, _mul(x, _c(x, _LN2)), K.B_DIV),)
    if uop == K.U_RECIP:
        return (_un(_mul(_mul(g, out), out), K.U_NEG),)
    if uop == K.U_SQRT:
        return (_bin(g, _mul(out, _c(out, 2.0)), K.B_DIV),)
    if uop == K.U_SIN:
        return (_mul(g, _un(x, K.U_COS)),)
    if uop == K.U_COS:
        return (_un(_mul(g, _un(x, K.U_SIN)), K.U_NEG),)
    if uop == K.U_TANH:
        return (_mul(g, _bin(_c(out, 1.0), _mul(out, out), K.B_SUB)),)
    if uop == K.U_ERF:
        return (_mul(_mul(g, _un(_un(_mul(x, x), K.U_NEG), K.U_EXP)), _c(g, _TWO_OVER_SQRT_PI)),)
    if uop == K.U_ABS:     # sign(x) * g, 0 at x == 0 like torch
        z = _c(x, 0.0)
        return (_where(_cmp(x, z, K.B_CMPGT), g,
                       _where(_cmp(x, z, K.B_CMPLT), _un(g, K.U_NEG), _c(g, 0.0))),)
    if uop in (K.U_FLOOR, K.U_TRUNC):
        return (_zero_like(x),)        # piecewise constant
    return (None,)


def _binary_rule(out, g, bop, srcs, need):
    a, b = srcs
    if bop == K.B_ADD:
        return g, g
    if bop == K.B_SUB:
        return g, (_un(g, K.U_NEG) if need[1] else None)
    if bop == K.B_MUL:
        return (_mul(g, b) if need[0] else None), (_mul(g, a) if need[1] else None)
    if bop == K.B_DIV:
        ga = _bin(g, b, K.B_DIV) if need[0] else None
        gb = _un(_bin(_mul(g, a), _mul(b, b), K.B_DIV), K.U_NEG) if need[1] else None
        return ga, gb
    if bop == K.B_POW:
        ga = gb = None
        zero = _c(g, 0.0)
        if need[0]:   # torch: 0 where the exponent is 0, else g * b * a^(b-1)
            a_pow = _bin(a, _bin(b, _c(b, 1.0), K.B_SUB), K.B_POW)
            ga = _where(_cmp(b, zero, K.B_EQ), zero, _mul(_mul(g, b), a_pow))
        if need[1]:   # torch: 0 where a == 0 and b >= 0, else g * a^b * log(a)
            skip = _bin(_cmp(a, zero, K.B_EQ),
                        _un(_cmp(b, zero, K.B_CMPLT), K.U_BITNOT), K.B_AND)
            gb = _where(skip, zero, _mul(_mul(g, out), _un(a, K.U_LOG)))
        return ga, gb
    if bop in (K.B_MAX, K.B_MIN):
        # ties split the gradient in half between both sides (torch.maximum/minimum)
        eq = _cmp(a, b, K.B_EQ)
        half = _mul(g, _c(g, 0.5))
        zero = _c(g, 0.0)
        a_op, b_op = (K.B_CMPGT, K.B_CMPLT) if bop == K.B_MAX else (K.B_CMPLT, K.B_CMPGT)
        ga = _where(eq, half, _where(_cmp(a, b, a_op), g, zero)) if need[0] else None
        gb = _where(eq, half, _where(_cmp(a, b, b_op), g, zero)) if need[1] else None
        return ga, gb
    if bop == K.B_MOD:   # fmod: a - trunc(a/b) * b
        gb = None
        if need[1]:
            gb = _un(_mul(g, _un(_bin(a, b, K.B_DIV), K.U_TRUNC)), K.U_NEG)
        return g, gb
    return None, None    # comparisons and bit ops have no gradient


def _where_rule(out, g, arg, srcs, need):
    c = srcs[0]
    zero = _c(g, 0.0)
    return (None, _where(c, g, zero) if need[1] else None, _where(c, zero, g) if need[2] else None)


def _cast_rule(out, g, arg, srcs, need):
    d = _get(srcs[0]._id).dtype
    return (_cast(g, d) if d.is_float else None,)


def _reduce_rule(out, g, arg, srcs, need):
    rop, axes = arg
    x = srcs[0]
    shape = _get(x._id).shape
    if rop == K.R_SUM:
        return (_expand(g, shape),)
    zero = _c(x, 0.0)
    if rop in (K.R_MAX, K.R_MIN):
        # the gradient goes to the positions holding the extreme value, split on ties
        hit = _cmp(x, _expand(out, shape), K.B_EQ)
        count = _sum_keep(_cast(hit, _get(x._id).dtype), axes)
        return (_where(hit, _expand(_bin(g, count, K.B_DIV), shape), zero),)
    if rop == K.R_PROD:
        # d prod / d x_i = prod / x_i, except at zeros: the product of the other elements
        # when x_i is the only zero, else 0 (out / x is 0 at nonzero x_i when a zero exists)
        n = _get(x._id)
        is_zero = _cmp(x, zero, K.B_EQ)
        nz = _where(is_zero, _c(x, 1.0), x)
        kshape = tuple(1 if i in axes else s for i, s in enumerate(shape))
        nonzero_prod = _expand(x._make(G.REDUCE, (K.R_PROD, axes), (nz,), kshape, n.dtype), shape)
        n_zero = _expand(_sum_keep(_cast(is_zero, n.dtype), axes), shape)
        at_zero = _where(_cmp(n_zero, _c(x, 1.0), K.B_EQ), nonzero_prod, zero)
        return (_mul(_expand(g, shape),
                     _where(is_zero, at_zero, _bin(_expand(out, shape), x, K.B_DIV))),)
    raise ZyxError(f"no backward rule for reduce op {rop}")


def _reshape_rule(out, g, arg, srcs, need):
    n = _get(srcs[0]._id)
    return (g._make(G.RESHAPE, n.shape, (g,), n.shape, n.dtype),)


def _permute_rule(out, g, order, srcs, need):
    inv = [0] * len(order)
    for i, a in enumerate(order):
        inv[a] = i
    n = _get(srcs[0]._id)
    return (g._make(G.PERMUTE, tuple(inv), (g,), n.shape, n.dtype),)


def _expand_rule(out, g, arg, srcs, need):
    xs, os = _get(srcs[0]._id).shape, _get(out._id).shape
    axes = tuple(i for i, (a, b) in enumerate(zip(xs, os)) if a != b)
    if not axes:
        return (g,)
    parts = _product_parts(g, os, axes)
    if parts == 1:
        return (_sum_keep(g, axes),)
    # split-K: the leading axes flattened and cut into `parts` pieces, each piece's
    # product summed on its own, then the pieces summed
    n = _get(g._id)
    rest = os[len(axes):]
    cut = (parts, math.prod(os[:len(axes)]) // parts) + rest
    pieces = g._make(G.REDUCE, (K.R_SUM, (1,)), (g._make(G.RESHAPE, cut, (g,), cut, n.dtype),),
                     (parts, 1) + rest, n.dtype)
    total = g._make(G.REDUCE, (K.R_SUM, (0,)), (pieces,), (1, 1) + rest, n.dtype)
    return (total._make(G.RESHAPE, xs, (total,), xs, n.dtype),)


def _product_parts(g, shape, axes):
    """Pieces for the sum over `axes` of gradient g (of `shape`): more than 1 when g is a
    product summed over its leading axes (a linear layer's or a matmul's weight
    gradient: outputs rows x cols, a reduce over the batch) on a device whose gemm tiles
    would otherwise leave compute units idle (DeviceInfo.product_parts: split-K)."""
    lead = len(axes)
    if axes != tuple(range(lead)) or len(shape) - lead < 2:
        return 1
    n = _get(g._id)
    if n.op != G.BINARY or n.arg != K.B_MUL:
        return 1
    terms = math.prod(shape[:lead])
    return RT.device_of(g._id).info().split_k(math.prod(shape[lead:-1]), shape[-1], terms,
                                              terms)


def _pad_rule(out, g, arg, srcs, need):
    pads, _fill = arg     # padded positions hold a constant: no gradient flows there
    n = _get(srcs[0]._id)
    inv = tuple((-a, -b) for a, b in pads)
    return (g._make(G.PAD, (inv, 0.0), (g,), n.shape, n.dtype),)


def _flip_rule(out, g, axes, srcs, need):
    n = _get(g._id)
    return (g._make(G.FLIP, axes, (g,), n.shape, n.dtype),)


_RULES = [None] * len(G.OP_NAMES)
_RULES[G.CAST] = _cast_rule
_RULES[G.UNARY] = _unary_rule
_RULES[G.BINARY] = _binary_rule
_RULES[G.WHERE] = _where_rule
_RULES[G.REDUCE] = _reduce_rule
_RULES[G.RESHAPE] = _reshape_rule
_RULES[G.PERMUTE] = _permute_rule
_RULES[G.EXPAND] = _expand_rule
_RULES[G.PAD] = _pad_rule
_RULES[G.FLIP] = _flip_rule

# Composite ops: a tensor built from primitives while recording was off, recorded as one
# op whose backward is written by hand (record_composite). For a convolution the
# primitives' rules give an input gradient that materializes every window (8-D, 40M
# elements for the MNIST convnet's second conv); its hand-written backward is a
# transposed convolution, one windowed reduce like the forward.
COMPOSITE = len(G.OP_NAMES)
_COMPOSITES = {}     # name (arg[0]) -> rule(out, g, arg, srcs, need)


def register_composite(name, rule):
    """Make `rule(out, g, arg, srcs, need) -> gradients` the backward of composite `name`."""
    _COMPOSITES[name] = rule


def record_composite(out, arg, srcs):
    """Record `out`, built from `srcs` while recording was off, as the composite op
    `arg[0]` (arg: a hashable tuple of its parameters; backward templates key on it),
    when autograd would have recorded a primitive with these inputs (inside a Tape, or
    an input requires grad, and `out` is a float). Returns `out`."""
    if not _TB.is_recording() or not out.dtype.is_float:
        return out
    if _tapes() or any(s.requires_grad for s in srcs):
        out._ctx = (COMPOSITE, arg, tuple(srcs))
        out.requires_grad = True
    return out


def _composite_rule(out, g, arg, srcs, need):
    return _COMPOSITES[arg[0]](out, g, arg, srcs, need)


_RULES.append(_composite_rule)


# ---------------------------------------------------------------------------------------
# the backward pass

_walk = _TB.walk   # compiled: the walk touches every recorded tensor
_needs_of = _TB.needs_of


# Backward templates (zyx/_core/replay.pyx): "on" replays a structure seen before, "off"
# always runs the rules, "always" also replays right after tracing (tests use it to run
# every backward of the suite through a template).
_REPLAY_MODE = os.environ.get("ZYX_BACKWARD_REPLAY", "on").lower()
MAX_TEMPLATES = 1024
_templates = {}
# zyx/inplace.py puts its check here: recorded inputs written in place after the op that
# read them are replaced by their old versions, or the backward raises (torch's version
# counter). Empty until zyx.inplace is imported; returns True when it rewrote something.
# (Public so that zyx.inplace can set it; not part of the zyx API.)
inplace_repair = []


def _run_backward(targets, out_grads, is_source, record):
    """Gradients of sum(target * out_grad) for every tensor the walk marks as a source.
    Returns ({id: grad}, visited tensors)."""
    order, visited = _walk(targets, is_source)
    if inplace_repair and inplace_repair[0](visited):
        order, visited = _walk(targets, is_source)   # inputs rewritten to their old versions
    if record or _REPLAY_MODE == "off":
        return _apply_rules(targets, out_grads, order, _needs_of(visited), record), visited
    key, ins = _replay.backward_key(_graph, targets, out_grads, order, _FREED)
    tpl = _templates.get(key, False) if key is not None else None
    if tpl:
        RT.stats["backward_replays"] += 1
        return tpl.run(_graph, ins, order, Tensor._wrap), visited
    needs = _needs_of(visited)
    if tpl is None:           # freed, or traced before and not replayable
        return _apply_rules(targets, out_grads, order, needs, record), visited
    _graph.trace = trace = []
    try:
        result = _apply_rules(targets, out_grads, order, needs, record)
    finally:
        _graph.trace = None
    tpl = _replay.build_template(trace, ins, result, order)
    if len(_templates) >= MAX_TEMPLATES:     # bounded: drop the oldest
        del _templates[next(iter(_templates))]
    _templates[key] = tpl
    if tpl is not None and _REPLAY_MODE == "always":
        del result
        result = tpl.run(_graph, ins, order, Tensor._wrap)
    return result, visited


def _apply_rules(targets, out_grads, order, needs, record):
    """The backward pass proper: every recorded op's rule, in reverse walk order."""
    grads = {}
    for t, g in zip(targets, out_grads):
        k = id(t)
        grads[k] = g if k not in grads else grads[k] + g
    result = {}
    prev = _set_hook(record)
    if record:
        # record every backward op, also those on leaves nobody marked (e.g. x in x * g
        # when the forward ran under a Tape that has exited): the result must be
        # differentiable with respect to everything the forward pass depended on
        _push_tape(None)
    try:
        for t in reversed(order):
            k = id(t)
            g = grads.pop(k, None)
            if g is None:
                continue
            if needs[k] == 2:      # a source (walk's mark)
                result[k] = g
            ctx = t._ctx
            if ctx is None:
                continue
            if ctx is _FREED:
                if k in result:
                    continue
                raise ZyxError(
                    "backward through a graph that was already freed by an earlier "
                    "backward()/gradient(): pass retain_graph=True (or use Tape(persistent="
                    "True)) the first time, or detach() the shared tensor")
            op, arg, srcs = ctx
            need = [needs.get(id(s), False) for s in srcs]
            if not any(need):
                continue
            for s, n, gs in zip(srcs, need, _RULES[op](t, g, arg, srcs, need)):
                if n and gs is not None:
                    ks = id(s)
                    prev_g = grads.get(ks)
                    grads[ks] = gs if prev_g is None else _bin(prev_g, gs, K.B_ADD)
    finally:
        if record:
            _pop_tape(None)
        _set_hook(prev)
    return result


def _free(visited):
    """Forget recorded inputs, so forward intermediates can be freed."""
    for t in visited:
        if t._ctx is not None:
            t._ctx = _FREED
            t.requires_grad = False


def _as_list(x):
    if isinstance(x, Tensor):
        return [x], True
    return list(x), False


def _default_out_grads(targets, output_gradients, strict_scalar):
    if output_gradients is None:
        out = []
        for t in targets:
            if strict_scalar and t.numel() != 1:
                raise ShapeError(f"backward() of a tensor of shape {t.shape} needs a gradient "
                                 f"argument; only one-element tensors get an implicit one")
            out.append(const_tensor(1, t.dtype, t.shape))
        return out
    ogs, _ = _as_list(output_gradients)
    if len(ogs) != len(targets):
        raise ShapeError(f"{len(ogs)} output gradient(s) for {len(targets)} target(s)")
    out = []
    for t, g in zip(targets, ogs):
        if g is None:
            g = const_tensor(1, t.dtype, t.shape)
        elif not isinstance(g, Tensor):
            g = Tensor(g, dtype=t.dtype)
        if g.shape != t.shape:
            raise ShapeError(f"output gradient of shape {g.shape} for a target of shape {t.shape}")
        out.append(g.cast(t.dtype))
    return out


def _grads(tl, sl, output_gradients, record, keep, unconnected):
    """Shared by grad() and Tape.gradient: lazy gradients of targets `tl` for sources `sl`."""
    for s in sl:
        if not isinstance(s, Tensor):
            raise TypeError(f"gradient sources must be Tensors, got {type(s).__name__}")
    ogs = _default_out_grads(tl, output_gradients, False)
    ids = {id(s) for s in sl}
    res, visited = _run_backward(tl, ogs, lambda t: id(t) in ids, record)
    if not keep:
        _free(visited)
    out = []
    for s in sl:
        g = res.get(id(s))
        if g is None and unconnected == "zero":
            g = _zero_like(s)
        out.append(g)
    return out


def grad(targets, sources, output_gradients=None, create_graph=False, retain_graph=None,
         unconnected="zero"):
    """Functional form (torch.autograd.grad-like): lazy gradients of `targets` with respect
    to `sources` (a tensor, a list, or a dict). Unconnected sources get zeros
    (`unconnected="zero"`) or None (`unconnected="none"`)."""
    tl, _ = _as_list(targets)
    if isinstance(sources, dict):
        keys = list(sources)
        vals = [sources[k] for k in keys]
        got = grad(tl, vals, output_gradients, create_graph, retain_graph, unconnected)
        return dict(zip(keys, got))
    sl, single = _as_list(sources)
    record = bool(create_graph) and is_grad_enabled()
    keep = retain_graph if retain_graph is not None else record
    out = _grads(tl, sl, output_gradients, record, keep, unconnected)
    return out[0] if single else out


class Tape:
    """Records the ops written inside `with Tape() as tape:` for `tape.gradient`.

    `persistent=True` allows several `gradient` calls (the graph is then kept until the
    recorded tensors are dropped). Gradients of gradients: call `gradient` inside an outer
    Tape, or pass `create_graph=True`."""

    def __init__(self, persistent: bool = False):
        self.persistent = persistent
        self._used = False
        self._active = False

    def __enter__(self):
        _push_tape(self)
        self._active = True
        return self

    def __exit__(self, *exc):
        if self._active:
            _pop_tape(self)
            self._active = False
        return False

    def stop_recording(self):
        """Context in which nothing is recorded (tf spelling of no_grad)."""
        return no_grad()

    def gradient(self, target, sources, output_gradients=None, create_graph=False,
                 retain_graph=None, unconnected_gradients="zero"):
        """Lazy gradients of `target` (a tensor or a list: their sum) with respect to
        `sources` (a tensor, a list or a dict; the result has the same structure).

        `output_gradients` weights each target (default ones, also for non-scalar
        targets, as in TensorFlow). Sources the target does not depend on get zeros
        (`unconnected_gradients="none"` gives None instead). The backward ops are recorded
        themselves when `create_graph=True` or another Tape encloses this call."""
        if self._used and not self.persistent:
            raise ZyxError("a non-persistent Tape computes gradients once; use "
                           "Tape(persistent=True) to call gradient() several times")
        self._used = True
        outer = any(t is not self for t in _tapes())
        record = (bool(create_graph) or outer) and is_grad_enabled()
        keep = self.persistent or record if retain_graph is None else retain_graph
        tl, _ = _as_list(target)
        if isinstance(sources, dict):
            keys = list(sources)
            got = _grads(tl, [sources[k] for k in keys], output_gradients, record, keep,
                         unconnected_gradients)
            return dict(zip(keys, got))
        sl, single = _as_list(sources)
        got = _grads(tl, sl, output_gradients, record, keep, unconnected_gradients)
        return got[0] if single else got


# ---------------------------------------------------------------------------------------
# PyTorch habit: requires_grad, backward(), .grad

def _backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    """Accumulate d(self)/d(leaf) into `.grad` of every leaf with requires_grad (or of
    `inputs`). The gradients (and self, when not yet computed) are computed by the next
    realization, whatever it is for: `opt.step()`, `.numpy()`, `.item()`, ... all in one
    pass with it, so a training step runs one plan. Inputs shared with numpy
    (`zyx.from_numpy`) are therefore read then, not here."""
    if self._ctx is None and not self.requires_grad:
        raise ZyxError("backward() of a tensor that does not require grad and has no "
                       "recorded graph (was it computed under no_grad, or detached?)")
    if self._ctx is _FREED:
        raise ZyxError("backward() through a graph that was already freed: pass "
                       "retain_graph=True to the first backward()")
    ogs = _default_out_grads([self], None if gradient is None else [gradient], True)
    if inputs is not None:
        il, _ = _as_list(inputs)
        ids = {id(t) for t in il}
        is_source = lambda t: id(t) in ids  # noqa: E731
    else:
        def is_source(t):
            return (t._ctx is None and t.requires_grad) or id(t) in _retained
    record = bool(create_graph) and is_grad_enabled()
    res, visited = _run_backward([self], ogs, is_source, record)
    by_id = {id(t): t for t in visited}
    new = []
    for k, g in res.items():
        t = by_id[k]
        if t.grad is not None:
            with no_grad() if not record else enable_grad():
                g = t.grad + g
        new.append((t, g))
    for t, g in new:
        t.grad = g if record else g.detach()
    if not record:
        RT.defer([self] + [t.grad for t, _ in new])
    if not (retain_graph if retain_graph is not None else create_graph):
        _free(visited)
    if _post_accumulate:
        for t, _ in new:
            hooks = _post_accumulate.get(id(t))
            if hooks:
                for hook in list(hooks[1].values()):
                    hook(t)


# id(leaf) -> (weakref, {handle id: hook}): Tensor.register_post_accumulate_grad_hook
_post_accumulate = {}


class _HookHandle:
    """What register_post_accumulate_grad_hook returns: `remove()` unregisters the hook."""

    _next = [0]

    def __init__(self, key):
        self._key = key
        self.id = _HookHandle._next[0] = _HookHandle._next[0] + 1

    def remove(self):
        entry = _post_accumulate.get(self._key)
        if entry is not None:
            entry[1].pop(self.id, None)
            if not entry[1]:
                _post_accumulate.pop(self._key, None)


def _register_post_accumulate_grad_hook(self, hook):
    """torch's `Tensor.register_post_accumulate_grad_hook(hook)`: `hook(tensor)` runs at
    the end of every `backward()` that accumulated into this leaf's `.grad` (all of that
    backward's `.grad`s are set by then; they are still lazy). Returns a handle whose
    `remove()` unregisters it. zyx.nn.parallel.DistributedDataParallel averages
    gradients from here."""
    if self._ctx is not None:
        raise RuntimeError("post accumulate grad hooks cannot be registered on non-leaf "
                           "tensors")
    key = id(self)
    entry = _post_accumulate.get(key)
    if entry is None:
        entry = (weakref.ref(self, lambda _r, k=key: _post_accumulate.pop(k, None)), {})
        _post_accumulate[key] = entry
    handle = _HookHandle(key)
    entry[1][handle.id] = hook
    return handle


def _requires_grad_(self, requires_grad=True):
    """Mark this tensor as a leaf whose gradient `backward()` accumulates in `.grad`."""
    self.requires_grad = bool(requires_grad)
    return self


def _is_leaf(self):
    """True for tensors not made by a recorded op (torch semantics)."""
    return self._ctx is None


def _retain_grad(self):
    """Also fill `.grad` of this non-leaf tensor on backward()."""
    k = id(self)
    _retained[k] = weakref.ref(self, lambda _r, k=k: _retained.pop(k, None))


def _grad_fn(self):
    """The primitive that made this tensor (name), or None for leaves."""
    ctx = self._ctx
    if ctx is None:
        return None
    if ctx is _FREED:
        return "<freed>"
    return ctx[1][0] if ctx[0] == COMPOSITE else G.OP_NAMES[ctx[0]]


def _detach_(self):
    self._ctx = None
    self.requires_grad = False
    return self


Tensor.backward = _backward
Tensor.requires_grad_ = _requires_grad_
Tensor.is_leaf = property(_is_leaf)
Tensor.retain_grad = _retain_grad
Tensor.grad_fn = property(_grad_fn)
Tensor.detach_ = _detach_
Tensor.register_post_accumulate_grad_hook = _register_post_accumulate_grad_hook

_TB.setup(None, None, _FREED)
