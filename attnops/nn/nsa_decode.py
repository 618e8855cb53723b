"""The NSA layer for new tokens that continue the sequences of an :class:`NSACache`.

``q [B, t, N1, D]`` at positions ``past .. past + t - 1`` (their keys/values already appended) attends like the
full layer (:func:`attnops.native_sparse_attention`) at those positions, at a cost that does not grow with the
square of the context: the compression branch and the top-k scoring run :func:`attnops.nsa_compress_attention` over
the cached compressed blocks (``atten_mask`` / ``topk_mask`` rows at the tokens' positions), the selection branch
runs :func:`attnops.nsa_selected_attention_infer` over the pages (one request per new token, its KV length its
position + 1: causal; slices of requests on the CPU workers), the window branch :func:`attnops.flash_attention`
over the last ``window_size - 1 + t`` tokens (causal, bottom-right aligned).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._core.parallel import run_jobs
from ..ops.flash_attention import flash_attention
from ..ops.nsa.api import nsa_compress, nsa_compress_attention, nsa_selected_attention_infer
from ..ops.nsa.layer import causal_compressed_mask, compress_weights, forced_blocks, unused_future_blocks
from .nsa_cache import NSACache


def compress_pending(cache: NSACache, compress: str, weight_k: Tensor | None, weight_v: Tensor | None) -> None:
    """Compress the blocks completed by the latest tokens (``nsa_compress`` on their tokens) into ``cache``."""
    first, end = cache.pending_compression()
    if end == first:
        return
    block, stride = cache.compress_block_size, cache.compress_stride
    k, v = cache.rows(first * stride, (end - 1) * stride + block)  # [B, span, N2, D]
    wk, wv = compress_weights(compress, weight_k, weight_v, block, k.shape[2], k)
    span = k.shape[1]
    cum = [span * (b + 1) for b in range(cache.batch_size)]
    k_cmp, v_cmp = (nsa_compress(x.flatten(0, 1), w, block_size=block, stride=stride, actual_seq_len=cum)
                    for x, w in ((k, wk), (v, wv)))
    cache.add_compressed(k_cmp.unflatten(0, (cache.batch_size, -1)), v_cmp.unflatten(0, (cache.batch_size, -1)))


def cached_sparse_attention(cache: NSACache, q: Tensor, gates: Tensor, *, compress_block_size: int,
                            compress_stride: int, select_block_size: int, select_block_count: int, window_size: int,
                            local_blocks: int) -> Tensor:
    """``q [B, t, N1, D]``, ``gates [B, t, N1, 3]`` of the cache's last ``t`` tokens -> ``[B, t, N1, Dv]``."""
    b, t = q.shape[:2]
    length = cache.seq_len
    past = length - t
    pos = torch.arange(past, length, device=q.device)
    q_flat, g = q.flatten(0, 1), gates.flatten(0, 1)
    out = q.new_zeros(b * t, q.shape[2], cache.value_pages.shape[-1])
    if window_size > 0:
        k_win, v_win = cache.rows(max(0, past - (window_size - 1)), length)
        o_win = flash_attention(q, k_win, v_win, layout="BSND", causal=True, window_size=(window_size - 1, 0))
        out = out + g[..., 2].unsqueeze(-1) * o_win.flatten(0, 1)
    ls, m = select_block_size, select_block_size // compress_stride
    n_sel = max(select_block_count, (length - 1) // ls + 1)  # selection blocks scored: every token's own included
    rows = n_sel * m  # compressed rows passed: the complete blocks, then zeros (masked: they end after every token)
    k_cmp, v_cmp = cache.compressed(rows)
    o_cmp, topk, _, _ = nsa_compress_attention(
        q_flat, k_cmp.flatten(0, 1), v_cmp.flatten(0, 1), compress_block_size=compress_block_size,
        compress_stride=compress_stride, select_block_size=ls, select_block_count=select_block_count,
        atten_mask=causal_compressed_mask(pos.cpu(), rows, compress_block_size, compress_stride),
        topk_mask=forced_blocks(pos.cpu(), n_sel, ls, local_blocks), actual_seq_qlen=[t * (i + 1) for i in range(b)],
        actual_cmp_seq_kvlen=[rows * (i + 1) for i in range(b)])
    out = out + g[..., 0].unsqueeze(-1) * o_cmp
    idx = unused_future_blocks(topk, pos.repeat(b), ls).to(torch.int32)
    out = out + g[..., 1].unsqueeze(-1) * _selected(cache, q_flat, idx, (pos + 1).repeat(b).tolist(), t, ls)
    return out.unflatten(0, (b, t))


def _selected(cache: NSACache, q: Tensor, idx: Tensor, kv_lens: list[int], t: int, ls: int) -> Tensor:
    """The selection branch: one ``nsa_selected_attention_infer`` request per query row (``t`` rows per sequence),
    in slices run side by side on the single-threaded CPU workers (its small per-request operations would
    otherwise each pay an intra-op fork/join)."""
    out = q.new_empty(q.shape[0], q.shape[1], cache.value_pages.shape[-1])
    table = cache.block_table.to(q.device).repeat_interleave(t, 0)
    step = -(-q.shape[0] // (4 * torch.get_num_threads()))

    def job(start: int) -> None:
        rows = slice(start, start + step)
        out[rows] = nsa_selected_attention_infer(q[rows], cache.key_pages, cache.value_pages, idx[rows], table[rows],
                                                 kv_lens[rows], select_block_size=ls)
    run_jobs(job, range(0, q.shape[0], step), q.device)
    return out
