"""zyx.nn.functional: PyTorch's torch.nn.functional, built from zyx Tensor ops.

Everything here is lazy graph building from the Tensor API and its primitives, so every op
is differentiable wherever the autograd tape can see the primitives it is made of.

Convolutions and pools share one idea: a window view. A padded input is turned into a view
of shape (..., *out, *kernel) with reshape/expand/shrink only (free index math in zyx, no
copies), then multiplied by the weights and reduced. A convolution is therefore one reduce
node, and a bias and activation after it fuse into the same kernel.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .. import dtype as dt
from .. import random as _random
from .._core import graph as _G
from .._core import tensorbase as _TB
from .._core import kernel as K
from .._core import replay as _replay
from ..errors import DTypeError, InvalidArgumentError, ShapeError, ZyxError
from ..runtime import RT
from ..tensor import (Tensor, clamp_float_scalars, const_tensor, iota, linear_nt, matmul_nt,
                      rebind, watch_range, where)
from .init import copy_into   # in-place update of running stats (torch's copy_)

__all__ = [
    # convolution and pooling
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "interpolate", "upsample", "pad", "unfold",
    "pixel_shuffle", "pixel_unshuffle",
    # linear, normalization, dropout, sparse
    "linear", "bilinear", "layer_norm", "batch_norm", "group_norm", "instance_norm", "rms_norm",
    "normalize", "dropout", "dropout1d", "dropout2d", "dropout3d", "embedding", "one_hot",
    "scaled_dot_product_attention", "cosine_similarity", "pairwise_distance",
    # activations
    "relu", "relu6", "sigmoid", "tanh", "gelu", "silu", "softplus", "leaky_relu", "elu", "selu",
    "celu", "mish", "hardtanh", "hardsigmoid", "hardswish", "softsign", "logsigmoid", "softmax",
    "log_softmax", "softmin", "glu", "prelu", "threshold", "tanhshrink", "softshrink",
    "hardshrink",
    # losses
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "cross_entropy", "nll_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div",
]

_graph = RT.graph


# ---------------------------------------------------------------------------------------
# small helpers
def _t(x) -> Tensor:
    return x if isinstance(x, Tensor) else Tensor(x)


def int_tuple(v, n: int, name: str) -> tuple:
    """An int or a sequence of n ints -> tuple of n ints.
    Internal helper shared by zyx.nn's modules (not in __all__)."""
    if isinstance(v, (int, np.integer)):
        return (int(v),) * n
    v = tuple(int(a) for a in v)
    if len(v) == 1:
        return v * n
    if len(v) != n:
        raise ShapeError(f"{name} needs {n} value(s), got {v}")
    return v


def _check_positive(stride, dilation, what):
    """torch's errors for a zero or negative stride or dilation (which would otherwise
    divide by zero while sizing the output)."""
    if any(v <= 0 for v in stride):
        raise InvalidArgumentError(f"{what}: non-positive stride is not supported, got {stride}")
    if any(v <= 0 for v in dilation):
        raise InvalidArgumentError(f"{what}: dilation should be greater than zero, got {dilation}")


def _float(x: Tensor) -> Tensor:
    return x if x.dtype.is_float else x.cast(dt.float32)


def _neg_inf(d):
    """The identity of max for dtype d (what max-pool pads with)."""
    if d.is_float:
        return float("-inf")
    if d.is_bool:
        return False
    return 0 if d.kind == "u" else -(1 << (d.itemsize * 8 - 1))


def _reduce_loss(loss: Tensor, reduction: str) -> Tensor:
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _check_same_shape(a: Tensor, b: Tensor, what: str):
    if a.shape != b.shape:
        raise ShapeError(f"{what}: input shape {a.shape} and target shape {b.shape} differ")


# ---------------------------------------------------------------------------------------
# window views
def _window_count(i, k, s, d):
    """Windows of size k, stride s and dilation d that fit in i positions."""
    return (i - d * (k - 1) - 1) // s + 1


def _windows(x: Tensor, k: Sequence[int], s: Sequence[int], d: Sequence[int]) -> Tensor:
    """View of the last len(k) dims of `x` as sliding windows: (..., *out, *k), with
    out = (i - d*(k-1) - 1) // s + 1 per dim. Reshape/expand/shrink only.

    Windows that do not overlap (k <= s, no dilation) are a pad to out*s, a split into
    (out, s) and a shrink to (out, k). Overlapping windows use the repeat trick: repeating
    the row e times and re-reading it with row length i+d starts row j at offset j*d."""
    nd = len(k)
    lead = x.shape[:-nd]
    nl = len(lead)
    ins = x.shape[-nd:]
    outs = []
    for i, kk, ss, dd in zip(ins, k, s, d):
        o = _window_count(i, kk, ss, dd)
        if o <= 0:
            raise ShapeError(f"window of size {kk} (dilation {dd}) does not fit an input of "
                             f"size {i}; input shape {x.shape}")
        outs.append(o)
    keep = tuple((0, n) for n in lead)
    if all(kk <= ss and dd == 1 for kk, ss, dd in zip(k, s, d)):
        x = x._pad([(0, 0)] * nl + [(0, o * ss - i) for o, ss, i in zip(outs, s, ins)])
        x = x.reshape(lead + sum(((o, ss) for o, ss in zip(outs, s)), ()))
        x = x.shrink(keep + sum((((0, o), (0, kk)) for o, kk in zip(outs, k)), ()))
        return x.permute(list(range(nl)) + [nl + 2 * j for j in range(nd)] +
                         [nl + 2 * j + 1 for j in range(nd)])
    # pad so that the row read with length i+d never runs past what is needed
    ins2 = [max(i, o * ss) for i, o, ss in zip(ins, outs, s)]
    x = x._pad([(0, 0)] * nl + [(0, i2 - i) for i, i2 in zip(ins, ins2)])
    e = [-(-kk * (i + dd) // i) for kk, i, dd in zip(k, ins2, d)]
    x = x.reshape(lead + sum(((1, i) for i in ins2), ()))
    x = x.expand(lead + sum(((ee, i) for ee, i in zip(e, ins2)), ()))
    x = x.reshape(lead + tuple(ee * i for ee, i in zip(e, ins2)))
    x = x.shrink(keep + tuple((0, kk * (i + dd)) for kk, i, dd in zip(k, ins2, d)))
    x = x.reshape(lead + sum(((kk, i + dd) for kk, i, dd in zip(k, ins2, d)), ()))
    x = x.shrink(keep + sum((((0, kk), (0, o * ss)) for kk, o, ss in zip(k, outs, s)), ()))
    x = x.reshape(lead + sum(((kk, o, ss) for kk, o, ss in zip(k, outs, s)), ()))
    x = x.shrink(keep + sum((((0, kk), (0, o), (0, 1)) for kk, o in zip(k, outs)), ()))
    x = x.reshape(lead + sum(((kk, o) for kk, o in zip(k, outs)), ()))
    return x.permute(list(range(nl)) + [nl + 2 * j + 1 for j in range(nd)] +
                     [nl + 2 * j for j in range(nd)])


def _take(x: Tensor, axis: int, idx, message=None, info=()) -> Tensor:
    """x indexed along `axis` by the integer tensor (or array) `idx` (numpy's take): shape
    x.shape[:axis] + idx.shape + x.shape[axis+1:]. A one-hot select and a sum over the
    indexed axis, so it is one fused reduce and differentiable. Negative indices count
    from the end. With `message` (a user's index), the realization checks -n <= idx < n
    and raises IndexError (see tensor.watch_range)."""
    idx = idx if isinstance(idx, Tensor) else Tensor(np.asarray(idx, dtype=np.int64))
    n = x.shape[axis]
    a, b, ni = x.shape[:axis], x.shape[axis + 1:], idx.ndim
    if (idx.dtype is dt.int64 or idx.dtype is dt.int32) and not x.dtype.is_bool:
        return _take_nodes(x, idx, n, a, b, message, info)
    raw = idx
    idx = where(idx < 0, idx + n, idx)
    cls = iota(n, idx.dtype)
    sel = idx.reshape((1,) * len(a) + idx.shape + (1,) + (1,) * len(b)) == \
        cls.reshape((1,) * (len(a) + ni) + (n,) + (1,) * len(b))
    if message is not None:
        watch_range(sel, raw, -n, n, message, info)
    xv = x.reshape(a + (1,) * ni + (n,) + b)
    if x.dtype.is_bool:
        return (xv & sel)._reduce(K.R_MAX, len(a) + ni, False)
    return where(sel, xv, const_tensor(0, x.dtype, ()))._reduce(K.R_SUM, len(a) + ni, False)


def _take_nodes(x, idx, n, a, b, message, info):
    """_take's nodes for an int32/int64 `idx` into a non-bool `x`, made directly (an embedding
    lookup is built every token of a sampling loop; the general path's public methods cost
    most of it): the same wrap of negative indices, one-hot compare, range check and sum."""
    mk, ish, di, d = _TB.make, idx.shape, idx.dtype, x.dtype
    ni = len(ish)
    neg = mk(_G.BINARY, K.B_CMPLT, (idx, const_tensor(0, di, ish)), ish, dt.bool_)
    wrapped = mk(_G.WHERE, None, (neg, mk(_G.BINARY, K.B_ADD, (idx, const_tensor(n, di, ish)),
                                           ish, di), idx), ish, di)
    full = a + ish + (n,) + b
    ishape = (1,) * len(a) + ish + (1,) + (1,) * len(b)
    cshape = (1,) * (len(a) + ni) + (n,) + (1,) * len(b)
    ie = mk(_G.RESHAPE, ishape, (wrapped,), ishape, di)
    ce = mk(_G.RESHAPE, cshape, (iota(n, di),), cshape, di)
    if ishape != full:
        ie = mk(_G.EXPAND, full, (ie,), full, di)
    if cshape != full:
        ce = mk(_G.EXPAND, full, (ce,), full, di)
    sel = mk(_G.BINARY, K.B_EQ, (ie, ce), full, dt.bool_)
    if message is not None:
        watch_range(sel, idx, -n, n, message, info)
    xshape = a + (1,) * ni + (n,) + b
    xv = mk(_G.RESHAPE, xshape, (x,), xshape, d) if xshape != x.shape else x
    if xshape != full:
        xv = mk(_G.EXPAND, full, (xv,), full, d)
    picked = mk(_G.WHERE, None, (sel, xv, const_tensor(0, d, full)), full, d)
    kept = a + ish + (1,) + b
    summed = mk(_G.REDUCE, (K.R_SUM, (len(a) + ni,)), (picked,), kept, d)
    out = a + ish + b
    return mk(_G.RESHAPE, out, (summed,), out, d)


def _batched(x: Tensor, nd: int, what: str):
    """(x with a batch dim, whether one was added) for inputs of nd spatial dims."""
    if x.ndim == nd + 1:
        return x.unsqueeze(0), True
    if x.ndim != nd + 2:
        raise ShapeError(f"{what} expects a {nd + 1}-D (unbatched) or {nd + 2}-D (batched) "
                         f"input, got shape {x.shape}")
    return x, False


def conv_padding(padding, k, d, s, nd, what):
    """Per-dim (before, after) padding from an int, a tuple, 'same' or 'valid'.
    Internal helper shared by zyx.nn's modules (not in __all__)."""
    if isinstance(padding, str):
        if padding == "valid":
            return [(0, 0)] * nd
        if padding == "same":
            if any(ss != 1 for ss in s):
                raise ZyxError(f"{what}: padding='same' is not supported for strided convolutions")
            out = []
            for kk, dd in zip(k, d):
                total = dd * (kk - 1)
                out.append((total // 2, total - total // 2))   # extra on the right, as torch
            return out
        raise ValueError(f"{what}: padding must be an int, a tuple, 'same' or 'valid', "
                         f"got {padding!r}")
    return [(p, p) for p in int_tuple(padding, nd, f"{what} padding")]


def _convnd(x, weight, bias, stride, padding, dilation, groups, nd, what):
    x, w = _t(x), _t(weight)
    x, squeeze = _batched(x, nd, what)
    if w.ndim != nd + 2:
        raise ShapeError(f"{what}: weight must be {nd + 2}-D (out, in/groups, *kernel), "
                         f"got {w.shape}")
    n, cin = x.shape[:2]
    cout, cg = w.shape[:2]
    k = w.shape[2:]
    g = int(groups)
    if g < 1 or cin != cg * g or cout % g:
        raise ShapeError(f"{what}: input {x.shape} with {cin} channels, weight {w.shape} and "
                         f"groups={g} do not fit (need in_channels == weight.shape[1] * groups "
                         f"and out_channels divisible by groups)")
    s = int_tuple(stride, nd, f"{what} stride")
    d = int_tuple(dilation, nd, f"{what} dilation")
    _check_positive(s, d, what)
    pads = conv_padding(padding, k, d, s, nd, what)
    ct = dt.promote(x.dtype, w.dtype)
    x, w = x.cast(ct), w.cast(ct)
    out = _conv_recorded(x, w, tuple(pads), tuple(s), tuple(d), g, nd)
    if bias is not None:
        b = _t(bias)
        if b.shape != (cout,):
            raise ShapeError(f"{what}: bias must have shape ({cout},), got {b.shape}")
        out = out + b.cast(ct).reshape((1, cout) + (1,) * nd)
    return out.squeeze(0) if squeeze else out


def stored(x):
    """x in a buffer of its own, in its logical (row-major) order: a sum over a new size-1
    axis is a reduce, which the kernelizer stores (what reads it then reads plain rows,
    and what computes x runs once instead of in every kernel reading it).
    Internal helper shared by zyx.nn's modules (not in __all__)."""
    return x.unsqueeze(0).sum(0)


CHANNELS_LAST_WEIGHTS = True   # CPU convolutions read a copy of w with channels innermost


GPU_CHANNELS_LAST_MIN = 8192   # weights at least this large get the copy on GPUs


def _channels_last_weights(w, channels, width, gradient=False):
    """Whether a convolution (or with `gradient`, its weight gradient) over `channels`
    output channels per group, whose output's last axis is `width` long, reads its
    channel operand through a stored copy with the channels innermost.
    - CPU (devices that tile convolution windows): where the kernelizer then takes
      vector lanes over the channels (heuristics._choose_channel_lanes: whole vectors of
      channels; a last axis without whole vectors).
    - GPU lowerings that tile products themselves (DeviceInfo.own_tiles): a forward's
      weights of at least GPU_CHANNELS_LAST_MIN values, the rows operand of its implicit
      GEMM, whose copies then read 128 consecutive bytes a warp instead of values 576
      apart (H200, 64x64x56x56 3x3: 0.86 -> 0.72 ms). Smaller ones are not worth the
      copy's launch; the weight gradient keeps the output gradient as it is."""
    if not CHANNELS_LAST_WEIGHTS:
        return False
    info = RT.device_of(w._id).info()
    if info.own_tiles is not None:
        return not gradient and w.numel() >= GPU_CHANNELS_LAST_MIN and channels >= 16
    vec = max(info.preferred_vector_size // 4, 4)
    return bool(info.register_tiles and info.window_tiles and channels % vec == 0
                and width % 16 != 0)


GPU_CHANNELS_LAST_INPUT = True   # GPU convolutions read a channels-last copy of x
GPU_IMAGE_MIN = 1 << 20          # ... when x has at least this many values


def _channels_last_input(x, cg):
    """Whether a convolution with `cg` input channels per group reads its image through a
    stored channels-last copy: on GPU lowerings that tile products themselves
    (DeviceInfo.own_tiles), for images of at least GPU_IMAGE_MIN values with at least
    16 channels per group, a multiple of 8. The implicit GEMM's flat K then walks the
    channels innermost with consecutive addresses, so a pixel's channels are copied 16
    bytes at a time under one padding test (gemm.vector_lanes) instead of value by
    value, each with its own index math and test."""
    if not GPU_CHANNELS_LAST_INPUT or cg < 16 or cg % 8 or x.numel() < GPU_IMAGE_MIN:
        return False
    return RT.device_of(x._id).info().own_tiles is not None


def _window_weights(x, w, out_size):
    """Whether a convolution reading a channels-last image (`_channels_last_input`)
    reads its weights through a stored copy with the input channels innermost,
    (cout, *k, cin): on a GPU whose lowering copies windows through tensor maps into
    warpgroup products (DeviceInfo.reads_windows_k_major: CUDA sm_90a,
    codegen/gpu/nvidia/products.py), for 16-bit
    weights, float32 ones the precision setting lets run on TF32, and float32 ones at
    "highest" (FMA tiles; not with the gemm knob "fma=0"), whose products read both
    operands K-major.
    Only for outputs of the image's size (`out_size` == x's): the window's flat pixel
    position is then the image's plus a constant per tap."""
    return tuple(out_size) == tuple(x.shape[2:]) and \
        RT.device_of(w._id).info().reads_windows_k_major(w.dtype)


def _conv_forward(x, w, pads, s, d, g, nd, channels_last, image_last=False):
    """The convolution as one windowed reduce over a pad/reshape/expand view of x (no
    copy): (n, g, cout/g, *o, cg, *k) products summed over (cg, *k). `channels_last`:
    read w through a stored copy with the output channels innermost
    (`_channels_last_weights`), or with "k" the input channels innermost
    (`_window_weights`); `image_last`: read x through a stored copy with its channels
    innermost (`_channels_last_input`)."""
    n, cin = x.shape[:2]
    cout, cg = w.shape[:2]
    k = w.shape[2:]
    if image_last:
        x = stored(x.permute([0] + list(range(2, 2 + nd)) + [1]))
        x = x.permute([0, nd + 1] + list(range(1, nd + 1)))
    x = x._pad([(0, 0), (0, 0)] + list(pads))
    win = _windows(x, k, s, d)                                   # (n, cin, *o, *k)
    o = win.shape[2:2 + nd]
    # (n, g, 1, cg, *o, *k) -> (n, g, 1, *o, cg, *k) -> expand the out-channel axis
    win = win.reshape((n, g, 1, cg) + o + k)
    win = win.permute([0, 1, 2] + list(range(4, 4 + nd)) + [3] + list(range(4 + nd, 4 + 2 * nd)))
    full = (n, g, cout // g) + o + (cg,) + k
    win = win.expand(full)
    if channels_last == "k":
        # w from a stored copy (cout, *k, cg): K-major rows for warpgroup products
        w = stored(w.permute([0] + list(range(2, 2 + nd)) + [1]))
        w = w.permute([0, nd + 1] + list(range(1, nd + 1)))
    elif channels_last:
        # w from a stored copy with the output channels innermost: vector lanes over them
        perm = list(range(1, 2 + nd)) + [0]
        w = stored(w.permute(perm)).permute([nd + 1] + list(range(nd + 1)))
    wv = w.reshape((1, g, cout // g) + (1,) * nd + (cg,) + k).expand(full)
    out = (win * wv)._reduce(K.R_SUM, tuple(range(3 + nd, 4 + 2 * nd)), False)
    return out.reshape((n, cout) + o)


_CONV_TEMPLATES = _replay.ForwardTemplates(128)


def _conv_recorded(x, w, pads, s, d, g, nd):
    """_conv_forward recorded for autograd as one composite op ("conv") with the
    hand-written backward `_conv_backward`. Its nodes depend only on the shapes, dtypes
    and parameters, so they are replayed from a template after the first call (a
    convolution's ~20 view and product ops: 72 -> 12 us of host time per call,
    benches/bench_conv.py -k graph_build)."""
    width = _window_count(x.shape[-1] + sum(pads[-1]), w.shape[-1], s[-1], d[-1])
    cl = _channels_last_weights(w, w.shape[0] // g, width)
    il = _channels_last_input(x, w.shape[1])
    if il and g == 1 and all(v == 1 for v in d):     # (wgmma._plain_window's windows)
        out_size = [_window_count(x.shape[2 + i] + sum(pads[i]), w.shape[2 + i], s[i], d[i])
                    for i in range(nd)]
        if _window_weights(x, w, out_size):
            cl = "k"
    out, = _CONV_TEMPLATES.run(
        _graph, ("conv", pads, s, d, g, nd, cl, il), [x, w],
        lambda x, w: [_conv_forward(x, w, pads, s, d, g, nd, cl, il)], Tensor._wrap)
    return _record_composite(out, ("conv", nd, pads, s, d, g), (x, w))


def _conv_backward(out, gy, arg, srcs, need):
    """Gradients of a convolution: the weight's is one reduce of windows of x times gy
    over (n, *o) (4x4 register tiles over output and input channels); the input's is the
    transposed convolution of gy (one windowed reduce like the forward, instead of the
    8-D window tensor the primitives' rules would store), cut or padded from the padded
    input's extent back to x's."""
    _, nd, pads, s, d, g = arg
    x, w = srcs
    gx = gw = None
    k = w.shape[2:]
    if need[1]:
        n, cin = x.shape[:2]
        cout, cg = w.shape[:2]
        o = gy.shape[2:]
        win = _windows(x._pad([(0, 0), (0, 0)] + list(pads)), k, s, d)
        full = (n, g, cout // g, cg) + o + k
        win = win.reshape((n, g, 1, cg) + o + k).expand(full)
        gc = gy
        if _channels_last_weights(w, cout // g, k[-1], gradient=True):
            # gy in a stored copy with channels innermost: lanes over output channels
            gc = stored(gy.permute([0] + list(range(2, 2 + nd)) + [1]))
            gc = gc.permute([0, nd + 1] + list(range(1, nd + 1)))
        gv = gc.reshape((n, g, cout // g, 1) + o + (1,) * nd).expand(full)
        # split-K on GPU lowerings whose tiles would not fill the device (product_parts)
        parts = RT.device_of(w._id).info().split_k(cout // g, cg * math.prod(k),
                                                  n * math.prod(o), n)
        if parts == 1:
            gw = (win * gv)._reduce(K.R_SUM, (0,) + tuple(range(4, 4 + nd)), False)
        else:
            # split-K: `parts` products over n / parts images each, then their sum
            cut = (parts, n // parts) + full[1:]
            gw = (win.reshape(cut) * gv.reshape(cut))._reduce(
                K.R_SUM, (1,) + tuple(range(5, 5 + nd)), False)
            gw = gw._reduce(K.R_SUM, (0,), False)
        gw = gw.reshape((cout, cg) + k)
    if need[0]:
        t = _conv_transposend(gy, w, None, s, 0, 0, g, d, nd, "conv backward", True)
        crop = []
        for ti, xi, (pb, pa) in zip(t.shape[2:], x.shape[2:], pads):
            # t spans the padded input's first ti positions: pad it to the padded extent
            # (xi + pb + pa; positions no window reached get 0), then cut pb and pa off
            crop.append((-pb, xi + pb - ti))
        gx = t._pad([(0, 0), (0, 0)] + crop)
    return gx, gw


def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """1-D convolution (cross-correlation) over (N, C, L) or (C, L)."""
    return _convnd(input, weight, bias, stride, padding, dilation, groups, 1, "conv1d")


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """2-D convolution over (N, C, H, W) or (C, H, W); padding may be 'same' or 'valid'."""
    return _convnd(input, weight, bias, stride, padding, dilation, groups, 2, "conv2d")


def conv3d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """3-D convolution over (N, C, D, H, W) or (C, D, H, W)."""
    return _convnd(input, weight, bias, stride, padding, dilation, groups, 3, "conv3d")


def _lazy_last_axis(w, channels, batch, out):
    """Whether a CPU transposed convolution with `channels` output channels per group,
    batch `batch` and output sizes `out` pads its input's last axis lazily (through
    guards the C backend can narrow) instead of in the stored copy: where the kernelizer's
    tile will put its lanes on the channels (`_channels_last_weights`) and its rows on
    another axis than the last (that axis takes fewer rows; ties go to the last). A
    proxy of the kernelizer's choice: with the last axis in the tile, its guards sit in
    the vector loop (conv2d K5's input gradient 39 -> 56 ms); left to the narrowing
    (K3's, the last axis an index of the kernel) 5.25 -> 4.87 ms."""
    if not _channels_last_weights(w, channels, out[-1]):
        return False
    info = RT.device_of(w._id).info()
    rows = [info.channel_lane_rows(s, True) for s in [batch] + list(out)]
    return rows[-1] < max(rows[:-1])


def _gpu_tiles(x):
    """True when x's device lowers products with its own tiles (a GPU backend)."""
    return RT.device_of(x._id).info().own_tiles is not None


def _conv_transposend(x, weight, bias, stride, padding, output_padding, groups, dilation, nd, what,
                      store_input=None):
    """Transposed convolution as a plain one: insert stride-1 zeros between input elements,
    pad by dilation*(k-1)-padding (plus output_padding on the far side), then convolve with
    the flipped, channel-swapped weights. `store_input` (None: on the CPU only; the input
    gradient passes True): that input gets a buffer of its own, so what computes x (a
    ReLU's backward) runs once instead of once per tap: on the CPU unpadded, the padding
    read through guards whose taps the C backend skips (`_lazy_last_axis` says where the
    last axis' padding is stored instead), on GPUs padded whole (the loads need no range
    check per tap). conv_transpose2d of (128, 64, 8, 8) by a 3x3 kernel on the CPU: 6.4
    -> 1.75 ms (BENCHMARKS.md)."""
    x, w = _t(x), _t(weight)
    x, squeeze = _batched(x, nd, what)
    if w.ndim != nd + 2:
        raise ShapeError(f"{what}: weight must be {nd + 2}-D (in, out/groups, *kernel), "
                         f"got {w.shape}")
    n, cin = x.shape[:2]
    g = int(groups)
    if g < 1 or w.shape[0] != cin or cin % g:
        raise ShapeError(f"{what}: input {x.shape} with {cin} channels, weight {w.shape} and "
                         f"groups={g} do not fit (need weight.shape[0] == in_channels, "
                         f"divisible by groups)")
    cog = w.shape[1]
    k = w.shape[2:]
    s = int_tuple(stride, nd, f"{what} stride")
    d = int_tuple(dilation, nd, f"{what} dilation")
    _check_positive(s, d, what)
    p = int_tuple(padding, nd, f"{what} padding")
    op = int_tuple(output_padding, nd, f"{what} output_padding")
    for oo, ss, dd in zip(op, s, d):
        if oo >= max(ss, dd) or oo < 0:
            raise ShapeError(f"{what}: output_padding {op} must be smaller than stride {s} "
                             f"or dilation {d}")
    ins = x.shape[2:]
    if any(ss > 1 for ss in s):
        x = x.reshape((n, cin) + sum(((i, 1) for i in ins), ()))
        x = x._pad(((0, 0), (0, 0)) + sum((((0, 0), (0, ss - 1)) for ss in s), ()))
        x = x.reshape((n, cin) + tuple(i * ss for i, ss in zip(ins, s)))
        x = x.shrink([(0, n), (0, cin)] + [(0, (i - 1) * ss + 1) for i, ss in zip(ins, s)])
    pads = [(dd * (kk - 1) - pp, dd * (kk - 1) - pp + oo) for kk, dd, pp, oo in zip(k, d, p, op)]
    gpu = _gpu_tiles(x)
    if store_input is None:
        store_input = not gpu
    if store_input and not gpu:
        # CPU: stored before its padding, read through guards whose taps the C backend
        # skips (codegen/cpu/padtaps.py), except along the last axis where a tile's lanes or
        # rows would walk it (its guards would sit in the vector loop): that padding is
        # stored
        out = [x.shape[2 + i] + sum(pads[i]) - dd * (kk - 1) for i, (kk, dd) in
               enumerate(zip(k, d))]
        lazy = _lazy_last_axis(w, w.shape[1], n, out)
        x = stored(x._pad([(0, 0)] * (nd + 1) + [(0, 0) if lazy else pads[-1]]))
        x = x._pad([(0, 0), (0, 0)] + pads[:-1] + [pads[-1] if lazy else (0, 0)])
    else:
        # (GPU lowerings read the padded input stored whole: no range check per tap)
        x = x._pad([(0, 0), (0, 0)] + pads)
        if store_input:
            x = stored(x)
    cg = cin // g
    wt = w.reshape((g, cg, cog) + k).permute([0, 2, 1] + list(range(3, 3 + nd)))
    wt = wt.reshape((g * cog, cg) + k).flip(tuple(range(2, 2 + nd)))
    out = _convnd(x, wt, bias, 1, 0, d, g, nd, what)
    return out.squeeze(0) if squeeze else out


def conv_transpose1d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1,
                     dilation=1):
    return _conv_transposend(input, weight, bias, stride, padding, output_padding, groups,
                             dilation, 1, "conv_transpose1d")


def conv_transpose2d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1,
                     dilation=1):
    """Transposed 2-D convolution (the gradient of conv2d w.r.t. its input); weight is
    (in, out/groups, kH, kW) as in torch."""
    return _conv_transposend(input, weight, bias, stride, padding, output_padding, groups,
                             dilation, 2, "conv_transpose2d")


def conv_transpose3d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1,
                     dilation=1):
    return _conv_transposend(input, weight, bias, stride, padding, output_padding, groups,
                             dilation, 3, "conv_transpose3d")


def unfold(input, kernel_size, dilation=1, padding=0, stride=1):
    """im2col: (N, C, H, W) -> (N, C*kH*kW, L) with L the number of window positions."""
    x = _t(input)
    x, squeeze = _batched(x, 2, "unfold")
    k = int_tuple(kernel_size, 2, "unfold kernel_size")
    d = int_tuple(dilation, 2, "unfold dilation")
    s = int_tuple(stride, 2, "unfold stride")
    _check_positive(s, d, "unfold")
    p = int_tuple(padding, 2, "unfold padding")
    x = x._pad([(0, 0), (0, 0)] + [(pp, pp) for pp in p])
    win = _windows(x, k, s, d)                    # (n, c, oh, ow, kh, kw)
    n, c, oh, ow = win.shape[:4]
    out = win.permute(0, 1, 4, 5, 2, 3).reshape(n, c * k[0] * k[1], oh * ow)
    return out.squeeze(0) if squeeze else out


# ---------------------------------------------------------------------------------------
# pooling
def _pool_geometry(ins, k, s, p, d, ceil_mode, what):
    """Output sizes and right-side extra padding (ceil mode) of a pool."""
    outs, extra = [], []
    for i, kk, ss, pp, dd in zip(ins, k, s, p, d):
        if pp * 2 > kk:
            raise ShapeError(f"{what}: padding {p} must be at most half of kernel_size {k}")
        span = i + 2 * pp - dd * (kk - 1) - 1
        if span < 0:
            raise ShapeError(f"{what}: kernel {k} (dilation {d}) is larger than the padded "
                             f"input {tuple(ins)}")
        o = (span + (ss - 1 if ceil_mode else 0)) // ss + 1
        if ceil_mode and (o - 1) * ss >= i + pp:
            o -= 1   # the last window must start inside the input or its left padding
        outs.append(o)
        extra.append(max(0, (o - 1) * ss + dd * (kk - 1) + 1 - (i + 2 * pp)))
    return outs, extra


def _pool_args(x, kernel_size, stride, padding, dilation, nd, what):
    k = int_tuple(kernel_size, nd, f"{what} kernel_size")
    s = k if stride is None or (not isinstance(stride, int) and len(stride) == 0) else \
        int_tuple(stride, nd, f"{what} stride")
    p = int_tuple(padding, nd, f"{what} padding")
    d = int_tuple(dilation, nd, f"{what} dilation")
    _check_positive(s, d, what)
    if x.ndim < nd + 1:
        raise ShapeError(f"{what} needs at least {nd + 1} dimensions, got shape {x.shape}")
    return k, s, p, d


def _max_poolnd(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices, nd, what):
    x = _t(input)
    k, s, p, d = _pool_args(x, kernel_size, stride, padding, dilation, nd, what)
    ins = x.shape[-nd:]
    outs, extra = _pool_geometry(ins, k, s, p, d, ceil_mode, what)
    lead = x.ndim - nd
    x = x._pad([(0, 0)] * lead + [(pp, pp + e) for pp, e in zip(p, extra)], _neg_inf(x.dtype))
    win = _windows(x, k, s, d)
    axes = tuple(range(x.ndim, x.ndim + nd))
    out = win._reduce(K.R_MAX, axes, False)
    if not return_indices:
        return out
    return out, _pool_argmax(win, out, axes, _window_positions(ins, outs, k, s, p, d))


def _window_positions(ins, outs, k, s, p, d) -> Tensor:
    """int64 (*outs, *k): the flat index in the unpadded input plane of each window element
    (torch's max-pool indices count positions of one (H, W) plane)."""
    nd = len(k)
    flat = np.zeros(tuple(outs) + tuple(k), np.int64)
    plane_stride = 1
    for j in reversed(range(nd)):
        o = np.arange(outs[j]).reshape([-1 if a == j else 1 for a in range(2 * nd)])
        kk = np.arange(k[j]).reshape([-1 if a == nd + j else 1 for a in range(2 * nd)])
        flat = flat + (o * s[j] - p[j] + kk * d[j]) * plane_stride
        plane_stride *= ins[j]
    return Tensor(flat)


def _pool_argmax(win, out, axes, positions):
    """Index of the first maximum of every window (row-major window order, as torch's CPU
    kernel), as int64 positions in the input plane. Only padding holds -inf where a
    window has no real element, which pool geometry rules out."""
    n_lead = win.ndim - positions.ndim
    pos = positions.reshape((1,) * n_lead + positions.shape)
    m = out.reshape(out.shape + (1,) * len(axes))
    big = const_tensor(np.iinfo(np.int64).max, dt.int64, ())
    hit = (win == m) | (win != win)           # a NaN is the maximum of its window (torch)
    cand = where(hit.detach(), pos, big)
    return cand._reduce(K.R_MIN, axes, False)


def _unpool_nd(input, indices, kernel_size, stride, padding, output_size, nd, what):
    """Scatter each value to its recorded position of an output plane, zeros elsewhere.
    Built from one-hot comparisons (value j goes to position q where indices[j] == q): no
    scatter primitive is needed, and the gradient is the gather torch computes."""
    x, idx = _t(input), _t(indices)
    if not idx.dtype.is_int:
        raise DTypeError(f"{what}: indices must be an integer tensor, got {idx.dtype.name}")
    if idx.shape != x.shape:
        raise ShapeError(f"{what}: Expected shape of indices to be same as that of the input "
                         f"tensor ({x.shape}) but got indices tensor with shape {idx.shape}")
    if x.ndim not in (nd + 1, nd + 2):
        raise ShapeError(f"{what}: Expected {nd + 1}D or {nd + 2}D input, got shape {x.shape}")
    k = int_tuple(kernel_size, nd, f"{what} kernel_size")
    s = k if stride is None else int_tuple(stride, nd, f"{what} stride")
    p = int_tuple(padding, nd, f"{what} padding")
    ins = x.shape[-nd:]
    default = tuple((i - 1) * ss - 2 * pp + kk for i, ss, pp, kk in zip(ins, s, p, k))
    if output_size is None:
        size = default
    else:
        size = tuple(output_size)[-nd:]
        if len(size) != nd or any(abs(a - b) >= ss for a, b, ss in zip(size, default, s)):
            raise ValueError(f"{what}: invalid output_size {tuple(output_size)} (expected about "
                             f"{default})")
    lead = x.shape[:-nd]
    q = int(np.prod(size))
    flat_x = x.reshape(lead + (-1, 1))
    flat_i = idx.reshape(lead + (-1, 1)).cast(dt.int64)
    hit = flat_i == iota(q, dt.int64).reshape((1,) * (len(lead) + 1) + (q,))
    watch_range(hit, idx, 0, q, lambda v: (
        f"{what}: Found an invalid max index: {v} (output volumes are of size "
        f"{'x'.join(str(a) for a in size)})"))
    total = where(hit, flat_x, const_tensor(0, x.dtype, ())).sum(-2)
    if all(ss >= kk for ss, kk in zip(s, k)):
        return total.reshape(lead + size)        # windows do not overlap: no repeats
    # overlapping windows can record one position twice (with the same value); torch
    # writes one copy, and its gradient hands every copy the output's gradient (a
    # gather). Value: the copies' mean; gradient: that of the sum (zero-valued term).
    count = hit.cast(x.dtype).sum(-2)
    value = (total / count.maximum(const_tensor(1, x.dtype, ()))).detach()
    out = value + (total - total.detach())
    return out.reshape(lead + size)


def max_unpool1d(input, indices, kernel_size, stride=None, padding=0, output_size=None):
    """Inverse of max_pool1d(return_indices=True): values at their indices, zeros elsewhere."""
    return _unpool_nd(input, indices, kernel_size, stride, padding, output_size, 1,
                      "max_unpool1d")


def max_unpool2d(input, indices, kernel_size, stride=None, padding=0, output_size=None):
    """Inverse of max_pool2d(return_indices=True): (N, C, H_out, W_out) with each value at
    its flat plane index, zeros elsewhere; H_out = (H_in - 1) * stride - 2 * padding +
    kernel_size unless output_size says."""
    return _unpool_nd(input, indices, kernel_size, stride, padding, output_size, 2,
                      "max_unpool2d")


def max_pool1d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
               return_indices=False):
    return _max_poolnd(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices,
                       1, "max_pool1d")


def max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
               return_indices=False):
    """Max over windows of (N, C, H, W) or (C, H, W); padding counts as -inf."""
    return _max_poolnd(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices,
                       2, "max_pool2d")


def max_pool3d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
               return_indices=False):
    return _max_poolnd(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices,
                       3, "max_pool3d")


_COUNT_CACHE = {}


def _avg_divisor(ins, outs, k, s, p, count_include_pad):
    """Per-output-position element counts (torch's rule: padding counts when
    count_include_pad, the ceil-mode overhang never does). Kept per geometry so a training
    loop reuses the same constant buffer."""
    key = (tuple(ins), tuple(outs), k, s, p, count_include_pad)
    t = _COUNT_CACHE.get(key)
    if t is None:
        c = np.ones((), dtype=np.float64)
        for i, o, kk, ss, pp in zip(ins, outs, k, s, p):
            start = np.arange(o) * ss - pp
            end = np.minimum(start + kk, i + pp)
            if not count_include_pad:
                start, end = np.maximum(start, 0), np.minimum(end, i)
            c = np.multiply.outer(c, (end - start).astype(np.float64))
        t = Tensor(c.astype(np.float32))
        _COUNT_CACHE[key] = t
    return t


def avg_poolnd(input, kernel_size, stride, padding, ceil_mode, count_include_pad,
               divisor_override, nd, what):
    """avg_pool{1,2,3}d over the last `nd` dims (`what` names the op in errors).
    Internal helper shared by zyx.nn's modules (not in __all__)."""
    x = _float(_t(input))
    k, s, p, d = _pool_args(x, kernel_size, stride, padding, 1, nd, what)
    ins = x.shape[-nd:]
    outs, extra = _pool_geometry(ins, k, s, p, d, ceil_mode, what)
    lead = x.ndim - nd
    xp = x._pad([(0, 0)] * lead + [(pp, pp + e) for pp, e in zip(p, extra)])
    tot = _windows(xp, k, s, d)._reduce(K.R_SUM, tuple(range(x.ndim, x.ndim + nd)), False)
    if divisor_override:
        return tot * (1.0 / divisor_override)
    if not any(p) and not any(extra):
        return tot * (1.0 / math.prod(k))
    return tot / _avg_divisor(ins, outs, k, s, p, count_include_pad).cast(x.dtype)


def avg_pool1d(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True):
    return avg_poolnd(input, kernel_size, stride, padding, ceil_mode, count_include_pad, None, 1,
                      "avg_pool1d")


def avg_pool2d(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    """Mean over windows of (N, C, H, W) or (C, H, W)."""
    return avg_poolnd(input, kernel_size, stride, padding, ceil_mode, count_include_pad,
                      divisor_override, 2, "avg_pool2d")


def avg_pool3d(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    return avg_poolnd(input, kernel_size, stride, padding, ceil_mode, count_include_pad,
                      divisor_override, 3, "avg_pool3d")


_MATRIX_CACHE = {}


def _axis_map(x: Tensor, axis: int, m: np.ndarray) -> Tensor:
    """Apply the linear map m (in, out) along `axis` of x: out[..., j, ...] = sum_i x[..., i,
    ...] * m[i, j]. Used for resampling, which is separable per axis."""
    key = (m.shape, m.tobytes(), x.dtype)
    w = _MATRIX_CACHE.get(key)
    if w is None:
        w = Tensor(m.astype(np.float64), dtype=x.dtype)
        if len(_MATRIX_CACHE) < 256:
            _MATRIX_CACHE[key] = w
    xa = x.transpose(axis, -1).unsqueeze(-1)                     # (..., in, 1)
    sh = xa.shape[:-2] + m.shape
    out = (xa.expand(sh) * w.expand(sh))._reduce(K.R_SUM, xa.ndim - 2, False)
    return out.transpose(axis, -1)


def _adaptive_matrix(i, o):
    m = np.zeros((i, o))
    for j in range(o):
        a, b = (j * i) // o, -(-((j + 1) * i) // o)
        m[a:b, j] = 1.0 / (b - a)
    return m


def _adaptive_avg(x, output_size, nd, what):
    x = _float(_t(x))
    if x.ndim < nd + 1:
        raise ShapeError(f"{what} needs at least {nd + 1} dimensions, got shape {x.shape}")
    ins = x.shape[-nd:]
    outs = output_size if isinstance(output_size, (tuple, list)) else (output_size,) * nd
    outs = tuple(i if o is None else int(o) for i, o in zip(ins, outs))
    for j, (i, o) in enumerate(zip(ins, outs)):
        axis = x.ndim - nd + j
        if i == o:
            continue
        if i % o == 0:   # even windows: a plain mean over a split axis (no matrix)
            sh = x.shape
            x = x.reshape(sh[:axis] + (o, i // o) + sh[axis + 1:]).mean(axis + 1)
        else:
            x = _axis_map(x, axis, _adaptive_matrix(i, o))
    return x


def adaptive_avg_pool1d(input, output_size):
    return _adaptive_avg(input, output_size, 1, "adaptive_avg_pool1d")


def adaptive_avg_pool2d(input, output_size):
    """Average pool to a fixed output size (torch's start=floor, end=ceil windows)."""
    return _adaptive_avg(input, output_size, 2, "adaptive_avg_pool2d")


# ---------------------------------------------------------------------------------------
# resampling
def _source_index(o, i, scale, align_corners, mode):
    """Fractional source coordinates of the o output positions along an axis of size i."""
    j = np.arange(o, dtype=np.float64)
    if mode == "nearest":
        return np.minimum(np.floor(j * scale), i - 1).astype(np.int64)
    if mode == "nearest-exact":
        return np.minimum(np.floor((j + 0.5) * scale), i - 1).astype(np.int64)
    if align_corners:
        return j * ((i - 1) / (o - 1)) if o > 1 else np.zeros(o)
    return np.maximum((j + 0.5) * scale - 0.5, 0.0)


def interpolate(input, size=None, scale_factor=None, mode="nearest", align_corners=None,
                recompute_scale_factor=None, antialias=False):
    """Resize the spatial dims of (N, C, *spatial): modes 'nearest', 'nearest-exact',
    'linear', 'bilinear', 'trilinear', 'area' (torch's coordinate rules, align_corners too).
    Each axis is resampled separately: an integer nearest upscale is an expand, anything
    else a gather or a small interpolation matrix."""
    x = _t(input)
    nd = x.ndim - 2
    if nd < 1:
        raise ShapeError(f"interpolate expects (N, C, *spatial), got shape {x.shape}")
    if antialias:
        raise NotImplementedError("interpolate: antialias=True is not supported")
    linear = {"linear": 1, "bilinear": 2, "trilinear": 3}
    if mode in linear:
        if linear[mode] != nd:
            raise ShapeError(f"interpolate: mode {mode!r} needs {linear[mode]} spatial dims, "
                             f"input {x.shape} has {nd}")
    elif mode not in ("nearest", "nearest-exact", "area"):
        raise NotImplementedError(f"interpolate mode {mode!r}")
    elif align_corners is not None:
        raise ValueError("align_corners can only be set with the linear modes")
    ins = x.shape[2:]
    if (size is None) == (scale_factor is None):
        raise ValueError("interpolate needs exactly one of size and scale_factor")
    if size is not None:
        outs = int_tuple(size, nd, "interpolate size")
        scales = [i / o for i, o in zip(ins, outs)]
    else:
        sf = scale_factor if isinstance(scale_factor, (tuple, list)) else (scale_factor,) * nd
        if len(sf) != nd:
            raise ShapeError(f"interpolate: scale_factor {scale_factor} for {nd} spatial dims")
        outs = [int(math.floor(i * f)) for i, f in zip(ins, sf)]
        scales = [i / o for i, o in zip(ins, outs)] if recompute_scale_factor else \
            [1.0 / f for f in sf]
    if mode == "area":   # torch's area mode is adaptive average pooling
        return _adaptive_avg(x, tuple(outs), nd, "interpolate")
    if mode in linear:
        x = _float(x)
    for j, (i, o, sc) in enumerate(zip(ins, outs, scales)):
        axis = 2 + j
        if mode in linear:
            src = _source_index(o, i, sc, align_corners, mode)
            i0 = np.minimum(np.floor(src).astype(np.int64), i - 1)
            i1 = np.minimum(i0 + 1, i - 1)
            lam = src - i0
            m = np.zeros((i, o))
            np.add.at(m, (i0, np.arange(o)), 1.0 - lam)
            np.add.at(m, (i1, np.arange(o)), lam)
            x = _axis_map(x, axis, m)
            continue
        idx = _source_index(o, i, sc, None, mode)
        if o % i == 0 and np.array_equal(idx, np.arange(o) // (o // i)):
            r = o // i   # integer upscale: each element repeated r times, an expand
            sh = x.shape
            x = x.unsqueeze(axis + 1).expand(sh[:axis + 1] + (r,) + sh[axis + 1:])
            x = x.reshape(sh[:axis] + (o,) + sh[axis + 1:])
        elif np.array_equal(idx, np.arange(o) * (i // o)) and i % o == 0:
            r = i // o   # integer downscale: every r-th element, a strided slice
            sl = [slice(None)] * x.ndim
            sl[axis] = slice(0, i, r)
            x = x[tuple(sl)]
        else:
            x = _take(x, axis, idx)
    return x


def upsample(input, size=None, scale_factor=None, mode="nearest", align_corners=None):
    return interpolate(input, size, scale_factor, mode, align_corners)


def pad(input, pad, mode="constant", value=None):
    """torch.nn.functional.pad: `pad` lists (before, after) pairs from the last dim
    backwards. Modes 'constant', 'reflect', 'replicate', 'circular'."""
    x = _t(input)
    pad = tuple(int(v) for v in pad)
    if len(pad) % 2 or len(pad) // 2 > x.ndim:
        raise ShapeError(f"pad {pad} does not fit a tensor of {x.ndim} dimension(s)")
    if mode == "constant":
        return x.pad(pad, value=0 if value is None else value)
    if mode not in ("reflect", "replicate", "circular"):
        raise ValueError(f"pad mode must be constant, reflect, replicate or circular, got {mode!r}")
    from ..tensor import cat
    for j in range(len(pad) // 2):
        axis = x.ndim - 1 - j
        before, after = pad[2 * j], pad[2 * j + 1]
        n = x.shape[axis]
        if mode == "reflect" and (before >= n or after >= n):
            raise ShapeError(f"reflect padding {(before, after)} must be smaller than the "
                             f"dimension size {n}")
        if mode == "circular" and (before > n or after > n):
            raise ShapeError(f"circular padding {(before, after)} is larger than the size {n}")
        sl = lambda a, b: x[(slice(None),) * axis + (slice(a, b),)]  # noqa: E731
        parts = []
        if before > 0:
            if mode == "reflect":
                parts.append(sl(1, before + 1).flip(axis))
            elif mode == "replicate":
                parts.append(sl(0, 1).expand(x.shape[:axis] + (before,) + x.shape[axis + 1:]))
            else:
                parts.append(sl(n - before, n))
        parts.append(sl(max(0, -before), n - max(0, -after)))
        if after > 0:
            if mode == "reflect":
                parts.append(sl(n - 1 - after, n - 1).flip(axis))
            elif mode == "replicate":
                parts.append(sl(n - 1, n).expand(x.shape[:axis] + (after,) + x.shape[axis + 1:]))
            else:
                parts.append(sl(0, after))
        x = cat(parts, axis) if len(parts) > 1 else parts[0]
    return x


def pixel_shuffle(input, upscale_factor):
    """(N, C*r*r, H, W) -> (N, C, H*r, W*r): channels become spatial sub-positions."""
    x, r = _t(input), int(upscale_factor)
    if x.ndim < 3 or x.shape[-3] % (r * r):
        raise ShapeError(f"pixel_shuffle: channels of {x.shape} are not divisible by {r * r}")
    *lead, c, h, w = x.shape
    lead, nl = tuple(lead), len(lead)
    x = x.reshape(lead + (c // (r * r), r, r, h, w))
    x = x.permute(list(range(nl)) + [nl, nl + 3, nl + 1, nl + 4, nl + 2])
    return x.reshape(lead + (c // (r * r), h * r, w * r))


def pixel_unshuffle(input, downscale_factor):
    """(N, C, H*r, W*r) -> (N, C*r*r, H, W), the inverse of pixel_shuffle."""
    x, r = _t(input), int(downscale_factor)
    if x.ndim < 3 or x.shape[-1] % r or x.shape[-2] % r:
        raise ShapeError(f"pixel_unshuffle: spatial dims of {x.shape} are not divisible by {r}")
    *lead, c, h, w = x.shape
    lead, nl = tuple(lead), len(lead)
    x = x.reshape(lead + (c, h // r, r, w // r, r))
    x = x.permute(list(range(nl)) + [nl, nl + 2, nl + 4, nl + 1, nl + 3])
    return x.reshape(lead + (c * r * r, h // r, w // r))


# ---------------------------------------------------------------------------------------
# linear, normalization
def linear(input, weight, bias=None):
    """y = x @ W.T + b with W of shape (out_features, in_features)."""
    x, w = _t(input), _t(weight)
    xs, ws = x.shape, w.shape
    if len(xs) == 2 and len(ws) == 2 and xs[1] == ws[1] and x.dtype is w.dtype:
        y = matmul_nt(x, w)     # the common case: no transpose nodes
        return y if bias is None else y + bias
    if w.ndim not in (1, 2) or x.ndim == 0 or x.shape[-1] != w.shape[-1]:
        raise ShapeError(f"linear: input {x.shape} and weight {w.shape} do not fit "
                         f"(need input.shape[-1] == weight.shape[-1])")
    if w.ndim == 2 and x.ndim > 2 and x.dtype is w.dtype and x.dtype.is_float:
        # (..., 1, in) * (1.., out, in) summed over in: W broadcast over every leading axis
        # in one expand, so its gradient is one reduce over all of them (x @ W.T would
        # broadcast W over the batch axes only and sum their partial gradients afterwards:
        # a (batch, out, in) intermediate, 1M floats for a (64, 32, 128) input)
        y = linear_nt(x, w)
    elif w.ndim == 2 and x.ndim > 2 and x.dtype is w.dtype:
        lead, n = xs[:-1], ws[0]
        xe = x.reshape(lead + (1, xs[-1])).expand(lead + (n, xs[-1]))
        we = w.reshape((1,) * len(lead) + ws).expand(lead + ws)
        y = (xe * we).sum(-1)
    else:
        y = x @ (w.T if w.ndim == 2 else w)
    if bias is not None:
        y = y + bias
    return y


def bilinear(input1, input2, weight, bias=None):
    """y[..., k] = x1 @ W[k] @ x2 + b[k] with W of shape (out, in1, in2)."""
    a, b, w = _float(_t(input1)), _float(_t(input2)), _t(weight)
    if w.ndim != 3 or a.shape[-1] != w.shape[1] or b.shape[-1] != w.shape[2]:
        raise ShapeError(f"bilinear: inputs {a.shape}, {b.shape} and weight {w.shape} do not fit")
    t = (a.unsqueeze(-2).unsqueeze(-1) * w).sum(-2)          # (..., out, in2)
    y = (t * b.unsqueeze(-2)).sum(-1)
    return y + bias if bias is not None else y


def _norm_dims(x, normalized_shape, what):
    ns = (int(normalized_shape),) if isinstance(normalized_shape, (int, np.integer)) else \
        tuple(int(v) for v in normalized_shape)
    if x.shape[x.ndim - len(ns):] != ns or len(ns) > x.ndim:
        raise ShapeError(f"{what}: normalized_shape {ns} does not match the trailing dims of "
                         f"input shape {x.shape}")
    return ns, tuple(range(x.ndim - len(ns), x.ndim))


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """(x - mean) / sqrt(var + eps) over the trailing `normalized_shape` dims (biased var)."""
    x = _float(_t(input))
    ns, axes = _norm_dims(x, normalized_shape, "layer_norm")
    fast = _layer_norm_nodes(x, ns, axes, weight, bias, eps)
    if fast is not None:
        return fast
    m = x.mean(axes, keepdim=True)
    c = x - m
    v = (c * c).mean(axes, keepdim=True)
    y = c * (v + eps).rsqrt()
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def _layer_norm_nodes(x, ns, axes, weight, bias, eps):
    """layer_norm of a float32/float64 `x` whose weight and bias (when given) are tensors of
    its dtype and shape `ns`: the nodes of the general path below, made directly (a
    transformer builds five per token while sampling, and the public methods' checks were
    most of their cost). None when the case does not apply."""
    d = x.dtype
    if d is not dt.float32 and d is not dt.float64 or type(eps) not in (float, int):
        return None
    for p in (weight, bias):
        if p is not None and not (isinstance(p, Tensor) and p.dtype is d and p.shape == ns):
            return None
    shape = x.shape
    count = math.prod(ns)
    if not count:
        return None
    mk = _TB.make
    kshape = shape[:len(shape) - len(ns)] + (1,) * len(ns)
    inv = const_tensor(1.0 / count, d, kshape)
    mean = mk(_G.BINARY, K.B_MUL, (mk(_G.REDUCE, (K.R_SUM, axes), (x,), kshape, d), inv),
              kshape, d)
    c = mk(_G.BINARY, K.B_SUB, (x, mk(_G.EXPAND, shape, (mean,), shape, d)), shape, d)
    sq = mk(_G.REDUCE, (K.R_SUM, axes), (mk(_G.BINARY, K.B_MUL, (c, c), shape, d),), kshape, d)
    var = mk(_G.BINARY, K.B_MUL, (sq, inv), kshape, d)
    root = mk(_G.UNARY, K.U_SQRT, (mk(_G.BINARY, K.B_ADD, (var, const_tensor(eps, d, kshape)),
                                      kshape, d),), kshape, d)
    scale = mk(_G.UNARY, K.U_RECIP, (root,), kshape, d)
    y = mk(_G.BINARY, K.B_MUL, (c, mk(_G.EXPAND, shape, (scale,), shape, d)), shape, d)
    ones = (1,) * (len(shape) - len(ns)) + ns
    for p, op in ((weight, K.B_MUL), (bias, K.B_ADD)):
        if p is not None:
            pe = mk(_G.RESHAPE, ones, (p,), ones, d) if ones != ns else p
            if ones != shape:
                pe = mk(_G.EXPAND, shape, (pe,), shape, d)
            y = mk(_G.BINARY, op, (y, pe), shape, d)
    return y


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """x / sqrt(mean(x^2) + eps) over the trailing dims; eps defaults to the dtype's
    machine epsilon, as in torch."""
    x = _float(_t(input))
    _, axes = _norm_dims(x, normalized_shape, "rms_norm")
    if eps is None:   # machine epsilon of the dtype (bfloat16 has 7 mantissa bits)
        eps = 2.0 ** -7 if x.dtype is dt.bfloat16 else float(np.finfo(x.dtype.np).eps)
    y = x * ((x * x).mean(axes, keepdim=True) + eps).rsqrt()
    return y * weight if weight is not None else y


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
               momentum=0.1, eps=1e-5):
    """Batch normalization over (N, C, *). In training the batch statistics normalize and
    the running stats are updated in place (torch's rule: unbiased variance, exponential
    moving average with `momentum`); in eval the running stats normalize."""
    x = _float(_t(input))
    if x.ndim < 2:
        raise ShapeError(f"batch_norm expects (N, C, *), got shape {x.shape}")
    c = x.shape[1]
    axes = (0,) + tuple(range(2, x.ndim))
    bshape = (1, c) + (1,) * (x.ndim - 2)
    for name, t in (("running_mean", running_mean), ("running_var", running_var),
                    ("weight", weight), ("bias", bias)):
        if t is not None and t.shape != (c,):
            raise ShapeError(f"batch_norm: {name} must have shape ({c},), got {t.shape}")
    if training:
        n = x.numel() // c
        if n <= 1:
            raise ShapeError(f"batch_norm: expected more than 1 value per channel when "
                             f"training, got input shape {x.shape}")
        m = x.mean(axes, keepdim=True)
        d = x - m
        v = (d * d).mean(axes, keepdim=True)
        if running_mean is not None or running_var is not None:
            mom = momentum
            mb, vb = m.detach().reshape(c), v.detach().reshape(c)
            if running_mean is not None:
                copy_into(running_mean,
                          running_mean * (1 - mom) + mb.cast(running_mean.dtype) * mom)
            if running_var is not None:
                unb = vb * (n / (n - 1))
                copy_into(running_var,
                          running_var * (1 - mom) + unb.cast(running_var.dtype) * mom)
    else:
        if running_mean is None or running_var is None:
            raise ZyxError("batch_norm: running_mean and running_var are required when not "
                           "training")
        m = running_mean.cast(x.dtype).reshape(bshape)
        d = x - m
        v = running_var.cast(x.dtype).reshape(bshape)
    y = d * (v + eps).rsqrt()
    if weight is not None:
        y = y * weight.reshape(bshape)
    if bias is not None:
        y = y + bias.reshape(bshape)
    return y


def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None,
                  use_input_stats=True, momentum=0.1, eps=1e-5):
    """Normalize each (sample, channel) over its spatial dims."""
    x = _float(_t(input))
    if not use_input_stats:
        return batch_norm(x, running_mean, running_var, weight, bias, False, momentum, eps)
    if running_mean is not None or running_var is not None:
        raise NotImplementedError("instance_norm with running stats")
    axes = tuple(range(2, x.ndim))
    m = x.mean(axes, keepdim=True)
    d = x - m
    y = d * ((d * d).mean(axes, keepdim=True) + eps).rsqrt()
    bshape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    if weight is not None:
        y = y * weight.reshape(bshape)
    if bias is not None:
        y = y + bias.reshape(bshape)
    return y


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    """Normalize (N, C, *) over groups of C/num_groups channels and the spatial dims."""
    x = _float(_t(input))
    if x.ndim < 2 or x.shape[1] % num_groups:
        raise ShapeError(f"group_norm: {num_groups} groups do not divide the channels of "
                         f"input shape {x.shape}")
    n, c = x.shape[:2]
    xg = x.reshape(n, num_groups, -1)
    m = xg.mean(2, keepdim=True)
    d = xg - m
    y = (d * ((d * d).mean(2, keepdim=True) + eps).rsqrt()).reshape(x.shape)
    bshape = (1, c) + (1,) * (x.ndim - 2)
    if weight is not None:
        y = y * weight.reshape(bshape)
    if bias is not None:
        y = y + bias.reshape(bshape)
    return y


def _p_norm(x, p, dim, keepdim):
    if p == 2:
        return (x * x).sum(dim, keepdim=keepdim).sqrt()
    if p == 1:
        return x.abs().sum(dim, keepdim=keepdim)
    if p == float("inf"):
        return x.abs().amax(dim, keepdim=keepdim)
    return (x.abs() ** p).sum(dim, keepdim=keepdim) ** (1.0 / p)


def normalize(input, p=2.0, dim=1, eps=1e-12):
    """x / max(||x||_p, eps) along `dim`."""
    x = _float(_t(input))
    return x / _p_norm(x, p, dim, True).maximum(eps)


def cosine_similarity(x1, x2, dim=1, eps=1e-8):
    a, b = _float(_t(x1)), _float(_t(x2))
    na = (a * a).sum(dim, keepdim=True).sqrt().maximum(eps)
    nb = (b * b).sum(dim, keepdim=True).sqrt().maximum(eps)
    return ((a / na) * (b / nb)).sum(dim)


def pairwise_distance(x1, x2, p=2.0, eps=1e-6, keepdim=False):
    d = _float(_t(x1)) - _float(_t(x2)) + eps
    return _p_norm(d, p, -1, keepdim)


# ---------------------------------------------------------------------------------------
# dropout, sparse
def dropout(input, p=0.5, training=True, inplace=False):
    """Zero each element with probability p and scale the rest by 1/(1-p) (training only).
    The mask is computed on the device by zyx's counter-based generator (zyx/random.py)
    inside the kernel that uses it: no mask buffer, no extra kernel; zyx.manual_seed
    makes it reproducible."""
    x = _t(input)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0
    keep = _random.keep_mask(x.shape, p, x.device)
    return where(keep, x * (1.0 / (1.0 - p)), 0.0)


def _feature_dropout(x, p, training, nd, what):
    x = _t(x)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{what} probability must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    if x.ndim not in (nd + 1, nd + 2):
        raise ShapeError(f"{what} expects {nd + 1}-D or {nd + 2}-D input, got {x.shape}")
    if p == 1.0:
        return x * 0
    lead = x.ndim - nd
    keep = _random.keep_mask(x.shape[:lead] + (1,) * nd, p, x.device)
    return where(keep, x * (1.0 / (1.0 - p)), 0.0)


def dropout1d(input, p=0.5, training=True, inplace=False):
    return _feature_dropout(input, p, training, 1, "dropout1d")


def dropout2d(input, p=0.5, training=True, inplace=False):
    """Zero whole channels of (N, C, H, W) with probability p."""
    return _feature_dropout(input, p, training, 2, "dropout2d")


def dropout3d(input, p=0.5, training=True, inplace=False):
    return _feature_dropout(input, p, training, 3, "dropout3d")


def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0,
              scale_grad_by_freq=False, sparse=False):
    """Rows of `weight` (num_embeddings, dim) picked by the integer tensor `input`."""
    idx = _t(input)
    w = _t(weight)
    if not idx.dtype.is_int:
        raise DTypeError(f"embedding indices must be integers, got {idx.dtype.name}")
    if w.ndim != 2:
        raise ShapeError(f"embedding weight must be 2-D, got {w.shape}")
    if max_norm is not None:
        w = _embedding_renorm(weight, idx, float(max_norm), float(norm_type))
    if padding_idx is not None:
        # the padding row reads a detached copy: it never receives a gradient (torch's rule)
        v = w.shape[0]
        pad_row = (iota(v, dt.int64) == int(padding_idx) % v).reshape(v, 1)
        w = where(pad_row, w.detach(), w)
    return _take(w, 0, idx, "index out of range in self: index {} is out of bounds for "
                 "dimension 0 with size {} (in embedding)", (w.shape[0],))


def _embedding_renorm(weight, idx, max_norm, norm_type):
    """torch's embedding_renorm_: rows of `weight` that `idx` looks up and whose p-norm
    exceeds max_norm are scaled to max_norm / (norm + 1e-7), outside autograd. torch
    changes the weight in place; zyx rebinds the weight tensor object (a parameter stays
    the same object, as after an optimizer step) to the renormalized value and returns it."""
    from ..autograd import no_grad
    w = _t(weight)
    v = w.shape[0]
    with no_grad():
        rows = iota(v, idx.dtype).reshape((1, v))
        used = (idx.reshape((-1, 1)) == rows).cast(dt.int32).amax(0).reshape((v, 1)) > 0
        wd = w.detach()
        if norm_type == float("inf"):
            norm = wd.abs().amax(1, keepdim=True)
        else:
            norm = (wd.abs() ** norm_type).sum(1, keepdim=True) ** (1.0 / norm_type)
        scale = where(used & (norm > max_norm), max_norm / (norm + 1e-7), 1.0)
        new = (wd * scale.cast(w.dtype)).realize()
    if isinstance(weight, Tensor):
        rg = weight.requires_grad
        rebind(weight, new)
        weight.requires_grad = rg
        return weight
    return new


def one_hot(tensor, num_classes=-1):
    """int64 one-hot encoding along a new last dim (num_classes=-1: max + 1, which reads
    the data)."""
    t = _t(tensor)
    if not t.dtype.is_int:
        raise DTypeError(f"one_hot needs an integer tensor, got {t.dtype.name}")
    if num_classes < 0:
        num_classes = int(t.max().item()) + 1 if t.numel() else 0
    cls = iota(num_classes, t.dtype).reshape((1,) * t.ndim + (num_classes,))
    hit = t.unsqueeze(-1) == cls
    watch_range(hit, t, 0, num_classes, lambda v: (
        f"Class values must be non-negative, got {v} (in one_hot)" if v < 0 else
        f"Class values must be smaller than num_classes, got {v} with num_classes="
        f"{num_classes} (in one_hot)"))
    return hit.cast(dt.int64)


def causal_mask(L, S):
    """bool (L, S): True where query i may attend key j (j <= i).
    Internal helper shared by zyx.nn's modules (not in __all__)."""
    r = iota(L, dt.int32).reshape(L, 1)
    c = iota(S, dt.int32).reshape(1, S)
    return c <= r


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """softmax(q @ k^T * scale + mask) @ v over (..., L, E), (..., S, E), (..., S, Ev).
    A bool attn_mask says which positions take part (True = attend); a float one is added."""
    q, k, v = _float(_t(query)), _float(_t(key)), _float(_t(value))
    if q.ndim < 2 or k.ndim < 2 or v.ndim < 2 or q.shape[-1] != k.shape[-1] or \
            k.shape[-2] != v.shape[-2]:
        raise ShapeError(f"scaled_dot_product_attention: query {q.shape}, key {k.shape} and "
                         f"value {v.shape} do not fit")
    if enable_gqa and q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = _repeat_heads(k, rep), _repeat_heads(v, rep)
    L, S = q.shape[-2], k.shape[-2]
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-2, -1)) * sc
    if is_causal:
        if attn_mask is not None:
            raise ZyxError("scaled_dot_product_attention: give attn_mask or is_causal, not both")
        s = where(causal_mask(L, S), s, float("-inf"))
    if attn_mask is not None:
        mk = _t(attn_mask)
        s = where(mk, s, float("-inf")) if mk.dtype.is_bool else s + mk
    a = s.softmax(-1)
    if dropout_p > 0.0:
        a = dropout(a, dropout_p, True)
    return a @ v


def _repeat_heads(x, rep):
    sh = x.shape
    x = x.unsqueeze(-3).expand(sh[:-3] + (sh[-3], rep) + sh[-2:])
    return x.reshape(sh[:-3] + (sh[-3] * rep,) + sh[-2:])


# ---------------------------------------------------------------------------------------
# activations
def relu(input, inplace=False):
    return _t(input).relu()


def _hardtanh(x, lo, hi):
    # torch's hardtanh family (hardtanh, relu6, hardsigmoid) passes no gradient on a
    # bound, where clamp passes all of it: select with <= / >= (NaN still flows through)
    r = clamp_float_scalars(x, lo, hi, False)
    return r if r is not None else where(x <= lo, lo, where(x >= hi, hi, x))


def relu6(input, inplace=False):
    return _hardtanh(_t(input), 0, 6)


def sigmoid(input):
    return _t(input).sigmoid()


def tanh(input):
    return _t(input).tanh()


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu(input, approximate="none"):
    """x * Phi(x): exact with erf, or the tanh approximation (approximate='tanh')."""
    x = _float(_t(input))
    if approximate == "none":
        return x * 0.5 * (1.0 + (x * (1.0 / math.sqrt(2.0))).erf())
    if approximate == "tanh":
        return x * 0.5 * (1.0 + ((x + x * x * x * 0.044715) * _SQRT_2_OVER_PI).tanh())
    raise ValueError(f"gelu approximate must be 'none' or 'tanh', got {approximate!r}")


def silu(input, inplace=False):
    x = _float(_t(input))
    return x * x.sigmoid()


def _log1p_exp(x):
    """log(1 + exp(x)) without overflow: max(x, 0) + log(1 + exp(-|x|))."""
    return x.maximum(0) + ((-x.abs()).exp() + 1).log()


def softplus(input, beta=1.0, threshold=20.0):
    """log(1 + exp(beta*x)) / beta, and x itself where beta*x > threshold (as torch)."""
    x = _float(_t(input))
    bx = x * beta if beta != 1 else x
    sp = _log1p_exp(bx)
    if beta != 1:
        sp = sp * (1.0 / beta)
    return where(bx > threshold, x, sp)


def logsigmoid(input):
    """log(sigmoid(x)) = min(x, 0) - log(1 + exp(-|x|)), stable for large |x|."""
    x = _float(_t(input))
    return x.minimum(0) - ((-x.abs()).exp() + 1).log()


def leaky_relu(input, negative_slope=0.01, inplace=False):
    x = _t(input)
    return where(x > 0, x, x * negative_slope)


def elu(input, alpha=1.0, inplace=False):
    x = _float(_t(input))
    return where(x > 0, x, (x.exp() - 1) * alpha)


_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def selu(input, inplace=False):
    x = _float(_t(input))
    return where(x > 0, x, (x.exp() - 1) * _SELU_ALPHA) * _SELU_SCALE


def celu(input, alpha=1.0, inplace=False):
    x = _float(_t(input))
    return where(x > 0, x, ((x * (1.0 / alpha)).exp() - 1) * alpha)


def mish(input, inplace=False):
    x = _float(_t(input))
    return x * softplus(x).tanh()


def hardtanh(input, min_val=-1.0, max_val=1.0, inplace=False):
    return _hardtanh(_t(input), min_val, max_val)


def hardsigmoid(input, inplace=False):
    return _hardtanh(_float(_t(input)) * (1.0 / 6.0) + 0.5, 0.0, 1.0)


def hardswish(input, inplace=False):
    x = _float(_t(input))
    return x * hardsigmoid(x)


def softsign(input):
    x = _float(_t(input))
    return x / (x.abs() + 1)


def tanhshrink(input):
    x = _float(_t(input))
    return x - x.tanh()


def softshrink(input, lambd=0.5):
    x = _float(_t(input))
    return where(x > lambd, x - lambd, where(x < -lambd, x + lambd, 0.0))


def hardshrink(input, lambd=0.5):
    x = _float(_t(input))
    return where(x.abs() > lambd, x, 0.0)


def threshold(input, threshold, value, inplace=False):
    x = _t(input)
    return where(x > threshold, x, value)


def glu(input, dim=-1):
    """a * sigmoid(b) with a, b the two halves of `dim`."""
    x = _float(_t(input))
    if x.shape[dim] % 2:
        raise ShapeError(f"glu: dim {dim} of shape {x.shape} has odd size")
    a, b = x.chunk(2, dim)
    return a * b.sigmoid()


def prelu(input, weight):
    """max(0, x) + weight * min(0, x), weight per channel (dim 1) or a single value."""
    x, w = _float(_t(input)), _t(weight)
    if w.numel() > 1:
        if x.ndim < 2 or w.shape != (x.shape[1],):
            raise ShapeError(f"prelu: weight {w.shape} does not match the channels of {x.shape}")
        w = w.reshape((1, x.shape[1]) + (1,) * (x.ndim - 2))
    else:
        w = w.reshape(())
    return where(x > 0, x, x * w)


def _dim_arg(dim, x, what):
    if dim is None:   # torch's legacy implicit dim
        return 0 if x.ndim in (0, 1, 3) else 1
    return dim


def softmax(input, dim=None, _stacklevel=3, dtype=None):
    x = _t(input)
    return x.softmax(_dim_arg(dim, x, "softmax"), dtype=dtype)


def log_softmax(input, dim=None, _stacklevel=3, dtype=None):
    """x - logsumexp(x) along dim (max-shifted, stable)."""
    x = _t(input)
    return x.log_softmax(_dim_arg(dim, x, "log_softmax"), dtype=dtype)


def softmin(input, dim=None, _stacklevel=3, dtype=None):
    x = _t(input)
    return (-_float(x)).softmax(_dim_arg(dim, x, "softmin"), dtype=dtype)


# ---------------------------------------------------------------------------------------
# losses
def mse_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    x, y = _float(_t(input)), _t(target)
    _check_same_shape(x, y, "mse_loss")
    d = x - y
    loss = d * d
    return _reduce_loss(loss * weight if weight is not None else loss, reduction)


def l1_loss(input, target, size_average=None, reduce=None, reduction="mean"):
    x, y = _float(_t(input)), _t(target)
    _check_same_shape(x, y, "l1_loss")
    return _reduce_loss((x - y).abs(), reduction)


def smooth_l1_loss(input, target, size_average=None, reduce=None, reduction="mean", beta=1.0):
    """0.5 d^2 / beta where |d| < beta, else |d| - 0.5 beta."""
    x, y = _float(_t(input)), _t(target)
    _check_same_shape(x, y, "smooth_l1_loss")
    d = (x - y).abs()
    if beta == 0:
        return _reduce_loss(d, reduction)
    loss = where(d < beta, d * d * (0.5 / beta), d - 0.5 * beta)
    return _reduce_loss(loss, reduction)


def huber_loss(input, target, reduction="mean", delta=1.0, weight=None):
    """0.5 d^2 where |d| < delta, else delta * (|d| - 0.5 delta)."""
    x, y = _float(_t(input)), _t(target)
    _check_same_shape(x, y, "huber_loss")
    d = (x - y).abs()
    loss = where(d < delta, d * d * 0.5, (d - 0.5 * delta) * delta)
    return _reduce_loss(loss * weight if weight is not None else loss, reduction)


def _class_view(x, w):
    """weight (C,) broadcast along the class dim (1) of x."""
    return w.reshape((1, x.shape[1]) + (1,) * (x.ndim - 2)) if x.ndim > 1 else w


# torch's "Target 5 is out of bounds." with the valid range
_TARGET_MESSAGE = ("Target {} is out of bounds. ({}: class-index targets must be in [0, {}) "
                   "or equal ignore_index={})")


def _nll(logp, target, weight, ignore_index, reduction, what):
    """Negative log likelihood of integer targets: logp (N, C, *) or (C,), target (N, *) or
    (). Returns (loss per element, sum of the weights of the counted elements)."""
    if target.dtype.is_float or target.dtype.is_bool:
        raise DTypeError(f"{what}: class-index targets must be integers, got {target.dtype.name}")
    if logp.ndim == 1:
        logp, target = logp.unsqueeze(0), target.reshape(1)
        squeeze = True
    else:
        squeeze = False
    c = logp.shape[1]
    if target.shape != (logp.shape[0],) + logp.shape[2:]:
        raise ShapeError(f"{what}: target shape {target.shape} does not fit input shape "
                         f"{logp.shape} (expected {(logp.shape[0],) + logp.shape[2:]})")
    cls = iota(c, target.dtype).reshape((1, c) + (1,) * (logp.ndim - 2))
    hit = target.unsqueeze(1) == cls          # all-false rows where target == ignore_index
    watch_range(hit, target, 0, c, _TARGET_MESSAGE, (what, c, ignore_index),
                exempt=ignore_index)
    if ignore_index is not None and 0 <= ignore_index < c:
        hit = hit & (target.unsqueeze(1) != ignore_index)
    picked = where(hit, logp, 0.0).sum(1)
    if weight is not None:
        w = _t(weight)
        if w.shape != (c,):
            raise ShapeError(f"{what}: weight must have shape ({c},), got {w.shape}")
        wt = where(hit, _class_view(logp, w.cast(logp.dtype)), 0.0).sum(1)
    else:
        wt = hit.cast(logp.dtype).sum(1)
    loss = -picked * wt if weight is not None else -picked
    if squeeze:
        loss, wt = loss.reshape(()), wt.reshape(())
    return loss, wt


def nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
             reduction="mean"):
    """-input[n, target[n]] (times weight[target[n]]); 'mean' divides by the total weight."""
    logp, y = _float(_t(input)), _t(target)
    loss, wt = _nll(logp, y, weight, ignore_index, reduction, "nll_loss")
    if reduction == "mean":
        return loss.sum() / wt.sum()
    return _reduce_loss(loss, reduction)


def _cross_entropy_2d(x, y, ignore_index):
    """The training-loop case of cross_entropy: logits (N, C), integer targets (N,), mean,
    no weight / smoothing / in-range ignore_index. Builds the nodes of the general path
    (log_softmax, one-hot select, sum / number of counted rows) directly; None when the
    case does not apply."""
    xs, ys = x.shape, y.shape
    yd = y.dtype
    if len(xs) != 2 or ys != xs[:1] or not (yd.is_int and not yd.is_bool) or \
            (ignore_index is not None and 0 <= ignore_index < xs[1]):
        return None
    (n, c), d = xs, x.dtype
    mk = x._make
    nc, n1 = (n, c), (n, 1)
    # the shift is detached (its gradient is zero: see tensor._logsumexp)
    xd = x.detach()
    m = xd._make(_G.REDUCE, (K.R_MAX, (1,)), (xd,), n1, d)
    z = x - mk(_G.EXPAND, nc, (m,), nc, d)
    lse = mk(_G.REDUCE, (K.R_SUM, (1,)), (z.exp(),), n1, d).log()
    logp = z - mk(_G.EXPAND, nc, (lse,), nc, d)
    ye = mk(_G.EXPAND, nc, (mk(_G.RESHAPE, n1, (y,), n1, yd),), nc, yd)
    cls = iota(c, yd)
    ce = mk(_G.EXPAND, nc, (mk(_G.RESHAPE, (1, c), (cls,), (1, c), yd),), nc, yd)
    hit = mk(_G.BINARY, K.B_EQ, (ye, ce), nc, dt.bool_)
    watch_range(hit, y, 0, c, _TARGET_MESSAGE, ("cross_entropy", c, ignore_index),
                exempt=ignore_index)
    zero = const_tensor(0.0, d, nc)
    picked = mk(_G.REDUCE, (K.R_SUM, (1,)), (mk(_G.WHERE, None, (hit, logp, zero), nc, d),),
                n1, d)
    total = mk(_G.REDUCE, (K.R_SUM, (0, 1)), (picked,), (1, 1), d)
    # rows counted: those whose target is a class (ignore_index is not one here), read
    # from the n targets instead of the n x c one-hot compare
    counted = ((y >= 0) & (y < c)).cast(d)
    wt = mk(_G.REDUCE, (K.R_SUM, (0,)), (counted,), (1,), d).reshape(1, 1)
    return mk(_G.RESHAPE, (), (-total / wt,), (), d)


def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                  reduction="mean", label_smoothing=0.0):
    """log_softmax over dim 1 followed by NLL; targets are class indices (N, *) or class
    probabilities (same shape as input). Matches torch's rules for weight, ignore_index,
    label_smoothing and every reduction."""
    x, y = _float(_t(input)), _t(target)
    if weight is None and label_smoothing == 0 and reduction == "mean":
        fast = _cross_entropy_2d(x, y, ignore_index)
        if fast is not None:
            return fast
    if x.ndim == 0:
        raise ShapeError("cross_entropy needs an input of at least 1 dimension")
    cdim = 0 if x.ndim == 1 else 1
    c = x.shape[cdim]
    logp = x.log_softmax(cdim)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    w = None
    if weight is not None:
        w = _t(weight).cast(x.dtype)
        if w.shape != (c,):
            raise ShapeError(f"cross_entropy: weight must have shape ({c},), got {w.shape}")
    if y.dtype.is_float:   # class probabilities
        _check_same_shape(x, y, "cross_entropy (probability targets)")
        if label_smoothing > 0:
            y = y * (1 - label_smoothing) + label_smoothing / c
        lp = logp * _class_view(x, w) if w is not None else logp
        loss = -(lp * y).sum(cdim)
        if reduction == "mean":
            return loss.sum() * (1.0 / (x.numel() // c)) if x.numel() else loss.sum() / 0.0
        return _reduce_loss(loss, reduction)
    nll, wt = _nll(logp, y, w, ignore_index, reduction, "cross_entropy")
    if reduction == "mean":
        nll_r = nll.sum() / wt.sum()
    else:
        nll_r = _reduce_loss(nll, reduction)
    if label_smoothing == 0:
        return nll_r
    lp = logp * _class_view(x, w) if w is not None else logp
    smooth = -lp.sum(cdim)
    smooth = where(y == ignore_index, 0.0, smooth)
    if reduction == "mean":
        sm = smooth.sum() / (wt.sum() if w is not None else (y != ignore_index).sum().cast(x.dtype))
    else:
        sm = _reduce_loss(smooth, reduction)
    return nll_r * (1 - label_smoothing) + sm * (label_smoothing / c)


def binary_cross_entropy(input, target, weight=None, size_average=None, reduce=None,
                         reduction="mean"):
    """-(t log x + (1-t) log(1-x)) with the logs clamped at -100, as torch."""
    x, y = _float(_t(input)), _float(_t(target))
    _check_same_shape(x, y, "binary_cross_entropy")
    loss = -(y * x.log().maximum(-100.0) + (1 - y) * (1 - x).log().maximum(-100.0))
    if weight is not None:
        loss = loss * weight
    return _reduce_loss(loss, reduction)


def binary_cross_entropy_with_logits(input, target, weight=None, size_average=None, reduce=None,
                                     reduction="mean", pos_weight=None):
    """BCE on logits in the stable form (1-t) x + (1 + (pw-1) t) log(1 + exp(-x))."""
    x, y = _float(_t(input)), _float(_t(target))
    _check_same_shape(x, y, "binary_cross_entropy_with_logits")
    sp = _log1p_exp(-x)                 # log(1 + exp(-x)) = -logsigmoid(x)
    if pos_weight is not None:
        lw = (_t(pos_weight) - 1) * y + 1
        loss = (1 - y) * x + lw * sp
    else:
        loss = (1 - y) * x + sp
    if weight is not None:
        loss = loss * weight
    return _reduce_loss(loss, reduction)


def kl_div(input, target, size_average=None, reduce=None, reduction="mean", log_target=False):
    """KL(target || exp(input)) pointwise: target * (log target - input)."""
    x, y = _float(_t(input)), _float(_t(target))
    if log_target:
        loss = y.exp() * (y - x)
    else:
        loss = where(y > 0, y * (where(y > 0, y, 1.0).log() - x), 0.0)
    if reduction == "batchmean":
        return loss.sum() * (1.0 / x.shape[0]) if x.ndim else loss.sum()
    return _reduce_loss(loss, reduction)


def _register_composites():
    """Hook the composite ops up with autograd (imported here: autograd imports the
    tensor module this one builds on)."""
    global _record_composite
    from .. import autograd
    _record_composite = autograd.record_composite
    autograd.register_composite("conv", _conv_backward)


_record_composite = None
_register_composites()
