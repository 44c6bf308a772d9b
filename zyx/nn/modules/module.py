"""Module: the base class of every layer (torch.nn.Module's API on zyx tensors).

Assigning attributes registers them, as in torch: a Module becomes a submodule, a Tensor
with `requires_grad=True` becomes a parameter, and `register_buffer` declares a buffer
(state that is saved but not trained, like BatchNorm's running statistics).
"""
from __future__ import annotations

import copy
import sys
import threading
from collections import OrderedDict, namedtuple
from typing import Iterator

import numpy as np

from ... import dtype as dt
from ...errors import ShapeError, ZyxError
from ...runtime import RT
from ...tensor import Tensor, rebind, parse_to_args, new_handle
from ..init import copy_into

__all__ = ["Module", "Parameter"]

_IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])

# This module is compiled, and calls between compiled functions pass no Python recursion
# check: a module that contains itself, or a very deep nesting, would overflow the C stack
# (a segfault) in the recursive walks below. They count their own depth and raise
# RecursionError as torch does; the cap keeps the C stack safe under a raised recursion limit.
_MAX_DEPTH = 8000
_walk = threading.local()


class _Deeper:
    __slots__ = ("what",)

    def __init__(self, what):
        self.what = what

    def __enter__(self):
        d = getattr(_walk, "depth", 0) + 1
        if d > min(sys.getrecursionlimit(), _MAX_DEPTH):
            raise RecursionError(f"maximum recursion depth exceeded in Module.{self.what} "
                                 "(does a module contain itself?)")
        _walk.depth = d

    def __exit__(self, *exc):
        _walk.depth -= 1


def Parameter(data=None, requires_grad=True) -> Tensor:  # noqa: N802  (torch spelling)
    """A trainable tensor: a plain zyx.Tensor with requires_grad set (zyx has no Parameter
    class; assigning such a tensor to a Module attribute registers it as a parameter).
    A Tensor argument is not copied: a new handle on the same value is returned."""
    if data is None:
        data = np.zeros(0, np.float32)
    t = new_handle(data) if isinstance(data, Tensor) else Tensor(np.asarray(data))
    t.requires_grad = requires_grad
    return t


# numpy kinds a state-dict value may have: bool, ints, floats (cast to the parameter's
# dtype, as torch's copy_ does); strings, objects and complex numbers are refused
_NUMERIC_KINDS = "biuf"


def _state_value(key, value, dst: Tensor):
    """(value as a Tensor of dst's shape and dtype, None) or (None, what is wrong)."""
    if isinstance(value, Tensor):
        if value.shape != dst.shape:
            return None, _size_mismatch(key, value.shape, dst.shape)
        return value, None
    try:
        if hasattr(value, "detach") and hasattr(value, "cpu"):   # a torch tensor
            v = value.detach().cpu()
            value = (v.float() if str(v.dtype) == "torch.bfloat16" else v).numpy()
        arr = np.asarray(value)
    except (TypeError, ValueError) as e:
        return None, f"value for {key!r} is not an array ({e})"
    if arr.dtype.kind not in _NUMERIC_KINDS:
        return None, (f"value for {key!r} has numpy dtype {arr.dtype}, which cannot be "
                      f"copied into a {dst.dtype} tensor")
    if arr.shape != dst.shape:
        return None, _size_mismatch(key, arr.shape, dst.shape)
    return Tensor(arr, dtype=dst.dtype), None


def _size_mismatch(key, shape, want):
    return (f"size mismatch for {key!r}: copying a value of shape {tuple(shape)} from the "
            f"state_dict, the shape in the current model is {want}")


def _addindent(s: str, n: int) -> str:
    lines = s.split("\n")
    if len(lines) == 1:
        return lines[0]
    return "\n".join([lines[0]] + [" " * n + ln for ln in lines[1:]])


class Module:
    """Base class of layers: subclass it, assign parameters and submodules in __init__
    (after `super().__init__()`), write `forward`, call the module like a function."""

    training: bool

    def __init__(self, *args, **kwargs):
        d = self.__dict__
        d["_parameters"] = OrderedDict()
        d["_buffers"] = OrderedDict()
        d["_non_persistent"] = set()
        d["_modules"] = OrderedDict()
        d["training"] = True

    # -- registration ----------------------------------------------------------------------
    def _dicts(self):
        d = self.__dict__
        if "_parameters" not in d:
            raise ZyxError(f"{type(self).__name__}: call super().__init__() before assigning "
                           f"attributes")
        return d["_parameters"], d["_buffers"], d["_modules"]

    def __setattr__(self, name, value):
        params, buffers, modules = self._dicts()
        if isinstance(value, Module):
            params.pop(name, None)
            buffers.pop(name, None)
            self.__dict__.pop(name, None)
            modules[name] = value
        elif name in buffers:
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(f"cannot assign {type(value).__name__} as buffer {name!r} "
                                f"(a zyx.Tensor or None expected)")
            buffers[name] = value
        elif isinstance(value, Tensor) and (name in params or (
                value.requires_grad and getattr(value, "is_leaf", True))):
            # only leaves become parameters: an intermediate of a recorded op also has
            # requires_grad=True, and caching one on the module must not register it
            modules.pop(name, None)
            self.__dict__.pop(name, None)
            params[name] = value
        elif value is None and (name in params or name in modules):
            (params if name in params else modules)[name] = None
        else:
            if name in params or name in modules:
                raise TypeError(f"cannot assign {type(value).__name__} to {name!r} of "
                                f"{type(self).__name__} (it is a "
                                f"{'parameter' if name in params else 'submodule'})")
            object.__setattr__(self, name, value)

    def __getattr__(self, name):
        d = self.__dict__
        for key in ("_parameters", "_buffers", "_modules"):
            table = d.get(key)
            if table is not None and name in table:
                return table[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name):
        for table in self._dicts():
            if name in table:
                del table[name]
                self.__dict__["_non_persistent"].discard(name)
                return
        object.__delattr__(self, name)

    def register_parameter(self, name: str, param) -> None:
        if param is not None and not isinstance(param, Tensor):
            raise TypeError(f"parameter {name!r} must be a zyx.Tensor or None")
        params, buffers, modules = self._dicts()
        if name in buffers or name in modules:
            raise KeyError(f"attribute {name!r} already exists")
        params[name] = param

    def register_buffer(self, name: str, tensor, persistent: bool = True) -> None:
        """Declare state that is not trained: saved in state_dict (unless persistent=False),
        moved by to()/float(), never returned by parameters()."""
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(f"buffer {name!r} must be a zyx.Tensor or None")
        params, buffers, modules = self._dicts()
        if name in params or name in modules:
            raise KeyError(f"attribute {name!r} already exists")
        self.__dict__.pop(name, None)
        buffers[name] = tensor
        if persistent:
            self._non_persistent.discard(name)
        else:
            self._non_persistent.add(name)

    def add_module(self, name: str, module) -> None:
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"{type(module).__name__} is not a Module")
        params, buffers, modules = self._dicts()
        params.pop(name, None)
        buffers.pop(name, None)
        modules[name] = module

    register_module = add_module

    def get_submodule(self, target: str) -> "Module":
        m = self
        for part in target.split(".") if target else []:
            m = m._modules.get(part) if isinstance(m, Module) else None
            if m is None:
                raise AttributeError(f"{type(self).__name__} has no submodule {target!r}")
        return m

    # -- traversal -------------------------------------------------------------------------
    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        # Depth-first with an explicit stack (the order of torch's recursion), so a deep
        # nesting cannot overflow the C stack; with remove_duplicate=False a module that
        # contains itself would never end, and raises RecursionError as in torch.
        if memo is None:
            memo = set()
        if remove_duplicate:
            if id(self) in memo:
                return
            memo.add(id(self))
        yield prefix, self
        path = [id(self)]
        on_path = {id(self)}
        frames = [(prefix, iter(self._modules.items()))]
        while frames:
            pfx, it = frames[-1]
            for name, m in it:
                if m is None:
                    continue
                if remove_duplicate:
                    if id(m) in memo:
                        continue
                    memo.add(id(m))
                elif id(m) in on_path:
                    raise RecursionError("maximum recursion depth exceeded in "
                                         f"Module.named_modules: {type(m).__name__} "
                                         "contains itself")
                sub = pfx + ("." if pfx else "") + name
                yield sub, m
                frames.append((sub, iter(m._modules.items())))
                path.append(id(m))
                on_path.add(id(m))
                break
            else:
                frames.pop()
                on_path.discard(path.pop())

    def modules(self) -> Iterator["Module"]:
        for _, m in self.named_modules():
            yield m

    def named_children(self):
        seen = set()
        for name, m in self._modules.items():
            if m is not None and id(m) not in seen:
                seen.add(id(m))
                yield name, m

    def children(self) -> Iterator["Module"]:
        for _, m in self.named_children():
            yield m

    def _named_members(self, table, prefix, recurse, remove_duplicate=True):
        seen = set()
        mods = self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) if recurse \
            else [(prefix, self)]
        for mp, m in mods:
            for name, t in m.__dict__[table].items():
                if t is None or (remove_duplicate and id(t) in seen):
                    continue
                seen.add(id(t))
                yield mp + ("." if mp else "") + name, t

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        yield from self._named_members("_parameters", prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[Tensor]:
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        yield from self._named_members("_buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def apply(self, fn) -> "Module":
        with _Deeper("apply"):
            for m in self.children():
                m.apply(fn)
            fn(self)
        return self

    # -- state -----------------------------------------------------------------------------
    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        """Parameters and persistent buffers by dotted name (torch's key names and order).
        Values are detached aliases unless keep_vars=True (the tensors themselves): as in
        torch they share storage with the module's tensors, so `sd["w"].copy_(v)` (or an
        EMA loop's `v.mul_(d).add_(...)`) changes the module, and a later optimizer step or
        load_state_dict shows in `sd`. Save a snapshot with `{k: v.clone() ...}`."""
        if destination is None:
            destination = OrderedDict()
        with _Deeper("state_dict"):
            self._state_dict_into(destination, prefix, keep_vars)
        return destination

    def _state_dict_into(self, destination, prefix, keep_vars):
        for name, p in self._parameters.items():
            if p is not None:
                destination[prefix + name] = p if keep_vars else p.detach()
        for name, b in self._buffers.items():
            if b is not None and name not in self._non_persistent:
                destination[prefix + name] = b if keep_vars else b.detach()
        for name, m in self._modules.items():
            if m is not None:
                m.state_dict(destination, prefix + name + ".", keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Copy values into this module's parameters and buffers (same tensor objects, new
        values). Keys missing from `state_dict` or unknown to the module raise a ZyxError
        naming them when strict; a shape mismatch always raises. Nothing is loaded when an
        error is raised. Returns (missing_keys, unexpected_keys)."""
        own = self.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        errors = []
        if strict:
            if missing:
                errors.append("missing key(s) in state_dict: " +
                              ", ".join(repr(k) for k in missing))
            if unexpected:
                errors.append("unexpected key(s) in state_dict: " +
                              ", ".join(repr(k) for k in unexpected))
        # every value is checked and converted before the first one is assigned
        values = {}
        for k, dst in own.items():
            if k in state_dict:
                value, error = _state_value(k, state_dict[k], dst)
                if error:
                    errors.append(error)
                else:
                    values[k] = value
        if errors:
            raise ZyxError(f"error(s) in loading state_dict for {type(self).__name__}: " +
                           "; ".join(errors))
        for k, v in values.items():
            copy_into(own[k], v)
        return _IncompatibleKeys(missing, unexpected)

    # -- modes, grads, dtypes ---------------------------------------------------------------
    def train(self, mode: bool = True) -> "Module":
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        for m in self.modules():
            m.__dict__["training"] = mode
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def requires_grad_(self, requires_grad: bool = True) -> "Module":
        for p in self.parameters():
            p.requires_grad = requires_grad
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the parameters' gradients: None (default), or zeros with
        set_to_none=False (zeros even where the gradient was NaN, as torch's zero_)."""
        for p in self.parameters():
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad = Tensor(np.zeros(p.shape, np.float32 if p.dtype is dt.bfloat16
                                         else p.dtype.np), dtype=p.dtype)

    def to(self, *args, dtype=None, device=None, non_blocking=False) -> "Module":
        """Move parameters and buffers to a device and/or cast the floating ones to a
        dtype (torch's `to(device)`, `to(dtype)`, `to(device, dtype)`, `to(tensor)`), in
        place: the tensor objects stay the same, so an optimizer built before still holds
        them (its state follows at the next step). Gradients move with their parameters."""
        device, dtype = parse_to_args(args, device, dtype)
        d = None
        if dtype is not None:
            d = dt.to_dtype(dtype)
            if not d.is_float:
                raise TypeError(f"Module.to only accepts floating dtypes, got {d.name}")
        target = None if device is None else RT.resolve(device)
        for t in list(self.parameters()) + list(self.buffers()):
            rg = t.requires_grad
            if d is not None and t.dtype.is_float and t.dtype is not d:
                _assign_cast(t, d)
            if target is not None:
                _move(t, target)
                if t.grad is not None:
                    _move(t.grad, target)
            t.requires_grad = rg
        return self

    def float(self) -> "Module":
        return self.to(dt.float32)

    def double(self) -> "Module":
        return self.to(dt.float64)

    def half(self) -> "Module":
        return self.to(dt.float16)

    def bfloat16(self) -> "Module":
        return self.to(dt.bfloat16)

    def cpu(self) -> "Module":
        """Move parameters and buffers to the CPU (C backend)."""
        return self.to(device="cpu")

    def cuda(self, device=None) -> "Module":
        """Move parameters and buffers to a CUDA device (`cuda:0` unless `device` says)."""
        return self.to(device="cuda" if device is None else
                       (f"cuda:{device}" if isinstance(device, int) else device))

    # -- calling ----------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} has no forward()")

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    # -- copying, printing ------------------------------------------------------------------
    def __deepcopy__(self, memo):
        """Deep copies share no tensors: every tensor reachable from a module attribute is
        replaced by a fresh handle on the same value (zyx tensors are immutable values)."""
        with _Deeper("__deepcopy__"):
            return self._module_deepcopy(memo)

    def _module_deepcopy(self, memo):
        for m in self.modules():
            for v in list(m.__dict__.values()) + list(m._parameters.values()) + \
                    list(m._buffers.values()):
                if isinstance(v, Tensor) and id(v) not in memo:
                    c = new_handle(v)     # not detach(): a copy shares no storage
                    c.requires_grad = v.requires_grad
                    memo[id(v)] = c
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            new.__dict__[k] = copy.deepcopy(v, memo)
        return new

    def extra_repr(self) -> str:
        return ""

    def __repr__(self):
        with _Deeper("__repr__"):
            return self._module_repr()

    def _module_repr(self):
        extra = self.extra_repr()
        lines = extra.split("\n") if extra else []
        for name, m in self._modules.items():
            lines.append(f"({name}): " + _addindent(repr(m), 2))
        main = type(self).__name__ + "("
        if lines:
            if len(lines) == 1 and not self._modules:
                main += lines[0]
            else:
                main += "\n  " + "\n  ".join(lines) + "\n"
        return main + ")"

    def __dir__(self):
        return sorted(set(object.__dir__(self)) | set(self._parameters) | set(self._buffers) |
                      set(self._modules))


def _assign_cast(t: Tensor, d) -> None:
    _assign_any(t, t.cast(d))


def _move(t: Tensor, dev) -> None:
    """Rebind tensor object `t` to a copy of its value on backend device `dev`."""
    if RT.device_of(t._id) is not dev:
        rebind(t, new_handle(t).to(dev))


def _assign_any(dst: Tensor, src: Tensor) -> None:
    """Like init.copy_into but lets the dtype change (Module.to)."""
    rebind(dst, src)


def _check_shape(x: Tensor, ndims, what: str) -> None:
    if x.ndim not in ndims:
        raise ShapeError(f"{what} expects a {' or '.join(f'{n}-D' for n in ndims)} input, "
                         f"got shape {x.shape}")


def new_parameter(*shape, dtype=None, fill=None) -> Tensor:
    """A new trainable tensor of `shape` (zeros, or `fill`); initializers then give it its
    values. Parameters are always realized buffers, never lazy constants.
    Internal helper shared by zyx.nn's modules (not in __all__)."""
    d = dt.to_dtype(dtype) if dtype is not None else dt.float32
    arr = np.full(shape, 0.0 if fill is None else fill,
                  dtype=np.float32 if d is dt.bfloat16 else d.np)
    t = Tensor(arr, dtype=d)
    t.requires_grad = True
    return t


def new_buffer(arr, dtype=None) -> Tensor:
    """A module buffer (not trainable) holding array `arr`, of `dtype` if given.
    Internal helper shared by zyx.nn's modules (not in __all__)."""
    d = dt.to_dtype(dtype) if dtype is not None else None
    return Tensor(np.asarray(arr), dtype=d)
