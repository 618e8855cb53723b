"""DeepSeek sparse attention (DSA) as an ``nn.Module``: MLA with absorbed projections, whose queries attend only to
the ``index_topk`` keys the lightning indexer picks per token.

Per token: ``q = W_q x`` split into ``q_nope [N, D]`` and ``q_rope [N, Dr]``; the latent ``c = RMSNorm(W_c x)``
``[Dc]`` and ``k_rope [Dr]`` (one kv head); ``q_nope`` is absorbed into the latent space (``q_nope @ W_uk``
``[N, Dc]``), attention runs over the latent rows (key = value = ``c``, plus the rope term) with
:func:`attnops.sparse_flash_attention`, the result goes back through ``W_uv [N, Dc, Dv]`` and ``W_o``. The indexer
(``index_heads`` heads of ``index_dim``, ReLU, learned per-head weights) picks the keys with
:func:`attnops.lightning_indexer`. RoPE is DeepSeek's interleaved form.

Without a cache the call is a causal prefill over ``x [B, S, H]`` (differentiable in every weight but the indexer's,
which trains with :func:`attnops.lightning_indexer_kl_loss`); with a :class:`~attnops.nn.DSACache` the new tokens'
latent, rope and indexer rows are appended and the queries attend over the cache (prefill, then one-token decode
steps).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.dsa import lightning_indexer, sparse_flash_attention
from ..ops.mla.rope import interleave_rope
from .dsa_cache import DSACache
from .layer_input import check_layer_input
from .rotary import rotary_angles


class DeepSeekSparseAttention(nn.Module):
    """DSA over ``x [B, S, hidden]``; ``heads`` query heads of ``qk_nope_dim + qk_rope_dim``, latent ``kv_rank``,
    values of ``v_head_dim``, an indexer of ``index_heads x index_dim`` keeping ``index_topk`` keys per token."""

    def __init__(self, hidden: int, heads: int, *, kv_rank: int = 512, qk_nope_dim: int = 128,
                 qk_rope_dim: int = 64, v_head_dim: int = 128, index_heads: int = 64, index_dim: int = 128,
                 index_topk: int = 2048, rope_theta: float = 10000.0, eps: float = 1e-6):
        super().__init__()
        self.heads, self.kv_rank, self.nope, self.rope_dim, self.v_dim = heads, kv_rank, qk_nope_dim, qk_rope_dim, \
            v_head_dim
        self.index_heads, self.index_dim, self.index_topk, self.theta = index_heads, index_dim, index_topk, rope_theta
        self.q_proj = nn.Linear(hidden, heads * (qk_nope_dim + qk_rope_dim), bias=False)
        self.kv_proj = nn.Linear(hidden, kv_rank + qk_rope_dim, bias=False)
        self.kv_norm = nn.RMSNorm(kv_rank, eps=eps)
        self.w_uk = nn.Parameter(torch.randn(heads, qk_nope_dim, kv_rank) * qk_nope_dim ** -0.5)
        self.w_uv = nn.Parameter(torch.randn(heads, kv_rank, v_head_dim) * kv_rank ** -0.5)
        self.o_proj = nn.Linear(heads * v_head_dim, hidden, bias=False)
        self.index_q = nn.Linear(hidden, index_heads * index_dim, bias=False)
        self.index_k = nn.Linear(hidden, index_dim, bias=False)
        self.index_w = nn.Linear(hidden, index_heads, bias=False)
        self.scale = (qk_nope_dim + qk_rope_dim) ** -0.5

    def new_cache(self, batch: int, max_len: int, *, block_size: int = 16) -> DSACache:
        p = self.q_proj.weight
        return DSACache(batch, max_len, latent_dim=self.kv_rank, rope_dim=self.rope_dim, index_dim=self.index_dim,
                        block_size=block_size, dtype=p.dtype, device=p.device)

    def forward(self, x: Tensor, cache: DSACache | None = None) -> Tensor:
        check_layer_input(x, self.q_proj.weight, self.q_proj.in_features, packed=False)
        b, s, _ = x.shape
        start = 0 if cache is None else cache.lengths[0]
        positions = torch.arange(start, start + s, device=x.device)
        cos, sin = rotary_angles(positions, self.rope_dim, self.theta, torch.float32)  # [S, 1, Dr]
        q = self.q_proj(x).view(b, s, self.heads, -1)
        q_latent = torch.einsum("bsnd,ndc->bsnc", q[..., :self.nope], self.w_uk)
        q_rope = interleave_rope(q[..., self.nope:], cos, sin).to(x.dtype)
        kv = self.kv_proj(x)
        latent = self.kv_norm(kv[..., :self.kv_rank])
        k_rope = interleave_rope(kv[..., self.kv_rank:], cos[:, 0], sin[:, 0]).to(x.dtype)
        iq = self.index_q(x).view(b, s, self.index_heads, self.index_dim)
        ik = self.index_k(x)
        iw = self.index_w(x) * (self.index_heads ** -0.5 * self.index_dim ** -0.5)
        with torch.no_grad():
            if cache is None:
                keys = dict(layout="BSND")
                selected = lightning_indexer(iq, ik[:, :, None], iw, sparse_count=self.index_topk).sparse_indices
            else:
                lengths = cache.append(latent.detach(), k_rope.detach(), ik.detach())
                keys = dict(layout="BSND", layout_kv="PA_BSND", block_table=cache.block_table,
                            actual_seq_lengths_query=[s] * b, actual_seq_lengths_kv=lengths)
                selected = lightning_indexer(iq, cache.index, iw, sparse_count=self.index_topk, layout="BSND",
                                             layout_key="PA_BSND", block_table=cache.block_table,
                                             actual_seq_lengths_query=[s] * b,
                                             actual_seq_lengths_key=lengths).sparse_indices
        if cache is None:
            key, key_rope = latent[:, :, None], k_rope[:, :, None]
        else:
            key, key_rope = cache.latent, cache.rope
        out = sparse_flash_attention(q_latent, key, key, selected, scale=self.scale, query_rope=q_rope,
                                     key_rope=key_rope, **keys).attention_out  # [B, S, N, Dc]
        return self.o_proj(torch.einsum("bsnc,ncv->bsnv", out, self.w_uv).reshape(b, s, -1))
