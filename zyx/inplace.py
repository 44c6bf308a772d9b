"""In-place ops (`x.add_(y)`, `x += y`, `x[idx] = v`, ...) on zyx's lazy graph.

zyx tensors are nodes of an immutable graph; an in-place op is a functional update: the new
value is built from the old one with ordinary ops (a slice assignment is a pad of the value
into the region and a `where`, a boolean-mask assignment a `where`, an integer-index
assignment a one-hot compare and a reduce), then the Tensor object is pointed at the new
node (`tensor.rebind`), keeping its identity. Nothing runs on the host and the update fuses
with whatever reads it, like any other op.

Torch semantics kept:
- dtype: the result keeps self's dtype; an op whose result type cannot be cast to it in place
  (float into an integer tensor, anything but bool into a bool tensor) raises RuntimeError
  "result type Float can't be cast to the desired output type Long". Assigned values
  (`x[i] = v`, `fill_`, `copy_`) are cast to self's dtype.
- views: tensors made by basic indexing (ints, slices, None, Ellipsis), reshape/view/flatten/
  squeeze/unsqueeze and permute/transpose/T/mT remember their base (`_view`, a strong
  reference, as torch's `._base`). Writing a view writes its base (`v = x[0]; v += 1`
  changes x; `x[0][1] = 5` too), and writing a base re-derives its live views (weak
  references in the base's `_views`), so views see later writes to the base. zyx differs:
  `expand`, `narrow`-like ops other than indexing, and advanced indexing results are not
  views (advanced indexing copies in torch too), and a view re-derived after a write of its
  base is a new node, so an op recorded on the view before the write raises at backward
  (torch raises there too when that op saved the view).
- aliases: `detach()` (and `.data`, and so `state_dict()` values) is a view of kind "data":
  writing it writes its source, as a storage write: not recorded, the source keeps
  requires_grad and its recorded history (a computed source's gradient passes to its
  version before the write, op "storage_write"), and writes to the source (in-place ops,
  and `tensor.rebind` by optimizers, load_state_dict, init: `_rebound`) re-derive it.
  Torch's version counter is shared with the alias: an op recorded before the write that
  read a leaf requiring grad raises at backward, as in torch.
- shared memory: a tensor whose memory numpy (`from_numpy`) or a DLPack peer shares
  (`tensor.share_memory`) is computed at each write and its values copied into that
  memory (`_sync_shared`); its older node keeps the old values for lazy readers.
- autograd: an in-place op records like its out-of-place form; the object's recorded inputs
  become the new op's. In-place on a leaf that requires grad raises unless grad mode is off
  (`with zyx.no_grad(): p -= lr * p.grad`). Ops recorded before an in-place write keep
  reading the value they saw: their backward uses the old version (kept as a snapshot),
  so the gradient is the gradient of what was computed (torch raises instead when the op
  saved the overwritten tensor; zyx's answer equals torch's gradient of the out-of-place
  code). Where the old version is gone (a leaf that requires grad, a view re-derived after
  its base was written, an op whose node was realized) the backward raises torch's
  "one of the variables needed for gradient computation has been modified by an inplace
  operation".
- state updates: a write under no_grad to a computed (realized) tensor is deferred
  (`RT.defer`) so that the next realization computes it in the same plan as the rest; a
  second write after a backward() realizes the pending work first, so a hand-written
  optimizer loop realizes once per step and its graph never grows across steps.
"""
from __future__ import annotations

import builtins
import sys
import weakref

import numpy as np

from . import dtype as dt
from ._core import graph as G
from ._core import kernel as K
from ._core import tensorbase as _TB
from . import autograd as _autograd
from .runtime import RT
from .tensor import Tensor, const_tensor, expand_ellipsis, rebind, broadcast_shape, iota, \
    watch_range, INDEX_MESSAGE, where, link_view, new_handle, shared_buffer, \
    unshare_memory, REBIND_HOOK

_tensor_mod = sys.modules["zyx.tensor"]   # `zyx.tensor` is the function

_graph = RT.graph
_COMPOSITE = _autograd.COMPOSITE

# ---------------------------------------------------------------------------------------
# bookkeeping: which tensors were written, their old versions, deferred state updates

_written = {}     # id(tensor) -> (weakref, had recorded history): tensors written in place
# id(tensor) -> _RegionWrite: boxes waiting for a realization to be copied into the
# tensor's memory (see _write_region)
_region_writes = {}
_snapshots = {}   # (id(tensor), old node id) -> weakref to the old version's tensor object
_deferred = {}    # id(tensor) -> (weakref, foreign epoch when deferred)
_pending_seen = [None, 0, 0]   # RT.pending list last seen, its length, foreign epoch


def _forget(table, key):
    def cb(_ref):
        table.pop(key, None)
    return cb


def _mark_written(t, had_history=False):
    k = id(t)
    entry = _written.get(k)
    if entry is None:
        _written[k] = (weakref.ref(t, _forget(_written, k)), had_history)
    elif had_history and not entry[1]:
        _written[k] = (entry[0], True)


def _snapshot(t):
    """A new tensor object holding t's current node and recorded inputs: what ops written
    now compute from, so that t's own recorded history stays correct after t is rebound."""
    if not _TB.is_recording():
        return t        # nothing records: the ops read t's current node, as a snapshot would
    return _old_object(t)


def _old_object(t):
    """A new tensor object on t's current node with t's recorded inputs, registered as t's
    old version (what autograd's repair reads for ops recorded before t is rebound)."""
    _graph.retain(t._id)
    old = Tensor._wrap(t._id)
    old._ctx = t._ctx
    old.requires_grad = t.requires_grad
    if t._ctx is not None:
        key = (id(t), t._id)
        _snapshots[key] = weakref.ref(old, _forget(_snapshots, key))
    return old


def _foreign_epoch():
    """Counts the times someone else (backward()) deferred work since our last deferral."""
    seen = _pending_seen
    p = RT.pending
    if p is not seen[0]:
        if p:
            seen[2] += 1
        seen[0], seen[1] = p, len(p)
    elif len(p) != seen[1]:
        seen[2] += 1
        seen[1] = len(p)
    return seen[2]


def _realize_chained(t):
    """t was written lazily, deferred, and a backward() came since: realize everything
    pending now (the previous update with this step's forward and backward), so a
    hand-written optimizer loop does not grow one graph across steps."""
    entry = _deferred.get(id(t))
    if entry is None or entry[0]() is not t or _graph.get(t._id).op == G.LEAF:
        return
    if _foreign_epoch() > entry[1]:
        RT.realize([t._id])


def _defer(t):
    epoch = _foreign_epoch()
    RT.defer([t])
    _pending_seen[0], _pending_seen[1] = RT.pending, len(RT.pending)
    k = id(t)
    _deferred[k] = (weakref.ref(t, _forget(_deferred, k)), epoch)


# ---------------------------------------------------------------------------------------
# checks

_TORCH_NAMES = {"float32": "Float", "float64": "Double", "float16": "Half",
                "bfloat16": "BFloat16", "int64": "Long", "int32": "Int", "int16": "Short",
                "int8": "Char", "uint8": "Byte", "bool": "Bool", "uint16": "UInt16",
                "uint32": "UInt32", "uint64": "UInt64"}


def _torch_name(d):
    return _TORCH_NAMES.get(d.name, d.name)


def _can_cast(src, dst):
    """torch.can_cast: no float into an integer tensor, nothing but bool into a bool one."""
    if src.is_float and not dst.is_float:
        return False
    if dst.is_bool and not src.is_bool:
        return False
    return True


def _root(t):
    while t._view is not None:
        t = t._view[0]
    return t


def _through_data(t):
    """Whether t is (a view of) some tensor's `.data`: writes there are not recorded."""
    while t._view is not None:
        if t._view[1] == "data":
            return True
        t = t._view[0]
    return False


def _check_writable(t):
    """torch refuses in-place ops on leaves that require grad while grad mode is on
    (a detached alias made to require grad, `w.detach().requires_grad_()`, is such a
    leaf; writes through an alias that does not are storage writes, never refused)."""
    if not _TB.is_recording():
        return
    if t.requires_grad and t._ctx is None and (t._view is None or t._view[1] == "data"):
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place "
                           "operation.")
    if t._view is not None and _through_data(t):
        return
    if t._view is not None:
        r = _root(t)
        if r.requires_grad and r._ctx is None:
            raise RuntimeError("a view of a leaf Variable that requires grad is being used "
                               "in an in-place operation.")


def _fit(t, new):
    """`new` as t's next value: same shape as t, t's dtype (torch's in-place casting)."""
    if new.shape != t.shape:
        try:
            shape = broadcast_shape(new.shape, t.shape)
        except Exception:
            shape = None
        if shape != t.shape:
            raise RuntimeError(f"output with shape {list(t.shape)} doesn't match the "
                               f"broadcast shape {list(shape or new.shape)}")
        new = new.expand(t.shape)
    if new.dtype is not t.dtype:
        if not _can_cast(new.dtype, t.dtype):
            raise RuntimeError(f"result type {_torch_name(new.dtype)} can't be cast to the "
                               f"desired output type {_torch_name(t.dtype)}")
        new = new.cast(t.dtype)
    return new


# ---------------------------------------------------------------------------------------
# committing a new value

_storage_write = [0]   # > 0 while a write through a detached alias reaches its source


def _set_node(t, new):
    """Point t at new's node; t's recorded inputs become new's (and t counts as written).
    Inside a storage write (through `detach()`/`.data`) a computed tensor keeps its
    history: its gradient passes to its old version, as torch's grad_fn stays. A tensor
    sharing numpy/DLPack memory gets its new value written there."""
    _mark_written(t, t._ctx is not None)
    buf = shared_buffer(t)
    old = t._id
    if buf is not None:
        _graph.retain(old)
    keep = _storage_write[0] and new._ctx is None and t._ctx is not None
    prev = _old_object(t) if keep else None
    rebind(t, new, False)
    if new._ctx is not None:
        t._ctx = new._ctx
        t.requires_grad = True
    elif keep:
        t._ctx = (_COMPOSITE, ("storage_write",), (prev,))
    elif t._ctx is not None:      # a computed tensor overwritten without recording
        t._ctx = None
        t.requires_grad = False
    if buf is not None:
        try:
            _sync_shared(t, old, buf)
        finally:
            _graph.release(old)


def _storage_write_rule(out, g, arg, srcs, need):
    """Backward of a value written through a detached alias: the gradient goes to the
    version before the write, as torch's unchanged grad_fn sends it."""
    return [g if need[0] else None]


_autograd.register_composite("storage_write", _storage_write_rule)


def _copy_buffer(src, dst):
    """src's bytes into dst (through host memory: any pool to any pool)."""
    host = np.empty(dst.nbytes, dtype=np.uint8)
    src.pool.pool_to_host(src, host, [src.event] if src.event is not None else [])
    ev = dst.pool.host_to_pool(host, dst, [])
    if ev is not None:
        dst.event = ev


def _sync_shared(t, old, buf):
    """t shares `buf` with numpy or a DLPack peer and moved from node `old` to a new value:
    compute the value now, write it into buf, and put t back on a leaf over buf, so the
    peer sees every write and t sees the peer's later writes (torch's shared storage).
    Node `old`, when something still reads it (a lazy op recorded before the write, an
    autograd snapshot), first takes a private copy of the old values. A value of another
    size or dtype (Module.to) ends the sharing, as torch's `.data =` would."""
    if buf.handle is None:           # the memory was given back: nothing shares it now
        unshare_memory(t)
        return
    RT.realize([t._id])
    node = _graph.get(t._id)
    if node.buffer is buf:
        return
    old_node = _graph.get(old)
    if node.buffer is None or node.dtype is not old_node.dtype or \
            node.buffer.nbytes != buf.nbytes:
        unshare_memory(t)
        return
    with RT.lock:
        buf.refs += 1                # the leaf made below
    if old_node.buffer is buf and old_node.rc > 1:
        own, _ = buf.pool.allocate(buf.nbytes)
        _copy_buffer(buf, own)
        old_node.buffer = own
        _graph.free_buffer(buf)      # old no longer holds it (t's new leaf does)
    _copy_buffer(node.buffer, buf)
    if buf.pool.name != "host":      # a GPU peer reads on its own stream: finish the copy
        RT.synchronize(RT.device_of(t._id))
    leaf = Tensor._wrap(_graph.leaf(buf, tuple(node.shape), node.dtype))
    rebind(t, leaf, False)


def _rebound(t, old):
    """tensor.rebind's hook (optimizer steps, load_state_dict, init, Module.to): what
    shares t's storage follows its new value."""
    buf = shared_buffer(t)
    if buf is not None:
        _sync_shared(t, old, buf)
    if t._views:
        _propagate(t)


def _commit(t, new):
    """t (a tensor object) takes the value `new` (t's shape and dtype): a view writes its
    base, a base re-derives its views."""
    info = t._view
    if info is not None:
        base, kind, arg = info
        before = t._id
        if kind == "data":
            _write_storage(base, new)
        else:
            _commit(base, _write_back(_snapshot(base), kind, arg, new))
        if t._id == before:          # not among the base's views re-derived: do it here
            _set_node(t, _derive(base, kind, arg))
        return
    _realize_chained(t)
    # (a write still waiting to go into t's memory is superseded: t's value is computed)
    was_buffer = _graph.get(t._id).op == G.LEAF or _drop_region_write(t)
    _set_node(t, new)
    if was_buffer:
        _defer(t)
    _propagate(t)


def _write_storage(base, new):
    """A write through a detached alias (`detach()`, `.data`): base takes new's values,
    not recorded, keeping its requires_grad and recorded history (as torch's storage)."""
    with _autograd.no_grad():
        _storage_write[0] += 1
        try:
            _commit(base, new_handle(new))
        finally:
            _storage_write[0] -= 1


def _propagate(t):
    """Re-derive the live views of t (and theirs) from t's new value."""
    refs = t._views
    if not refs:
        return
    live = []
    for r in refs:
        c = r()
        if c is None or c._view is None or c._view[0] is not t:
            continue
        live.append(r)
        _, kind, arg = c._view
        _set_node(c, _derive(t, kind, arg))
        _propagate(c)
    t._views = live or None


def _inplace(t, compute):
    """The shape of every in-place method: check, compute from a snapshot, commit."""
    _check_writable(t)
    new = _fit(t, compute(_snapshot(t)))
    _commit(t, new)
    return t


# ---------------------------------------------------------------------------------------
# views: remembered by the view ops, written back through their inverse

_orig = {}


_link = link_view


def _reshape_view(self, *shape):
    out = _orig["reshape"](self, *shape)
    return _link(out, self, "shape", out.shape) if out is not self else out


def _permute_view(self, *axes):
    out = _orig["permute"](self, *axes)
    if out is self:
        return out
    return _link(out, self, "perm", _graph.get(out._id).arg)


def _is_basic(i):
    return i is None or i is Ellipsis or isinstance(i, slice) or (
        isinstance(i, (builtins.int, np.integer)) and not isinstance(i, (builtins.bool, np.bool_)))


def _getitem_view(self, idx):
    out = _orig["__getitem__"](self, idx)
    if out is self:
        return out
    key = idx if isinstance(idx, tuple) else (idx,)
    for i in key:
        if not _is_basic(i):
            return out       # advanced indexing copies (as in torch)
    return _link(out, self, "index", key)


def _derive(base, kind, arg):
    """The view (kind, arg) of base's current value. A view of a tensor that requires grad
    stays connected to it (recorded even under no_grad), as torch's views keep their
    grad_fn when the base is updated under no_grad."""
    if kind == "data":
        return new_handle(base)
    if base.requires_grad and not _TB.is_recording():
        with _autograd.enable_grad():
            return _derive_now(base, kind, arg)
    return _derive_now(base, kind, arg)


def _derive_now(base, kind, arg):
    if kind == "shape":
        return _orig["reshape"](base, arg)
    if kind == "perm":
        return _orig["permute"](base, arg)
    return _orig["__getitem__"](base, arg)


def _write_back(base, kind, arg, val):
    """The base's new value when its view (kind, arg) takes the value `val`."""
    if kind == "data":
        return val
    if kind == "shape":
        return _orig["reshape"](val, base.shape)
    if kind == "perm":
        inv = [0] * len(arg)
        for i, a in enumerate(arg):
            inv[a] = i
        return _orig["permute"](val, tuple(inv))
    return _put(base, arg, val)


def _data_get(self):
    """torch's `.data`: the same values, detached; in-place writes to it change this tensor
    without being recorded (`p.data.add_(-lr * p.grad)`), like torch's shared storage."""
    return self.detach()


def _data_set(self, value):
    """`t.data = value`: t takes value's values (any shape), not recorded."""
    if not isinstance(value, Tensor):
        raise TypeError(f"data must be a Tensor, got {type(value).__name__}")
    if value.device != self.device:
        value = value.to(self.device)
    _mark_written(self, self._ctx is not None)
    unshare_memory(self)         # torch's `.data =` swaps the storage: no longer shared
    rebind(self, value, False)
    _propagate(self)


# ---------------------------------------------------------------------------------------
# setitem: x[idx] = value as a functional update

def _parse(x, idx):
    """Steps like getitem's: ("new",), ("int", d, j), ("slice", d, start, stop, step),
    ("tensor", d, t) and ("mask", d, t) (a bool tensor covering t.ndim dims)."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    if builtins.sum(1 for i in idx if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    conv = []
    for i in idx:
        if isinstance(i, (list, np.ndarray)):
            arr = np.asarray(i)
            i = Tensor(arr, dtype=dt.bool_ if arr.dtype == np.bool_ else dt.int64)
        conv.append(i)
    used = builtins.sum(i.ndim if isinstance(i, Tensor) and i.dtype.is_bool else 1
                        for i in conv if i is not None and i is not Ellipsis)
    if used > x.ndim:
        raise IndexError(f"too many indices for tensor of dimension {x.ndim}")
    full = expand_ellipsis(conv, x.ndim, used)
    steps, d = [], 0
    for i in full:
        if i is None:
            steps.append(("new",))
            continue
        if isinstance(i, (builtins.bool, np.bool_)):
            raise IndexError("boolean scalar indices are not supported")
        if isinstance(i, Tensor) and i.dtype.is_bool:
            if i.shape != x.shape[d:d + i.ndim]:
                raise IndexError(f"The shape of the mask {list(i.shape)} at index {d} does not "
                                 f"match the shape of the indexed tensor {list(x.shape)}")
            steps.append(("mask", d, i))
            d += i.ndim
            continue
        size = x.shape[d]
        if isinstance(i, (builtins.int, np.integer)):
            j = builtins.int(i)
            if not -size <= j < size:
                raise IndexError(f"index {j} is out of bounds for dimension {d} with size {size}")
            steps.append(("int", d, j % size))
        elif isinstance(i, slice):
            steps.append(("slice", d) + i.indices(size))
        elif isinstance(i, Tensor):
            if not i.dtype.is_int:
                raise IndexError(f"tensors used as indices must be long, int, byte or bool "
                                 f"tensors, got {i.dtype.name}")
            steps.append(("tensor", d, i))
        else:
            raise IndexError(f"unsupported index {i!r}")
        d += 1
    return steps


def _scalar_const(value, d, shape, what):
    """A Python number as a constant of dtype d, cast as torch casts (a float into an
    integer tensor truncates); numbers out of d's range raise like torch."""
    if isinstance(value, np.generic):
        value = value.item()
    _tensor_mod.check_fits(value, d, what)
    if d.is_int and isinstance(value, builtins.float):
        value = builtins.int(value)
    return const_tensor(value, d, shape)


def _value_tensor(value, d):
    """The assigned value as a tensor of dtype d (torch casts assigned values silently)."""
    if isinstance(value, Tensor):
        return value.cast(d)
    if isinstance(value, (list, np.ndarray)):
        return Tensor(np.asarray(value)).cast(d)
    return None


def _fit_value(v, shape):
    """v broadcast to `shape` (leading size-1 dims of v may be dropped, as in torch)."""
    while v.ndim > len(shape) and v.shape[0] == 1:
        v = _orig["reshape"](v, v.shape[1:])
    try:
        ok = broadcast_shape(v.shape, shape) == tuple(shape)
    except Exception:
        ok = False
    if not ok:
        raise RuntimeError(f"shape mismatch: value tensor of shape {list(v.shape)} cannot be "
                           f"broadcast to indexing result of shape {list(shape)}")
    return v.expand(tuple(shape)) if v.shape != tuple(shape) else v


def _length(start, stop, step):
    if step > 0:
        return builtins.max(0, (stop - start + step - 1) // step)
    return builtins.max(0, (start - stop - step - 1) // (-step))


def _embed(t, d, start, length, step, n, fill):
    """t (size `length` along d) placed at start, start+step, ... of an axis of size n;
    the other positions hold `fill` (pads only: index arithmetic, no copy)."""
    if step < 0:
        t = t.flip(d)
        start, step = start + (length - 1) * step, -step
    span = length
    if step > 1 and length > 1:     # (one element needs no spacing: x[::2**62] = v)
        sh = t.shape
        t = _orig["reshape"](t, sh[:d] + (length, 1) + sh[d + 1:])
        pads = [(0, 0)] * t.ndim
        pads[d + 1] = (0, step - 1)
        t = _orig["reshape"](t._pad(pads, fill), sh[:d] + (length * step,) + sh[d + 1:])
        span = length * step
    pads = [(0, 0)] * t.ndim
    pads[d] = (start, n - start - span)
    return t._pad(pads, fill)


def _put(x, idx, value, accumulate=False):
    """x with x[idx] set to `value` (or increased by it with accumulate=True), as a new
    tensor of x's shape and dtype."""
    steps = _parse(x, idx)
    kinds = {s[0] for s in steps}
    if "mask" in kinds:
        return _put_mask(x, steps, value, accumulate)
    if "tensor" in kinds:
        return _put_indexed(x, steps, value, accumulate)
    return _put_basic(x, steps, value, accumulate)


def _safe_slice(start, stop, step):
    """A slice object for slice.indices' (start, stop, step): its stop -1 with a negative
    step means "through index 0", which a slice would read as "the last"."""
    return slice(start, None if stop < 0 else stop, step)


def _region_readers(steps):
    """Per basic step, a function taking x's region along that dim (size 1 for ints)."""
    fns = []
    for s in steps:
        if s[0] == "int":
            fns.append(lambda x, d=s[1], j=s[2]: _tensor_mod.shrink_axis(x, d, j, j + 1))
        elif s[0] == "slice":
            fns.append(lambda x, s=s: _tensor_mod.slice_axis(x, *s[1:]))
    return fns


def _leaf_scalar(value, d, like):
    """A 0-d leaf holding `value` on like's device: a write's position or value as data,
    not as a constant folded into the kernel, so writes in a loop share one plan."""
    if isinstance(value, np.generic):
        value = value.item()
    _tensor_mod.check_fits(value, d, "setitem")
    if d.is_int and isinstance(value, builtins.float):
        value = builtins.int(value)
    arr = np.asarray(value, dtype=np.float32 if d is dt.bfloat16 else d.np)
    return Tensor(arr, dtype=d, device=_tensor_mod.device_of_like(like, None))


def _put_point(x, steps, value):
    """x[i, j, :] = scalar (ints and full slices only): where(position == index, value, x)
    with the indices and the value as 0-d leaves, so `for i: y[i] = v` builds the same graph
    every time (plans reused; constants would make every write a new kernel)."""
    v = _leaf_scalar(value, x.dtype, x)
    return where(_position_mask(x, steps), v, x)


def _position_mask(x, steps):
    """bool, broadcastable to x: x's position equals every int step's index, the indices
    as 0-d leaves (see _put_point)."""
    mask = None
    for s in steps:
        if s[0] != "int":
            continue
        _, d, j = s
        sh = [1] * x.ndim
        sh[d] = x.shape[d]
        axis = _orig["reshape"](iota(x.shape[d], dt.int32), tuple(sh))
        m = axis == _leaf_scalar(j, dt.int32, x).expand(tuple(sh))
        mask = m if mask is None else mask & m
    return mask


def _put_rows(x, steps, v):
    """x[:, :, t] = tensor (ints and full slices only): where(position == index, v
    broadcast along the int axes, x), the indices as 0-d leaves, so a cache written at
    step t (`cache[:, :, t] = k`) builds the same graph at every t: one plan for the
    loop, not one per position (a pad of v to t would put t in the plan's key)."""
    region, out = [], []
    for s in steps:
        if s[0] == "new":
            out.append(1)
        elif s[0] == "slice":
            out.append(x.shape[s[1]])
    for d, n in enumerate(x.shape):
        region.append(1 if any(s[0] == "int" and s[1] == d for s in steps) else n)
    v = _orig["reshape"](_fit_value(v, tuple(out)), tuple(region))
    return where(_position_mask(x, steps), v.expand(x.shape), x)


def _put_basic(x, steps, value, accumulate):
    points = any(s[0] == "int" for s in steps) and \
        all(s[0] in ("int", "new") or s[2:] == (0, x.shape[s[1]], 1) for s in steps)
    if not accumulate and points:
        if not isinstance(value, (Tensor, list, np.ndarray)):
            return _put_point(x, steps, value)
        if isinstance(value, Tensor) and x.numel() > 0:
            return _put_rows(x, steps, _value_tensor(value, x.dtype))
    region = list(x.shape)          # per x dim: the written length
    where_at = [(0, n, 1) for n in x.shape]
    out = []                        # getitem's result shape
    for s in steps:
        if s[0] == "new":
            out.append(1)
        elif s[0] == "int":
            region[s[1]] = 1
            where_at[s[1]] = (s[2], 1, 1)
        else:
            _, d, start, stop, step = s
            n = _length(start, stop, step)
            region[d] = n
            out.append(n)
            where_at[d] = (start, n, step)
    v = _value_tensor(value, x.dtype)
    if v is None:
        v = _scalar_const(value, x.dtype, tuple(region), "setitem")
    else:
        v = _orig["reshape"](_fit_value(v, tuple(out)), tuple(region))
    if 0 in region:
        return x
    if all(w == (0, n, 1) for w, n in zip(where_at, x.shape)):
        return x + v if accumulate else v      # the whole tensor
    if accumulate:
        old = x
        for d, s in enumerate(_region_readers(steps)):
            old = s(old)
        v = v + old
    mask = const_tensor(True, dt.bool_, tuple(region))
    for d, (start, n, step) in enumerate(where_at):
        if (start, n, step) != (0, x.shape[d], 1):
            v = _embed(v, d, start, n, step, x.shape[d], 0)
            mask = _embed(mask, d, start, n, step, x.shape[d], False)
    return where(mask, v, x)


def _put_mask(x, steps, value, accumulate):
    """x[mask] = value: a where. The value is a scalar, broadcasts to the dims after the
    mask, or has one row per True element (gathered by the running count of the mask)."""
    if builtins.sum(1 for s in steps if s[0] != "slice" or s[2:] != (0, x.shape[s[1]], 1)) > 1:
        raise IndexError("a boolean mask can be combined only with full slices (:) and ...")
    _, d, m = next(s for s in steps if s[0] == "mask")
    k = m.ndim
    rest = x.shape[d + k:]
    mx = _orig["reshape"](m, (1,) * d + m.shape + (1,) * len(rest)).expand(x.shape)
    v = _value_tensor(value, x.dtype)
    if v is None:
        v = _scalar_const(value, x.dtype, x.shape, "setitem")
    elif d == 0 and v.ndim == 1 + len(rest) and v.shape[0] != 1:
        # one value row per True element, in order: row = (running count of the mask) - 1
        flat = _orig["reshape"](m, (m.numel(),)).cast(dt.int64).cumsum(0) - 1
        rows = _orig["__getitem__"](v, (flat.clamp(0, None),))
        v = _orig["reshape"](rows, m.shape + rest)
    else:
        v = _fit_value(v, x.shape[:d] + (1,) + rest)
        v = _orig["reshape"](v, x.shape[:d] + (1,) * k + rest).expand(x.shape)
    return where(mx, x + v if accumulate else v, x)


def _put_indexed(x, steps, value, accumulate):
    """x[i0, i1, ...] = value with integer index tensors (ints and slices beside them):
    a one-hot compare of every index with its axis, and per written element the last
    matching value (duplicates: the last wins; accumulate=True adds them all)."""
    if any(s[0] == "new" for s in steps):
        raise IndexError("None cannot be combined with index tensors in an assignment")
    if any(s[0] == "slice" and s[2:] != (0, x.shape[s[1]], 1) for s in steps):
        # partial slices: write the sliced region as a whole (view, update, write back)
        outer = tuple(_safe_slice(*s[2:]) if s[0] == "slice" else slice(None) for s in steps)
        inner = tuple(slice(None) if s[0] == "slice" else (s[2]) for s in steps)
        sub = _orig["__getitem__"](x, outer)
        return _put_basic(x, _parse(x, outer), _put_indexed(sub, _parse(sub, inner), value,
                                                            accumulate), False)
    tsteps = [(s[1], s[2]) for s in steps if s[0] == "tensor"]
    isteps = [(s[1], s[2]) for s in steps if s[0] == "int"]
    tdims = [d for d, _ in tsteps]
    bshape = broadcast_shape(*[t.shape for _, t in tsteps])
    nd, k = x.ndim, len(bshape)
    rest = [d for d in range(nd) if d not in tdims and d not in dict(isteps)]
    adjacent = tdims == list(range(tdims[0], tdims[0] + len(tdims)))
    # getitem's result layout (ints dropped): the index block where the indexed dims were
    # when they are adjacent, else first
    lead = len([d for d in rest if d < tdims[0]]) if adjacent else 0
    out_shape = tuple(x.shape[d] for d in rest[:lead]) + bshape + \
        tuple(x.shape[d] for d in rest[lead:])
    hit = None
    for d, t in tsteps:
        n = x.shape[d]
        ti = where(t < 0, t + n, t).expand(bshape)
        sh = [1] * (nd + k)
        sh[d] = n
        axis = _orig["reshape"](iota(n, ti.dtype), tuple(sh))
        h = _orig["reshape"](ti, (1,) * nd + bshape) == axis
        watch_range(h, t, -n, n, INDEX_MESSAGE, (d, n, "index_put"))
        hit = h if hit is None else (hit & h)
    for d, j in isteps:
        sh = [1] * (nd + k)
        sh[d] = x.shape[d]
        hit = hit & (_orig["reshape"](iota(x.shape[d], dt.int32), tuple(sh)) == j)
    # the value in the layout x dims (indexed ones of size 1) + index block
    v = _value_tensor(value, x.dtype)
    if v is None:
        v = _scalar_const(value, x.dtype, out_shape, "index_put")
    v = _fit_value(v, out_shape)
    rest_pos = list(range(lead)) + list(range(lead + k, len(out_shape)))
    v = _orig["permute"](v, tuple(rest_pos + list(range(lead, lead + k))))
    sh = [1] * nd
    for d, s in zip(rest, v.shape[:len(rest)]):
        sh[d] = s
    v = _orig["reshape"](v, tuple(sh) + bshape)
    full = x.shape + bshape
    hit = hit.expand(full)
    block = tuple(range(nd, nd + k))
    calc = dt.int32 if x.dtype.is_bool else x.dtype
    vv = v.cast(calc).expand(full)
    if accumulate:
        add = where(hit, vv, const_tensor(0, calc, ()))._reduce(K.R_SUM, block, False)
        return (x.cast(calc) + add).cast(x.dtype)
    nb = 1
    for s in bshape:
        nb *= s
    order = _orig["reshape"](iota(nb, dt.int32), (1,) * nd + bshape).expand(full)
    last = where(hit, order, const_tensor(-1, dt.int32, ()))._reduce(K.R_MAX, block, True)
    pick = hit & (order == last.expand(full))
    val = where(pick, vv, const_tensor(0, calc, ()))._reduce(K.R_SUM, block, False).cast(x.dtype)
    written = _orig["reshape"](last, x.shape) >= 0
    return where(written, val, x)


def _setitem(self, idx, value):
    """`x[idx] = value` (torch semantics): ints, slices (steps, negative), None, Ellipsis,
    boolean masks and integer index tensors/lists; `value` a scalar or a tensor that
    broadcasts to `x[idx]`'s shape, cast to x's dtype. The right side is read before the
    write (`x[1:] = x[:-1]` shifts). With duplicate indices the last value wins (torch
    leaves it unspecified). A boolean-mask assignment of one row per True element checks
    only that the count does not exceed the rows (torch also checks equality).
    A small box of a large realized tensor goes into its memory (_write_region)."""
    if not _write_region(self, idx, value):
        _inplace(self, lambda old: _put(old, idx, value))


# ---------------------------------------------------------------------------------------
# writes into a tensor's memory: a key/value cache written at one position

class _RegionWrite:
    """A box of tensor `t` waiting to be copied into the memory of its leaf `leaf`
    (retained here) from the tensor `value` (the box's shape) once a realization has
    computed value; until then t is the functional update `node` (where(box, value,
    leaf)), so reads of t in that realization see the new values."""
    __slots__ = ("t", "node", "leaf", "box", "value")

    def __init__(self, t, node, leaf, box, value):
        self.t, self.node, self.leaf, self.box, self.value = t, node, leaf, box, value


def _box(x, steps):
    """(start, length) per axis of x for basic steps of ints and unit-step slices, and
    getitem's result shape; None for other steps."""
    box, out = [(0, n) for n in x.shape], []
    for s in steps:
        if s[0] == "new":
            out.append(1)
        elif s[0] == "int":
            box[s[1]] = (s[2], 1)
        elif s[0] == "slice" and s[4] == 1 and s[3] > s[2]:
            box[s[1]] = (s[2], s[3] - s[2])
            out.append(s[3] - s[2])
        else:
            return None, None
    return box, tuple(out)


def _write_region(t, idx, value):
    """`t[idx] = value` into t's memory, without a new tensor of t's size: a key/value
    cache written at step t (`cache[:, :, t] = k`) then costs k's bytes, not the cache's.
    Taken when nothing records for autograd (no_grad, t not requiring grad), t is not a
    view, has no live views, shares no numpy/DLPack memory, and Runtime.region_fits the
    box (t a realized leaf of its own, large enough, in memory that copies regions).

    The write waits for the next realization: t becomes the functional update, as on
    the other path, except that it is not stored; the value is computed with that
    realization (deferred), which reads t's new values through the update; after it,
    _finish_region_writes copies the value into t's old memory and puts t back on it.
    Whether anything else still reads the old values is checked then, not now: the lazy
    results of a loop's previous step (the last attention scores, still held by the
    user's variables) read them now, and are usually gone by then. False (nothing done)
    when not taken."""
    if (_TB.is_recording() or t.requires_grad or t._view is not None or t._views
            and any(r() is not None for r in t._views) or shared_buffer(t) is not None
            or not isinstance(value, (Tensor, list, np.ndarray)) or id(t) in _region_writes
            or _graph.get(t._id).op != G.LEAF):
        return False
    box, out = _box(t, _parse(t, idx))
    if box is None or not RT.region_fits(t._id, box):
        return False
    v = _fit_value(_value_tensor(value, t.dtype), out)
    if v.device != t.device:
        return False
    region = _orig["reshape"](v, tuple(n for _, n in box))
    leaf = t._id
    _graph.retain(leaf)
    _set_node(t, _put(t, idx, v))
    _region_writes[id(t)] = _RegionWrite(weakref.ref(t), t._id, leaf, box, region)
    RT.defer([region])
    return True


def waiting_region_writes():
    """How many box writes wait for the next realization to copy their value into their
    tensor's memory (tests: the table empties after each realization)."""
    return len(_region_writes)


def _drop_region_write(t):
    """Forget t's waiting write (its value is then computed as a whole); True if there
    was one."""
    w = _region_writes.pop(id(t), None)
    if w is None:
        return False
    _graph.release(w.leaf)
    return True


def _finish_region_writes():
    """After a realization (Runtime.after_realize): copy every computed waiting value into
    its tensor's memory and put the tensor back on it. A write whose tensor was dropped,
    moved to another value, or computed as a whole is forgotten; one whose old values
    something other than the update still reads (a lazy result kept from before the
    write) is left to be computed as a whole, with the next realization."""
    for key, w in list(_region_writes.items()):
        t = w.t()
        if t is None or t._id != w.node or _graph.get(w.node).op == G.LEAF:
            _region_writes.pop(key)
            _graph.release(w.leaf)
            continue
        if _graph.get(w.value._id).op != G.LEAF:
            continue                 # not computed yet (a realization on another device)
        _region_writes.pop(key)
        # (zyx.jit's replays would not repeat a copy made outside the captured plans)
        if _graph.get(w.leaf).rc != 2 or RT.recorder is not None \
                or not RT.write_region(w.leaf, w.box, w.value._id):
            _graph.release(w.leaf)
            _defer(t)
            continue
        holder = Tensor._wrap(w.leaf)       # (takes over the write's reference)
        rebind(t, holder, False)


RT.after_realize.append(_finish_region_writes)


# ---------------------------------------------------------------------------------------
# the in-place methods

def _index_put_(self, indices, values, accumulate=False):
    """torch.Tensor.index_put_(indices, values, accumulate=False): `self[indices] = values`,
    or `+=` with every duplicate index counted when accumulate=True."""
    return _inplace(self, lambda old: _put(old, tuple(indices), values, accumulate))


def _binop(name):
    op = getattr(Tensor, name)

    def method(self, other):
        return _inplace(self, lambda old: op(old, other))
    method.__name__ = name + "_"
    method.__doc__ = f"torch.Tensor.{name}_(other): self = self.{name}(other) in place."
    return method


def _add_(self, other, alpha=1):
    """torch.Tensor.add_(other, alpha=1): self += alpha * other."""
    return _inplace(self, lambda old: old + (other * alpha if alpha != 1 else other))


def _sub_(self, other, alpha=1):
    """torch.Tensor.sub_(other, alpha=1): self -= alpha * other."""
    return _inplace(self, lambda old: old - (other * alpha if alpha != 1 else other))


def _mul_(self, other):
    """torch.Tensor.mul_(other): self *= other (a tensor or a scalar)."""
    return _inplace(self, lambda old: old * other)


def _div_(self, other, rounding_mode=None):
    """torch.Tensor.div_(other, rounding_mode=None); true division of an integer tensor
    raises (its Float result cannot be stored in place), as in torch."""
    return _inplace(self, lambda old: old.div(other, rounding_mode=rounding_mode))


def _pow_(self, exponent):
    """torch.Tensor.pow_(exponent)."""
    return _inplace(self, lambda old: old ** exponent)


def _clamp_(self, min=None, max=None):  # noqa: A002  (torch names)
    """torch.Tensor.clamp_(min=None, max=None)."""
    return _inplace(self, lambda old: old.clamp(min, max))


def _clamp_min_(self, min):  # noqa: A002
    """torch.Tensor.clamp_min_(min)."""
    return _inplace(self, lambda old: old.clamp(min, None))


def _clamp_max_(self, max):  # noqa: A002
    """torch.Tensor.clamp_max_(max)."""
    return _inplace(self, lambda old: old.clamp(None, max))


def _fill_(self, value):
    """torch.Tensor.fill_(value): every element set to `value` (a number or a 0-d tensor)."""
    if isinstance(value, Tensor):
        if value.ndim != 0:
            raise RuntimeError(f"fill_ only supports 0-dimension value tensor but got tensor "
                               f"with {value.ndim} dimensions.")
        return _inplace(self, lambda old: value.cast(self.dtype).expand(self.shape))
    return _inplace(self, lambda old: _scalar_const(value, self.dtype, self.shape, "fill_"))


def _zero_(self):
    """torch.Tensor.zero_(): every element set to 0."""
    return _fill_(self, 0)


def _copy_(self, src, non_blocking=False):
    """torch.Tensor.copy_(src): src's values (broadcast to self's shape, cast to its
    dtype; moved to self's device) written into self."""
    if not isinstance(src, Tensor):
        src = Tensor(np.asarray(src))
    if src.device != self.device:
        src = src.to(self.device)

    def compute(old):
        s = src
        if s.shape != self.shape:
            try:
                ok = broadcast_shape(s.shape, self.shape) == self.shape
            except Exception:
                ok = False
            if not ok:
                raise RuntimeError(f"The size of tensor a ({list(self.shape)}) must match the "
                                   f"size of tensor b ({list(s.shape)})")
            s = s.expand(self.shape)
        return s.cast(self.dtype)
    return _inplace(self, compute)


def _masked_fill_(self, mask, value):
    """torch.Tensor.masked_fill_(mask, value): value where mask is True (mask broadcasts
    to self's shape)."""
    def compute(old):
        if isinstance(value, Tensor):
            return where(mask, value.cast(self.dtype), old)
        return where(mask, _scalar_const(value, self.dtype, (), "masked_fill_"), old)
    return _inplace(self, compute)


def _unary(name):
    def method(self):
        return _inplace(self, lambda old: getattr(old, name)())
    method.__name__ = name + "_"
    method.__doc__ = f"torch.Tensor.{name}_(): self = self.{name}() in place (self's dtype)."
    return method


def _check_float(t, what):
    if not t.dtype.is_float:
        raise RuntimeError(f"\"{what}\" not implemented for '{_torch_name(t.dtype)}'")


def _uniform_(self, a=0.0, b=1.0, generator=None):
    """torch.Tensor.uniform_(from=0, to=1): uniform samples from zyx's generator
    (`zyx.manual_seed`); `generator` is not supported (must be None)."""
    _check_float(self, "uniform_")
    if generator is not None:
        raise TypeError("zyx's uniform_ takes no generator (seed with zyx.manual_seed)")
    return _inplace(self, lambda old: _tensor_mod.rand(*self.shape, dtype=self.dtype,
                                                       device=self.device) * (b - a) + a)


def _normal_(self, mean=0.0, std=1.0, generator=None):
    """torch.Tensor.normal_(mean=0, std=1): normal samples from zyx's generator."""
    _check_float(self, "normal_")
    if generator is not None:
        raise TypeError("zyx's normal_ takes no generator (seed with zyx.manual_seed)")
    return _inplace(self, lambda old: _tensor_mod.randn(*self.shape, dtype=self.dtype,
                                                        device=self.device) * std + mean)


def _fill_diagonal_(self, fill_value, wrap=False):
    """torch.Tensor.fill_diagonal_(fill_value, wrap=False): the main diagonal (all indices
    equal) set to fill_value; a tensor of more than 2 dims must have equal sizes. With
    wrap=True a tall matrix's diagonal starts again after every N+1 rows, as in torch."""
    if self.ndim < 2:
        raise RuntimeError("dimensions must larger than 1")
    if self.ndim > 2 and len(set(self.shape)) != 1:
        raise RuntimeError("all dimensions of input must be of equal length")

    def compute(old):
        n = self.numel()
        flat = iota(n, dt.int64, None) if n else None
        if flat is None:
            return old
        if self.ndim == 2:
            rows, cols = self.shape
            if wrap:
                on = (flat % (cols + 1)) == 0
            else:
                on = ((flat % (cols + 1)) == 0) & (flat < builtins.min(rows, cols) * cols)
        else:
            step = builtins.sum(self.shape[0] ** i for i in range(self.ndim))
            on = (flat % step) == 0
        on = _orig["reshape"](on, self.shape)
        return where(on, _scalar_const(fill_value, self.dtype, (), "fill_diagonal_"), old)
    return _inplace(self, compute)


def _lerp_(self, end, weight):
    """torch.Tensor.lerp_(end, weight): self += weight * (end - self)."""
    return _inplace(self, lambda old: old.lerp(end, weight))


def _addcmul_(self, tensor1, tensor2, value=1):
    """torch.Tensor.addcmul_(tensor1, tensor2, value=1): self += value * tensor1 * tensor2."""
    return _inplace(self, lambda old: old + (tensor1 * tensor2) * value)


def _addcdiv_(self, tensor1, tensor2, value=1):
    """torch.Tensor.addcdiv_(tensor1, tensor2, value=1): self += value * tensor1 / tensor2
    (integer tensor1 and tensor2 are refused, as in torch)."""
    if isinstance(tensor1, Tensor) and isinstance(tensor2, Tensor) and \
            not tensor1.dtype.is_float and not tensor2.dtype.is_float:
        raise RuntimeError("Integer division with addcdiv is no longer supported, and in a "
                           "future release addcdiv will perform a true division of tensor1 "
                           "and tensor2.")
    return _inplace(self, lambda old: old + (tensor1 / tensor2) * value)


def _augmented(name):
    op = getattr(Tensor, name)

    def method(self, other):
        return _inplace(self, lambda old: op(old, other))
    method.__name__ = name.replace("__", "__i", 1)
    method.__doc__ = f"`x {name}= other` in place: x keeps its identity and dtype (torch)."
    return method


def _functional_forms(name):
    """scatter_/scatter_add_/index_add_ as thin in-place wrappers of the functional ops,
    when this build has them."""
    def method(self, *args, **kwargs):
        return _inplace(self, lambda old: getattr(old, name)(*args, **kwargs))
    method.__name__ = name + "_"
    method.__doc__ = f"torch.Tensor.{name}_: self = self.{name}(...) in place."
    return method


# ---------------------------------------------------------------------------------------
# the backward check (autograd._run_backward calls it before walking the graph)

def _old_version(s, old_id):
    """The tensor to read in place of s's current value: its version of node `old_id`."""
    r = _snapshots.get((id(s), old_id))
    snap = r() if r is not None else None
    if snap is None and not (s.requires_grad or s._ctx is not None or _written[id(s)][1]):
        _graph.retain(old_id)
        return Tensor._wrap(old_id)         # a constant input: its old value, no gradient
    if snap is None:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{_torch_name(s.dtype)} {list(s.shape)}] was written in "
            f"place after an op recorded it, and its old version is gone (a leaf that "
            f"requires grad, or a view re-derived from its base). Hint: write a clone() "
            f"instead, or write after backward().")
    return snap


def _repair(visited):
    """Point every recorded op whose input was written in place after it at the input's
    old version. True when something changed (the walk is then repeated)."""
    if not _written:
        return False
    changed = False
    for t in visited:
        ctx = t._ctx
        if type(ctx) is not tuple:
            continue
        srcs = ctx[2]
        for s in srcs:
            if id(s) in _written:
                break
        else:
            continue
        node = _graph.get(t._id)
        if ctx[0] == _COMPOSITE or len(node.srcs) != len(srcs):
            # realized since it was recorded, or a composite (its node is not the op on
            # its recorded inputs): which version it read is unknown
            if any(id(s) in _written and (s.requires_grad or s._ctx is not None or
                                          _written[id(s)][1]) for s in srcs):
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified "
                    "by an inplace operation, or may have been: an op whose result was "
                    "computed (realized) reads a tensor written in place since. Hint: write "
                    "a clone() instead.")
            continue
        new = list(srcs)
        moved = False
        for i, s in enumerate(srcs):
            if s._id != node.srcs[i]:
                new[i] = _old_version(s, node.srcs[i])
                moved = True
        if moved:
            t._ctx = (ctx[0], ctx[1], tuple(new))
            changed = True
    return changed


# ---------------------------------------------------------------------------------------
# in-place view ops: only the shape changes (unsqueeze_, squeeze_, t_, transpose_, ...)

def _restride(t, view):
    """t becomes `view(t)` (a reshape or permute of its value; torch's in-place view ops).
    A hidden tensor object takes t's old value and its place in the view tree (t's base
    and t's views point at it), and t becomes a view of it, so writes through t, through
    views taken before, or through t's base still reach each other."""
    _check_writable(t)
    old = _old_object(t)
    old._view, old._views = t._view, t._views
    if t._view is not None:
        base = t._view[0]
        base._views = [weakref.ref(old) if r() is t else r for r in base._views or ()]
    for r in old._views or ():
        c = r()
        if c is not None and c._view is not None and c._view[0] is t:
            c._view = (old, c._view[1], c._view[2])
    t._view = t._views = None
    new = view(old)                      # recorded like the out-of-place view
    _set_node(t, new)
    kind, arg = new._view[1], new._view[2]
    old._views = [r for r in old._views if r() is not new] or None
    _link(t, old, kind, arg)
    return t


def _unsqueeze_(self, dim):
    """torch.Tensor.unsqueeze_: a size-1 axis inserted at `dim`, in place."""
    return _restride(self, lambda x: x.unsqueeze(dim))


def _squeeze_(self, dim=None):
    """torch.Tensor.squeeze_: size-1 axes (or axis `dim`) removed, in place."""
    if self.squeeze(*(() if dim is None else (dim,))).shape == self.shape:
        return self          # nothing to remove (also checks dim)
    return _restride(self, lambda x: x.squeeze() if dim is None else x.squeeze(dim))


def _transpose_(self, dim0, dim1):
    """torch.Tensor.transpose_ / swapdims_ / swapaxes_: two axes swapped, in place."""
    n = builtins.max(self.ndim, 1)
    if (dim0 % n if isinstance(dim0, builtins.int) else dim0) == \
            (dim1 % n if isinstance(dim1, builtins.int) else dim1):
        self.transpose(dim0, dim1)      # checks the dims; swapping an axis with itself
        return self
    return _restride(self, lambda x: x.transpose(dim0, dim1))


def _t_(self):
    """torch.Tensor.t_: a 0-, 1- or 2-D tensor transposed in place."""
    if self.ndim > 2:
        raise RuntimeError(f"t_() expects a tensor with <= 2 dimensions, but self is "
                           f"{self.ndim}D")
    return self if self.ndim < 2 else _transpose_(self, 0, 1)


def _resize_(self, *sizes, memory_format=None):
    """torch.Tensor.resize_: t takes the shape `sizes`, keeping its values in row-major
    order: truncated when the new shape holds fewer, followed by zeros when it holds
    more (torch leaves those uninitialized; zyx gives zeros). As in torch, a tensor that
    requires grad cannot be resized while grad mode is on; neither can a view or a
    tensor with live views (their elements would no longer line up)."""
    shape = tuple(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)) \
        else tuple(sizes)
    if not all(isinstance(d, (builtins.int, np.integer)) and not isinstance(d, builtins.bool)
               and d >= 0 for d in shape):
        raise RuntimeError(f"resize_: sizes must be non-negative integers, got {sizes!r}")
    shape = tuple(builtins.int(d) for d in shape)
    if self.requires_grad and _TB.is_recording():
        raise RuntimeError("cannot resize variables that require grad")
    if self._view is not None or any(r() is not None for r in self._views or ()):
        raise RuntimeError("resize_: cannot resize a view or a tensor with views; resize "
                           "a clone() instead")
    if shared_buffer(self) is not None and shape != self.shape:
        raise RuntimeError("Trying to resize storage that is not resizable: this tensor "
                           "shares its memory with numpy or DLPack; resize a clone()")
    if shape == self.shape:
        return self
    n = 1
    for d in shape:
        n *= d
    flat = _orig["reshape"](self, (self.numel(),))
    have = flat.shape[0]
    if n < have:
        flat = _orig["__getitem__"](flat, slice(0, n))
    elif n > have:
        from .tensor import cat, zeros
        flat = cat([flat, zeros(n - have, dtype=self.dtype, device=self.device)])
    _set_node(self, _orig["reshape"](flat, shape))
    return self


def _resize_as_(self, other, memory_format=None):
    """torch.Tensor.resize_as_: resize_ to other's shape."""
    return _resize_(self, tuple(other.shape))


# ---------------------------------------------------------------------------------------
# attach

def _attach():
    for name in ("reshape", "view", "permute", "__getitem__"):
        _orig[name] = getattr(Tensor, name)
    Tensor.reshape = _reshape_view
    Tensor.view = _reshape_view
    Tensor.permute = _permute_view
    Tensor.__getitem__ = _getitem_view
    Tensor.__setitem__ = _setitem
    Tensor.data = property(_data_get, _data_set)
    for name, fn in (("add_", _add_), ("sub_", _sub_), ("mul_", _mul_), ("div_", _div_),
                     ("pow_", _pow_), ("clamp_", _clamp_), ("clip_", _clamp_),
                     ("clamp_min_", _clamp_min_), ("clamp_max_", _clamp_max_),
                     ("zero_", _zero_), ("fill_", _fill_), ("copy_", _copy_),
                     ("unsqueeze_", _unsqueeze_), ("squeeze_", _squeeze_),
                     ("transpose_", _transpose_), ("swapdims_", _transpose_),
                     ("swapaxes_", _transpose_), ("t_", _t_),
                     ("resize_", _resize_), ("resize_as_", _resize_as_),
                     ("masked_fill_", _masked_fill_), ("index_put_", _index_put_),
                     ("uniform_", _uniform_), ("normal_", _normal_),
                     ("fill_diagonal_", _fill_diagonal_), ("lerp_", _lerp_),
                     ("addcmul_", _addcmul_), ("addcdiv_", _addcdiv_),
                     ("true_divide_", _div_), ("multiply_", _mul_), ("subtract_", _sub_)):
        setattr(Tensor, name, fn)
    for name in ("neg", "abs", "exp", "log", "sqrt", "sigmoid", "tanh", "relu", "sin", "cos",
                 "floor", "ceil", "trunc", "round", "reciprocal", "rsqrt", "square", "sign",
                 "log1p", "expm1", "exp2", "log2", "erf"):
        if hasattr(Tensor, name):
            setattr(Tensor, name + "_", _unary(name))
    Tensor.neg_ = Tensor.negative_ = _inplace_neg
    for name in ("__add__", "__sub__", "__mul__", "__truediv__", "__pow__", "__floordiv__",
                 "__mod__", "__and__", "__or__", "__xor__", "__lshift__", "__rshift__"):
        setattr(Tensor, name.replace("__", "__i", 1), _augmented(name))
    for name in ("fmod", "remainder", "bitwise_and", "bitwise_or", "bitwise_xor",
                 "maximum", "minimum", "logical_and", "logical_or"):
        if hasattr(Tensor, name):
            setattr(Tensor, name + "_", _binop(name))
    for name in ("scatter", "scatter_add", "index_add", "index_fill", "index_copy",
                 "masked_scatter"):
        if hasattr(Tensor, name):
            setattr(Tensor, name + "_", _functional_forms(name))
    _autograd.inplace_repair[:] = [_repair]
    REBIND_HOOK[:] = [_rebound]


def _inplace_neg(self):
    """torch.Tensor.neg_(): self = -self."""
    return _inplace(self, lambda old: -old)


_attach()
