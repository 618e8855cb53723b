"""The MLA prolog (``npu_mla_prolog_v3`` / ``_v2``, non-quantized path): query and latent-KV projections with
their RMSNorms and interleaved RoPE, the latent KV and its rope part written into the caches.

``c_q = qc_qr_scale * RmsNorm(x @ W_dq)``; ``[q_c | q_r] = c_q @ W_uq_qr`` per head; ``query = q_c @ W_uk`` per
head (``[T, N, Hckv]``); ``query_rope = IRoPE(q_r)``; ``kv = x @ W_dkv_kr``, ``c_kv = kc_scale * RmsNorm(kv[:, :Hckv])``
and ``k_r = IRoPE(kv[:, Hckv:])`` go to ``kv_cache`` / ``kr_cache`` (every kv head) at the token's slot:
``PA_BSND`` / ``PA_NZ``: ``cache_index`` flat slots; ``PA_BLK_BSND`` / ``PA_BLK_NZ``: ``cache_index`` holds a block
id per (batch, page of its tokens), batches from ``actual_seq_len`` (cumulative) for ``[T, He]`` tokens;
``BSND`` / ``TND``: caches shaped like the tokens, token ``t`` fills row ``t``. Work in fp32, results rounded to
``token_x``'s dtype (caches: their dtype).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..._core.checks import check_choice, check_tensor, require
from .cache_write import write_rows
from .rope import interleave_rope, rms_norm, work_dtype

CACHE_MODES = ("PA_BSND", "PA_NZ", "PA_BLK_BSND", "PA_BLK_NZ", "BSND", "TND")


def check_prolog(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, gamma_cq, gamma_ckv, rope_sin,
                 rope_cos, kv_cache, kr_cache, cache_index, cache_mode) -> None:
    check_choice("cache_mode", cache_mode, CACHE_MODES)
    check_tensor("token_x", token_x, ndim=(2, 3))
    he = token_x.shape[-1]
    check_tensor("weight_dq", weight_dq, ndim=2, shape=(he, None))
    hcq = weight_dq.shape[1]
    check_tensor("weight_uk", weight_uk, ndim=3)
    n, d, hckv = weight_uk.shape
    check_tensor("weight_uq_qr", weight_uq_qr, ndim=2, shape=(hcq, None))
    dr = weight_uq_qr.shape[1] // n - d
    require(weight_uq_qr.shape[1] % n == 0 and dr > 0 and dr % 2 == 0, "weight_uq_qr",
            f"[Hcq={hcq}, N*(D+Dr)] with N={n}, D={d} and an even Dr > 0", weight_uq_qr)
    check_tensor("weight_dkv_kr", weight_dkv_kr, shape=(he, hckv + dr))
    check_tensor("rmsnorm_gamma_cq", gamma_cq, shape=(hcq,))
    check_tensor("rmsnorm_gamma_ckv", gamma_ckv, shape=(hckv,))
    for name, x in (("rope_sin", rope_sin), ("rope_cos", rope_cos)):
        check_tensor(name, x, shape=(*token_x.shape[:-1], dr))
    check_tensor("kv_cache", kv_cache)
    check_tensor("kr_cache", kr_cache)
    require(kv_cache.shape[-1] == hckv, "kv_cache", f"last dim Hckv={hckv}", kv_cache)
    require(kr_cache.shape[-1] == dr, "kr_cache", f"last dim Dr={dr}", kr_cache)
    if cache_mode in ("BSND", "TND"):
        require(tuple(kv_cache.shape[:-2]) == tuple(token_x.shape[:-1]), "kv_cache",
                f"token-shaped rows {list(token_x.shape[:-1])} for cache_mode {cache_mode!r}", kv_cache)
    else:
        check_tensor("cache_index", cache_index, dtypes=(torch.int32, torch.int64))


def token_slots(token_x: Tensor, cache_index: Tensor | None, cache_mode: str, block_size: int,
                actual_seq_len: Tensor | None) -> Tensor:
    """``[T]`` flat cache slots of the tokens (-1: not written)."""
    tokens = token_x.shape[:-1].numel()
    if cache_mode in ("BSND", "TND"):
        return torch.arange(tokens)
    index = cache_index.cpu().to(torch.int64)
    if not cache_mode.startswith("PA_BLK"):
        require(index.numel() == tokens, "cache_index", f"{tokens} flat slots (one per token)", cache_index)
        return index.reshape(-1)
    if token_x.dim() == 3:  # [B, S, He]: cache_index [B, pages]
        b, s = token_x.shape[:2]
        pos = torch.arange(s)
        blocks = index.view(b, -1)[:, pos // block_size]
        return torch.where(blocks >= 0, blocks * block_size + pos % block_size, -1).reshape(-1)
    ends = [tokens] if actual_seq_len is None else [int(v) for v in actual_seq_len.tolist()]
    slots, page = [], 0
    for start, end in zip([0, *ends[:-1]], ends):
        pos = torch.arange(end - start)
        blocks = index[page + pos // block_size]
        slots.append(torch.where(blocks >= 0, blocks * block_size + pos % block_size, -1))
        page += -(-(end - start) // block_size)
    return torch.cat(slots)


def mla_prolog(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, gamma_cq, gamma_ckv, rope_sin, rope_cos,
               kv_cache, kr_cache, cache_index, actual_seq_len, eps_cq: float, eps_ckv: float, cache_mode: str,
               qc_qr_scale: float, kc_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Writes the caches in place; returns ``(query [.., N, Hckv], query_rope [.., N, Dr], query_norm [.., Hcq])``
    in ``token_x``'s dtype."""
    dt = work_dtype(token_x)
    lead = token_x.shape[:-1]
    x = token_x.reshape(-1, token_x.shape[-1]).to(dt)
    n, d, hckv = weight_uk.shape
    cos = rope_cos.reshape(x.shape[0], -1).to(dt)
    sin = rope_sin.reshape(x.shape[0], -1).to(dt)
    c_q = qc_qr_scale * rms_norm(x @ weight_dq.to(dt), gamma_cq, eps_cq)
    u = (c_q @ weight_uq_qr.to(dt)).view(x.shape[0], n, -1)
    query = torch.einsum("tnd,ndh->tnh", u[..., :d], weight_uk.to(dt))
    query_rope = interleave_rope(u[..., d:], cos[:, None], sin[:, None])
    kv = x @ weight_dkv_kr.to(dt)
    c_kv = kc_scale * rms_norm(kv[:, :hckv], gamma_ckv, eps_ckv)
    k_r = interleave_rope(kv[:, hckv:], cos, sin)
    nz = cache_mode.endswith("NZ")
    for cache, rows in ((kv_cache, c_kv), (kr_cache, k_r)):
        block = cache.shape[1] if cache_mode.startswith("PA") else 1
        slots = token_slots(token_x, cache_index, cache_mode, block, actual_seq_len)
        heads = cache.shape[-2]
        data = rows[:, None].expand(-1, heads, -1).to(cache.dtype)
        write_rows(cache, data, slots, nz=nz, block_size=block)
    out = token_x.dtype
    return (query.to(out).contiguous().view(*lead, n, hckv), query_rope.to(out).contiguous().view(*lead, n, -1),
            c_q.to(out).contiguous().view(*lead, -1))
