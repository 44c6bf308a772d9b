"""zyx.nn.utils: gradient clipping, parameter/vector conversion (torch.nn.utils) and
sequence padding (zyx.nn.utils.rnn)."""
from __future__ import annotations

from ...errors import ShapeError
from ...runtime import RT
from ...tensor import Tensor, cat, stack
from ..init import copy_into

__all__ = ["clip_grad_norm_", "clip_grad_value_", "parameters_to_vector", "vector_to_parameters"]


def _params(parameters):
    return [parameters] if isinstance(parameters, Tensor) else list(parameters)


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """Scale the gradients so that their joint norm is at most max_norm; returns the norm
    before clipping. Lazy: the norm and the scaled gradients are computed by the next
    realization (usually opt.step()), in one pass with the backward and the update."""
    params = _params(parameters)   # a generator can be walked only once
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return Tensor(0.0)
    norm_type = float(norm_type)
    if norm_type == float("inf"):
        total = stack([g.abs().amax() for g in grads]).amax()
    else:
        total = stack([(g.abs() ** norm_type).sum() for g in grads]).sum() ** (1.0 / norm_type)
    if error_if_nonfinite and not bool(total.isfinite().item()):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite")
    coef = (max_norm / (total + 1e-6)).minimum(1.0)
    for p in params:
        if p.grad is not None:
            p.grad = p.grad * coef.cast(p.grad.dtype)
    # stored by the next realization like the gradients backward() made: reading them (or
    # logging the norm) after the step must not recompute the backward pass
    RT.defer([total] + [p.grad for p in params if p.grad is not None])
    return total


def clip_grad_value_(parameters, clip_value, foreach=None):
    """Clamp every gradient element into [-clip_value, clip_value]."""
    params = _params(parameters)
    for p in params:
        if p.grad is not None:
            p.grad = p.grad.clamp(-clip_value, clip_value)
    RT.defer([p.grad for p in params if p.grad is not None])


def parameters_to_vector(parameters):
    return cat([p.reshape(-1) for p in _params(parameters)])


def vector_to_parameters(vec, parameters):
    """Copy consecutive slices of the 1-D `vec` into the parameters (same objects)."""
    params = _params(parameters)
    n = sum(p.numel() for p in params)
    if vec.ndim != 1 or vec.shape[0] != n:
        raise ShapeError(f"vector of shape {vec.shape} does not hold {n} parameter values")
    off = 0
    for p in params:
        k = p.numel()
        copy_into(p, vec[off:off + k].reshape(p.shape))
        off += k


from . import rnn  # noqa: E402  (torch.nn.utils.rnn)
