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


def check_nz_rope(key: Tensor, key_rope: Tensor, dr: int) -> None:
    """``key_rope`` must be an NZ cache like the NZ ``key`` ``[blocknum, KV_N, D/x, blocksize, x]`` but for its
    ``Dr/x`` (the V3 doc's form: ``key_rope`` has ``key``'s format and dtype; ``dr``: the query rope's head dim)."""
    check_tensor("key_rope", key_rope, dtypes=(key.dtype,))
    x = key.shape[-1]
    expected = (*key.shape[:2], dr // x, *key.shape[3:])
    require(tuple(key_rope.shape) == expected and dr % x == 0 and key_rope.device == key.device, "key_rope",
            f"an NZ cache like key with query_rope's Dr={dr}: [blocknum={key.shape[0]}, KV_N={key.shape[1]}, "
            f"Dr/{x}={dr / x:g}, blocksize={key.shape[3]}, {x}] on {key.device}", key_rope)


def append_nz_rope(key: Tensor, key_rope: Tensor, dr: int) -> Tensor:
    """An NZ paged ``key`` with its NZ ``key_rope`` appended to each head's D: their concatenation along ``D/x``,
    which is the NZ form of ``[key | key_rope]``."""
    check_nz_rope(key, key_rope, dr)
    return torch.cat([key, key_rope], 2)


def split_head_dim(x: Tensor, d: int, *, packed: bool, heads: int) -> tuple[Tensor, Tensor]:
    """Each head's first ``d`` elements and the rest, as two contiguous tensors in ``x``'s layout."""
    parts = head_split(x, packed, heads)
    return head_merge(parts[..., :d], packed).contiguous(), head_merge(parts[..., d:], packed).contiguous()
