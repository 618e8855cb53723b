"""MLA rope inputs of the torch_npu ops (``query_rope``/``key_rope``): the rope part of each head's query and key,
appended to that head's D so that ``Q K^T`` runs over both parts; helpers to take a rope-extended result apart.

``packed`` tensors hold all heads in their last dim (``H = heads * D``: layout BSH/SBH, a ``(blocknum, blocksize,
H)`` paged cache); the others have a head dim of their own.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._core.checks import check_tensor, require


def head_split(x: Tensor, packed: bool, heads: int) -> Tensor:
    return x.unflatten(-1, (heads, -1)) if packed else x


def head_merge(x: Tensor, packed: bool) -> Tensor:
    return x.flatten(-2) if packed else x


def rope_given(query_rope, key_rope) -> bool:
    """Whether the call uses MLA rope (both tensors, or neither)."""
    if query_rope is None and key_rope is None:
        return False
    require(query_rope is not None and key_rope is not None, "key_rope" if key_rope is None else "query_rope",
            "query_rope and key_rope together", None)
    return True


def check_rope(name: str, x: Tensor, rope: Tensor, *, packed: bool, heads: int, like: str) -> None:
    """``rope`` (named ``name``) must be shaped like ``x`` (named ``like``) but for the head dim, in ``x``'s dtype."""
    check_tensor(name, rope, dtypes=(x.dtype,))
    ok = rope.shape[:-1] == x.shape[:-1] and rope.device == x.device and (not packed or rope.shape[-1] % heads == 0)
    dims = [*x.shape[:-1], f"{heads}*Dr" if packed else "Dr"]
    require(ok, name, f"a tensor shaped like {like} except its head dim ({dims}) on {x.device}", rope)


def append_rope(name: str, x: Tensor, rope: Tensor, *, packed: bool, heads: int, like: str) -> Tensor:
    """``x`` (the tensor named ``like``) with ``rope`` (named ``name``) appended to each of its ``heads`` heads' D."""
    check_rope(name, x, rope, packed=packed, heads=heads, like=like)
    return head_merge(torch.cat([head_split(x, packed, heads), head_split(rope, packed, heads)], -1), packed)


def split_head_dim(x: Tensor, d: int, *, packed: bool, heads: int) -> tuple[Tensor, Tensor]:
    """Each head's first ``d`` elements and the rest, as two contiguous tensors in ``x``'s layout."""
    parts = head_split(x, packed, heads)
    return head_merge(parts[..., :d], packed).contiguous(), head_merge(parts[..., d:], packed).contiguous()
