"""RMSNorm + interleaved RoPE of the latent KV, written into the MLA caches (``npu_kv_rmsnorm_rope_cache``).

V1 (``v`` None, DeepSeek): ``kv [B, 1, S, Dc + Dr]`` (512 + 64): ``y = RmsNorm(kv[..., :Dc]; gamma)`` goes to
``ckv_cache``, ``k_embed = IRoPE(kv[..., Dc:], cos, sin)`` to ``k_cache``. V2 (``v [B, N, S, Dv]`` given):
``kv [B, N, S, Dk]`` is normalized over all ``Dk`` (``gamma [Dk]``), its first ``Dr`` (cos's last dim) dims are
rotated, and that row goes to ``k_cache``; ``v`` goes unchanged to ``ckv_cache``. Both computed in fp32 and rounded
to the cache's dtype (int8 caches: ``clamp(round(value * scale (+ offset)))``, scales ``[D]``, ``[1]`` or
``[N, D]``). Where token ``s`` of batch ``b`` (head ``n``) goes, per ``cache_mode``:

* ``Norm``: caches ``[B, N, L, D]``, ``index [B, S]`` positions: ``cache[b, n, index[b, s]]``;
* ``PA`` / ``PA_BNSD`` / ``PA_NZ``: paged caches ``[blocks, block_size, N, D]``, ``index [B*S]`` flat slots
  ``block * block_size + row``;
* ``PA_BLK_BNSD`` / ``PA_BLK_NZ``: ``index [B*ceil(S/block_size)]``, the slot of each page's first row:
  ``cache[index[b*ceil(S/bs) + s // bs] // bs, s % bs]``.

``*_NZ`` modes store the caches in NZ order (:mod:`.cache_write`). Negative indices write nothing. A CPU ``index``
is checked against the caches; an ``index`` on a device is never read on the host (clamped into the caches).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..._core.checks import check_choice, check_host_or_same_device, check_same_device, check_tensor, require
from ..._core.indices import check_slots, valid_ids, validation_enabled
from .cache_write import nz_width, quantize_int8, write_rows
from .rope import interleave_rope, rms_norm

CACHE_MODES = ("Norm", "PA", "PA_BNSD", "PA_NZ", "PA_BLK_BNSD", "PA_BLK_NZ")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CACHE_DTYPES = (*FLOAT_DTYPES, torch.int8)


def _row_widths(kv: Tensor, gamma: Tensor, cos: Tensor, v: Tensor | None) -> tuple[int, int, int]:
    """``(rope width Dr, k_cache width, ckv_cache width)``: V1 ``(Dr, Dr, Dc)``, V2 ``(Dr, Dk, Dv)``."""
    if v is None:
        dc = gamma.shape[-1]
        return kv.shape[-1] - dc, kv.shape[-1] - dc, dc
    return cos.shape[-1], kv.shape[-1], v.shape[-1]


def check_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, k_rope_scale, c_kv_scale,
                                cache_mode, v=None) -> None:
    check_choice("cache_mode", cache_mode, CACHE_MODES)
    check_tensor("kv", kv, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("gamma", gamma, ndim=1, dtypes=FLOAT_DTYPES)
    for name, x in (("cos", cos), ("sin", sin)):
        check_tensor(name, x, dtypes=FLOAT_DTYPES)
    for name, x in (("k_cache", k_cache), ("ckv_cache", ckv_cache)):
        check_tensor(name, x, dtypes=CACHE_DTYPES)
    check_same_device("kv", kv, gamma=gamma, cos=cos, sin=sin, k_cache=k_cache, ckv_cache=ckv_cache, v=v)
    heads = kv.shape[1]
    if v is None:
        require(heads == 1, "kv", "[B, 1, S, Dc + Dr] (one kv head; V2 with v takes N heads)", kv)
        require(gamma.shape[0] < kv.shape[-1] and (kv.shape[-1] - gamma.shape[0]) % 2 == 0, "gamma",
                f"[Dc] with Dc < kv's last dim {kv.shape[-1]} and an even rest", gamma)
    else:
        check_tensor("v", v, ndim=4, dtypes=(kv.dtype,))
        require(tuple(v.shape[:3]) == tuple(kv.shape[:3]), "v", f"[B, N, S, Dv] with B, N, S = {list(kv.shape[:3])}",
                v)
        check_tensor("gamma", gamma, shape=(kv.shape[-1],))
    dr, dk, dv = _row_widths(kv, gamma, cos, v)
    for name, x in (("cos", cos), ("sin", sin)):
        check_tensor(name, x, ndim=4)
        if v is None:
            require(tuple(x.shape) == (kv.shape[0], 1, kv.shape[2], dr), name,
                    f"[{kv.shape[0]}, 1, {kv.shape[2]}, Dr={dr}] (kv's last dim minus gamma's)", x)
        else:
            require(tuple(x.shape[:3]) == (kv.shape[0], 1, kv.shape[2]) and 0 < x.shape[3] <= dk
                    and x.shape[3] % 2 == 0 and x.shape[3] == dr, name,
                    f"[{kv.shape[0]}, 1, {kv.shape[2]}, Dr] with an even Dr <= Dk={dk} (cos's)", x)
    check_tensor("index", index, dtypes=(torch.int32, torch.int64))
    check_host_or_same_device("kv", kv, index=index)
    check_tensor("k_cache", k_cache, ndim=4)
    check_tensor("ckv_cache", ckv_cache, ndim=4)
    for name, cache, d, what in (("k_cache", k_cache, dk, "the rope part" if v is None else "kv's Dk"),
                                 ("ckv_cache", ckv_cache, dv, "gamma's" if v is None else "v's Dv")):
        n = cache.shape[1] if cache_mode == "Norm" else cache.shape[2]
        require(cache.shape[-1] == d and n == heads, name, f"last dim {d} ({what}) and {heads} kv head(s)", cache)
    for name, cache, scale, d in (("k_rope_scale", k_cache, k_rope_scale, dk), ("c_kv_scale", ckv_cache, c_kv_scale,
                                                                                  dv)):
        if cache.dtype == torch.int8:
            check_tensor(name, scale, ndim=(1, 2))
            require(tuple(scale.shape) in ((d,), (1,), (heads, d)), name, f"[{d}], [1] or [{heads}, {d}]", scale)
        else:
            require(scale is None, name, f"None for a {cache.dtype} cache (scales quantize int8 caches)", scale)
    b, s = kv.shape[0], kv.shape[2]
    if cache_mode == "Norm":
        check_tensor("index", index, shape=(b, s))
    elif cache_mode.startswith("PA_BLK"):
        pages = -(-s // k_cache.shape[1])
        check_tensor("index", index, shape=(b * pages,))
    else:
        check_tensor("index", index, shape=(b * s,))  # flat slots


def token_slots(index: Tensor, cache_mode: str, batch: int, seq: int, block_size: int) -> Tensor:
    """``[B*S]`` flat cache slots of the tokens, -1 where nothing is written; ``block_size``: the paged caches' block
    size, the Norm caches' length ``L`` (slot ``b * L + position``). Computed on ``index``'s device; Norm positions
    are validated as slots of a cache of ``L`` rows (:func:`~attnops._core.indices.check_slots`) when
    :func:`~attnops._core.indices.validation_enabled`, and write nothing outside ``[0, L)`` otherwise."""
    index = index.to(torch.int64)
    s = torch.arange(seq, device=index.device)
    if cache_mode == "Norm":
        pos = index.view(batch, seq)
        if validation_enabled(index.device):
            check_slots("index", pos, block_size, what="positions below the caches' length")
        rows = torch.arange(batch, device=index.device)[:, None] * block_size + pos
        return torch.where(valid_ids(pos, block_size), rows, -1).reshape(-1)
    if not cache_mode.startswith("PA_BLK"):
        return index.reshape(-1)
    pages = -(-seq // block_size)
    first = index.view(batch, pages)[:, s // block_size]
    return torch.where(first >= 0, (first // block_size) * block_size + s % block_size, -1).reshape(-1)


def _to_cache(x: Tensor, cache: Tensor, scale, offset) -> Tensor:
    return quantize_int8(x, scale, offset) if cache.dtype == torch.int8 else x.to(cache.dtype)


def cache_rows(kv: Tensor, gamma: Tensor, cos: Tensor, sin: Tensor, v: Tensor | None, epsilon: float
               ) -> tuple[Tensor, Tensor]:
    """``(k_cache rows, ckv_cache rows)`` ``[B, N, S, D]`` in the work dtype: V1 ``(IRoPE(rope part),
    RmsNorm(latent))``, V2 ``(RmsNorm(kv) with its first Dr dims rotated, v)``."""
    if v is None:
        dc = gamma.shape[-1]
        return interleave_rope(kv[..., dc:], cos, sin), rms_norm(kv[..., :dc], gamma, epsilon)
    y = rms_norm(kv, gamma, epsilon)
    dr = cos.shape[-1]
    return torch.cat([interleave_rope(y[..., :dr], cos, sin), y[..., dr:]], -1), v.to(y.dtype, copy=True)


def kv_rmsnorm_rope_cache(kv: Tensor, gamma: Tensor, cos: Tensor, sin: Tensor, index: Tensor, k_cache: Tensor,
                          ckv_cache: Tensor, k_rope_scale, c_kv_scale, k_rope_offset, c_kv_offset, epsilon: float,
                          cache_mode: str, v: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Writes both caches in place; returns the rows written, unquantized, in kv's dtype: V1 ``(k_embed [B, 1, S, Dr],
    y [B, 1, S, Dc])``, V2 ``(k rows [B, N, S, Dk], v)``."""
    k_rows, c_rows = cache_rows(kv, gamma, cos, sin, v, epsilon)
    batch, heads, seq = kv.shape[:3]
    norm, nz = cache_mode == "Norm", cache_mode.endswith("NZ")
    for cache, rows, scale, offset in ((k_cache, k_rows, k_rope_scale, k_rope_offset),
                                       (ckv_cache, c_rows, c_kv_scale, c_kv_offset)):
        data = _to_cache(rows.transpose(1, 2), cache, scale, offset)  # [B, S, N, D]
        block = cache.shape[2] if norm else cache.shape[1]
        x = cache.shape[-1] if norm else nz_width(cache.dtype) if nz else None
        write_rows(cache, data.reshape(batch * seq, heads, -1), token_slots(index, cache_mode, batch, seq, block),
                   block_size=block, x=x)
    return k_rows.to(kv.dtype), c_rows.to(kv.dtype)
