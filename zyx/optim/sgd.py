"""Stochastic gradient descent (torch.optim.SGD semantics)."""
from __future__ import annotations

from .optimizer import Optimizer


class SGD(Optimizer):
    """SGD with momentum, dampening, Nesterov momentum, L2 weight decay and `maximize`.

    As torch: d = g (+ weight_decay * p); with momentum, buf = d on the first step, else
    buf = momentum * buf + (1 - dampening) * d, and d = d + momentum * buf (Nesterov) or
    buf; then p = p - lr * d."""

    def __init__(self, params=None, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, maximize=False):
        if momentum < 0:
            raise ValueError(f"invalid momentum {momentum}")
        if weight_decay < 0:
            raise ValueError(f"invalid weight_decay {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov,
                                      maximize=maximize))

    def _update(self, p, g, group, state):
        d = -g if group["maximize"] else g
        wd = group["weight_decay"]
        if wd != 0:
            d = d + p * wd
        upd = {}
        mom = group["momentum"]
        if mom != 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = d
            else:
                buf = buf * mom + d * (1.0 - group["dampening"])
            upd["momentum_buffer"] = buf
            d = d + buf * mom if group["nesterov"] else buf
        lr = self._scalars(p, group, state)[0]
        return p - lr * d, upd

    def _scalars(self, p, group, state):
        """The learning rate as a step scalar: a zyx.jit replay (Optimizer._replayed)
        writes a changed param_groups lr into the same leaf."""
        return [self.step_scalar(("lr", id(group)), group["lr"], p.dtype)]
