"""RMSprop (torch.optim.RMSprop semantics)."""
from __future__ import annotations

from ..tensor import const_tensor
from .optimizer import Optimizer


class RMSprop(Optimizer):
    """RMSprop with `centered`, `momentum`, L2 `weight_decay` and `maximize`.

    As torch: v = alpha * v + (1 - alpha) * g^2; with centered, avg = sqrt(v - mean_g^2)
    where mean_g = lerp(mean_g, g, 1 - alpha), else sqrt(v); avg += eps; with momentum,
    buf = momentum * buf + g / avg and p -= lr * buf, else p -= lr * g / avg."""

    def __init__(self, params=None, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0,
                 momentum=0.0, centered=False, maximize=False):
        if eps < 0 or alpha < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError("RMSprop: lr, alpha, eps, momentum and weight_decay must be >= 0")
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                                      momentum=momentum, centered=centered, maximize=maximize))

    def _update(self, p, g, group, state):
        alpha, eps, wd, mom = group["alpha"], group["eps"], group["weight_decay"], group["momentum"]
        if group["maximize"]:
            g = -g
        if wd != 0:
            g = g + p * wd
        zero = const_tensor(0, p.dtype, p.shape)
        v = state.get("square_avg", zero)
        v = v * alpha + g * g * (1.0 - alpha)
        upd = {"square_avg": v}
        if group["centered"]:
            ga = state.get("grad_avg", zero)
            ga = ga + (g - ga) * (1.0 - alpha)
            upd["grad_avg"] = ga
            avg = (v - ga * ga).sqrt()
        else:
            avg = v.sqrt()
        avg = avg + eps
        lr = self._scalars(p, group, state)[0]
        if mom > 0:
            buf = state.get("momentum_buffer", zero)
            buf = buf * mom + g / avg
            upd["momentum_buffer"] = buf
            return p - lr * buf, upd
        return p - lr * (g / avg), upd

    def _scalars(self, p, group, state):
        """The learning rate as a step scalar: a zyx.jit replay (Optimizer._replayed)
        writes a changed param_groups lr into the same leaf."""
        return [self.step_scalar(("lr", id(group)), group["lr"], p.dtype)]
