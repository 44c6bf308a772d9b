"""zyx.nn.utils.rnn: padding variable-length sequences into one tensor (torch.nn.utils.rnn).

Packed sequences (pack_padded_sequence) are not implemented: zyx's RNNs take padded input.
"""
from __future__ import annotations

from ...tensor import Tensor, stack
from .. import functional as F

__all__ = ["pad_sequence"]


def pad_sequence(sequences, batch_first: bool = False, padding_value: float = 0.0,
                 padding_side: str = "right") -> Tensor:
    """Stack tensors of shape (L_i, *) into (max L, B, *), or (B, max L, *) with
    batch_first, filling with `padding_value` after each sequence (padding_side='right')
    or before it ('left')."""
    if padding_side not in ("right", "left"):
        raise ValueError(f"Expected padding_side to be one of left or right, but got "
                         f"{padding_side}.")
    sequences = list(sequences)
    if not sequences:
        raise RuntimeError("received an empty list of sequences")
    trailing = sequences[0].shape[1:]
    for s in sequences:
        if not isinstance(s, Tensor):
            raise TypeError(f"pad_sequence expects zyx tensors, got {type(s).__name__}")
        if s.shape[1:] != trailing:
            raise RuntimeError(f"The size of each sequence's trailing dimensions must match: "
                               f"{trailing} vs {s.shape[1:]}")
    longest = max(s.shape[0] for s in sequences)
    padded = []
    for s in sequences:
        extra = longest - s.shape[0]
        # F.pad's list runs from the last dim backwards; the sequence dim is the first
        before, after = (extra, 0) if padding_side == "left" else (0, extra)
        padded.append(F.pad(s, [0, 0] * (s.ndim - 1) + [before, after], value=padding_value)
                      if extra else s)
    return stack(padded, 0 if batch_first else 1)
