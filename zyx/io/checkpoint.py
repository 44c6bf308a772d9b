"""Checkpoints: `zyx.save(obj, path)` / `zyx.load(path)` of nested state in one safetensors file.

    zyx.save({"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}, "ck.st")
    ck = zyx.load("ck.st"); model.load_state_dict(ck["model"]); opt.load_state_dict(ck["optim"])

A flat mapping of names to tensors is written exactly as `zyx.io.save` writes it (a plain
safetensors file any safetensors reader opens). Anything else is split in two: every tensor
(zyx Tensor or numpy array) goes into the safetensors data under a dotted key made of its
path ("model.fc.weight", "optim.state.0.exp_avg"), and the structure around them (dicts,
lists, tuples, numbers, strings, bools, None) is JSON in the header's `__metadata__` under
`zyx.structure`, with each tensor replaced by a reference to its key. `zyx.load` rebuilds
the same nesting, tensors mapped lazily from the file.

Where this differs from torch.save: no pickle, so only the types above round-trip (a
custom object raises TypeError); dicts come back as plain dicts (OrderedDict order kept);
numpy scalars come back as Python numbers.
"""
from __future__ import annotations

import json
import numbers
from collections.abc import Mapping

import numpy as np

from . import safetensors as st

__all__ = ["save", "load", "STRUCTURE_KEY"]

STRUCTURE_KEY = "zyx.structure"
_TENSOR, _TUPLE, _PAIRS = "__zyx_tensor__", "__zyx_tuple__", "__zyx_pairs__"


def _is_array(v) -> bool:
    from ..tensor import Tensor
    return isinstance(v, (Tensor, np.ndarray))


def _is_flat(obj) -> bool:
    return isinstance(obj, Mapping) and all(
        isinstance(k, str) and k != "__metadata__" and _is_array(v) for k, v in obj.items())


class _Flattener:
    """Walks a nested value: tensors to `self.tensors` under unique dotted keys, the rest
    to a JSON-ready structure."""

    def __init__(self):
        self.tensors = {}

    def key_for(self, path):
        base = ".".join(path) or "tensor"
        key, n = base, 1
        while key in self.tensors:        # {"a.b": t1, "a": {"b": t2}} both want "a.b"
            key, n = f"{base}#{n}", n + 1
        return key

    def walk(self, v, path):
        if _is_array(v):
            key = self.key_for(path)
            self.tensors[key] = v
            return {_TENSOR: key}
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, np.generic):
            return v.item()
        if isinstance(v, numbers.Integral):
            return int(v)
        if isinstance(v, numbers.Real):
            return float(v)
        if isinstance(v, Mapping):
            return self.walk_mapping(v, path)
        if isinstance(v, tuple):
            return {_TUPLE: [self.walk(x, path + [str(i)]) for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [self.walk(x, path + [str(i)]) for i, x in enumerate(v)]
        raise TypeError(f"zyx.save cannot store a {type(v).__name__} (at "
                        f"{'.'.join(path) or 'the top level'}): checkpoints hold tensors, numpy "
                        "arrays, dicts, lists, tuples, numbers, strings, bools and None")

    def walk_mapping(self, m, path):
        plain = all(isinstance(k, str) and not k.startswith("__zyx_") for k in m)
        if plain:
            return {k: self.walk(v, path + [k]) for k, v in m.items()}
        # non-string keys (an optimizer's parameter indices) keep their type as pairs
        pairs = []
        for k, v in m.items():
            if not (k is None or isinstance(k, (bool, str, numbers.Integral, float))):
                raise TypeError(f"zyx.save: dict key {k!r} of type {type(k).__name__} is not "
                                "a string, number, bool or None")
            key = int(k) if isinstance(k, numbers.Integral) and not isinstance(k, bool) else k
            pairs.append([key, self.walk(v, path + [str(k)])])
        return {_PAIRS: pairs}


def _rebuild(v, tensors):
    if isinstance(v, list):
        return [_rebuild(x, tensors) for x in v]
    if isinstance(v, dict):
        if _TENSOR in v:
            return tensors[v[_TENSOR]]
        if _TUPLE in v:
            return tuple(_rebuild(x, tensors) for x in v[_TUPLE])
        if _PAIRS in v:
            return {k: _rebuild(x, tensors) for k, x in v[_PAIRS]}
        return {k: _rebuild(x, tensors) for k, x in v.items()}
    return v


def save(obj, path, metadata=None) -> None:
    """Write `obj` to `path` as safetensors: a flat name -> tensor mapping (or a Module)
    exactly as `zyx.io.save`, anything nested with its structure in the metadata."""
    if hasattr(obj, "state_dict") and not isinstance(obj, Mapping):
        obj = obj.state_dict()
    if _is_flat(obj):
        return st.save(obj, path, metadata)
    if metadata is not None and STRUCTURE_KEY in metadata:
        raise st.SafetensorsError(f"metadata key {STRUCTURE_KEY!r} is reserved for the "
                                  "checkpoint structure")
    flat = _Flattener()
    structure = flat.walk(obj, [])
    meta = dict(metadata or {})
    meta[STRUCTURE_KEY] = json.dumps(structure, separators=(",", ":"), allow_nan=True)
    st.save(flat.tensors, path, meta)


def load(path):
    """Read a file written by `save` (or any safetensors file): the nested structure it was
    saved with, or a flat dict name -> Tensor. Tensors are read lazily."""
    tensors = st.load(path)
    structure = st.load_metadata(path).get(STRUCTURE_KEY)
    if structure is None:
        return tensors
    # RecursionError: "[[[[..." deeper than json's parser or _rebuild recurses (a corrupt
    # or hostile file; the config and tuning files are read the same way)
    try:
        tree = json.loads(structure)
    except ValueError as e:
        raise st.SafetensorsError(f"{path}: corrupt {STRUCTURE_KEY!r} metadata ({e})") from None
    except RecursionError:
        raise st.SafetensorsError(f"{path}: corrupt {STRUCTURE_KEY!r} metadata (nested too "
                                  "deeply)") from None
    try:
        return _rebuild(tree, tensors)
    except KeyError as e:
        raise st.SafetensorsError(f"{path}: the structure names tensor {e} which the file "
                                  "does not hold") from None
    except RecursionError:
        raise st.SafetensorsError(f"{path}: the {STRUCTURE_KEY!r} metadata nests values too "
                                  "deeply to rebuild") from None
