"""Attention and transformer layers: MultiheadAttention, CausalSelfAttention,
PositionalEncoding, TransformerEncoderLayer/DecoderLayer and their stacks.

Parameter names, init and masks follow torch (MultiheadAttention's bool masks mark what is
*excluded*; scaled_dot_product_attention's bool masks mark what is *included*)."""
from __future__ import annotations

import copy
import math

import numpy as np

from ... import dtype as dt
from ...errors import ShapeError, ZyxError
from ...tensor import Tensor, iota, where
from .. import functional as F
from .. import init
from .activation import GELU, ReLU
from .container import ModuleList
from .dropout import Dropout
from .linear import Linear
from .module import Module, new_parameter
from .norm import LayerNorm

__all__ = ["MultiheadAttention", "CausalSelfAttention", "PositionalEncoding",
           "TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder",
           "TransformerDecoder"]


def _additive(mask, dtype, what):
    """A torch-style mask (bool True = excluded, or float added) as a float additive mask."""
    if mask is None:
        return None
    m = mask if isinstance(mask, Tensor) else Tensor(np.asarray(mask))
    if m.dtype.is_bool:
        return where(m, float("-inf"), 0.0).cast(dtype)
    if not m.dtype.is_float:
        raise ZyxError(f"{what} must be bool or float, got {m.dtype.name}")
    return m.cast(dtype)


class MultiheadAttention(Module):
    """torch.nn.MultiheadAttention: in_proj_weight (3E, E) (or q/k/v_proj_weight when kdim or
    vdim differ), in_proj_bias, out_proj (Linear). forward(query, key, value,
    key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal) returns
    (output, weights or None)."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim=None, vdim=None,
                 batch_first: bool = False, device=None, dtype=None):
        super().__init__()
        if add_bias_kv or add_zero_attn:
            raise NotImplementedError("MultiheadAttention: add_bias_kv and add_zero_attn")
        if embed_dim % num_heads:
            raise ShapeError(f"embed_dim {embed_dim} must be divisible by num_heads {num_heads}")
        self.embed_dim, self.num_heads, self.dropout = embed_dim, num_heads, dropout
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        if self._qkv_same_embed_dim:
            self.in_proj_weight = new_parameter(3 * embed_dim, embed_dim, dtype=dtype)
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.register_parameter("in_proj_weight", None)
            self.q_proj_weight = new_parameter(embed_dim, embed_dim, dtype=dtype)
            self.k_proj_weight = new_parameter(embed_dim, self.kdim, dtype=dtype)
            self.v_proj_weight = new_parameter(embed_dim, self.vdim, dtype=dtype)
        if bias:
            self.in_proj_bias = new_parameter(3 * embed_dim, dtype=dtype)
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias, dtype=dtype)
        self._reset_parameters()

    def _reset_parameters(self):
        if self._qkv_same_embed_dim:
            init.xavier_uniform_(self.in_proj_weight)
        else:
            init.xavier_uniform_(self.q_proj_weight)
            init.xavier_uniform_(self.k_proj_weight)
            init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            init.zeros_(self.in_proj_bias)
            init.zeros_(self.out_proj.bias)

    def _projections(self, q, k, v):
        e = self.embed_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else (b[:e], b[e:2 * e], b[2 * e:])
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight
            wq, wk, wv = w[:e], w[e:2 * e], w[2 * e:]
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        return F.linear(q, wq, bq), F.linear(k, wk, bk), F.linear(v, wv, bv)

    def forward(self, query, key, value, key_padding_mask=None, need_weights: bool = True,
                attn_mask=None, average_attn_weights: bool = True, is_causal: bool = False):
        # self-attention (one tensor as query, key and value): one product with the packed
        # in_proj_weight, as torch's in_projection_packed, instead of three with its slices
        packed = query is key and key is value and self._qkv_same_embed_dim
        batched = query.ndim == 3
        if not batched:
            if query.ndim != 2:
                raise ShapeError(f"MultiheadAttention expects 2-D or 3-D query, got {query.shape}")
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0) if isinstance(
                    key_padding_mask, Tensor) else Tensor(np.asarray(key_padding_mask)[None])
        elif self.batch_first:
            if packed:
                query = key = value = query.transpose(0, 1)
            else:
                query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        # (L, N, E) from here on
        L, n, e = query.shape
        S = key.shape[0]
        if e != self.embed_dim or key.shape[:2] != value.shape[:2] or key.shape[1] != n:
            raise ShapeError(f"MultiheadAttention: query {query.shape}, key {key.shape}, value "
                             f"{value.shape} do not fit embed_dim {self.embed_dim}")
        h, hd = self.num_heads, self.head_dim
        if packed:
            qkv = F.linear(query, self.in_proj_weight, self.in_proj_bias)
            qkv = qkv.reshape(L, n, 3, h, hd).permute(2, 1, 3, 0, 4)  # (3, N, H, L, hd)
            q, k, v = qkv[0], qkv[1], qkv[2]
        else:
            q, k, v = self._projections(query, key, value)
            q = q.reshape(L, n, h, hd).permute(1, 2, 0, 3)           # (N, H, L, hd)
            k = k.reshape(S, n, h, hd).permute(1, 2, 0, 3)
            v = v.reshape(S, n, h, hd).permute(1, 2, 0, 3)
        mask = _additive(attn_mask, q.dtype, "attn_mask")
        if mask is not None:
            if mask.shape == (L, S):
                mask = mask.reshape(1, 1, L, S)
            elif mask.shape == (n * h, L, S):
                mask = mask.reshape(n, h, L, S)
            else:
                raise ShapeError(f"attn_mask must be {(L, S)} or {(n * h, L, S)}, got {mask.shape}")
        elif is_causal:
            mask = where(F.causal_mask(L, S), 0.0, float("-inf")).reshape(1, 1, L, S)
        kpm = _additive(key_padding_mask, q.dtype, "key_padding_mask")
        if kpm is not None:
            if kpm.shape != (n, S):
                raise ShapeError(f"key_padding_mask must be {(n, S)}, got {kpm.shape}")
            kpm = kpm.reshape(n, 1, 1, S)
            mask = kpm if mask is None else mask + kpm
        s = (q * (1.0 / math.sqrt(hd))) @ k.transpose(-2, -1)       # (N, H, L, S)
        if mask is not None:
            s = s + mask
        a = s.softmax(-1)
        if self.dropout > 0.0 and self.training:
            a = F.dropout(a, self.dropout, True)
        out = (a @ v).permute(2, 0, 1, 3).reshape(L, n, e)          # (L, N, E)
        out = self.out_proj(out)
        if batched and self.batch_first:
            out = out.transpose(0, 1)
        elif not batched:
            out = out.squeeze(1)
        if not need_weights:
            return out, None
        w = a.mean(1) if average_attn_weights else a
        if not batched:
            w = w.squeeze(0)
        return out, w


class CausalSelfAttention(Module):
    """GPT-style masked self-attention over (B, T, E): c_attn Linear(E, 3E) gives q, k, v;
    c_proj Linear(E, E) projects back; dropout on attention weights and the output."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        if embed_dim % num_heads:
            raise ShapeError(f"embed_dim {embed_dim} must be divisible by num_heads {num_heads}")
        self.embed_dim, self.num_heads, self.dropout = embed_dim, num_heads, dropout
        self.c_attn = Linear(embed_dim, 3 * embed_dim, bias=bias)
        self.c_proj = Linear(embed_dim, embed_dim, bias=bias)
        self.attn_dropout = Dropout(dropout)
        self.resid_dropout = Dropout(dropout)

    def forward(self, x):
        if x.ndim != 3 or x.shape[-1] != self.embed_dim:
            raise ShapeError(f"CausalSelfAttention expects (B, T, {self.embed_dim}), got {x.shape}")
        b, t, e = x.shape
        h = self.num_heads
        q, k, v = self.c_attn(x).split(e, 2)
        q, k, v = (z.reshape(b, t, h, e // h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(b, t, e)
        return self.resid_dropout(self.c_proj(y))


class PositionalEncoding(Module):
    """Adds the sinusoidal table pe[pos, 2i] = sin(pos / 10000^(2i/d)), pe[pos, 2i+1] = cos(.)
    to (B, T, d) inputs (or (T, B, d) with batch_first=False), then dropout. The table is a
    non-persistent buffer (not in state_dict)."""

    def __init__(self, d_model: int, max_len: int = 5000, dropout: float = 0.0,
                 batch_first: bool = True):
        super().__init__()
        self.d_model, self.max_len, self.batch_first = d_model, max_len, batch_first
        pos = np.arange(max_len, dtype=np.float64)[:, None]
        div = np.exp(np.arange(0, d_model, 2, dtype=np.float64) * (-math.log(10000.0) / d_model))
        pe = np.zeros((max_len, d_model))
        pe[:, 0::2] = np.sin(pos * div)
        pe[:, 1::2] = np.cos(pos * div[:d_model // 2])
        self.register_buffer("pe", Tensor(pe.astype(np.float32)), persistent=False)
        self.dropout = Dropout(dropout)

    def forward(self, x):
        t = x.shape[1] if self.batch_first else x.shape[0]
        if t > self.max_len:
            raise ShapeError(f"sequence length {t} exceeds max_len {self.max_len}")
        pe = self.pe[:t]
        pe = pe.unsqueeze(0) if self.batch_first else pe.unsqueeze(1)
        return self.dropout(x + pe)

    def extra_repr(self):
        return f"d_model={self.d_model}, max_len={self.max_len}"


def _activation(act):
    if isinstance(act, str):
        if act == "relu":
            return ReLU()
        if act == "gelu":
            return GELU()
        raise ValueError(f"activation should be relu/gelu, not {act}")
    return act


class TransformerEncoderLayer(Module):
    """Self-attention + feed-forward with residuals and LayerNorms (post-norm, or pre-norm
    with norm_first=True), torch's submodule names."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation="relu", layer_norm_eps: float = 1e-5, batch_first: bool = False,
                 norm_first: bool = False, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                            batch_first=batch_first, dtype=dtype)
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, dtype=dtype)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, dtype=dtype)
        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.activation = _activation(activation)

    def _sa_block(self, x, mask, kpm, is_causal):
        x = self.self_attn(x, x, x, attn_mask=mask, key_padding_mask=kpm, need_weights=False,
                           is_causal=is_causal)[0]
        return self.dropout1(x)

    def _ff_block(self, x):
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal: bool = False):
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x


class TransformerDecoderLayer(Module):
    """Masked self-attention, cross-attention over `memory`, feed-forward; torch's names."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation="relu", layer_norm_eps: float = 1e-5, batch_first: bool = False,
                 norm_first: bool = False, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                            batch_first=batch_first, dtype=dtype)
        self.multihead_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                                 batch_first=batch_first, dtype=dtype)
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, dtype=dtype)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, dtype=dtype)
        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype)
        self.norm3 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.dropout3 = Dropout(dropout)
        self.activation = _activation(activation)

    def _sa_block(self, x, mask, kpm, is_causal):
        x = self.self_attn(x, x, x, attn_mask=mask, key_padding_mask=kpm, is_causal=is_causal,
                           need_weights=False)[0]
        return self.dropout1(x)

    def _mha_block(self, x, mem, mask, kpm, is_causal):
        x = self.multihead_attn(x, mem, mem, attn_mask=mask, key_padding_mask=kpm,
                                is_causal=is_causal, need_weights=False)[0]
        return self.dropout2(x)

    def _ff_block(self, x):
        return self.dropout3(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal: bool = False,
                memory_is_causal: bool = False):
        x = tgt
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), tgt_mask, tgt_key_padding_mask, tgt_is_causal)
            x = x + self._mha_block(self.norm2(x), memory, memory_mask, memory_key_padding_mask,
                                    memory_is_causal)
            x = x + self._ff_block(self.norm3(x))
        else:
            x = self.norm1(x + self._sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal))
            x = self.norm2(x + self._mha_block(x, memory, memory_mask, memory_key_padding_mask,
                                               memory_is_causal))
            x = self.norm3(x + self._ff_block(x))
        return x


class TransformerEncoder(Module):
    """`num_layers` deep copies of `encoder_layer` (same initial weights, as torch), then an
    optional final norm."""

    def __init__(self, encoder_layer, num_layers: int, norm=None, enable_nested_tensor=True,
                 mask_check=True):
        super().__init__()
        self.layers = ModuleList([copy.deepcopy(encoder_layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        x = src
        for layer in self.layers:
            x = layer(x, src_mask=mask, src_key_padding_mask=src_key_padding_mask,
                      is_causal=bool(is_causal))
        return self.norm(x) if self.norm is not None else x


class TransformerDecoder(Module):
    def __init__(self, decoder_layer, num_layers: int, norm=None):
        super().__init__()
        self.layers = ModuleList([copy.deepcopy(decoder_layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal=None, memory_is_causal=False):
        x = tgt
        for layer in self.layers:
            x = layer(x, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
                      memory_key_padding_mask, bool(tgt_is_causal), memory_is_causal)
        return self.norm(x) if self.norm is not None else x


class Transformer(Module):
    """torch.nn.Transformer: an encoder of num_encoder_layers TransformerEncoderLayers and
    a decoder of num_decoder_layers TransformerDecoderLayers, each stack ending in a
    LayerNorm (torch's submodule names: encoder.layers.0..., encoder.norm, decoder.norm),
    matrices initialized xavier-uniform as torch does. forward(src, tgt, ...) -> the
    decoder's output, shaped like tgt."""

    def __init__(self, d_model: int = 512, nhead: int = 8, num_encoder_layers: int = 6,
                 num_decoder_layers: int = 6, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation="relu", custom_encoder=None, custom_decoder=None,
                 layer_norm_eps: float = 1e-5, batch_first: bool = False, norm_first: bool = False,
                 bias: bool = True, device=None, dtype=None):
        super().__init__()
        kw = dict(dim_feedforward=dim_feedforward, dropout=dropout, activation=activation,
                  layer_norm_eps=layer_norm_eps, batch_first=batch_first,
                  norm_first=norm_first, bias=bias, dtype=dtype)
        self.encoder = custom_encoder if custom_encoder is not None else TransformerEncoder(
            TransformerEncoderLayer(d_model, nhead, **kw), num_encoder_layers,
            LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype))
        self.decoder = custom_decoder if custom_decoder is not None else TransformerDecoder(
            TransformerDecoderLayer(d_model, nhead, **kw), num_decoder_layers,
            LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype))
        self.d_model, self.nhead, self.batch_first = d_model, nhead, batch_first
        for p in self.parameters():
            if p.ndim > 1:
                init.xavier_uniform_(p)

    def forward(self, src, tgt, src_mask=None, tgt_mask=None, memory_mask=None,
                src_key_padding_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, src_is_causal=None, tgt_is_causal=None,
                memory_is_causal=False):
        batch_axis = 0 if self.batch_first else 1
        if src.ndim == 3 and tgt.ndim == 3 and src.shape[batch_axis] != tgt.shape[batch_axis]:
            raise RuntimeError("the batch number of src and tgt must be equal")
        if src.shape[-1] != self.d_model or tgt.shape[-1] != self.d_model:
            raise RuntimeError("the feature number of src and tgt must be equal to d_model")
        memory = self.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                              is_causal=src_is_causal)
        return self.decoder(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                            tgt_key_padding_mask=tgt_key_padding_mask,
                            memory_key_padding_mask=memory_key_padding_mask,
                            tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)

    @staticmethod
    def generate_square_subsequent_mask(sz: int, device=None, dtype=None) -> Tensor:
        """(sz, sz) float mask for causal attention: -inf above the diagonal (a position
        may not attend to later ones), 0.0 on and below it."""
        d = dt.float32 if dtype is None else dt.to_dtype(dtype)
        if not d.is_float:
            m = np.triu(np.full((sz, sz), -np.inf), k=1)
            return Tensor(m, dtype=d, device=device)
        # computed where it is used, from two cached ranges: no host array and no upload
        # every call (a sampling loop asks for one per token)
        rows = iota(sz, dt.int32, device).reshape(sz, 1)
        cols = iota(sz, dt.int32, device).reshape(1, sz)
        return where(cols > rows, float("-inf"), 0.0).cast(d)
