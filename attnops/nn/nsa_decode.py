"""The NSA layer for new tokens that continue the sequences of an :class:`NSACache`.

``q [B, t, N1, D]`` at positions ``pos [B, t]`` (their keys/values already appended) attends like the full layer
(:func:`attnops.native_sparse_attention`) at those positions, at a cost that does not grow with the square of the
context: the compression branch and the top-k scoring run :func:`attnops.nsa_compress_attention` over the cached
compressed blocks (``atten_mask`` / ``topk_mask`` rows at the tokens' positions), the selection branch runs
:func:`attnops.nsa_selected_attention_infer` over the pages (one request per new token, its KV length its position +
1: causal; slices of requests on the CPU workers), the window branch :func:`attnops.flash_attention` over the
``window_size - 1 + t`` cached tokens ending at the last new one (an explicit mask hides positions before 0).

Shapes depend on ``t`` and the cache's allocation only, never on its length: the positions are read from
``cache.lengths`` on the device, so a step reads nothing back and, with preallocated storage (``max_seq_len``), can
be captured in a CUDA graph and replayed for the following tokens.
"""
from __future__ import annotations


import torch
from torch import Tensor

from .._core.indices import validation_enabled
from .._core.parallel import run_jobs
from ..ops.flash_attention import flash_attention
from ..ops.nsa import op as nsa_op
from ..ops.nsa.api import nsa_compress, nsa_compress_attention, nsa_selected_attention_infer
from ..ops.nsa.layer import compress_weights, gated_sum, unused_future_blocks
from .nsa_cache import NSACache
from .nsa_step import DecodeStep, compressed_masks, window_rows


def compress_pending(cache: NSACache, compress: str, weight_k: Tensor | None, weight_v: Tensor | None) -> None:
    """Compress the blocks completed by the cached tokens and not compressed yet (``nsa_compress`` on their tokens,
    host-known lengths: a prefill or a chunk of several tokens) into ``cache``."""
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


def compress_new(cache: NSACache, step: DecodeStep, compress: str, weight_k: Tensor | None,
                 weight_v: Tensor | None) -> None:
    """Compress the blocks the step's new tokens complete (``nsa_compress_infer`` per token: the token at position
    ``p`` completes block ``(p + 1 - block) / stride`` when that is a whole number >= 0), written into the cache's
    compressed rows the step looked up, on the device (nothing read back)."""
    block, stride = cache.compress_block_size, cache.compress_stride
    b, t = step.positions.shape
    wk, wv = compress_weights(compress, weight_k, weight_v, block, cache.key_pages.shape[2], cache.key_pages)
    table = cache.block_table[:, None].expand(b, t, -1).flatten(0, 1)
    for pages, w, store in ((cache.key_pages, wk, cache.compressed_keys), (cache.value_pages, wv,
                                                                            cache.compressed_values)):
        nsa_op.nsa_compress_infer(pages, w, step.compressed_slots, table, store.flatten(0, 1), block, stride,
                                  cache.page_size, None, step.ends)
    cache.compressed_len = cache.pending_compression()[1]


def cached_sparse_attention(cache: NSACache, q: Tensor, gates: Tensor, step: DecodeStep, *, compress_block_size: int,
                            compress_stride: int, select_block_size: int, select_block_count: int, window_size: int,
                            local_blocks: int) -> Tensor:
    """``q [B, t, N1, D]``, ``gates [B, t, N1, 3]`` of the step's tokens (the cache's last) -> ``[B, t, N1, Dv]``."""
    b, t = q.shape[:2]
    q_flat, g = q.flatten(0, 1), gates.flatten(0, 1)
    outs = {}  # by gate column
    if window_size > 0:
        outs[2] = _window(cache, q, step).flatten(0, 1)
    ls, m = select_block_size, select_block_size // compress_stride
    rows = cache.compressed_rows()  # the complete blocks, then rows the causal mask hides
    if t > 1 and not _capturing(q):  # a chunk: the rules from its first position, as the host counts it
        masks = dict(causal=True, local_blocks=local_blocks, position_offset=cache.seq_len - t)
    else:  # a decoding step (capturable): the masks of the positions the device holds
        atten_mask, topk_mask = compressed_masks(step, rows, rows // m, compress_block_size, compress_stride, ls)
        masks = dict(atten_mask=atten_mask, topk_mask=topk_mask)
    o_cmp, topk, _, _ = nsa_compress_attention(
        q_flat, cache.compressed_keys[:, :rows].flatten(0, 1), cache.compressed_values[:, :rows].flatten(0, 1),
        compress_block_size=compress_block_size, compress_stride=compress_stride, select_block_size=ls,
        select_block_count=select_block_count, actual_seq_qlen=[t * (i + 1) for i in range(b)],
        actual_cmp_seq_kvlen=[rows * (i + 1) for i in range(b)], **masks)
    outs[0] = o_cmp
    if validation_enabled(q.device):  # the operator checks each index against the KV length: mark them unused
        topk = unused_future_blocks(topk, step.positions.flatten(), ls)
    # unchecked, the blocks after a token's own (last in the top-k order) select nothing as they are: every key of
    # theirs is at or past the token's KV length, where the selected attention cuts each block
    outs[1] = _selected(cache, q_flat, topk, step.ends, t, ls)
    return gated_sum(outs, [g[..., i] for i in range(3)], g).unflatten(0, (b, t))


def _capturing(q: Tensor) -> bool:
    """Whether a CUDA graph is being captured on ``q``'s device (a host position would be frozen into it)."""
    return q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _window(cache: NSACache, q: Tensor, step: DecodeStep) -> Tensor:
    """The window branch ``[B, t, N1, Dv]``: the ``window - 1 + t`` cached tokens ending at the last new one
    (positions clamped at 0), attended causally within ``window`` tokens; positions before 0 are masked."""
    slots, mask = window_rows(step)
    keys = cache.key_pages.view(-1, *cache.key_pages.shape[2:]).index_select(0, slots.flatten())
    values = cache.value_pages.view(-1, *cache.value_pages.shape[2:]).index_select(0, slots.flatten())
    return flash_attention(q, keys.unflatten(0, slots.shape), values.unflatten(0, slots.shape), layout="BSND",
                           atten_mask=mask, sparse_mode=0)


def _selected(cache: NSACache, q: Tensor, idx: Tensor, kv_lens: Tensor, t: int, ls: int) -> Tensor:
    """The selection branch: one ``nsa_selected_attention_infer`` request per query row (``t`` rows per sequence,
    KV lengths ``kv_lens`` on the device); on the CPU in slices run side by side on the single-threaded workers (its
    small per-request operations would otherwise each pay an intra-op fork/join)."""
    table = cache.block_table[:, None].expand(-1, t, -1).flatten(0, 1)

    def attend(rows: slice) -> Tensor:
        return nsa_selected_attention_infer(q[rows], cache.key_pages, cache.value_pages, idx[rows], table[rows],
                                            kv_lens[rows], select_block_size=ls)
    if q.device.type != "cpu" or torch.compiler.is_compiling():  # one call (compiled: no worker threads to trace)
        return attend(slice(None))
    out = q.new_empty(q.shape[0], q.shape[1], cache.value_pages.shape[-1])
    step = -(-q.shape[0] // (4 * torch.get_num_threads()))

    def job(start: int) -> None:
        rows = slice(start, start + step)
        out[rows] = attend(rows)
    run_jobs(job, range(0, q.shape[0], step), q.device)
    return out
