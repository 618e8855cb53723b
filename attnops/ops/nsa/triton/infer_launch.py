"""Host side of the NSA compressed-attention and decode kernels: plans (allocated outputs and launches, run on the
NSA kernel family of ``family.py``) and the torch steps around them on the device (forced blocks, top-k).

Compressed attention is the FlashAttention forward kernel (output and statistics), then ``importance_kernel``
(block scores ``[T, N2, maxSel]`` from the final statistics, the ``[T, N1, CmpS]`` probabilities never stored),
then the forced blocks and a stable descending sort: ``torch.sort(stable=True)`` orders equal scores by index, the
reference's tie rule, and blocks past a batch's selection length sit at -inf after every real block.

Decode (one query token per request, paged caches): ``selected_decode_kernel`` and ``compress_decode_kernel`` (one
program per request and KV head); the decode top-k rule (first and last two blocks forced, then the best others)
sorts the kernel's block scores on the device. Compression into the cache is a vectorised gather and weighted sum on
the device.
"""
from __future__ import annotations

import torch

from ...._core.softmax_stats import FLT_MAX
from ...._core.triton.launch import Launch, cdiv, pow2, unit_last_stride
from ...._core.triton.support import interpreting
from ...flash_attention.triton import launch as fa_launch
from ..compress_attention import CompressAttentionSpec
from ..decode import FORCED, CompressSelection, PagedKV, _completes
from .family import KERNELS, SCORE_BLOCK_K, precision_flags


def importance_plan(spec: CompressAttentionSpec, query, key, softmax_max, softmax_sum, interpret: bool):
    """``(scores [T, N2, maxSel] fp32, launches)``: the group-summed block scores (-inf past each batch's blocks)."""
    fa, device = spec.fa, query.device
    g, seq = fa.geom, fa.seq
    sel_max = max(spec.sel_lens, default=0)
    scores = torch.full((fa.total_q, g.n2, sel_max), float("-inf"), dtype=torch.float32, device=device)
    if fa.total_q == 0 or sel_max == 0:
        return scores, []
    qv, kv = fa_launch.token_view(query, fa, g.n1), fa_launch.token_view(key, fa, g.n2)
    dummy = torch.zeros(1, dtype=torch.uint8, device=device)
    mask, mask_flags = fa_launch.mask_args(fa, device, dummy)
    sel = torch.tensor(spec.sel_lens, dtype=torch.int64, device=device)
    launch = Launch("importance_kernel", (seq.max_q, seq.batch * g.n2, cdiv(sel_max, SCORE_BLOCK_K)),
                    (qv, kv, softmax_max, softmax_sum, scores, fa_launch.batch_meta(fa, device), sel,
                     qv.stride(0), qv.stride(1), kv.stride(0), kv.stride(1), fa_launch.stats_geometry(fa)[2],
                     scores.stride(0), scores.stride(1), *mask, fa.scale, g.n2, g.group, g.d, spec.m, spec.nn),
                    dict(BLOCK_D=pow2(g.d), **precision_flags(query.dtype, interpret), **mask_flags),
                    "BLOCK_M")
    return scores, [launch]


def _row_geometry(spec: CompressAttentionSpec, device: torch.device):
    """Per query token: its row within its batch and its batch's selection length (0 for tokens past the
    batches)."""
    seq = spec.fa.seq
    lens = torch.tensor(list(seq.q_lens) + [spec.fa.total_q - sum(seq.q_lens)], dtype=torch.int64)
    starts = torch.tensor(list(seq.q_starts) + [sum(seq.q_lens)], dtype=torch.int64)
    local = torch.arange(spec.fa.total_q) - starts.repeat_interleave(lens)
    sel = torch.tensor(list(spec.sel_lens) + [0], dtype=torch.int64).repeat_interleave(lens)
    return local.to(device), sel.to(device)


def select_top_k(spec: CompressAttentionSpec, scores: torch.Tensor) -> torch.Tensor:
    """``topk_indices [T, N2, count]`` int32 from the ``[T, N2, maxSel]`` scores: ``topk_mask`` blocks forced,
    descending score, ties to the lower index; 0 on tokens past the batches (as the reference)."""
    local, sel = _row_geometry(spec, scores.device)
    if spec.topk_mask is not None:
        blocks = torch.arange(scores.shape[-1], device=scores.device)
        mask = spec.topk_mask.to(scores.device)[local.clamp(max=spec.topk_mask.shape[0] - 1), :scores.shape[-1]]
        forced = mask & (blocks < sel[:, None])
        scores = scores.masked_fill(forced.unsqueeze(1), FLT_MAX)
    scores = torch.nn.functional.pad(scores, (0, max(0, spec.select_count - scores.shape[-1])), value=float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :spec.select_count]
    return torch.where((sel > 0)[:, None, None], order, 0).to(torch.int32)


def compress_attention(spec: CompressAttentionSpec, query, key, value):
    """``(attention_out, topk_indices, softmax_max, softmax_sum)`` of ``nsa_compress_attention`` on the kernels."""
    out, smax, ssum = fa_launch.forward(spec.fa, query, key, value)
    scores, launches = importance_plan(spec, query, key, smax, ssum, interpreting(query.device))
    KERNELS.run_all(launches, query.device)
    return out, select_top_k(spec, scores), smax, ssum


def _decode_flags(kv: PagedKV, query: torch.Tensor, interpret: bool) -> dict:
    return dict(BLOCK_G=pow2(kv.n1 // kv.n2), BLOCK_D=pow2(query.shape[-1]), BLOCK_DV=pow2(kv.dv),
                **precision_flags(query.dtype, interpret))


def _cache_strides(cache: torch.Tensor) -> tuple[int, int, int]:
    return cache.stride(0), cache.stride(1), cache.stride(2)


def selected_decode_plan(kv: PagedKV, block: int, query, key, value, topk_indices, block_table, interpret: bool):
    """``(attention_out [B, N1, Dv], launches)`` of ``nsa_selected_attention_infer``."""
    device = query.device
    out = torch.zeros(kv.batch, kv.n1, kv.dv, dtype=query.dtype, device=device)
    if kv.batch == 0:
        return out, []
    q, k, v = (unit_last_stride(t) for t in (query, key, value))
    topk, table = topk_indices.contiguous(), block_table.contiguous()
    lens = torch.tensor(kv.kv_lens, dtype=torch.int64, device=device)
    launch = Launch("selected_decode_kernel", (kv.batch, kv.n2),
                    (q, k, v, out, topk, table, lens, q.stride(0), q.stride(1), *_cache_strides(k),
                     *_cache_strides(v), out.stride(0), out.stride(1), topk.stride(0), topk.stride(1),
                     table.stride(0), kv.scale, kv.n2, kv.n1 // kv.n2, query.shape[-1], kv.dv, key.shape[1], block,
                     topk.shape[-1]), _decode_flags(kv, query, interpret))
    return out, [launch]


def selected_decode(kv: PagedKV, block: int, query, key, value, topk_indices, block_table):
    out, launches = selected_decode_plan(kv, block, query, key, value, topk_indices, block_table,
                                         interpreting(query.device))
    KERNELS.run_all(launches, query.device)
    return out


def compress_decode_plan(kv: PagedKV, sel: CompressSelection, query, key, value, block_table, interpret: bool):
    """``((attention_out [B, N1, Dv], scores [B, N2, maxBlocks] fp32), launches)`` of
    ``nsa_compress_attention_infer`` (scores -inf past each request's blocks)."""
    device = query.device
    out = torch.zeros(kv.batch, kv.n1, kv.dv, dtype=query.dtype, device=device)
    n_blocks = [sel.blocks(n) for n in kv.kv_lens]
    scores = torch.full((kv.batch, kv.n2, max(n_blocks, default=0)), float("-inf"), dtype=torch.float32,
                        device=device)
    if kv.batch == 0:
        return (out, scores), []
    q, k, v = (unit_last_stride(t) for t in (query, key, value))
    table = block_table.contiguous()
    lens = torch.tensor(kv.kv_lens, dtype=torch.int64, device=device)
    launch = Launch("compress_decode_kernel", (kv.batch, kv.n2),
                    (q, k, v, out, scores, table, lens, q.stride(0), q.stride(1), *_cache_strides(k),
                     *_cache_strides(v), out.stride(0), out.stride(1), scores.stride(0), scores.stride(1),
                     table.stride(0), kv.scale, kv.n2, kv.n1 // kv.n2, query.shape[-1], kv.dv, key.shape[1],
                     sel.select_block // sel.stride, sel.block // sel.stride, sel.stride, sel.block, sel.select_block),
                    _decode_flags(kv, query, interpret))
    return (out, scores), [launch]


def decode_top_k(sel: CompressSelection, scores: torch.Tensor, n_blocks: list[int]) -> torch.Tensor:
    """``topk_indices [B, N2, count]`` int32: blocks 0, n-2, n-1 first, then the ``count - 3`` best of the blocks
    ``1 .. n-3`` by descending score, ties to the lower index (stable sort; the others sit at -inf)."""
    device = scores.device
    n = torch.tensor(n_blocks, dtype=torch.int64, device=device)[:, None, None]
    blocks = torch.arange(scores.shape[-1], device=device)
    middle = scores.masked_fill((blocks < 1) | (blocks >= n - 2), float("-inf"))
    best = torch.sort(middle, dim=-1, descending=True, stable=True).indices[..., :sel.count - FORCED]
    forced = torch.cat([torch.zeros_like(n), n - 2, n - 1], -1).expand(-1, scores.shape[1], FORCED)
    return torch.cat([forced, best], -1).to(torch.int32)


def compress_decode(kv: PagedKV, sel: CompressSelection, query, key, value, block_table):
    (out, scores), launches = compress_decode_plan(kv, sel, query, key, value, block_table,
                                                   interpreting(query.device))
    KERNELS.run_all(launches, query.device)
    return out, decode_top_k(sel, scores, [sel.blocks(n) for n in kv.kv_lens])


def compress_into_cache(input, weight, slot_mapping, block_table, cache, lens: list[int], block: int,
                        stride: int) -> None:
    """``nsa_compress_infer`` on the device: the last ``block`` keys of every request completing a block, gathered
    through the block table, weighted and summed in fp32, written to their cache rows (a row named twice keeps the
    later request's, as the reference)."""
    done = [b for b, n in enumerate(lens) if _completes(n, block, stride)]
    if not done:
        return
    slots = slot_mapping.tolist()
    last = list({slots[b]: b for b in done}.values())  # per cache row, its last request
    device = input.device
    reqs = torch.tensor(last, dtype=torch.int64, device=device)
    ends = torch.tensor([lens[b] for b in last], dtype=torch.int64, device=device)
    pos = ends[:, None] - block + torch.arange(block, device=device)  # [R, block]
    page = input.shape[1]
    pages = block_table[reqs].long().gather(1, pos // page)
    rows = input[pages, pos % page]  # [R, block, N, D]
    cache[slot_mapping[reqs].long()] = (rows.float() * weight.float()[None, :, :, None]).sum(1).to(cache.dtype)
