"""Pythonic DeepSeek-V4 compressor. No math here: validation and compute happen in the custom op
(:mod:`.compressor_op`)."""
from __future__ import annotations

from typing import Literal

from torch import Tensor

from ..._core.custom_ops import call
from . import compressor_op




def compressor(x: Tensor, wkv: Tensor, wgate: Tensor, state_cache: Tensor, ape: Tensor, *, cmp_ratio: int = 4,
               coff: int = 1, state_block_table: Tensor | None = None, cu_seqlens: Tensor | None = None,
               seqused: Tensor | None = None, start_pos: Tensor | None = None, cache_mode: Literal[1, 2] = 1,
               norm_weight: Tensor | None = None, rope_sin: Tensor | None = None, rope_cos: Tensor | None = None,
               rope_head_dim: int = 64, norm_eps: float = 1e-6, rotary_mode: Literal[1, 2] = 2) -> Tensor:
    """Compress the KV of DeepSeek-V4 attention: one row per block of ``cmp_ratio`` tokens, a per-column softmax
    (gate ``x @ wgate.T + ape``) weighted sum of ``x @ wkv.T`` over the block (``coff=1``, C128A) or over the
    block and the previous one (``coff=2``, overlapping C4A / C4Li). Streams: the ``[kv | score]`` of every new
    token is saved to ``state_cache`` (in place), and the positions before ``start_pos`` are read from it, so a
    prefill in chunks followed by decode steps gives the rows of one full pass.

    x ``[B, S, H]`` or packed ``[T, H]`` (with ``cu_seqlens [B+1]``, leading 0); wkv, wgate ``[coff * D, H]``
    (``nn.Linear`` weights, x's dtype); ape fp32 ``[cmp_ratio, coff * D]``; state_cache fp32
    ``[blocks, block_size, 2 * coff * D]``; ``start_pos [B]`` the absolute position of each batch's first new token
    (default 0); ``seqused [B]`` the new tokens to use per batch. ``state_block_table``: ``cache_mode=1``
    ``[B, max_blocks]`` maps position ``P`` to block ``table[b, P // block_size]`` (entry 0: read but never
    written); ``cache_mode=2`` ``[B]``: one ring block per batch (``block_size >= coff * cmp_ratio``); None: no
    state (every ``start_pos`` 0, nothing saved). Rows are emitted for the blocks that end inside the call; the
    output is ``[B, ceil(S / cmp_ratio), D]`` or ``[min(T, T // cmp_ratio + B), D]`` (rows in batch order, then
    zero padding), in x's dtype.

    vllm-ascend's form adds ``norm_weight [D]`` (RMSNorm of each row with ``norm_eps``) and ``rope_sin/rope_cos``
    (the output's shape with last dim ``rope_head_dim``): RoPE of the last ``rope_head_dim`` columns, pairs
    ``(2i, 2i+1)`` (``rotary_mode=2``) or halves (``1``). Not differentiable.

    >>> x, wkv, wgate = torch.randn(1, 8, 32), torch.randn(2 * 16, 32), torch.randn(2 * 16, 32)
    >>> state, table = torch.zeros(4, 8, 4 * 16), torch.tensor([[1]])
    >>> out = compressor(x, wkv, wgate, state, torch.zeros(4, 2 * 16), coff=2, state_block_table=table)
    >>> out.shape, bool(state[1].any())
    (torch.Size([1, 2, 16]), True)
    """
    return call(compressor_op.dsv4_compressor, x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, rope_cos,
                state_block_table, cu_seqlens, seqused, start_pos, cmp_ratio, coff, cache_mode, rope_head_dim,
                norm_eps, rotary_mode)
