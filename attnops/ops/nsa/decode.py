"""NSA decoding over a paged KV cache (torch_npu's ``npu_nsa_compress_infer.cache``,
``npu_nsa_compress_attention_infer`` and ``npu_nsa_select_attention_infer``), pure PyTorch, as op-plugin's goldens
for the three ops define them.

One new query token per request (``query [B, N1, D]``); keys and values in caches ``[blocks, page, N2, D/Dv]``
read through ``block_table [B, maxBlocks]`` up to each request's KV length. The query is the newest token, so
nothing is masked. fp32 compute (fp64 for fp64 inputs), outputs in the query's dtype.

* Selected attention: per KV head, the blocks of ``select_block_size`` keys named by ``topk_indices [B, N2, count]``,
  taken in order up to the first ``-1`` (padding), each cut at the KV length, concatenated (a repeated index
  counts twice, as in training); one softmax over them. A head that selects nothing gets output 0.
* Compressed attention: softmax attention over the request's ``S2`` compressed keys, and the top-k selection
  blocks of the next step. With ``m = select_block_size / compress_stride`` and ``nn = compress_block_size /
  compress_stride``, block ``k`` scores ``sum_t times[t] * P[m*(k+1) - t]`` (``times[t]`` = the number of pairs
  ``a < m, c < nn`` with ``a + c = t``; columns outside ``[0, S2)`` and blocks ``k >= S2 - 1`` contribute 0),
  summed over the GQA group. ``ceil(((S2 - 1) * compress_stride + compress_block_size) / select_block_size)``
  blocks cover the request; the first and the last two are always chosen and come first, in that order, then the
  ``count - 3`` best others by descending score (ties to the lower index).
* Compression into a cache: a request whose length ``L`` completes a compression block (``L >= block`` and
  ``(L - block) % stride == 0``) writes ``sum_t weight[t, n] * kv[L - block + t, n]`` to row ``slot_mapping[b]``
  of ``cache [slots, N, D]``; the other rows are left as they are.

The per-request lengths come as a host list (validated here, as on the NPU) or as a tensor: a CPU tensor is read
like a list, a tensor on another device is read only by the kernels (never on the host: no synchronisation, and a
CUDA graph can capture the call with lengths that change between replays). The values of block tables, indices and
slot mappings are validated (:mod:`attnops._core.indices`) where they are CPU tensors, unless
``ATTNOPS_VALIDATE=0`` (``=1`` validates device tensors too, reading them back). Unvalidated bad values are masked
out on every path: a block id outside the cache contributes no keys (zero rows in a compression), a negative index
other than -1 or one past the length selects nothing, a slot outside the cache writes nothing; device lengths are
clamped to the block table's capacity.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._core.checks import Described, check_int, check_scale, check_tensor, int_list, require
from ..._core.indices import (PAD, all_valid_ids, check_block_table, check_index_rows, check_slots, entries_read,
                              validation_enabled)
from ..common.npu_rounding import cast_output, npu_rounding, rounded_softmax
from ..._core.parallel import serial_ops
from ..common.reference import compute_dtype
from . import cpu_decode
from .paged_kv import PagedKV, addressable, paged_rows
from .compress import NSA_DTYPES
from .compress_attention import nan_ranked

FORCED = 3  # compressed attention: the first and the last two selection blocks


def lengths_arg(name: str, lens) -> tuple[list[int] | None, Tensor | None]:
    """Per-request lengths as ``(host list, None)`` (a list, or a CPU tensor: read for free) or ``(None, tensor)``: a
    device tensor (read by the kernels only; the operator checks its shape and dtype), or any tensor under
    ``torch.compile`` (the traced graph passes it to the op, which reads it when it runs)."""
    if isinstance(lens, Tensor) and (lens.device.type != "cpu" or torch.compiler.is_compiling()):
        return None, lens
    return int_list(name, lens), None


def check_paged(query: Tensor, key: Tensor, value: Tensor, block_table: Tensor, *, scale_value: float, head_num: int,
                key_value_head_num: int, page_block_size: int, seq_lens, lens_name: str,
                lens_tensor: Tensor | None = None, precision: str = "exact") -> PagedKV:
    """Validate ``query [B, N1, D]``, caches ``[blocks, page_block_size, N2, D/Dv]``, the block table and the
    per-request KV lengths (``seq_lens``, a host list; or ``lens_tensor`` on the device, not read; ``lens_name``:
    the argument holding them). Values of the block table are checked when it and the lengths are on the host.
    ``precision="npu"``: the batch carries the NPU rounding of the query's dtype."""
    check_tensor("query", query, ndim=3, dtypes=NSA_DTYPES)
    rounding = npu_rounding(precision, query.dtype)
    batch, n1, d = query.shape
    require(head_num == n1, "head_num", f"the number of query heads ({n1})", head_num)
    n2 = check_int("key_value_head_num", key_value_head_num, lo=1)
    require(n1 % n2 == 0, "key_value_head_num", f"a divisor of head_num={n1}", n2)
    page = check_int("page_block_size", page_block_size, lo=1)
    for name, t in (("key", key), ("value", value)):
        check_tensor(name, t, ndim=4, dtypes=(query.dtype,))
        require(tuple(t.shape[1:3]) == (page, n2), name, f"a paged cache [blocks, page_block_size={page}, "
                f"key_value_head_num={n2}, D]", t)
    require(key.shape[-1] == d, "key", f"head dim D={d} like query", key)
    require(value.shape[0] == key.shape[0], "value", f"{key.shape[0]} blocks like key", value)
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32, torch.int64))
    require(block_table.shape[0] == batch, "block_table", f"[B={batch}, maxBlocks]", block_table)
    capacity = block_table.shape[1] * page
    if lens_tensor is not None:
        require(seq_lens is None, lens_name, "a list or a tensor, not both", Described("both"))
        check_tensor(lens_name, lens_tensor, shape=(batch,), dtypes=(torch.int32, torch.int64))
        require(lens_tensor.device == query.device, lens_name, f"a tensor on {query.device} like query", lens_tensor)
        return PagedKV(batch, n1, n2, value.shape[-1], None, check_scale("scale_value", scale_value), capacity,
                       rounding)
    lens = int_list(lens_name, seq_lens)
    require(lens is not None and len(lens) == batch, lens_name, f"B={batch} per-request KV lengths", lens)
    for b, n in enumerate(lens):
        require(0 <= n <= capacity, f"{lens_name}[{b}]", f"a length in [0, {capacity}] (the block_table's pages)", n)
    if validation_enabled(block_table.device) and not all_valid_ids(block_table, key.shape[0]):
        check_block_table(block_table, lens, page, key.shape[0], lengths_name=lens_name)  # entries past a length
    return PagedKV(batch, n1, n2, value.shape[-1], tuple(lens), check_scale("scale_value", scale_value), capacity,
                   rounding)


# ------------------------------------------------------------------------------------------ selected attention
def check_selected_topk(kv: PagedKV, topk_indices: Tensor, *, select_block_size: int, select_block_count: int) -> int:
    """Validate ``topk_indices [B, N2, count]`` (block indices within each request's length, -1 padding);
    returns the selection block size."""
    block = check_int("select_block_size", select_block_size, lo=1)
    count = check_int("select_block_count", select_block_count, lo=1)
    check_tensor("topk_indices", topk_indices, dtypes=(torch.int32, torch.int64), shape=(kv.batch, kv.n2, count))
    if kv.kv_lens is None or not validation_enabled(topk_indices.device):
        return block  # unvalidated: a kernel reads a negative index or one past the length as nothing
    topk = topk_indices.detach().to("cpu")
    if all_valid_ids(topk, -(-min(kv.kv_lens, default=0) // block)):  # the common case: no -1, all in length
        return block
    topk = topk.long()
    check_index_rows("topk_indices", topk, entries_read(topk, torch.tensor(count)),
                     torch.tensor(kv.kv_lens).view(-1, 1), unit=block, what="the request's KV length")
    return block


def _chosen(topk: Tensor) -> list[Tensor]:
    """Per KV head, the block indices before the first ``-1``."""
    out = []
    for row in topk.long():
        pad = (row == PAD).nonzero()
        out.append(row[:int(pad[0])] if len(pad) else row)
    return out


def selected_decode(kv: PagedKV, block: int, query: Tensor, key: Tensor, value: Tensor, topk_indices: Tensor,
                    block_table: Tensor, lens: Tensor | None = None) -> Tensor:
    """``attention_out [B, N1, Dv]`` (``lens``: the lengths when ``kv`` holds none)."""
    kv = kv.with_lengths(lens)
    if cpu_decode.unsupported(kv, query, key, value) is None:
        return cpu_decode.selected_attention(kv, query, key, value, block_table, topk_indices, block).to(query.dtype)
    acc = compute_dtype(query.dtype)
    out = torch.zeros(kv.batch, kv.n1, kv.dv, dtype=acc, device=query.device)
    g = kv.n1 // kv.n2
    for b in range(kv.batch):
        for n2, blocks in enumerate(_chosen(topk_indices[b])):
            pos = (blocks.view(-1, 1) * block + torch.arange(block, device=blocks.device)).flatten()
            pos = pos[(pos >= 0) & (pos < kv.kv_lens[b])]
            pos = pos[addressable(key, block_table[b], pos)]
            if pos.numel() == 0:
                continue
            heads = slice(n2 * g, (n2 + 1) * g)
            s = query[b, heads].to(acc) @ kv.rows(key, block_table[b], pos)[:, n2].to(acc).T * kv.scale
            v = kv.rows(value, block_table[b], pos)[:, n2].to(acc)
            if kv.rounding is None:
                out[b, heads] = torch.softmax(s, -1) @ v
            else:
                p, total = rounded_softmax(s, kv.rounding)
                out[b, heads] = (p @ v).div_(total)
    return cast_output(kv.rounding, out, query.dtype)


# ---------------------------------------------------------------------------------------- compressed attention
@dataclass(frozen=True)
class CompressSelection:
    block: int  # compress_block_size
    stride: int  # compress_stride
    select_block: int
    count: int

    def blocks(self, cmp_len: int) -> int:
        """Selection blocks covering a request with ``cmp_len`` compressed keys."""
        return -(-((cmp_len - 1) * self.stride + self.block) // self.select_block)


def check_compress_selection(kv: PagedKV, *, compress_block_size: int, compress_stride: int, select_block_size: int,
                             select_block_count: int) -> CompressSelection:
    """Validate the compression and selection sizes against every request's compressed length."""
    block = check_int("compress_block_size", compress_block_size, lo=1)
    stride = check_int("compress_stride", compress_stride, lo=1, hi=block)
    require(block % stride == 0, "compress_block_size", f"a multiple of compress_stride={stride}", block)
    sel = check_int("select_block_size", select_block_size, lo=block)
    require(sel % stride == 0, "select_block_size", f"a multiple of compress_stride={stride}", sel)
    spec = CompressSelection(block, stride, sel, check_int("select_block_count", select_block_count, lo=FORCED))
    for b, n in enumerate(kv.kv_lens or ()):
        require(n >= 1 and spec.count <= spec.blocks(n), f"actual_cmp_seq_kvlen[{b}]",
                f"at least 1 compressed key and select_block_count={spec.count} selection blocks "
                f"(ceil(((S2 - 1) * compress_stride + compress_block_size) / select_block_size))", n)
    return spec


@functools.lru_cache(maxsize=64)
def _tap_weights(m: int, nn: int, s2: int, n_blocks: int, dtype: torch.dtype) -> Tensor:
    """``times[t]`` of block ``k``'s column ``m * (k + 1) - t``, 0 where that column is outside ``[0, S2)`` or
    ``k >= S2 - 1``: ``[n_blocks, taps]``, the taps in reverse order (as :func:`_importance`'s windows hold them).
    Cached: the same for every step of a given length; never written to."""
    taps = torch.arange(m + nn - 1)
    times = torch.minimum(torch.minimum(taps + 1, torch.tensor(min(m, nn))), m + nn - 1 - taps)
    k = torch.arange(n_blocks).unsqueeze(1)
    cols = m * (k + 1) - taps  # [n_blocks, taps]
    valid = (cols >= 0) & (cols < s2) & (k < s2 - 1)
    return (times * valid).flip(-1).to(dtype)


def _importance(p: Tensor, sel: CompressSelection, n_blocks: int) -> Tensor:
    """Block scores ``[..., n_blocks]`` from the probabilities ``p [..., S2]`` (see the module docstring)."""
    m, nn, s2 = sel.select_block // sel.stride, sel.block // sel.stride, p.shape[-1]
    # p[..., cols.clamp(0, S2 - 1)] without a gather (slower): window k of p padded with its edge values holds
    # columns m * (k + 1) - taps in reverse order
    edges = F.pad(p.reshape(-1, 1, s2), (m + nn - 2, max(0, m * n_blocks - s2 + 1)), mode="replicate")
    windows = edges[..., m:].unfold(-1, m + nn - 1, m)[..., :n_blocks, :].view(*p.shape[:-1], n_blocks, -1)
    return (windows * _tap_weights(m, nn, s2, n_blocks, p.dtype)).sum(-1)


def compress_decode(kv: PagedKV, sel: CompressSelection, query: Tensor, key: Tensor, value: Tensor,
                    block_table: Tensor, lens: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(attention_out [B, N1, Dv], topk_indices [B, N2, count] int32)`` (``lens``: the lengths when ``kv`` holds
    none)."""
    kv = kv.with_lengths(lens)
    result = None
    if cpu_decode.unsupported(kv, query, key, value) is None:
        result = cpu_decode.compress_attention(kv, query, key, value, block_table)  # None: keys outside the cache
    out, probs = result or _compress_attention(kv, query, key, value, block_table)
    return cast_output(kv.rounding, out, query.dtype), _all_next_blocks(kv, sel, probs, query.device)


def _compress_attention(kv: PagedKV, query: Tensor, key: Tensor, value: Tensor,
                        block_table: Tensor) -> tuple[Tensor, list[Tensor]]:
    """``(attention_out [B, N1, Dv], per request the exact probabilities [N1, S2_b])`` in the compute dtype."""
    acc = compute_dtype(query.dtype)
    out = torch.zeros(kv.batch, kv.n1, kv.dv, dtype=acc, device=query.device)
    g = kv.n1 // kv.n2
    probs = []
    for b in range(kv.batch):
        pos = torch.arange(kv.kv_lens[b], device=query.device)
        keys, values = kv.rows(key, block_table[b], pos).to(acc), kv.rows(value, block_table[b], pos).to(acc)
        s = torch.einsum("hd,lhd->hl", query[b].to(acc), keys.repeat_interleave(g, 1)) * kv.scale
        s.masked_fill_(~addressable(key, block_table[b], pos), float("-inf"))
        p = torch.softmax(s, -1)  # [N1, S2]
        if kv.rounding is None:
            out[b] = torch.einsum("hl,lhd->hd", p, values.repeat_interleave(g, 1))
        else:  # the importance scores keep the exact p
            rounded, total = rounded_softmax(s, kv.rounding)
            out[b] = torch.einsum("hl,lhd->hd", rounded, values.repeat_interleave(g, 1)).div_(total)
        probs.append(p)
    return out, probs


@serial_ops()  # small tensor operations (serial_ops says why)
def _all_next_blocks(kv: PagedKV, sel: CompressSelection, probs: list[Tensor], device: torch.device) -> Tensor:
    """Every request's next selection blocks ``[B, N2, count]`` int32 from its probabilities ``probs[b] [N1, S2_b]``,
    the requests of one length together."""
    topk = torch.zeros(kv.batch, kv.n2, sel.count, dtype=torch.int32, device=device)
    by_length: dict[int, list[int]] = {}
    for b, p in enumerate(probs):
        by_length.setdefault(p.shape[-1], []).append(b)
    for rows in by_length.values():
        picked = _next_blocks(kv, sel, torch.stack([probs[b] for b in rows]), device)
        if len(rows) == kv.batch:
            return picked
        topk[rows] = picked
    return topk


def _next_blocks(kv: PagedKV, sel: CompressSelection, p: Tensor, device: torch.device) -> Tensor:
    """The next selection blocks ``[R, N2, count]`` of ``R`` requests of one length from their probabilities
    ``p [R, N1, S2]``: the forced ones, then the best others by descending score."""
    n_blocks = sel.blocks(p.shape[-1])
    grouped = p.view(p.shape[0], kv.n2, -1, p.shape[-1]).sum(2)  # the scores are linear in p: the group first
    score = _importance(grouped, sel, n_blocks)  # [R, N2, n_blocks]
    middle = torch.sort(nan_ranked(score[..., 1:n_blocks - 2]), dim=-1, descending=True, stable=True).indices + 1
    forced = torch.tensor([0, n_blocks - 2, n_blocks - 1], device=device).expand(p.shape[0], kv.n2, FORCED)
    return torch.cat([forced, middle[..., :sel.count - FORCED]], -1).to(torch.int32)


# ------------------------------------------------------------------------------------------------- compression
def check_compress_cache(input: Tensor, weight: Tensor, slot_mapping: Tensor, block_table: Tensor, cache: Tensor, *,
                         compress_block_size: int, compress_stride: int, page_block_size: int, actual_seq_len,
                         lens_tensor: Tensor | None = None) -> tuple[list[int] | None, int, int]:
    """Validate a compression into ``cache``; returns the lengths (None when ``lens_tensor`` holds them on the
    device), the block size and the stride. The values of the block table and the slot mapping are checked when
    they and the lengths are on the host."""
    check_tensor("input", input, ndim=4, dtypes=NSA_DTYPES)
    page, heads, d = input.shape[1:]
    block = check_int("compress_block_size", compress_block_size, lo=1)
    stride = check_int("compress_stride", compress_stride, lo=1, hi=block)
    require(page_block_size == page, "page_block_size", f"the page size of input [blocks, page={page}, N, D]",
            page_block_size)
    check_tensor("weight", weight, shape=(block, heads), dtypes=NSA_DTYPES)
    check_tensor("cache", cache, ndim=3, dtypes=(input.dtype,))
    require(tuple(cache.shape[1:]) == (heads, d), "cache", f"[slots, N={heads}, D={d}]", cache)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int32, torch.int64))
    batch = slot_mapping.shape[0]
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32, torch.int64))
    require(block_table.shape[0] == batch, "block_table", f"[B={batch}, maxBlocks] (B = slot_mapping's length)",
            block_table)
    if lens_tensor is not None:
        require(actual_seq_len is None, "actual_seq_len", "a list or a tensor, not both", Described("both"))
        check_tensor("actual_seq_len", lens_tensor, shape=(batch,), dtypes=(torch.int32, torch.int64))
        require(lens_tensor.device == input.device, "actual_seq_len", f"a tensor on {input.device} like input",
                lens_tensor)
        return None, block, stride
    lens = int_list("actual_seq_len", actual_seq_len)
    require(lens is not None and len(lens) == batch, "actual_seq_len", f"B={batch} per-request KV lengths", lens)
    for b, n in enumerate(lens):
        require(0 <= n <= block_table.shape[1] * page, f"actual_seq_len[{b}]",
                f"a length in [0, {block_table.shape[1] * page}] (the block_table's pages)", n)
    if validation_enabled(slot_mapping.device):
        # the table maps every page of a request's keys, as the decode attention reads it, though a compression
        # reads only the last compress_block_size keys
        check_block_table(block_table, lens, page, input.shape[0], lengths_name="actual_seq_len")
        completes = torch.tensor([_completes(n, block, stride) for n in lens], dtype=torch.bool)
        check_slots("slot_mapping", torch.where(completes, slot_mapping.detach().cpu().long(), PAD), cache.shape[0],
                    what="the cache's rows")
    return lens, block, stride


def _completes(length: int, block: int, stride: int) -> bool:
    return length >= block and (length - block) % stride == 0


def compress_into_cache(input: Tensor, weight: Tensor, slot_mapping: Tensor, block_table: Tensor, cache: Tensor,
                        lens: list[int] | None, block: int, stride: int, lens_tensor: Tensor | None = None) -> None:
    """Write the compressed last block of every request that completes one into ``cache`` (in place; fp32, fp64
    for fp64 inputs; ``lens_tensor``: the lengths when ``lens`` is None)."""
    acc = compute_dtype(input.dtype)
    w = weight.to(acc).unsqueeze(-1)
    for b, n in enumerate(lens if lens is not None else lens_tensor.tolist()):
        if _completes(n, block, stride):
            slot = int(slot_mapping[b])
            if 0 <= slot < cache.shape[0]:  # an unvalidated slot outside the cache writes nothing
                rows = paged_rows(input, block_table[b], torch.arange(n - block, n, device=input.device))
                cache[slot] = (rows.to(acc) * w).sum(0).to(cache.dtype)
