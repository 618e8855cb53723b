"""RMSNorm + interleaved RoPE of the latent KV, written into the MLA caches (``npu_kv_rmsnorm_rope_cache``).

``kv [B, 1, S, Dc + Dr]`` (DeepSeek: 512 + 64): ``y = RmsNorm(kv[..., :Dc]; gamma)`` goes to ``ckv_cache``,
``k_embed = IRoPE(kv[..., Dc:], cos, sin)`` to ``k_cache``, both computed in fp32 and rounded to the cache's dtype
(int8 caches: ``clamp(round(value * scale (+ offset)))``). Where token ``s`` of batch ``b`` goes, per ``cache_mode``:

* ``Norm``: caches ``[B, 1, L, D]``, ``index [B, S]`` positions: ``cache[b, 0, index[b, s]]``;
* ``PA`` / ``PA_BNSD`` / ``PA_NZ``: paged caches, ``index [B*S]`` flat slots ``block * block_size + row``;
* ``PA_BLK_BNSD`` / ``PA_BLK_NZ``: ``index [B*ceil(S/block_size)]``, the slot of each page's first row:
  ``cache[index[b*ceil(S/bs) + s // bs] // bs, s % bs]``.

``*_NZ`` modes store the caches in NZ order (:mod:`.cache_write`). Negative indices write nothing.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..._core.checks import check_choice, check_tensor, require
from .cache_write import quantize_int8, write_rows
from .rope import interleave_rope, rms_norm

CACHE_MODES = ("Norm", "PA", "PA_BNSD", "PA_NZ", "PA_BLK_BNSD", "PA_BLK_NZ")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, k_rope_scale, c_kv_scale,
                                cache_mode) -> None:
    check_choice("cache_mode", cache_mode, CACHE_MODES)
    check_tensor("kv", kv, ndim=4, dtypes=FLOAT_DTYPES)
    require(kv.shape[1] == 1, "kv", "[B, 1, S, Dc + Dr] (one kv head)", kv)
    dc = gamma.shape[-1]
    check_tensor("gamma", gamma, ndim=1)
    dr = kv.shape[-1] - dc
    require(dr > 0 and dr % 2 == 0, "gamma", f"[Dc] with Dc < kv's last dim {kv.shape[-1]} and an even rest", gamma)
    for name, x in (("cos", cos), ("sin", sin)):
        check_tensor(name, x, shape=(kv.shape[0], 1, kv.shape[2], dr))
    check_tensor("index", index, dtypes=(torch.int32, torch.int64))
    check_tensor("k_cache", k_cache)
    check_tensor("ckv_cache", ckv_cache)
    require(k_cache.shape[-1] == dr, "k_cache", f"last dim {dr} (the rope part)", k_cache)
    require(ckv_cache.shape[-1] == dc, "ckv_cache", f"last dim {dc} (gamma's)", ckv_cache)
    for name, cache, scale, d in (("k_rope_scale", k_cache, k_rope_scale, dr), ("c_kv_scale", ckv_cache, c_kv_scale,
                                                                                  dc)):
        if cache.dtype == torch.int8:
            check_tensor(name, scale, shape=(d,))
        else:
            require(scale is None, name, f"None for a {cache.dtype} cache (scales quantize int8 caches)", scale)
    b, s = kv.shape[0], kv.shape[2]
    if cache_mode == "Norm":
        check_tensor("index", index, shape=(b, s))
    elif cache_mode.startswith("PA_BLK"):
        pages = -(-s // k_cache.shape[1])
        check_tensor("index", index, shape=(b * pages,))
    else:
        require(index.numel() == b * s, "index", f"{b * s} flat slots (B*S)", index)


def token_slots(index: Tensor, cache_mode: str, batch: int, seq: int, block_size: int) -> Tensor:
    """``[B, S]`` flat cache slots (Norm: positions) of every token, -1 where nothing is written."""
    index = index.to(torch.int64)
    if not cache_mode.startswith("PA_BLK"):
        return index.view(batch, seq)
    pages = -(-seq // block_size)
    s = torch.arange(seq)
    first = index.view(batch, pages)[:, s // block_size]
    return torch.where(first >= 0, (first // block_size) * block_size + s % block_size, -1)


def _to_cache(x: Tensor, cache: Tensor, scale, offset) -> Tensor:
    return quantize_int8(x, scale, offset) if cache.dtype == torch.int8 else x.to(cache.dtype)


def kv_rmsnorm_rope_cache(kv: Tensor, gamma: Tensor, cos: Tensor, sin: Tensor, index: Tensor, k_cache: Tensor,
                          ckv_cache: Tensor, k_rope_scale, c_kv_scale, k_rope_offset, c_kv_offset, epsilon: float,
                          cache_mode: str) -> tuple[Tensor, Tensor]:
    """Writes both caches in place; returns ``(k_embed [B, 1, S, Dr], y [B, 1, S, Dc])`` in kv's dtype."""
    dc = gamma.shape[-1]
    y = rms_norm(kv[..., :dc], gamma, epsilon)
    k_embed = interleave_rope(kv[..., dc:], cos, sin)
    batch, seq = kv.shape[0], kv.shape[2]
    nz = cache_mode.endswith("NZ")
    for cache, rows, scale, offset in ((k_cache, k_embed, k_rope_scale, k_rope_offset),
                                       (ckv_cache, y, c_kv_scale, c_kv_offset)):
        data = _to_cache(rows[:, 0], cache, scale, offset)  # [B, S, D]
        if cache_mode == "Norm":
            pos = index.to(torch.int64).view(batch, seq)
            keep = pos >= 0
            b = torch.arange(batch)[:, None].expand(batch, seq)
            cache[b[keep].to(cache.device), 0, pos[keep].to(cache.device)] = data[keep].to(cache.device)
        else:
            slots = token_slots(index.cpu(), cache_mode, batch, seq, cache.shape[1])
            write_rows(cache, data.reshape(batch * seq, 1, -1), slots.reshape(-1), nz=nz, block_size=cache.shape[1])
    return k_embed.to(kv.dtype), y.to(kv.dtype)
