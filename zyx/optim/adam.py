"""Adam and AdamW (torch.optim semantics)."""
from __future__ import annotations

import math

import numpy as np

from .._core import replay as _replay
from ..runtime import RT
from ..tensor import Tensor
from .optimizer import Optimizer


def _zero_state(p):
    """A realized zero tensor like `p`, on p's device. Not a constant: with the moments
    leaves from the first step on, the first step's graph has the structure of every
    later step's, so the second step reuses its plan instead of compiling another (a
    constant 0 folds away and makes step 1 a different plan: 1.2 s more of compiling
    for a 30-step LSTM)."""
    dev = RT.device_of(p._id) if RT._multi else None
    return Tensor(np.zeros(p.shape, np.float32), dtype=p.dtype, device=dev)


class Adam(Optimizer):
    """Adam with optional AMSGrad, L2 `weight_decay` (added to the gradient) and `maximize`.

    The bias corrections change every step, so they enter the kernel as 0-d leaves
    (`step_size = lr / (1 - beta1^t)` and `sqrt(1 - beta2^t)`): one plan serves all
    steps after the first."""

    _decoupled = False

    def __init__(self, params=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, maximize=False):
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"invalid betas {betas}")
        if eps < 0:
            raise ValueError(f"invalid eps {eps}")
        if weight_decay < 0:
            raise ValueError(f"invalid weight_decay {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, amsgrad=amsgrad,
                                      maximize=maximize))

    def _update(self, p, g, group, state):
        b1, b2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        t = state["step"]
        m = state.get("exp_avg")
        v = state.get("exp_avg_sq")
        if m is None:
            m = _zero_state(p)
            v = _zero_state(p)
        ins = [p, g, m, v] + self._scalars(p, group, state)
        decay = self._decoupled and wd != 0
        vmax = state.get("max_exp_avg_sq") if group["amsgrad"] else None
        if vmax is not None:
            ins.append(vmax)
        # the nodes depend on the constants below, never on values: replayed after the
        # first step of a parameter's shape (~12 ops per parameter a step)
        key = (b1, b2, eps, wd, decay, group["maximize"], group["amsgrad"], vmax is not None)
        made = _UPDATES.run(RT.graph, key, ins, lambda *a: self._math(a, key), Tensor._wrap)
        upd = {"exp_avg": made[1], "exp_avg_sq": made[2]}
        if group["amsgrad"]:
            upd["max_exp_avg_sq"] = made[3]
        return made[0], upd

    def _scalars(self, p, group, state):
        """The 0-d leaves of this step: lr / (1 - beta1^t), sqrt(1 - beta2^t) and, for
        AdamW, the decay factor (a leaf too: lr may follow a schedule). Step scalars,
        so that a zyx.jit replay (Optimizer._replayed) rewrites the same leaves."""
        b1, b2 = group["betas"]
        lr, wd, t = group["lr"], group["weight_decay"], state["step"]
        out = [self.step_scalar(("step_size", id(group)), lr / (1.0 - b1 ** t), p.dtype),
               self.step_scalar(("bc2_sqrt", id(group)), math.sqrt(1.0 - b2 ** t), p.dtype)]
        if self._decoupled and wd != 0:
            out.append(self.step_scalar(("decay", id(group)), 1.0 - lr * wd, p.dtype))
        return out

    def _math(self, ins, key):
        """[new p, m, v(, vmax)] from _update's inputs and key."""
        b1, b2, eps, wd, decay, maximize, amsgrad, has_vmax = key
        p, g, m, v, step_size, bc2_sqrt = ins[:6]
        if maximize:
            g = -g
        if decay:
            p = p * ins[6]
        elif wd != 0:
            g = g + p * wd
        m = m + (g - m) * (1.0 - b1)            # torch: exp_avg.lerp_(grad, 1 - beta1)
        v = v * b2 + g * g * (1.0 - b2)
        out = [None, m, v]
        if amsgrad:
            vmax = ins[-1].maximum(v) if has_vmax else v
            out.append(vmax)
            v = vmax
        denom = v.sqrt() / bc2_sqrt + eps
        out[0] = p - step_size * (m / denom)
        return out


_UPDATES = _replay.ForwardTemplates(256)    # Adam's per-parameter update nodes


class AdamW(Adam):
    """Adam with decoupled weight decay: p = p * (1 - lr * weight_decay) before the step."""

    _decoupled = True

    def __init__(self, params=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, maximize=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize)
