"""Recurrent layers: RNNCell, GRUCell, LSTMCell and the sequence modules RNN, LSTM, GRU
(torch's gate order, parameter names, init and output conventions).

Sequence modules compute the input projection of every timestep of a layer in one matmul
(`_project`), so a timestep adds only `h @ W_hh^T` and the gate math. Every timestep reads
its projected input from a buffer of its own (`_steps`): kernels then read the same offsets
at every step, so the per-step kernels are identical and the C backend compiles one copy.
"""
from __future__ import annotations

import math

from ... import autograd
from ..._core import replay as _replay
from ..._core import tensorbase as _TB
from ...runtime import RT
from ...errors import InvalidArgumentError, ShapeError
from ...tensor import Tensor, cat, stack, zeros
from .. import functional as F
from .. import init
from .module import Module, new_parameter

__all__ = ["RNNCell", "GRUCell", "LSTMCell", "RNNBase", "RNN", "LSTM", "GRU"]


class _CellBase(Module):
    _gates = 1

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, device=None,
                 dtype=None):
        super().__init__()
        self.input_size, self.hidden_size, self.bias = input_size, hidden_size, bias
        g = self._gates * hidden_size
        self.weight_ih = new_parameter(g, input_size, dtype=dtype)
        self.weight_hh = new_parameter(g, hidden_size, dtype=dtype)
        if bias:
            self.bias_ih = new_parameter(g, dtype=dtype)
            self.bias_hh = new_parameter(g, dtype=dtype)
        else:
            self.register_parameter("bias_ih", None)
            self.register_parameter("bias_hh", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        stdv = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0
        for p in self.parameters():
            init.uniform_(p, -stdv, stdv)

    def _prepare(self, x, hx):
        """(batched input, batched hidden state or None, whether the input was unbatched)."""
        if x.ndim not in (1, 2) or x.shape[-1] != self.input_size:
            raise ShapeError(f"{type(self).__name__}: expected input (N, {self.input_size}) or "
                             f"({self.input_size},), got {x.shape}")
        unbatched = x.ndim == 1
        if unbatched:
            x = x.unsqueeze(0)
        return x, unbatched

    def _hidden(self, h, n, unbatched, x):
        if h is None:
            return zeros(n, self.hidden_size, dtype=x.dtype)
        if unbatched:
            h = h.unsqueeze(0)
        if h.shape != (n, self.hidden_size):
            raise ShapeError(f"{type(self).__name__}: hidden state must have shape "
                             f"{(n, self.hidden_size)}, got {h.shape}")
        return h

    def _proj(self, x, h):
        return F.linear(x, self.weight_ih, self.bias_ih), F.linear(h, self.weight_hh, self.bias_hh)

    def extra_repr(self):
        s = f"{self.input_size}, {self.hidden_size}"
        return s + (", bias=False" if not self.bias else "")


class RNNCell(_CellBase):
    """h' = tanh(W_ih x + b_ih + W_hh h + b_hh) (or relu)."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 nonlinearity: str = "tanh", device=None, dtype=None):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}")
        super().__init__(input_size, hidden_size, bias, dtype=dtype)
        self.nonlinearity = nonlinearity

    def forward(self, x, hx=None):
        x, unbatched = self._prepare(x, hx)
        h = self._hidden(hx, x.shape[0], unbatched, x)
        a, b = self._proj(x, h)
        out = (a + b).tanh() if self.nonlinearity == "tanh" else (a + b).relu()
        return out.squeeze(0) if unbatched else out


class GRUCell(_CellBase):
    """Gates r, z, n (torch's order): n = tanh(W_in x + b_in + r * (W_hn h + b_hn)),
    h' = (1 - z) * n + z * h."""
    _gates = 3

    def forward(self, x, hx=None):
        x, unbatched = self._prepare(x, hx)
        h = self._hidden(hx, x.shape[0], unbatched, x)
        gi, gh = self._proj(x, h)
        ir, iz, in_ = gi.chunk(3, 1)
        hr, hz, hn = gh.chunk(3, 1)
        r = (ir + hr).sigmoid()
        z = (iz + hz).sigmoid()
        n = (in_ + r * hn).tanh()
        out = (1 - z) * n + z * h
        return out.squeeze(0) if unbatched else out


class LSTMCell(_CellBase):
    """Gates i, f, g, o (torch's order): c' = f*c + i*g, h' = o * tanh(c'). Returns (h', c')."""
    _gates = 4

    def forward(self, x, hx=None):
        x, unbatched = self._prepare(x, hx)
        n = x.shape[0]
        h, c = (None, None) if hx is None else hx
        h = self._hidden(h, n, unbatched, x)
        c = self._hidden(c, n, unbatched, x)
        gi, gh = self._proj(x, h)
        i, f, g, o = (gi + gh).chunk(4, 1)
        c2 = f.sigmoid() * c + i.sigmoid() * g.tanh()
        h2 = o.sigmoid() * c2.tanh()
        if unbatched:
            return h2.squeeze(0), c2.squeeze(0)
        return h2, c2


# ---------------------------------------------------------------------------------------------
# sequence modules
# ---------------------------------------------------------------------------------------------
# F.stored: x in a buffer of its own. A batch_first input transposed to time-major is
# copied once, so the input-projection matmul and its weight gradient read plain rows
# (tiled kernels) instead of div/mod index math on every load.
_stored = F.stored


def _steps(seq: Tensor):
    """The timesteps of `seq` (T, N, G) as T tensors (N, G), each stored in a buffer of its
    own (a sum over a size-1 axis is a reduce, which the kernelizer stores): every
    consumer then reads offset 0 of its step's buffer, so the kernels of different
    timesteps are the same source (one compiled copy) instead of one per step offset."""
    t = seq.shape[0]
    return [seq[i:i + 1].sum(0) for i in range(t)]


def _hidden_proj(h, w_hh, b_hh):
    """h @ W_hh^T (+ b_hh), with W_hh read through a flip (undone on the output).

    Autograd sums the T per-step weight gradients; a movement op (the flip) between each
    per-step matmul and that sum makes every per-step weight gradient a kernel of its own
    (a tiled matmul, the same source at every step) followed by one cheap elementwise sum,
    instead of one kernel that fuses T untiled reductions."""
    y = F.linear(h, w_hh.flip(0)).flip(1)
    return y if b_hh is None else y + b_hh


def _tanh_cell(gx, h, w_hh, b_hh):
    return (gx + _hidden_proj(h, w_hh, b_hh)).tanh()


def _relu_cell(gx, h, w_hh, b_hh):
    return (gx + _hidden_proj(h, w_hh, b_hh)).relu()


def _lstm_cell(gx, state, w_hh, b_hh):
    h, c = state
    i, f, g, o = (gx + _hidden_proj(h, w_hh, b_hh)).chunk(4, 1)
    # c is read only by elementwise ops, so unstored it would be inlined into the next
    # step's kernels, each step's kernel recomputing all earlier steps' c (a different
    # source per step); storing it keeps every step the same two kernels
    c2 = _stored(f.sigmoid() * c + i.sigmoid() * g.tanh())
    return o.sigmoid() * c2.tanh(), c2


_SEQUENCE_COMPOSITE = True   # LSTM layers record one "lstm" composite (False: per-step ops)


def _lstm_sequence(gx, state, w_hh):
    """(outputs (T, N, H), (h_T, c_T)) of an LSTM layer over its projected inputs gx
    (T, N, 4H, biases included), recorded for autograd as one composite op ("lstm") with
    a hand-written backward (`_lstm_backward`): the recurrent weight's gradient is then one
    matmul over every timestep, (T*N, 4H)^T @ (T*N, H), instead of one small matmul per
    step (a reduce over the batch alone) and a sum of T of them.

    Each step's [h, c, i, f, g, o] (gates activated) is stored in a buffer of its own and
    passed to the composite as an extra input that needs no gradient, so the backward
    reads the activations the forward computed; the composite's value is the stack of
    the steps' [h, c] (T, N, 2H)."""
    t_len = gx.shape[0]
    hid = w_hh.shape[1]
    ins = (gx, w_hh, state[0], state[1])
    packed, rows = _lstm_nodes(ins, hid)
    packed = autograd.record_composite(packed, ("lstm",), ins + tuple(rows))
    out = packed[:, :, :hid]
    return out, (out[t_len - 1], packed[t_len - 1, :, hid:])


_FORWARD_TEMPLATES = _replay.ForwardTemplates(64)    # _lstm_nodes' replays


def _lstm_nodes(ins, hid):
    """(packed, rows) of `_lstm_sequence` without recording: the T steps' nodes. They
    depend only on the inputs' shapes and dtypes, so the first call of a structure traces
    them and later calls add the same nodes from a template in one loop, without building
    tensors op by op (30 steps: ~2 ms of a training step's host time)."""
    made = _FORWARD_TEMPLATES.run(RT.graph, ("lstm", hid), list(ins),
                                  lambda *a: _lstm_results(a, hid), Tensor._wrap)
    return made[0], made[1:]


def _lstm_results(ins, hid):
    packed, rows = _lstm_steps(ins, hid)
    return [packed] + rows


def _lstm_steps(ins, hid):
    gx, w_hh, h, c = ins
    rows = []
    for g_t in _steps(gx):
        i, f, g, o = (g_t + F.linear(h, w_hh)).chunk(4, 1)
        i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
        c = _stored(f * c + i * g)
        h = o * c.tanh()
        rows.append(_stored(cat([h, c, i, f, g, o], 1)))
    packed = stack([r[:, :2 * hid] for r in rows], 0)          # (T, N, 2H)
    return packed, rows


def _lstm_backward(packed, grad, arg, srcs, need):
    """Backpropagation through time of `_lstm_sequence`: per step (last first) the gate
    gradients from the stored activations, d(h_prev) = dgates @ W_hh; then W_hh's gradient
    as one matmul of the stacked gate gradients and the stacked previous hidden states."""
    gx, w_hh, h0, c0 = srcs[:4]
    rows = srcs[4:]
    hid = w_hh.shape[1]
    grads = _steps(grad)                   # each step's output gradient in its own buffer
    dh_next = dc_next = None
    dgates = [None] * len(rows)
    for t in range(len(rows) - 1, -1, -1):
        row, gr = rows[t], grads[t]
        c = row[:, hid:2 * hid]
        i, f = row[:, 2 * hid:3 * hid], row[:, 3 * hid:4 * hid]
        g, o = row[:, 4 * hid:5 * hid], row[:, 5 * hid:]
        c_prev = rows[t - 1][:, hid:2 * hid] if t else c0
        dh = gr[:, :hid] if dh_next is None else gr[:, :hid] + dh_next
        dc = gr[:, hid:] if dc_next is None else gr[:, hid:] + dc_next
        tc = c.tanh()
        dct = _stored(dc + dh * o * (1 - tc * tc))
        dgate = _stored(cat([dct * g * i * (1 - i), dct * c_prev * f * (1 - f),
                             dct * i * (1 - g * g), dh * tc * o * (1 - o)], 1))
        dgates[t] = dgate
        dh_next = _stored(dgate @ w_hh)
        dc_next = dct * f
    d_all = stack(dgates, 0)                                  # (T, N, 4H)
    out = [None] * len(srcs)
    if need[0]:
        out[0] = d_all
    if need[1]:
        t_len, n = d_all.shape[0], d_all.shape[1]
        h_prev = cat([h0.unsqueeze(0), packed[:t_len - 1, :, :hid]], 0) if t_len > 1 \
            else h0.unsqueeze(0)
        out[1] = d_all.reshape(t_len * n, 4 * hid).T @ _stored(h_prev).reshape(t_len * n, hid)
    if need[2]:
        out[2] = dh_next
    if need[3]:
        out[3] = dc_next
    return tuple(out)


autograd.register_composite("lstm", _lstm_backward)


def _gru_cell(gx, h, w_hh, b_hh):
    ir, iz, in_ = gx.chunk(3, 1)
    hr, hz, hn = _hidden_proj(h, w_hh, b_hh).chunk(3, 1)
    r = (ir + hr).sigmoid()
    z = (iz + hz).sigmoid()
    n = (in_ + r * hn).tanh()
    return n + z * (h - n)      # (1 - z) * n + z * h, one op fewer


class RNNBase(Module):
    """Shared by RNN, LSTM and GRU: parameters weight_ih_l{k}[_reverse], weight_hh_l{k},
    bias_ih_l{k}, bias_hh_l{k} (torch's names, shapes and U(-1/sqrt(H), 1/sqrt(H)) init);
    inputs (L, N, H_in) or (N, L, H_in) with batch_first, or unbatched (L, H_in)."""
    _gates = 1
    mode = "RNN_TANH"

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, proj_size: int = 0, device=None, dtype=None):
        super().__init__()
        if not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError("hidden_size must be greater than zero")
        if not isinstance(num_layers, int) or num_layers <= 0:
            raise ValueError("num_layers must be greater than zero")
        if not 0 <= float(dropout) <= 1 or isinstance(dropout, bool):
            raise ValueError("dropout should be a number in range [0, 1] representing the "
                             "probability of an element being zeroed")
        if proj_size:
            raise NotImplementedError("proj_size (LSTM projections) is not supported by zyx")
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bias, batch_first, float(dropout)
        self.bidirectional, self.proj_size = bidirectional, 0
        dirs = 2 if bidirectional else 1
        g = self._gates * hidden_size
        for layer in range(num_layers):
            for d in range(dirs):
                sfx = f"_l{layer}" + ("_reverse" if d else "")
                n_in = input_size if layer == 0 else hidden_size * dirs
                setattr(self, "weight_ih" + sfx, new_parameter(g, n_in, dtype=dtype))
                setattr(self, "weight_hh" + sfx, new_parameter(g, hidden_size, dtype=dtype))
                if bias:
                    setattr(self, "bias_ih" + sfx, new_parameter(g, dtype=dtype))
                    setattr(self, "bias_hh" + sfx, new_parameter(g, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        stdv = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            init.uniform_(p, -stdv, stdv)

    def _weights(self, layer, d):
        sfx = f"_l{layer}" + ("_reverse" if d else "")
        get = self._parameters.get
        return get("weight_ih" + sfx), get("weight_hh" + sfx), get("bias_ih" + sfx), \
            get("bias_hh" + sfx)

    def _check_input(self, x):
        name = type(self).__name__
        if x.ndim not in (2, 3):
            raise ValueError(f"{name}: Expected input to be 2D or 3D, got {x.ndim}D instead")
        if x.shape[-1] != self.input_size:
            raise RuntimeError(f"input.size(-1) must be equal to input_size. Expected "
                               f"{self.input_size}, got {x.shape[-1]}")

    def _check_hidden(self, h, n, unbatched, what="hx"):
        dirs = 2 if self.bidirectional else 1
        want = (self.num_layers * dirs, self.hidden_size) if unbatched else \
            (self.num_layers * dirs, n, self.hidden_size)
        if h.shape != want:
            raise RuntimeError(f"Expected hidden size {want}, got {tuple(h.shape)}")
        return h.unsqueeze(1) if unbatched else h

    def _run_direction(self, seq, state, layer, d, batch_major=False):
        """One layer in one direction over seq (T, N, H_in), or (N, T, H_in) when
        batch_major: (outputs (T, N, H), last state)."""
        w_ih, w_hh, b_ih, b_hh = self._weights(layer, d)
        # one matmul for every timestep's input projection; b_hh joins it when the cell
        # adds it to h's projection unchanged (all but GRU's n gate)
        b_in = b_ih
        if b_ih is not None and self._fold_hh_bias:
            b_in, b_hh = b_ih + b_hh, None
        if batch_major:
            seq = _stored(seq.transpose(0, 1))
        t, n = seq.shape[0], seq.shape[1]
        gx = F.linear(seq.reshape(t * n, seq.shape[2]), w_ih, b_in)
        gx = gx.reshape(t, n, gx.shape[1])
        if d:
            gx = gx.flip(0)
        if self._gates == 4 and b_hh is None and _SEQUENCE_COMPOSITE and _TB.is_recording() and \
                (gx.requires_grad or w_hh.requires_grad or state[0].requires_grad
                 or state[1].requires_grad):
            out, state = _lstm_sequence(gx, state, w_hh)     # one composite, one dW matmul
            return (out.flip(0) if d else out), state
        outs = []
        for g_t in _steps(gx):
            state = self._cell(g_t, state, w_hh, b_hh)
            outs.append(state[0] if isinstance(state, tuple) else state)
        out = stack(outs, 0)
        return (out.flip(0) if d else out), state

    _fold_hh_bias = True

    def _forward(self, x, hx):
        """x: input; hx: None, a tensor, or a tuple for LSTM. Returns (output, h_n[, c_n])."""
        self._check_input(x)
        unbatched = x.ndim == 2
        if unbatched:
            x = x.unsqueeze(1)
        batch_major = self.batch_first and not unbatched    # x stays (N, T, H_in)
        n = x.shape[0] if batch_major else x.shape[1]
        if (x.shape[1] if batch_major else x.shape[0]) == 0:
            raise InvalidArgumentError(f"{type(self).__name__}: expected sequence length to be "
                                       f"larger than 0, got input of shape {x.shape}")
        dirs = 2 if self.bidirectional else 1
        states = self._initial_states(hx, n, unbatched, x)     # per (layer, dir)
        finals = []
        seq = x
        for layer in range(self.num_layers):
            outs = []
            for d in range(dirs):
                out, st = self._run_direction(seq, states[layer * dirs + d], layer, d,
                                              batch_major and layer == 0)
                outs.append(out)
                finals.append(st)
            seq = outs[0] if dirs == 1 else cat(outs, 2)
            if self.dropout and self.training and layer < self.num_layers - 1:
                seq = F.dropout(seq, self.dropout, True)
        out = seq
        if unbatched:
            out = out.squeeze(1)
        elif self.batch_first:
            out = out.transpose(0, 1)
        return out, self._final_states(finals, unbatched)

    def _initial_states(self, hx, n, unbatched, x):
        """One hidden state per (layer, direction): zeros or the rows of hx."""
        return [s if s is not None else self._zeros_state(n, x)
                for s in self._split_states(hx, n, unbatched, x)]

    def _final_states(self, finals, unbatched):
        return self._stack_states(finals, unbatched)

    def forward(self, input, hx=None):
        return self._forward(input, hx)

    def _zeros_state(self, n, x):
        return zeros(n, self.hidden_size, dtype=x.dtype)

    def _split_states(self, h, n, unbatched, x):
        if h is None:
            return [None] * (self.num_layers * (2 if self.bidirectional else 1))
        h = self._check_hidden(h, n, unbatched)
        return [h[i] for i in range(h.shape[0])]

    def _stack_states(self, hs, unbatched):
        h = stack(hs, 0)
        return h.squeeze(1) if unbatched else h

    def extra_repr(self):
        s = f"{self.input_size}, {self.hidden_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if not self.bias:
            s += ", bias=False"
        if self.batch_first:
            s += ", batch_first=True"
        if self.dropout:
            s += f", dropout={self.dropout}"
        if self.bidirectional:
            s += ", bidirectional=True"
        return s


class RNN(RNNBase):
    """Elman RNN: h_t = tanh(x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh) (or relu with
    nonlinearity='relu'). forward(input, hx=None) -> (output, h_n): output (L, N, D*H)
    holds the last layer's h_t for every t, h_n (D*num_layers, N, H) the last h_t of every
    layer and direction."""

    def __init__(self, *args, nonlinearity: str = "tanh", **kwargs):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"Unknown nonlinearity '{nonlinearity}'. Select from 'tanh' or "
                             f"'relu'.")
        self.__dict__["nonlinearity"] = nonlinearity
        super().__init__(*args, **kwargs)

    def _cell(self, gx, h, w_hh, b_hh):
        return (_tanh_cell if self.nonlinearity == "tanh" else _relu_cell)(gx, h, w_hh, b_hh)


class GRU(RNNBase):
    """GRU with torch's gates r, z, n: n = tanh(W_in x + b_in + r * (W_hn h + b_hn)),
    h' = (1 - z) * n + z * h. forward(input, hx=None) -> (output, h_n) as RNN."""
    _gates = 3
    _fold_hh_bias = False        # b_hn is multiplied by r: it stays with h's projection

    def _cell(self, gx, h, w_hh, b_hh):
        return _gru_cell(gx, h, w_hh, b_hh)


class LSTM(RNNBase):
    """LSTM with torch's gates i, f, g, o: c' = f*c + i*g, h' = o*tanh(c').
    forward(input, (h_0, c_0)=None) -> (output, (h_n, c_n)); shapes as RNN's. The input
    projection of all timesteps is one matmul per layer and direction."""
    _gates = 4

    def _cell(self, gx, state, w_hh, b_hh):
        return _lstm_cell(gx, state, w_hh, b_hh)

    def _initial_states(self, hx, n, unbatched, x):
        if hx is None:
            z = self._zeros_state(n, x)
            return [(z, z)] * (self.num_layers * (2 if self.bidirectional else 1))
        if not isinstance(hx, (tuple, list)) or len(hx) != 2:
            raise RuntimeError("LSTM expects hx to be a tuple (h_0, c_0)")
        hs = self._split_states(hx[0], n, unbatched, x)
        cs = self._split_states(hx[1], n, unbatched, x)
        return list(zip(hs, cs))

    def _final_states(self, finals, unbatched):
        return (self._stack_states([h for h, _ in finals], unbatched),
                self._stack_states([c for _, c in finals], unbatched))
