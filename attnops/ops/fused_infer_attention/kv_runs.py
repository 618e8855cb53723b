"""Where an FIA call's keys and values are read: the paged cache and its block table, the shared prefix, and the
per-batch KV runs (:class:`KVSegment`) of the normal form."""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from ..._core.checks import Described, check_int, check_tensor, int_list, require
from ..._core.indices import check_block_table, validation_enabled
from .paged import dense_segment, nz_width, page_segments
from .inputs import I32, Inputs, kv_token_view, kv_width
from .lengths import Lengths


def paged_kv(g: Inputs, lens: Lengths, block_table, block_size, strict) -> tuple[Lengths, int, int]:
    """Validate the caches and block table; returns the lengths with ``kv_cols`` set, the block size and blocknum."""
    cache = g.keys[0]
    w = kv_width(g)
    check_tensor("key", cache, ndim=(3, 4, 5))
    bs_dim = cache.shape[1] if cache.dim() == 3 else cache.shape[cache.dim() - 2]
    forms = (f"a paged cache (blocknum, blocksize, H={g.n2}*{w}), NZ (blocknum, KV_N={g.n2}, D/x, blocksize, x) or, "
             f"with a BNSD/TND query, (blocknum, KV_N={g.n2}, blocksize, D={w})")
    if not strict:
        forms += f", or flash-attn/vLLM's (blocknum, blocksize, KV_N={g.n2}, D={w})"
    hint = ("a flash-attn/vLLM cache (blocknum, blocksize, KV_N, D) is the (blocknum, blocksize, H) cache "
            ".flatten(2) gives")
    if cache.dim() == 3:
        require(cache.shape[2] == g.n2 * w, "key", forms, cache, hint)
    elif cache.dim() == 5:
        _check_nz(g, cache, "key", g.d)
        _check_nz(g, g.values[0], "value", g.dv)
    else:
        require(cache.shape[1] == g.n2 and cache.shape[3] == w and g.in_layout in ("BNSD", "TND"), "key", forms,
                cache, hint)
    if strict or block_size not in (None, 0):
        check_int("block_size", block_size, lo=1)
        require(block_size == bs_dim, "block_size", f"the cache's block size ({bs_dim})", block_size)
    block_size = bs_dim
    require(block_size > 0, "key", "a cache with a non-zero block size", cache)
    check_tensor("block_table", block_table, ndim=2, dtypes=(I32,) if strict else (I32, torch.int64))
    require(block_table.shape[0] == len(lens.kv_lens), "block_table", f"[B={len(lens.kv_lens)}, maxBlocks]",
            block_table)
    num_blocks = cache.shape[0]
    if lens.kv_lengths is not None:  # device lengths: every batch may use the whole table
        capacity = block_table.shape[1] * block_size
        return (dataclasses.replace(lens, kv_lens=[capacity] * len(lens.kv_lens), kv_cols=capacity), block_size,
                num_blocks)
    need = [math.ceil(n / block_size) for n in lens.kv_lens]
    max_blocks = max(need, default=0)
    require(block_table.shape[1] >= max_blocks, "block_table", f"at least maxBlockNumPerSeq={max_blocks} columns "
            f"(blocks of the longest actual_seq_lengths_kv)", block_table)
    require(sum(need) <= num_blocks, "key", f"at least {sum(need)} blocks (sum over batches of the blocks of "
            "actual_seq_lengths_kv)", cache)
    if validation_enabled(block_table.device):  # else ids outside the cache mask their keys out
        check_block_table(block_table, lens.kv_lens, block_size, num_blocks, lengths_name="actual_seq_lengths_kv")
    return dataclasses.replace(lens, kv_cols=max_blocks * block_size), block_size, num_blocks


def _check_nz(g: Inputs, cache: Tensor, name: str, d: int) -> None:
    """An NZ cache ``(blocknum, KV_N, D/x, blocksize, x)``, x = 32 bytes of the dtype (16 fp16/bf16, 32 int8)."""
    require(not g.int4, name, "an fp16/bf16/int8 NZ cache (int4 NZ caches are not supported)", cache)
    x = nz_width(cache.dtype)
    require(cache.shape[1] == g.n2 and cache.shape[4] == x and cache.shape[2] * x == d, name,
            f"an NZ (blocknum, KV_N={g.n2}, D/{x}, blocksize, {x}) cache with D={d} (a multiple of {x})", cache)


def shared_prefix(g: Inputs, key_shared_prefix, value_shared_prefix, actual_shared_prefix_len):
    """Validated prefix token views ``[P, N2, Dk]`` and the used length L (or None)."""
    if key_shared_prefix is None and value_shared_prefix is None:
        require(actual_shared_prefix_len is None, "actual_shared_prefix_len", "None without a shared prefix",
                actual_shared_prefix_len)
        return None
    require(key_shared_prefix is not None and value_shared_prefix is not None, "value_shared_prefix",
            "key_shared_prefix and value_shared_prefix together", Described("only one of them"))
    require(g.in_layout != "TND", "key_shared_prefix", "None for layout TND", key_shared_prefix)
    views = []
    for name, x in (("key_shared_prefix", key_shared_prefix), ("value_shared_prefix", value_shared_prefix)):
        check_tensor(name, x, dtypes=(g.keys[0].dtype,), ndim=g.keys[0].dim())
        tokens = kv_token_view(g, x, name, value=name.startswith("value"))
        require(tokens.shape[0] == 1, name, "batch size 1", x)
        views.append(tokens[0])
    kp, vp = views
    require(kp.shape[0] == vp.shape[0], "value_shared_prefix", f"the S of key_shared_prefix ({kp.shape[0]})",
            value_shared_prefix)
    lens = int_list("actual_shared_prefix_len", actual_shared_prefix_len)
    if lens is None:
        return kp, vp, kp.shape[0]
    require(len(lens) == 1 and 0 <= lens[0] <= kp.shape[0], "actual_shared_prefix_len",
            f"one value in [0, {kp.shape[0]}] (the prefix S)", lens)
    return kp, vp, lens[0]


def kv_segments(g: Inputs, lens: Lengths, kv_tokens, value_tokens, prefix, block_table, block_size) -> tuple:
    """Per batch, the effective KV runs: prefix rows, then the batch's keys."""
    out = []
    plen = 0 if prefix is None else prefix[2]
    table = block_table.tolist() if g.kind == "paged" else None
    for b, n in enumerate(lens.kv_lens):
        segs = [] if not plen else [dense_segment(prefix[0], prefix[1], 0, 0, plen, 0)]
        if g.kind == "paged" and n:
            blocks = table[b][:math.ceil(n / block_size)]
            segs += page_segments(g.keys[0], g.values[0], blocks, n, block_size, g.n2)
        elif n:
            if g.in_layout == "TND":
                kt, vt = kv_tokens[0], value_tokens[0]
            else:
                i = b if g.kind == "list" else 0
                kt = kv_tokens[i][0 if g.kind == "list" else b]
                vt = value_tokens[i][0 if g.kind == "list" else b]
            # per-token position: prefix first, then the physical (left-padded) key row; TND: the batch-local row
            pos = plen + (0 if g.in_layout == "TND" else lens.kv_starts[b])
            segs.append(dense_segment(kt, vt, plen, lens.kv_starts[b], n, pos))
        out.append(tuple(segs))
    return tuple(out)
