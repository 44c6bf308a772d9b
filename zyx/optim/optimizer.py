"""The Optimizer base: parameter groups, state, and one realization per update.

An update is written lazily for every parameter (new value and new optimizer state), then
everything is computed in one `RT.realize` call, so all parameters update in as few kernels
as fusion allows (with the Tape path, the gradients themselves and the forward pass fuse
in too). Parameter Tensors are then rebound in place to their new node, so references the
user (or a Module) holds stay valid.

Hyperparameters that change between steps (the learning rate under a scheduler, Adam's
bias corrections) enter kernels as 0-d leaf tensors, not folded constants: the graph cache
keys on constants' values but only on leaves' shapes, so a new value never means a new
kernel.
"""
from __future__ import annotations

import numpy as np

from ..autograd import enable_grad, no_grad
from ..errors import ZyxError
from ..runtime import RT
from .. import dtype as dt
from ..tensor import Tensor, f32_to_bf16_bits, new_handle, rebind


def _scalar_bits(value, dtype):
    """`value` as one element of `dtype`, the bytes a leaf of that dtype stores."""
    if dtype is dt.bfloat16:
        return f32_to_bf16_bits(np.array(value, dtype=np.float32))
    return np.array(value, dtype=dtype.np)


def _as_list(x):
    return [x] if isinstance(x, Tensor) else list(x)


class Optimizer:
    """Base class. Subclasses set `defaults` and implement
    `_update(p, g, group, state, scalars) -> (new_p, new_state_dict)` with lazy Tensor ops."""

    def __init__(self, params, defaults: dict):
        self.defaults = dict(defaults)
        self.param_groups = []
        self.state = {}            # id(param) -> dict of state tensors and the step count
        self._group_of = {}        # id(param) -> group
        self._scalar_cache = {}    # (value, dtype) -> 0-d leaf tensor
        self._live = {}            # (name, dtype) -> [[0-d leaf rewritten per step, value]]
        self._used = {}            # this update: ((name, dtype), value) -> leaf
        self._taken = {}           # this update: (name, dtype) -> leaves handed out
        if params is None:
            params = []
        if isinstance(params, Tensor):
            params = [params]
        params = list(params)
        if params and isinstance(params[0], dict):
            for g in params:
                self.add_param_group(g)
        else:
            self.add_param_group({"params": params})

    def __repr__(self):
        lines = [f"{type(self).__name__} ("]
        for i, g in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            for k in sorted(g):
                if k != "params":
                    lines.append(f"    {k}: {g[k]}")
        return "\n".join(lines) + "\n)"

    def add_param_group(self, group: dict) -> None:
        """Add a dict with 'params' and optional hyperparameters (defaults fill the rest)."""
        group = dict(group)
        ps = group.get("params", [])
        ps = _as_list(ps.parameters() if hasattr(ps, "parameters") else ps)
        for p in ps:
            if not isinstance(p, Tensor):
                raise TypeError(f"optimizer parameters must be Tensors, got {type(p).__name__}")
            if not p.dtype.is_float:
                raise ZyxError(f"can only optimize floating-point tensors, got {p.dtype.name}")
            if id(p) in self._group_of:
                raise ZyxError("a parameter appears in more than one parameter group")
        group["params"] = ps
        for k, v in self.defaults.items():
            group.setdefault(k, v)
        self._check_group(group)
        for p in ps:
            self._group_of[id(p)] = group
        self.param_groups.append(group)

    def _check_group(self, group):
        if group["lr"] < 0:
            raise ValueError(f"invalid learning rate {group['lr']}")

    # -- torch convention -----------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget accumulated `.grad`s (None, or zeros with set_to_none=False)."""
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none or p.grad is None:
                    p.grad = None
                else:
                    p.grad = Tensor(np.zeros(p.shape, p.dtype.np), dtype=p.dtype)

    def step(self, closure=None):
        """Update every parameter that has a `.grad`; returns closure() when given."""
        loss = None
        if closure is not None:
            with enable_grad():
                loss = closure()
        triples = [(p, p.grad, group) for group in self.param_groups
                   for p in group["params"] if p.grad is not None]
        self._apply(triples, ())
        return loss

    # -- zyx convention -------------------------------------------------------------------
    def update(self, params, grads, realize=()):
        """Apply `grads` (from `tape.gradient`) to `params`: lists in the same order, or
        dicts with the same keys. Parameters unknown to the optimizer join the first group.
        `realize` lists extra tensors (e.g. the loss) to compute in the same pass."""
        if isinstance(params, dict):
            keys = list(params)
            if not isinstance(grads, dict) or set(grads) != set(keys):
                raise ZyxError("update(params, grads): both must be dicts with the same keys")
            params, grads = [params[k] for k in keys], [grads[k] for k in keys]
        else:
            params = _as_list(params.parameters() if hasattr(params, "parameters") else params)
            grads = _as_list(grads)
        if len(params) != len(grads):
            raise ZyxError(f"update(params, grads): {len(params)} parameters but "
                           f"{len(grads)} gradients")
        triples = []
        for p, g in zip(params, grads):
            if g is None:
                continue
            if g.shape != p.shape:
                raise ZyxError(f"gradient of shape {g.shape} for a parameter of shape {p.shape}")
            group = self._group_of.get(id(p))
            if group is None:
                group = self.param_groups[0]
                group["params"].append(p)
                self._group_of[id(p)] = group
            triples.append((p, g, group))
        self._apply(triples, _as_list(realize))

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """{"state": {param index: {name: tensor or step}}, "param_groups": [...]} with
        parameters numbered in group order (torch layout)."""
        index, groups = {}, []
        for g in self.param_groups:
            ids = []
            for p in g["params"]:
                index.setdefault(id(p), len(index))
                ids.append(index[id(p)])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        state = {index[k]: dict(v) for k, v in self.state.items() if k in index}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore hyperparameters and state saved by `state_dict` (same parameter layout)."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)):
            raise ZyxError("optimizer state_dict has a different parameter group layout: "
                           f"{[len(g['params']) for g in groups]} parameters per group vs "
                           f"{[len(g['params']) for g in self.param_groups]}")
        by_index = {}
        for group, saved in zip(self.param_groups, groups):
            for p, i in zip(group["params"], saved["params"]):
                by_index[i] = p
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.state = {}
        for i, st in state_dict["state"].items():
            p = by_index[int(i)]
            new = {}
            for k, v in st.items():
                if k == "step":
                    # torch keeps the count as a 0-d tensor; zyx keeps a Python int
                    v = int(v.item()) if hasattr(v, "item") else int(v)
                elif isinstance(v, Tensor):
                    if v.shape != p.shape:
                        raise ZyxError(f"optimizer state {k!r} of parameter {i} has shape "
                                       f"{v.shape}, the parameter {p.shape}")
                    v = v.cast(p.dtype).detach()
                new[k] = v
            self.state[id(p)] = new

    # -- machinery ------------------------------------------------------------------------
    def scalar(self, value, dtype) -> Tensor:
        """A 0-d leaf holding `value` (cached while the value stays the same)."""
        key = (float(value), dtype)
        t = self._scalar_cache.get(key)
        if t is None:
            if len(self._scalar_cache) > 64:
                self._scalar_cache.clear()
            t = self.fresh_scalar(value, dtype)
            self._scalar_cache[key] = t
        return t

    @staticmethod
    def fresh_scalar(value, dtype) -> Tensor:
        """A new 0-d leaf."""
        return Tensor(np.array(value, dtype=np.float64), dtype=dtype)

    def step_scalar(self, name, value, dtype) -> Tensor:
        """A 0-d leaf for a value that changes every step (Adam's bias corrections).

        Leaves are reused across steps and their memory rewritten, instead of a new tensor
        and host->device copy per parameter per step. Within one update, equal values share
        a leaf and different values (parameters at different step counts) get different
        leaves. Safe because the leaves never leave the optimizer and `_apply` realizes
        every update that reads them before returning."""
        key = (name, dtype)
        t = self._used.get((key, value))
        if t is not None:
            return t
        leaves = self._live.setdefault(key, [])
        n = self._taken.get(key, 0)
        self._taken[key] = n + 1
        if n == len(leaves):
            leaves.append([self.fresh_scalar(value, dtype), value])
        slot = leaves[n]
        t = slot[0]
        if slot[1] != value:
            buf = RT.graph.get(t._id).buffer
            buf.pool.host_to_pool(_scalar_bits(value, dtype), buf,
                                  [buf.event] if buf.event is not None else [])
            slot[1] = value
        self._used[(key, value)] = t
        return t

    def _apply(self, triples, extra):
        if not triples:
            if extra:
                RT.realize([t._id for t in extra])
            return
        self._used.clear()
        self._taken.clear()
        with no_grad():
            new_params = []
            new_states = []
            for p, g, group in triples:
                if g.dtype is not p.dtype:
                    g = g.cast(p.dtype)
                state = self.state.setdefault(id(p), {"step": 0})
                state["step"] += 1
                new_p, upd = self._update(p, g.detach(), group, state)
                new_params.append((p, new_p))
                new_states.append((state, upd))
            ids = [t._id for t in extra]
            ids += [n._id for _, n in new_params]
            ids += [t._id for _, upd in new_states for t in upd.values()]
            try:
                RT.realize(ids)
            except BaseException:
                # nothing was bound (a failed index check, an interrupt): the step did
                # not happen, so its count must not either (Adam's bias corrections)
                for state, _ in new_states:
                    state["step"] -= 1
                raise
            for state, upd in new_states:
                for k, v in upd.items():
                    old = state.get(k)
                    if isinstance(old, Tensor):
                        # the same object every step, as torch's in-place state: what
                        # holds it (a state_dict, a zyx.jit capture) sees the new value
                        rebind(old, v)
                    else:
                        state[k] = new_handle(v)
            for p, n in new_params:
                rebind(p, n)
            if RT.recorder is not None:
                # zyx.jit replays this update without calling step(): the step counts and
                # the 0-d leaves written from them must still advance
                updated = [(p, group) for p, _, group in triples]
                RT.recorder.on_replay(lambda: self._replayed(updated))

    def _replayed(self, updated):
        """What an update does besides building its graph, for a zyx.jit replay of it:
        count the step of every parameter in `updated` ((param, group) pairs) and write
        the step scalars (bias corrections, a learning rate changed in param_groups)
        into the same leaves, in the order `_update` took them."""
        self._used.clear()
        self._taken.clear()
        for p, group in updated:
            state = self.state[id(p)]
            state["step"] += 1
            self._scalars(p, group, state)

    def _scalars(self, p, group, state):
        """The step scalars `_update` takes for parameter p, in its order (none here)."""
        return []

    def _update(self, p, g, group, state):
        raise NotImplementedError
