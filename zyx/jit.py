"""`zyx.jit`: a step that repeats replays its plans without running its Python again.

Call 1 of a decorated function runs it as written. Call 2 runs it again under a
`Recorder` (the runtime tells it of every plan a realization runs): which plans, in which
order, and where each of their leaves comes from (an argument, a result of an earlier plan
of the call, a tensor object that held it when the call began, a constant). Calls 3 and on
check the arguments' structure, bind the new argument buffers, run the recorded plans,
rebind the tensor objects the call had rebound (parameters, optimizer state, gradients) to
the new results and return new output tensors. The rules (what is an input, what is
frozen, the errors) are in docs/jit.md; `jit`'s docstring repeats the short form.
"""
from __future__ import annotations

import functools
import gc
import threading
import types
import warnings
import weakref

import numpy as np

from . import dtype as dt
from . import random as rnd
from ._core import valuecheck
from ._core.graph import LEAF
from ._core.tensorbase import TensorBase, wrap
from .autograd import is_grad_enabled
from .errors import JitError
from .runtime import RT
from .tensor import Tensor, rebind

__all__ = ["jit", "Jit", "Recorder", "on_replay", "capturing"]

MAX_CAPTURES = 4     # argument structures one function may capture before JitError

# where a plan's leaf comes from, at replay
_IN, _OUT, _OBJ, _CONST = 0, 1, 2, 3


def capturing():
    """True while a zyx.jit capture is recording on this thread."""
    rec = RT.recorder
    return rec is not None and rec.thread == threading.get_ident()


def on_replay(fn):
    """Have `fn()` called before each replay of the capture in progress (nothing when none
    is). For Python state a step changes besides its graph: the optimizers count their
    steps and write their step scalars this way."""
    rec = RT.recorder
    if rec is not None and rec.thread == threading.get_ident():
        rec.on_replay(fn)


def _tensors_alive():
    # type(), not isinstance: isinstance reads __class__, which lazy module proxies
    # (torch's deprecated names) answer with a warning
    return [o for o in gc.get_objects() if issubclass(type(o), TensorBase)]


class _Step:
    """One recorded realization: its plan and device, the length of the node list it
    runs on, its leaves' sources, its parameter values, its targets and checks."""
    __slots__ = ("plan", "dev", "n", "leaves", "ints", "floats", "fdt", "base", "draws",
                 "targets", "leaf_checks", "flags")


class Recorder:
    """The capture of one call (RT.recorder while it runs). `inputs`: the call's input
    tensors in argument order."""

    def __init__(self, inputs):
        self.thread = threading.get_ident()
        self.graph = RT.graph
        self.steps = []
        self.hooks = []
        self.failed = None         # why this capture cannot be replayed
        self.retry = False         # ... and whether capturing again may succeed
        self.random = {}           # constant node id -> (call number, word)
        self.produced = {}         # target node id -> (step, target index)
        self.held = []             # node ids retained while capturing
        self.consts = []           # node ids kept for the replays (constant leaves)
        self.fresh = []            # constant leaves made during the call: host data
        self.inputs = {}
        for k, t in enumerate(inputs):
            self.inputs.setdefault(t._id, k)
        self.seed = RT.seed
        self.rng_start = RT.rng_calls
        # tensor objects alive at the start and their nodes: state is read through them
        self.start = [(weakref.ref(o), o._id) for o in _tensors_alive()]
        self.owners = {}
        for i, (_, nid) in enumerate(self.start):
            self.owners.setdefault(nid, []).append(i)
        items = self.graph.nodes.items
        self.start_leaves = {i for i, n in enumerate(items) if n is not None and n.op == LEAF}
        self.obj_reads = {}        # start index -> the _OBJ source's slot (resolved at end)
        self.objects = []          # objects read at replay (strong references)

    # -- told by the runtime and the library -----------------------------------------------
    def on_replay(self, fn):
        if threading.get_ident() == self.thread:
            self.hooks.append(fn)

    def unsupported(self, why, retry=False):
        if threading.get_ident() == self.thread and self.failed is None:
            self.failed, self.retry = why, retry

    def random_words(self, nid_a, nid_b, k0, k1, c1):
        """A random draw's two round-0 constants (random.threefry2x32): replays compute
        them for their own call numbers, so the runtime makes them launch values."""
        if threading.get_ident() != self.thread or (k0 & rnd.MASK32) != (RT.seed & rnd.MASK32):
            return
        n = rnd.call_number(k1, c1)
        self.graph.retain(nid_a)
        self.graph.retain(nid_b)
        self.held += [nid_a, nid_b]
        self.random[nid_a] = (n, 0)
        self.random[nid_b] = (n, 1)

    def varies(self, nid):
        return nid in self.random and threading.get_ident() == self.thread

    def before(self, plan, order, ids, dev, checks):
        """Record a realization the runtime is about to run (nodes still as built)."""
        if threading.get_ident() != self.thread or self.failed is not None:
            return
        if plan.bound is not None:
            return self.unsupported("a size that grows (a plan at a bound)")
        graph = self.graph
        st = _Step()
        st.plan, st.dev, st.base = plan, dev, len(order)
        st.leaves = [(p, self._source(order[p], dev)) for p in plan.leaves if p < len(order)]
        if self.failed is not None:
            return
        st.ints, st.floats, st.fdt, st.draws = (), (), None, []
        params = set()
        extra = 0
        if plan.params is not None:
            spec, fdt, n_int, n_float = plan.params
            ints, floats = [], []
            for p, axis, is_float in spec:
                params.add(p)
                arg = graph.get(order[p]).arg
                if axis >= 0:
                    ints.append(-arg[0][axis][0])
                elif is_float:
                    floats.append(arg)
                else:
                    draw = self.random.get(order[p])
                    if draw is not None:
                        st.draws.append((len(ints), draw[0] - self.rng_start, draw[1]))
                    v = int(arg)
                    ints.append(v - (1 << 64) if v >= 1 << 63 else v)
            st.ints, st.floats, st.fdt = tuple(ints), tuple(floats), fdt
            extra = (1 if n_int else 0) + (1 if n_float else 0)
        for p, nid in enumerate(order):
            if nid in self.random and p not in params:
                # its counter is compiled into the plan (the graph matched a cached plan
                # exactly): the next capture finds the values family and makes it a value
                return self.unsupported("a random draw whose counter is compiled into "
                                        "the plan", retry=True)
        st.n = len(order) + extra
        st.targets = []
        index = len(self.steps)
        for j, p in enumerate(plan.targets):
            nid = order[p]
            if not plan.stored[p]:
                return self.unsupported("a result the plan does not store")
            node = graph.get(nid)
            st.targets.append((p, tuple(node.shape), node.dtype))
            if nid not in self.produced:
                self.produced[nid] = (index, j)
                graph.retain(nid)
                self.held.append(nid)
        st.leaf_checks, st.flags = [], []
        flagged = [c for c in checks if c.flag is not None]
        first_flag = len(ids) - len(flagged)
        for c in checks:
            if c.flag is None:
                st.leaf_checks.append((self._source(c.opid, None), c))
        for j, c in enumerate(flagged):
            st.flags.append((first_flag + j, c))
        self.steps.append(st)

    def _source(self, nid, dev):
        """Where the leaf `nid` read by a plan on `dev` comes from at replay."""
        k = self.inputs.get(nid)
        if k is not None:
            pool = self.graph.get(nid).buffer.pool
            if dev is not None and pool is not dev.pool:
                self.unsupported(f"input {k} lives on {RT.name_of(RT.device_of(nid))} but "
                                 f"is read on {RT.name_of(dev)}; move it there first")
                self.retry = False
                raise JitError(self.failed)
            return (_IN, k)
        got = self.produced.get(nid)
        if got is not None:
            return (_OUT,) + got
        owners = self.owners.get(nid)
        if owners:
            i = owners[0]
            got = self.obj_reads.get(i)
            if got is None:
                node = self.graph.get(nid)
                got = self.obj_reads[i] = (len(self.obj_reads), tuple(node.shape), node.dtype)
            return (_OBJ, got[0])
        self.graph.retain(nid)
        self.consts.append(nid)
        if nid not in self.start_leaves:
            self.fresh.append(nid)
        return (_CONST, nid)

    # -- the end of the call -------------------------------------------------------------
    def finish(self, outputs):
        """After the function returned: realize its outputs and state it left lazy (one
        more recorded realization), then find the tensor objects to rebind at replay.
        Returns the Capture, or None when this call cannot be replayed (`failed`)."""
        graph = self.graph
        lazy = [t._id for t in outputs if graph.get(t._id).op != LEAF]
        changed = []
        for ref, nid in self.start:
            o = ref()
            if o is not None and o._id != nid:
                changed.append(o)
                if graph.get(o._id).op != LEAF:
                    lazy.append(o._id)
        RT.realize(lazy)        # also what backward() deferred
        if self.failed is not None:
            return None
        if RT.seed != self.seed:
            self.unsupported("zyx.manual_seed inside the function")
            return None
        ndraws = RT.rng_calls - self.rng_start
        for n, _ in self.random.values():
            if not 0 <= n - self.rng_start < ndraws:
                self.unsupported("a random draw outside the call's own draws")
                return None
        out_ids = {id(t) for t in outputs}
        outs = [self._source(t._id, None) for t in outputs]
        gc.collect()        # tensors only a dead cycle holds are not state
        bindings = []
        moved = {id(o) for o in changed}
        for o in _tensors_alive():
            if id(o) in out_ids:
                continue
            nid = o._id
            got = self.produced.get(nid)
            if got is not None:
                bindings.append((o, (_OUT,) + got))
            elif id(o) in moved:       # rebound to an input or another existing leaf
                bindings.append((o, self._source(nid, None)))
        # an object read at replay: the owner of the node at the start that the call
        # rebound (a parameter) over one that still holds it (an alias made before)
        objects = [None] * len(self.obj_reads)
        for i, (slot, shape, d) in self.obj_reads.items():
            nid = self.start[i][1]
            best = None
            for j in self.owners[nid]:
                o = self.start[j][0]()
                if o is None:
                    continue
                if best is None or (id(o) in moved and id(best) not in moved):
                    best = o
            if best is None:
                self.unsupported("a tensor the function read was freed during the call")
                return None
            objects[slot] = (best, shape, d)
        if self.fresh:
            shapes = ", ".join(str(tuple(graph.get(n).shape)) for n in self.fresh[:4])
            warnings.warn(f"zyx.jit: {len(self.fresh)} tensor(s) made from host data inside "
                          f"the function (shapes {shapes}) are frozen at their captured "
                          "values; pass data that changes as arguments", stacklevel=4)
        return Capture(self, bindings, objects, outs, ndraws)

    def close(self):
        """Drop the references taken while capturing (the constants stay with the
        Capture)."""
        for nid in self.held:
            self.graph.release(nid)
        self.held = []


class Capture:
    """The replayable record of one call (see the module docstring)."""

    def __init__(self, rec, bindings, objects, outs, ndraws):
        self.steps = rec.steps
        self.hooks = rec.hooks
        self.bindings = bindings
        self.objects = objects
        self.outs = outs
        self.ndraws = ndraws
        self.rng_high = rec.rng_start >> 32
        self.graph = rec.graph
        self.consts = rec.consts
        rec.consts = []

    def __del__(self):
        try:
            for nid in self.consts:
                self.graph.release(nid)
        except Exception:      # interpreter shutdown: the graph may be gone already
            pass

    def valid(self):
        """Whether the objects the plans read still hold tensors of the captured shape
        and dtype (something outside may have resized a parameter)."""
        g = self.graph
        for o, shape, d in self.objects:
            node = g.get(o._id)
            if node.dtype is not d or tuple(node.shape) != shape:
                return False
        start = RT.rng_calls
        return ((start + self.ndraws) >> 32) == self.rng_high == (start >> 32)

    def replay(self, inputs):
        """Run the recorded plans on the input node ids `inputs`; rebind the state
        objects; the output node ids (new references, for the caller to wrap)."""
        g = self.graph
        for hook in self.hooks:
            hook()
        lazy = [o._id for o, _, _ in self.objects if g.get(o._id).op != LEAF]
        if lazy:        # rebound to a lazy value outside the function
            RT.realize(lazy)
        objs = [o._id for o, _, _ in self.objects]
        first = rnd.reserve(self.ndraws) if self.ndraws else 0
        results = []
        placeholders = []

        def node(src):
            kind = src[0]
            if kind == _OUT:
                return results[src[1]][src[2]]
            if kind == _IN:
                return inputs[src[1]]
            if kind == _OBJ:
                return objs[src[1]]
            return src[1]

        try:
            for st in self.steps:
                ex = [None] * st.n
                for p, src in st.leaves:
                    ex[p] = node(src)
                made = []
                try:
                    if st.fdt is not None:
                        ints = list(st.ints)
                        for i, d, word in st.draws:
                            ints[i] = rnd.round0_words(*rnd.stream(first + d))[word]
                        at = st.base
                        if ints:
                            made.append(_upload(np.array(ints, np.int64), dt.int64, st.dev))
                            ex[at] = made[-1]
                            at += 1
                        if st.floats:
                            made.append(_upload(np.array(st.floats, st.fdt.np), st.fdt, st.dev))
                            ex[at] = made[-1]
                    outs = []
                    for p, shape, d in st.targets:
                        if ex[p] is None:
                            ex[p] = g.leaf(None, shape, d)
                            placeholders.append(ex[p])
                        outs.append(ex[p])
                    for src, c in st.leaf_checks:
                        nid = node(src)
                        n = g.get(nid)
                        valuecheck.check_leaf(valuecheck.Check(
                            c.nid, n, nid, n, c.lo, c.hi, c.exempt, c.inside, c.error,
                            c.message, c.info))
                    verify = _verify(st.flags, st.plan) if st.flags else None
                    RT.replay(st.plan, ex, st.dev, verify)
                finally:
                    for nid in made:
                        g.release(nid)
                results.append(outs)
            for o, src in self.bindings:
                nid = node(src)
                if o._id != nid:
                    g.retain(nid)
                    rebind(o, wrap(nid))
            out = []
            for src in self.outs:
                nid = node(src)
                g.retain(nid)
                out.append(nid)
            return out
        finally:
            for nid in placeholders:
                g.release(nid)


def _upload(arr, d, dev):
    return RT.from_numpy(arr, d, None if dev is RT.device() else dev)


def _verify(flags, plan):
    """scheduler.execute's `verify` for a replay: raise the first set flag's error."""
    def verify(buffer_of):
        for p, c in flags:
            if RT.checks.is_set(buffer_of(plan.targets[p])):
                m = c.message
                raise c.error("zyx.jit replay: a value check failed: " +
                              (m if isinstance(m, str) else "value out of range"))
    return verify


# -- arguments -------------------------------------------------------------------------------
_STATIC_TYPES = (int, bool, str, bytes, type(None), type(Ellipsis))


def _walk(x, path, static, tensors, key):
    """Collect the input tensors of argument `x` (at `path`) into `tensors` and its
    structure into `key`; returns `x` with Python floats made 0-d tensors."""
    if static:
        key.append(("static", path, x))
        return x
    if isinstance(x, Tensor):
        if RT.graph.get(x._id).op != LEAF:
            x.realize()
        tensors.append(x)
        key.append((tuple(x.shape), x.dtype, id(RT.device_of(x._id))))
        return x
    if isinstance(x, float):
        dev = RT.device_of(tensors[0]._id) if tensors else RT.device()
        t = wrap(_upload(np.array(x, dtype=np.float32), dt.float32, dev))
        tensors.append(t)
        key.append("float")
        return t
    if isinstance(x, _STATIC_TYPES):
        key.append((type(x), x))
        return x
    if isinstance(x, (tuple, list)):
        key.append((type(x), len(x)))
        out = [_walk(v, path + (i,), False, tensors, key) for i, v in enumerate(x)]
        if type(x) is list:
            return out
        return tuple(out) if type(x) is tuple else type(x)(*out)      # a namedtuple
    if isinstance(x, dict):
        key.append((dict, tuple(x)))
        return {k: _walk(v, path + (k,), False, tensors, key) for k, v in x.items()}
    if isinstance(x, np.ndarray):
        raise JitError(f"zyx.jit: argument {_name(path)} is a numpy array; pass it as a "
                       "zyx tensor (host data inside a captured function is frozen)")
    key.append(("object", id(x)))       # a module, an optimizer: read as state
    return x


def _name(path):
    return "".join(f"[{p!r}]" if i else str(p) for i, p in enumerate(path))


def _outputs(out, tensors):
    """The output structure with each tensor replaced by its index in `tensors`."""
    if isinstance(out, Tensor):
        tensors.append(out)
        return len(tensors) - 1
    if out is None:
        return None
    if isinstance(out, (tuple, list)):
        return type(out), [_outputs(v, tensors) for v in out]
    if isinstance(out, dict):
        return dict, {k: _outputs(v, tensors) for k, v in out.items()}
    raise JitError(f"zyx.jit: the function returned a {type(out).__name__}; a captured "
                   "function returns tensors (None, or tuples, lists and dicts of them): "
                   "a Python value computed inside would be frozen at its captured value")


def _rebuild(spec, tensors):
    if spec is None:
        return None
    if isinstance(spec, int):
        return tensors[spec]
    kind, items = spec
    if kind is dict:
        return {k: _rebuild(v, tensors) for k, v in items.items()}
    vals = [_rebuild(v, tensors) for v in items]
    return vals if kind is list else kind(vals) if kind is tuple else kind(*vals)


_SEEN = object()      # a structure run once: the next call captures
_EAGER = object()     # a structure that cannot be replayed: runs as written


class Jit:
    """A function whose repeated calls replay the plans its second call ran (`jit`)."""

    def __init__(self, fn, static=(), max_captures=MAX_CAPTURES):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.static = frozenset(static)
        self.max_captures = max_captures
        self.entries = {}
        self.retries = {}
        self.calls = {"runs": 0, "captures": 0, "replays": 0}

    def __get__(self, obj, objtype=None):
        return self if obj is None else types.MethodType(self, obj)

    def __call__(self, *args, **kwargs):
        if RT.recorder is not None:         # inside another capture: a plain call
            return self.fn(*args, **kwargs)
        tensors, key = [], [is_grad_enabled()]
        args = [_walk(a, (i,), i in self.static, tensors, key) for i, a in enumerate(args)]
        kwargs = {k: _walk(v, (k,), k in self.static, tensors, key)
                  for k, v in kwargs.items()}
        try:
            key = tuple(key)
            entry = self.entries.get(key)
        except TypeError as exc:
            raise JitError(f"zyx.jit: a static argument is not hashable ({exc})") from None
        if RT.pending:
            RT.realize([])      # backward() outside the function is not part of it
        if entry is None:
            if len(self.entries) >= self.max_captures:
                raise JitError(
                    f"zyx.jit: {self.__name__} was called with {len(self.entries) + 1} "
                    f"argument structures (shapes, dtypes, devices, static values); "
                    f"max_captures={self.max_captures}. Keep shapes fixed (pad the last "
                    "batch) or raise max_captures")
            self.entries[key] = _SEEN
            return self._run(args, kwargs)
        if entry is _EAGER:
            return self._run(args, kwargs)
        if entry is _SEEN:
            return self._capture(key, args, kwargs, tensors)
        if not entry.valid():
            self.entries[key] = _SEEN
            return self._run(args, kwargs)
        with RT.lock:
            ids = entry.replay([t._id for t in tensors])
        self.calls["replays"] += 1
        return _rebuild(entry.spec, [wrap(nid) for nid in ids])

    def _run(self, args, kwargs):
        self.calls["runs"] += 1
        out = self.fn(*args, **kwargs)
        _outputs(out, [])
        return out

    def _capture(self, key, args, kwargs, tensors):
        self.calls["runs"] += 1
        rec = Recorder(tensors)
        RT.recorder = rec
        try:
            out = self.fn(*args, **kwargs)
            outputs = []
            spec = _outputs(out, outputs)
            cap = rec.finish(outputs)
        finally:
            RT.recorder = None
            rec.close()
        if cap is None:
            n = self.retries.get(key, 0)
            if rec.retry and n < 1:
                self.retries[key] = n + 1
                self.entries[key] = _SEEN
            else:
                warnings.warn(f"zyx.jit: {self.__name__} cannot be replayed ({rec.failed}); "
                              "it runs as written", stacklevel=3)
                self.entries[key] = _EAGER
            return out
        cap.spec = spec
        self.entries[key] = cap
        self.calls["captures"] += 1
        return out


def jit(fn=None, *, static=(), max_captures=MAX_CAPTURES):
    """Decorator: repeated calls of `fn` replay the plans its second call ran, without
    running its Python (torch.compile / tinygrad TinyJit for a training or sampling step).

    - Call 1 runs `fn` as written; call 2 runs it again and records every realization
      (plan, where its leaves come from); calls 3+ bind the new inputs, run the plans,
      rebind the tensors the call rebinds (parameters, optimizer state, `.grad`s) and
      return new output tensors. Outputs are realized when a captured call returns.
    - Inputs: tensor arguments (lazy ones are realized first) and Python floats, which are
      passed to `fn` as 0-d float32 tensors on every call (a learning rate passed in
      changes the result without a new plan). Tensors `fn` reads from elsewhere (a
      module's parameters, optimizer state) are read again at every replay. Random
      numbers (dropout, rand) draw new numbers at every replay, the same as without jit.
    - Structure: shapes, dtypes and devices of tensor arguments, Python ints, bools,
      strings and None, arguments named in `static` (positions or names; their values are
      keys), other objects by identity. A new structure runs as written, is captured on
      its second call, and is replayed after; more than `max_captures` structures raise
      JitError.
    - Frozen at capture (the Python does not run): Python values computed inside (a
      global, a slice start from numpy's random), tensors made from host data inside
      (a warning names them), Python side effects. The optimizers' step counts and a
      learning rate changed in `param_groups` are replayed (they register `on_replay`).
    - Errors (JitError): outputs that are not tensors, numpy arrays as arguments, inputs
      on another device than the work that reads them, too many structures. A function
      that uses a size that grows (bounds.py) warns and runs as written.

    See docs/jit.md."""
    if fn is None:
        return lambda f: Jit(f, static, max_captures)
    return Jit(fn, static, max_captures)
