"""DeepSeek-V4 attention as an ``nn.Module``: a sliding window of the latest tokens plus compressed keys, one KV
head (keys are values), per-head sinks, all under one softmax (:func:`attnops.sparse_flash_mla`).

Per token at position ``p``: ``q = W_q x`` (``heads x head_dim``) and the window row ``kv = RMSNorm(W_kv x)``
(``head_dim``), RoPE on the last ``rope_dim`` columns of both (rotate-half). A compressor (:func:`attnops.compressor`,
RMSNorm and RoPE at the block's first position ``c * cmp_ratio``) turns every complete block of ``cmp_ratio``
tokens into one compressed row: C4A (``coff=2``, overlapping) in a CSA layer, C128A (``coff=1``) in an HCA layer.
An HCA layer (``index_topk=None``) attends to every compressed row its position has completed; a CSA layer to the
``index_topk`` rows the lightning indexer v2 picks (:func:`attnops.lightning_indexer_v2`; queries ``W_iq x`` of
``index_heads x index_dim``, keys from a C4Li compressor, weights ``W_iw x / sqrt(index_heads * index_dim)``, RoPE
on their last ``rope_dim`` columns). The window covers the ``window`` latest tokens, the token itself included.
The attention output's last ``rope_dim`` columns are rotated back by the query's angle, then go through ``W_o``.

Without a cache the call is a causal prefill over ``x [B, S, hidden]``, differentiable in the query, window-KV and
output projections and the sinks (the compressors and the indexer are not differentiable operators: their rows
enter as constants). With a :class:`~attnops.nn.DSV4Cache` the new tokens are appended and attend over the cache:
chunked prefill, then one-token decode steps, give the outputs of one full pass.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .._core.checks import check_int
from ..ops.dsv4 import compressor, lightning_indexer_v2, sparse_flash_mla
from .dsv4_cache import DSV4Cache
from .layer_input import check_layer_input
from .rotary import apply_rotary, rotary_angles


def _rope_last(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x [.., S, N, D]`` with its last ``cos.shape[-1]`` columns rotated (``cos``, ``sin`` ``[S, 1, Dr]``)."""
    d = cos.shape[-1]
    return torch.cat([x[..., :-d], apply_rotary(x[..., -d:], cos, sin).to(x.dtype)], -1)


class KVCompressor(nn.Module):
    """One compressor of DeepSeek-V4 (:func:`attnops.compressor`): ``wkv``, ``wgate`` ``[coff * dim, hidden]``,
    ``ape [ratio, coff * dim]`` and the RMSNorm weight of the emitted rows; RoPE on their last ``rope_dim``."""

    def __init__(self, hidden: int, dim: int, ratio: int, coff: int, rope_dim: int, theta: float, eps: float):
        super().__init__()
        self.dim, self.ratio, self.coff, self.rope_dim, self.theta, self.eps = dim, ratio, coff, rope_dim, theta, eps
        self.wkv = nn.Parameter(torch.randn(coff * dim, hidden) * hidden ** -0.5)
        self.wgate = nn.Parameter(torch.randn(coff * dim, hidden) * hidden ** -0.5)
        self.ape = nn.Parameter(torch.randn(ratio, coff * dim) * 0.1)
        self.norm = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, start: int, state: Tensor | None = None, table: Tensor | None = None) -> Tensor:
        """The rows ``[B, c, dim]`` of the blocks that end among the tokens ``x [B, S, hidden]`` at positions
        ``start..start+S-1`` (the earlier tokens read from ``state``; without a state ``start`` is 0)."""
        b, s, _ = x.shape
        first, end = start // self.ratio, (start + s) // self.ratio
        rows = -(-s // self.ratio)
        cos, sin = rotary_angles(torch.arange(first, first + rows, device=x.device) * self.ratio, self.rope_dim,
                                 self.theta, torch.float32)
        cos, sin = cos[:, 0].expand(b, -1, -1).to(x.dtype), sin[:, 0].expand(b, -1, -1).to(x.dtype)
        stream = {} if state is None else dict(state_block_table=table, cache_mode=2,
                                               start_pos=torch.full((b,), start, dtype=torch.int32))
        if state is None:
            state = x.new_zeros(1, 1, 2 * self.coff * self.dim, dtype=torch.float32)  # unused: no table
        out = compressor(x.detach(), self.wkv.detach(), self.wgate.detach(), state, self.ape.detach().float(),
                         cmp_ratio=self.ratio, coff=self.coff, norm_weight=self.norm.detach(), rope_sin=sin,
                         rope_cos=cos, rope_head_dim=self.rope_dim, norm_eps=self.eps, rotary_mode=1, **stream)
        return out[:, :end - first]


class DeepSeekV4Attention(nn.Module):
    """DeepSeek-V4 attention over ``x [B, S, hidden]``: ``heads`` query heads of ``head_dim`` (one shared KV head),
    a window of ``window`` tokens, compressed rows of ``cmp_ratio`` tokens; CSA (C4A rows, ``index_topk`` picked by
    an indexer of ``index_heads x index_dim``) when ``index_topk`` is given, else HCA (C128A rows, all of them)."""

    def __init__(self, hidden: int, heads: int, *, head_dim: int = 512, rope_dim: int = 64, window: int = 128,
                 cmp_ratio: int = 4, index_topk: int | None = 512, index_heads: int = 64, index_dim: int = 128,
                 rope_theta: float = 10000.0, eps: float = 1e-6):
        super().__init__()
        self.heads, self.head_dim = check_int("heads", heads, lo=1), check_int("head_dim", head_dim, lo=2)
        self.rope_dim = check_int("rope_dim", rope_dim, lo=2, hi=head_dim)
        self.window, self.cmp_ratio = check_int("window", window, lo=1), check_int("cmp_ratio", cmp_ratio, lo=2)
        self.index_topk = None if index_topk is None else check_int("index_topk", index_topk, lo=1)
        self.coff = 1 if index_topk is None else 2
        self.theta, self.eps = rope_theta, eps
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(hidden, head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(head_dim, eps=eps)
        self.compressor = KVCompressor(hidden, head_dim, cmp_ratio, self.coff, rope_dim, rope_theta, eps)
        self.sinks = nn.Parameter(torch.zeros(heads))
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.index_heads = self.index_dim = None
        if index_topk is not None:
            self.index_heads, self.index_dim = check_int("index_heads", index_heads, lo=1), \
                check_int("index_dim", index_dim, lo=rope_dim)
            self.index_q = nn.Linear(hidden, index_heads * index_dim, bias=False)
            self.index_w = nn.Linear(hidden, index_heads, bias=False)
            self.index_compressor = KVCompressor(hidden, index_dim, cmp_ratio, 2, rope_dim, rope_theta, eps)

    def settings(self) -> dict:
        """What a cache of this layer must match."""
        return dict(head_dim=self.head_dim, cmp_ratio=self.cmp_ratio, coff=self.coff, index_dim=self.index_dim,
                    window=self.window, index_topk=self.index_topk, heads=self.heads)

    def new_cache(self, batch: int, max_len: int, *, block_size: int = 64) -> DSV4Cache:
        """An empty cache for ``batch`` sequences of up to ``max_len`` tokens, bound to this layer."""
        p = self.q_proj.weight
        cache = DSV4Cache(batch, max_len, head_dim=self.head_dim, cmp_ratio=self.cmp_ratio, coff=self.coff,
                          index_dim=self.index_dim, block_size=block_size, dtype=p.dtype, device=p.device)
        cache.bind(self, self.settings())
        return cache

    def forward(self, x: Tensor, cache: DSV4Cache | None = None) -> Tensor:
        check_layer_input(x, self.q_proj.weight, self.q_proj.in_features, packed=False)
        b, s, _ = x.shape
        if cache is not None:
            cache.bind(self, self.settings())
            cache.check_append(x)
        start = 0 if cache is None else cache.seq_len
        length, r = start + s, self.cmp_ratio
        cos, sin = rotary_angles(torch.arange(start, length, device=x.device), self.rope_dim, self.theta,
                                 torch.float32)
        q = _rope_last(self.q_proj(x).view(b, s, self.heads, self.head_dim), cos, sin)
        kv = _rope_last(self.kv_norm(self.kv_proj(x))[:, :, None], cos, sin)  # [B, S, 1, D]
        state = {} if cache is None else dict(state=cache.kv_state, table=cache.state_table)
        cmp = self.compressor(x, start, **state)
        index_keys = None
        if self.index_topk is not None:
            state = {} if cache is None else dict(state=cache.index_state, table=cache.state_table)
            index_keys = self.index_compressor(x, start, **state)
        if cache is not None:
            cache.append(kv[:, :, 0], cmp, index_keys)
        count = length // r
        lengths = torch.full((b,), length, dtype=torch.int32)
        residual = torch.full((b,), length % r, dtype=torch.int32)
        counts = torch.full((b,), count, dtype=torch.int32)
        if cache is None:
            window = dict(layout_kv="BSND")
            keys = dict(cmp_kv=cmp[:, :, None]) if count else {}
        else:
            window = dict(layout_kv="PA_BBND", ori_block_table=cache.window_table, seqused_ori_kv=lengths)
            keys = dict(cmp_kv=cache.compressed, cmp_block_table=cache.compressed_table, seqused_cmp_kv=counts) \
                if count else {}
        if keys and self.index_topk is not None:
            keys["cmp_sparse_indices"] = self._select(x, cos, sin, index_keys, cache, counts, residual)
        if keys:
            keys.update(cmp_ratio=r, cmp_residual_kv=residual)
        ori = kv if cache is None else cache.window
        out = sparse_flash_mla(q, ori, sinks=self.sinks.float(), ori_win_left=self.window - 1, **window,
                               **keys).attn_out
        out = _rope_last(out, cos, -sin)  # the rope columns back to the query's frame (inverse rotation)
        return self.o_proj(out.reshape(b, s, -1))

    @torch.no_grad()
    def _select(self, x: Tensor, cos: Tensor, sin: Tensor, index_keys: Tensor, cache: DSV4Cache | None,
                counts: Tensor, residual: Tensor) -> Tensor:
        """The indexer's ``index_topk`` compressed positions per token ``[B, S, 1, topk]`` (-1 padded)."""
        b, s, _ = x.shape
        iq = _rope_last(self.index_q(x).view(b, s, self.index_heads, self.index_dim), cos, sin)
        iw = self.index_w(x) * (self.index_heads * self.index_dim) ** -0.5
        if cache is None:
            keys = dict(layout_key="BSND")
            key = index_keys[:, :, None]
        else:
            keys = dict(layout_key="PA_BBND", block_table=cache.compressed_table, seqused_k=counts)
            key = cache.index_keys
        return lightning_indexer_v2(iq, key, iw, topk=self.index_topk, mask_mode=3, cmp_ratio=self.cmp_ratio,
                                    cmp_residual_k=residual, **keys).sparse_indices
