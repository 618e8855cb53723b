"""The MLA prolog (``npu_mla_prolog_v3`` / ``_v2``): query and latent-KV projections with their RMSNorms and
interleaved RoPE, the latent KV and its rope part written into the caches (int8 paths: :mod:`.prolog_quant`).

``c_q = qc_qr_scale * RmsNorm(x @ W_dq)``; ``[q_c | q_r] = c_q @ W_uq_qr`` per head; ``query = q_c @ W_uk`` per
head (``[T, N, Hckv]``); ``query_rope = IRoPE(q_r)``; ``kv = x @ W_dkv_kr``, ``c_kv = kc_scale * RmsNorm(kv[:, :Hckv])``
and ``k_r = IRoPE(kv[:, Hckv:])`` go to ``kv_cache`` / ``kr_cache`` (every kv head) at the token's slot:
``PA_BSND`` / ``PA_NZ``: ``cache_index`` flat slots; ``PA_BLK_BSND`` / ``PA_BLK_NZ``: ``cache_index`` holds a block
id per (batch, page of its tokens), batches from ``actual_seq_len`` (cumulative) for ``[T, He]`` tokens;
``BSND`` / ``TND``: caches shaped like the tokens, token ``t`` fills row ``t``. Work in fp32, results rounded to
``token_x``'s dtype (``rope_cos``'s for an int8 ``token_x``; caches: their dtype).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..._core.checks import check_choice, check_host_or_same_device, check_same_device, check_tensor, require
from .cache_write import nz_width, quantize_int8, write_rows
from .kv_cache import FLOAT_DTYPES
from .prolog_quant import PrologQuant, dynamic_int8, int8_matmul
from .rope import interleave_rope, rms_norm, work_dtype

CACHE_MODES = ("PA_BSND", "PA_NZ", "PA_BLK_BSND", "PA_BLK_NZ", "BSND", "TND")


def check_prolog(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, gamma_cq, gamma_ckv, rope_sin,
                 rope_cos, kv_cache, kr_cache, cache_index, cache_mode) -> None:
    check_choice("cache_mode", cache_mode, CACHE_MODES)
    check_tensor("token_x", token_x, ndim=(2, 3))
    floats = dict(weight_uk=weight_uk, rmsnorm_gamma_cq=gamma_cq, rmsnorm_gamma_ckv=gamma_ckv, rope_sin=rope_sin,
                  rope_cos=rope_cos)
    for name, x in floats.items():
        check_tensor(name, x, dtypes=FLOAT_DTYPES)
    for name, x in (("weight_dq", weight_dq), ("weight_uq_qr", weight_uq_qr), ("weight_dkv_kr", weight_dkv_kr),
                    ("kv_cache", kv_cache), ("kr_cache", kr_cache)):
        check_tensor(name, x, dtypes=(*FLOAT_DTYPES, torch.int8))  # int8: the quantized modes (check_quant)
    check_same_device("token_x", token_x, weight_dq=weight_dq, weight_uq_qr=weight_uq_qr,
                      weight_dkv_kr=weight_dkv_kr, kv_cache=kv_cache, kr_cache=kr_cache, **floats)
    he = token_x.shape[-1]
    check_tensor("weight_dq", weight_dq, ndim=2, shape=(he, None))
    hcq = weight_dq.shape[1]
    check_tensor("weight_uk", weight_uk, ndim=3)
    n, d, hckv = weight_uk.shape
    require(min(n, d, hckv) >= 1, "weight_uk", "[N, D, Hckv] with N, D, Hckv >= 1", weight_uk)
    check_tensor("weight_uq_qr", weight_uq_qr, ndim=2, shape=(hcq, None))
    dr = weight_uq_qr.shape[1] // n - d
    require(weight_uq_qr.shape[1] % n == 0 and dr > 0 and dr % 2 == 0, "weight_uq_qr",
            f"[Hcq={hcq}, N*(D+Dr)] with N={n}, D={d} and an even Dr > 0", weight_uq_qr)
    check_tensor("weight_dkv_kr", weight_dkv_kr, shape=(he, hckv + dr))
    check_tensor("rmsnorm_gamma_cq", gamma_cq, shape=(hcq,))
    check_tensor("rmsnorm_gamma_ckv", gamma_ckv, shape=(hckv,))
    for name, x in (("rope_sin", rope_sin), ("rope_cos", rope_cos)):
        check_tensor(name, x, shape=(*token_x.shape[:-1], dr))
    for name, cache in (("kv_cache", kv_cache), ("kr_cache", kr_cache)):
        require(cache.is_contiguous(), name, "a contiguous tensor (written in place)", cache)
    require(kv_cache.shape[-1] == hckv, "kv_cache", f"last dim Hckv={hckv}", kv_cache)
    require(kr_cache.shape[-1] == dr, "kr_cache", f"last dim Dr={dr}", kr_cache)
    if cache_mode in ("BSND", "TND"):
        require(tuple(kv_cache.shape[:-2]) == tuple(token_x.shape[:-1]), "kv_cache",
                f"token-shaped rows {list(token_x.shape[:-1])} for cache_mode {cache_mode!r}", kv_cache)
    else:
        # [T] flat slots, or [B, S] / [B, pages] by batch for [B, S, He] tokens
        check_tensor("cache_index", cache_index, ndim=(1, token_x.dim() - 1), dtypes=(torch.int32, torch.int64))
        check_host_or_same_device("token_x", token_x, cache_index=cache_index)


def token_slots(token_x: Tensor, cache_index: Tensor | None, cache_mode: str, block_size: int,
                actual_seq_len: Tensor | None, device: torch.device) -> Tensor:
    """``[T]`` flat cache slots of the tokens (-1: not written), on ``cache_index``'s device (``device`` for the
    token-shaped caches). A CPU ``cache_index`` is checked; one on a device is read by index only (no sync), its
    pages clamped into it, tokens past the last of ``actual_seq_len`` not written."""
    tokens = token_x.shape[:-1].numel()
    if cache_mode in ("BSND", "TND"):
        return torch.arange(tokens, device=device)
    index = cache_index.to(torch.int64).reshape(-1)
    if not cache_mode.startswith("PA_BLK"):
        require(index.numel() == tokens, "cache_index", f"{tokens} flat slots (one per token)", cache_index)
        return index
    t = torch.arange(tokens, device=index.device)
    if token_x.dim() == 3:  # [B, S, He]: cache_index [B, pages]
        b, s = token_x.shape[:2]
        require(index.numel() % b == 0 and index.numel() // b >= -(-s // block_size), "cache_index",
                f"[{b}, >= {-(-s // block_size)}] block ids (B, pages of S={s})", cache_index)
        pos = t[:s]
        blocks = index.view(b, -1)[:, pos // block_size]
        return torch.where(blocks >= 0, blocks * block_size + pos % block_size, -1).reshape(-1)
    ends = t.new_full((1,), tokens) if actual_seq_len is None else actual_seq_len.to(index.device, torch.int64)
    ends = ends.reshape(-1)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    pages = (ends - starts + block_size - 1).div(block_size, rounding_mode="floor")
    if index.device.type == "cpu":
        require(ends.numel() > 0 and bool((ends >= starts).all()) and int(ends[-1]) == tokens, "actual_seq_len",
                f"non-decreasing cumulative lengths ending at the {tokens} tokens", actual_seq_len)
        require(int(pages.sum()) <= index.numel(), "cache_index", f"{int(pages.sum())} block ids (one per page)",
                cache_index)
    batch = torch.searchsorted(ends, t, right=True)
    inside = batch < ends.numel()
    batch = batch.clamp(max=ends.numel() - 1)
    pos = t - starts[batch]
    page = (torch.cumsum(pages, 0) - pages)[batch] + pos // block_size
    blocks = index[page.clamp(0, index.numel() - 1)]
    return torch.where(inside & (blocks >= 0), blocks * block_size + pos % block_size, -1)


def _projections(x: Tensor, weight_dq: Tensor, weight_dkv_kr: Tensor, quant: PrologQuant, dt: torch.dtype
                 ) -> tuple[Tensor, Tensor]:
    """``(x @ W_dq, x @ W_dkv_kr)`` in ``dt`` (dequantized with ``weight_quant_mode`` 2)."""
    if quant.weight_mode == 2:
        return (int8_matmul(x, weight_dq, quant.dequant_scale_x, quant.dequant_scale_w_dq, dt),
                int8_matmul(x, weight_dkv_kr, quant.dequant_scale_x, quant.dequant_scale_w_dkv_kr, dt))
    x = x.to(dt)
    return x @ weight_dq.to(dt), x @ weight_dkv_kr.to(dt)


def mla_prolog(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, gamma_cq, gamma_ckv, rope_sin, rope_cos,
               kv_cache, kr_cache, cache_index, actual_seq_len, eps_cq: float, eps_ckv: float, cache_mode: str,
               qc_qr_scale: float, kc_scale: float, quant: PrologQuant = PrologQuant()
               ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Writes the caches in place; returns ``(query [.., N, Hckv], query_rope [.., N, Dr], dequant_scale_q_nope
    [T, N, 1], query_norm [.., Hcq], dequant_scale_q_norm [T, 1])``: query and query_norm int8 where quantized, the
    scales fp32 and empty ``[0]`` where the mode produces none."""
    out = token_x.dtype if token_x.is_floating_point() else rope_cos.dtype
    dt = work_dtype(rope_cos)
    lead = token_x.shape[:-1]
    x = token_x.reshape(-1, token_x.shape[-1])
    n, d, hckv = weight_uk.shape
    cos = rope_cos.reshape(x.shape[0], -1).to(dt)
    sin = rope_sin.reshape(x.shape[0], -1).to(dt)
    xq, kv = _projections(x, weight_dq, weight_dkv_kr, quant, dt)
    c_q = qc_qr_scale * rms_norm(xq, gamma_cq, eps_cq)
    norm_scale = token_x.new_empty(0, dtype=torch.float32)
    if quant.weight_mode >= 1:
        smooth = 1 if quant.smooth_scales_cq is None else quant.smooth_scales_cq.to(dt).reshape(-1)
        c_q, norm_scale = dynamic_int8(c_q * smooth, 1)  # query_norm becomes the int8 codes
        u = int8_matmul(c_q, weight_uq_qr, norm_scale, quant.dequant_scale_w_uq_qr, dt)
    else:
        u = c_q @ weight_uq_qr.to(dt)
    u = u.view(x.shape[0], n, -1)
    query = torch.einsum("tnd,ndh->tnh", u[..., :d], weight_uk.to(dt))
    query_rope = interleave_rope(u[..., d:], cos[:, None], sin[:, None])
    q_scale = token_x.new_empty(0, dtype=torch.float32)
    if quant.query_mode == 1:
        query, q_scale = dynamic_int8(query, 1)
        query_rope = query_rope * quant.cache_scales()[0].to(dt) / q_scale.masked_fill(q_scale == 0, 1)
    c_kv = kc_scale * rms_norm(kv[:, :hckv], gamma_ckv, eps_ckv)
    k_r = interleave_rope(kv[:, hckv:], cos, sin)
    ckv_scale, ckr_scale = quant.cache_scales()
    if ckv_scale is not None:
        c_kv = quantize_int8(c_kv, ckv_scale, None)
    if ckr_scale is not None:
        k_r = quantize_int8(k_r, ckr_scale, None)
    nz = cache_mode.endswith("NZ")
    for cache, rows in ((kv_cache, c_kv), (kr_cache, k_r)):
        block = cache.shape[1] if cache_mode.startswith("PA") else 1
        slots = token_slots(token_x, cache_index, cache_mode, block, actual_seq_len, cache.device)
        heads = cache.shape[-2]
        data = rows[:, None].expand(-1, heads, -1).to(cache.dtype)
        write_rows(cache, data, slots, block_size=block, x=nz_width(cache.dtype) if nz else None,
                   name="cache_index")
    query_dtype = torch.int8 if quant.query_mode == 1 else out
    norm_dtype = torch.int8 if quant.weight_mode >= 1 else out
    return (query.to(query_dtype).contiguous().view(*lead, n, hckv),
            query_rope.to(out).contiguous().view(*lead, n, -1), q_scale.to(torch.float32),
            c_q.to(norm_dtype).contiguous().view(*lead, -1), norm_scale.to(torch.float32))
