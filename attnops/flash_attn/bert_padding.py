"""``flash_attn.bert_padding``: between padded ``[B, S, ...]`` batches and the packed ``[T, ...]`` tokens of the
varlen functions, with flash-attn's names, arguments and return values. Plain PyTorch indexing: differentiable and
traced by ``torch.compile`` (``unpad_input`` returns ``max_seqlen`` as a Python int, so it reads one value back).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._core.checks import check_int, check_tensor, require

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input",
           "unpad_input_for_concatenated_sequences"]

_INDEX_DTYPES = (torch.int32, torch.int64)


def index_first_axis(input: Tensor, indices: Tensor) -> Tensor:  # noqa: A002 (flash-attn's argument name)
    """``input[indices]`` for ``input`` ``[N, ...]`` (at least 2-D) and integer ``indices`` ``[T]``."""
    check_tensor("input", input)
    require(input.dim() >= 2, "input", "a tensor of at least 2 dims [N, ...]", input)
    check_tensor("indices", indices, ndim=1, dtypes=_INDEX_DTYPES)
    return input[indices.long()]


def index_put_first_axis(values: Tensor, indices: Tensor, first_axis_dim: int) -> Tensor:
    """A zero ``[first_axis_dim, ...]`` tensor with ``values`` ``[T, ...]`` at rows ``indices`` ``[T]``."""
    check_tensor("values", values)
    require(values.dim() >= 2, "values", "a tensor of at least 2 dims [T, ...]", values)
    check_tensor("indices", indices, shape=(values.shape[0],), dtypes=_INDEX_DTYPES)
    out = values.new_zeros((check_int("first_axis_dim", first_axis_dim, lo=0), *values.shape[1:]))
    return out.index_put((indices.long(),), values)


def _check_mask(hidden_states: Tensor, name: str, mask: Tensor) -> None:
    check_tensor("hidden_states", hidden_states)
    check_tensor(name, mask, ndim=2)
    require(hidden_states.dim() >= 2 and tuple(hidden_states.shape[:2]) == tuple(mask.shape), "hidden_states",
            f"[B, S, ...] with [B, S] = {list(mask.shape)} (the shape of {name})", hidden_states)


def _cumulative(seqlens: Tensor) -> Tensor:
    """int32 ``[B + 1]`` prefix sums with a leading 0 (flash-attn's ``cu_seqlens``)."""
    return torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))


def unpad_input(hidden_states: Tensor, attention_mask: Tensor, unused_mask: Tensor | None = None):
    """The tokens of ``hidden_states`` ``[B, S, ...]`` where ``attention_mask`` ``[B, S]`` (bool or 0/1) is set,
    packed in batch-major order. ``unused_mask`` ``[B, S]`` marks tokens that are allocated but unused: they are
    packed too and counted in ``cu_seqlens``, not in ``seqused``.

    Returns ``(hidden_states [T, ...], indices [T] (int64, into the flattened B*S tokens), cu_seqlens [B + 1]
    (int32, leading 0), max_seqlen_in_batch (int), seqused [B] (int32, tokens set in attention_mask))``.
    """
    _check_mask(hidden_states, "attention_mask", attention_mask)
    selected = attention_mask.bool()
    if unused_mask is not None:
        _check_mask(hidden_states, "unused_mask", unused_mask)
        selected = selected | unused_mask.bool()
    seqlens = selected.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(selected.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    used = attention_mask.bool().sum(-1, dtype=torch.int32)
    return hidden_states.flatten(0, 1)[indices], indices, _cumulative(seqlens), max_seqlen, used


def pad_input(hidden_states: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """The inverse of :func:`unpad_input`: ``hidden_states`` ``[T, ...]`` placed at ``indices`` of a zero
    ``[batch, seqlen, ...]`` tensor."""
    check_int("batch", batch, lo=0)
    check_int("seqlen", seqlen, lo=0)
    return index_put_first_axis(hidden_states, indices, batch * seqlen).unflatten(0, (batch, seqlen))


def unpad_input_for_concatenated_sequences(hidden_states: Tensor, attention_mask_in_length: Tensor):
    """Packing for rows that hold several concatenated sequences: row ``b`` of ``attention_mask_in_length``
    ``[B, S]`` lists the lengths of its sequences (then zeros), e.g. ``[2, 3, 0, 0, 0, 0]`` for two sequences of 2
    and 3 tokens at the start of the row. Returns ``(hidden_states [T, ...], indices [T], cu_seqlens [count + 1]
    (int32, one entry per sequence), max_seqlen_in_batch (int))``."""
    _check_mask(hidden_states, "attention_mask_in_length", attention_mask_in_length)
    lengths = attention_mask_in_length.long()
    seqlen = lengths.shape[-1]
    selected = torch.arange(seqlen, device=lengths.device).expand_as(lengths) < lengths.sum(-1, keepdim=True)
    seqlens = lengths.flatten()[lengths.flatten() != 0]
    indices = torch.nonzero(selected.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    return hidden_states.flatten(0, 1)[indices], indices, _cumulative(seqlens), max_seqlen
