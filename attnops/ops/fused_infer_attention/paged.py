"""Paged KV: runs of KV tokens read in place (:class:`KVSegment`), the page gather of a block table, and
:class:`PagedKVCache`, a small cache that allocates blocks, appends tokens and hands out block tables.

Cache layouts (``cann_semantics.md`` §6.8): ``BnBsH`` ``[blocknum, blocksize, N2*D]``, ``BnNBsD``
``[blocknum, N2, blocksize, D]`` and ``NZ`` ``[blocknum, N2, D/x, blocksize, x]`` (x = 32 bytes: 16 fp16/bf16
values, 32 int8; element ``(n, t, d)`` of a block at ``[n, d // x, t, d % x]``), and outside the aclnn dialect
flash-attn/vLLM's ``[blocknum, blocksize, N2, D]``, read as its ``BnBsH`` view. Logical token ``t`` of batch
``b`` is in block ``block_table[b, t // blocksize]`` at offset ``t % blocksize``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..._core.checks import Described, check_choice, check_int, check_tensor, fail, require
from ..._core.indices import valid_ids
from ..._core.masks import MaskSpec
from .quant import pack_int4, quantize_int8

CACHE_LAYOUTS = ("BnBsH", "BnNBsD", "NZ")


def nz_width(dtype: torch.dtype) -> int:
    """x of an NZ cache: the values in 32 bytes."""
    return 32 // dtype.itemsize


def flash_attn_cache_views(key, value, options: dict) -> tuple:
    """``key``/``value`` paged caches in flash-attn/vLLM's ``[blocknum, blocksize, N2, D]`` layout as the
    ``[blocknum, blocksize, N2*D]`` views CANN reads (``.flatten(2)``, no copy for a cache with contiguous heads);
    anything else as it is (the aclnn dialect, ``strict``, takes CANN's layouts only). A 4-D cache that is also
    CANN's ``[blocknum, N2, blocksize, D]`` (``blocksize = N2``) with a BNSD/TND query is read as CANN's."""
    n2 = options.get("num_key_value_heads") or options.get("num_heads")
    layout = options.get("input_layout")
    if (options.get("block_table") is None or options.get("strict") or not isinstance(n2, int)
            or not isinstance(layout, str) or not all(isinstance(x, Tensor) and x.dim() == 4 for x in (key, value))):
        return key, value
    cann = key.shape[1] == n2 and layout.upper().split("_")[0] in ("BNSD", "TND")
    if cann or key.shape[2] != n2 or value.shape[2] != n2:
        return key, value
    return key.flatten(2), value.flatten(2)


@dataclass(frozen=True)
class KVSegment:
    """A run of one batch's effective KV tokens, read in place.

    ``key`` ``[R, N2, L, Dk]`` and ``value`` ``[R, N2, L, Dv']`` (any strides; int4 packed ``D/8``): token
    ``r*L + l`` is effective column ``start + r*L + l`` and has per-token antiquant position ``pos + r*L + l``;
    paged runs start at physical ``block`` (R consecutive blocks).
    """

    start: int
    key: Tensor
    value: Tensor
    pos: int
    block: int | None = None

    @property
    def length(self) -> int:
        return self.key.shape[0] * self.key.shape[2]


def dense_segment(key_tokens: Tensor, value_tokens: Tensor, start: int, first: int, length: int,
                  pos: int) -> KVSegment:
    """Rows ``[first, first + length)`` of ``[S, N2, D]`` token views as one run at effective column ``start``."""
    rows = slice(first, first + length)
    return KVSegment(start, key_tokens[rows].transpose(0, 1)[None], value_tokens[rows].transpose(0, 1)[None], pos)


def page_segments(key_cache: Tensor, value_cache: Tensor, blocks: list[int], length: int, block_size: int,
                  kv_heads: int) -> list[KVSegment]:
    """The first ``length`` tokens of the pages ``blocks`` as runs of consecutive physical blocks (no copy but
    for NZ caches, copied one run at a time). A block id outside the cache (an unvalidated table) reads block 0 in
    its place; :func:`unaddressable_columns` masks those keys out."""
    segments, t = [], 0
    num_blocks = key_cache.shape[0]
    while t < length:
        i = t // block_size
        first = blocks[i] if 0 <= blocks[i] < num_blocks else 0
        runs = 1  # extend over full, physically consecutive blocks
        while (t + (runs + 1) * block_size <= length and blocks[i + runs] == first + runs
               and first + runs < num_blocks):
            runs += 1
        tokens = min(block_size, length - t)
        k, v = (_blocks(c, first, runs, tokens, kv_heads) for c in (key_cache, value_cache))
        segments.append(KVSegment(t, k, v, t, first))
        t += runs * tokens
    return segments


def _blocks(cache: Tensor, first: int, runs: int, tokens: int, kv_heads: int) -> Tensor:
    """``[runs, N2, tokens, D]`` view of blocks ``first .. first + runs`` of a cache in any layout (NZ: a copy)."""
    if cache.dim() == 5:  # NZ
        return cache[first:first + runs, :, :, :tokens].permute(0, 1, 3, 2, 4).flatten(-2)
    offset = cache.storage_offset() + first * cache.stride(0)  # one view op per run: pages are many
    if cache.dim() == 4:  # BnNBsD
        return cache.as_strided((runs, cache.shape[1], tokens, cache.shape[3]), cache.stride(), offset)
    s0, s1, s2 = cache.stride()  # BnBsH
    d = cache.shape[2] // kv_heads
    return cache.as_strided((runs, kv_heads, tokens, d), (s0, d * s2, s1, s2), offset)


def unaddressable_columns(block_table: Tensor, lengths: list[int], block_size: int, num_blocks: int,
                          prefix_len: int) -> Tensor | None:
    """Bool ``[B, prefix_len + max(lengths)]``: the effective columns (the shared prefix first) of the tokens whose
    block id is outside the cache, or None when every block in use is in it (a pass over the pages, then, where one
    is outside, one over the tokens)."""
    lens = torch.tensor(lengths, dtype=torch.int64)
    width = max(lengths, default=0)
    if width == 0:
        return None
    table = block_table.to(torch.int64)
    in_use = torch.arange(table.shape[1]) < -(-lens[:, None] // block_size)  # pages first: the common case, every
    if not bool((~valid_ids(table, num_blocks) & in_use).any()):  # page valid, needs no token-long tensors
        return None
    pos = torch.arange(width)
    blocks = table[:, (pos // block_size).clamp_max(table.shape[1] - 1)]
    bad = ~valid_ids(blocks, num_blocks) & (pos < lens[:, None])
    return torch.nn.functional.pad(bad, (prefix_len, 0))


def with_masked_columns(spec: MaskSpec, columns: Tensor, rows: int) -> MaskSpec:
    """``spec`` with the columns ``columns [B, C]`` (True) masked for every row and head, merged into its explicit
    mask (a broadcast view when it has none)."""
    rows = max(rows, 1)
    if spec.explicit is None:
        explicit = columns[:, None, None, :].expand(columns.shape[0], 1, rows, columns.shape[1])
    else:
        old = spec.explicit
        width = max(old.shape[-1], columns.shape[1])
        cols = torch.nn.functional.pad(columns, (0, width - columns.shape[1]))
        old = torch.nn.functional.pad(old, (0, width - old.shape[-1]), value=False)
        explicit = old | cols[:, None, None, :]
    return dataclasses.replace(spec, explicit=explicit)


class PagedKVCache:
    """A paged KV cache for FIA: fixed-size blocks, per-sequence block lists, optional int8/int4 quantization.

    ``key_cache``/``value_cache`` have the FIA cache layout ``layout``: "BnNBsD" ``[num_blocks, N2, block_size,
    D]``, "BnBsH" ``[num_blocks, block_size, N2*D]`` or "NZ" ``[num_blocks, N2, D/x, block_size, x]`` (x = 16 for
    fp16/bf16, 32 for int8, 8 for fp32); ``value_head_dim`` (default ``head_dim``) is the values' D. With
    ``quant="int8"`` or ``"int4"`` (int4 packed 8 per int32) :meth:`append` quantizes each token per KV head,
    symmetrically: ``x_q = round(x / s)``, ``s = max|x| / 127`` (int4: ``/ 7``), and keeps ``s`` in
    ``key_scale``/``value_scale`` ``[num_blocks, N2, block_size]`` (fp32): the page-managed per-token+head antiquant
    (mode 5). :meth:`attention_kwargs` returns the FIA keywords.

    Example::

        >>> cache = PagedKVCache(64, 16, num_kv_heads=2, head_dim=64)
        >>> seqs = [cache.new_sequence() for _ in range(2)]
        >>> cache.append(seqs[0], torch.randn(40, 2, 64), torch.randn(40, 2, 64))   # [T, N2, D]
        >>> cache.append(seqs[1], torch.randn(7, 2, 64), torch.randn(7, 2, 64))
        >>> out = attnops.fused_infer_attention(torch.randn(2, 4, 1, 64), cache.key_cache, cache.value_cache,
        ...                                     num_key_value_heads=2, **cache.attention_kwargs(seqs))  # decode
        >>> out.shape
        torch.Size([2, 4, 1, 64])
    """

    def __init__(self, num_blocks: int, block_size: int, *, num_kv_heads: int, head_dim: int,
                 value_head_dim: int | None = None, dtype: torch.dtype = torch.float32, layout: str = "BnNBsD",
                 quant: str | None = None, device=None):
        check_int("num_blocks", num_blocks, lo=1)
        check_int("block_size", block_size, lo=1)
        check_int("num_kv_heads", num_kv_heads, lo=1)
        check_int("head_dim", head_dim, lo=1)
        value_head_dim = head_dim if value_head_dim is None else check_int("value_head_dim", value_head_dim, lo=1)
        check_choice("layout", layout, CACHE_LAYOUTS)
        check_choice("quant", quant, (None, "int8", "int4"))
        require(quant != "int4" or layout != "NZ", "quant", "None or int8 for an NZ cache", quant)
        x = nz_width(torch.int8 if quant == "int8" else dtype)
        for name, d in (("head_dim", head_dim), ("value_head_dim", value_head_dim)):
            require(quant != "int4" or d % 8 == 0, name, "a multiple of 8 for int4 (8 values per int32)", d)
            require(layout != "NZ" or d % x == 0, name, f"a multiple of {x} for an NZ cache of this dtype", d)
        self.block_size, self.num_kv_heads, self.head_dim, self.value_head_dim, self.layout, self.quant = (
            block_size, num_kv_heads, head_dim, value_head_dim, layout, quant)
        self.key_cache, self.value_cache = (self._storage(num_blocks, d, dtype, device)
                                            for d in (head_dim, value_head_dim))
        self.key_scale = self.value_scale = None
        if quant is not None:
            self.key_scale = torch.ones(num_blocks, num_kv_heads, block_size, device=device)
            self.value_scale = torch.ones(num_blocks, num_kv_heads, block_size, device=device)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._blocks: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._next_id = 0

    def _storage(self, num_blocks: int, head_dim: int, dtype: torch.dtype, device) -> Tensor:
        """A zero cache for heads of ``head_dim`` values in this cache's layout and storage dtype."""
        store_dtype, width = {None: (dtype, head_dim), "int8": (torch.int8, head_dim),
                              "int4": (torch.int32, head_dim // 8)}[self.quant]
        n2, bs = self.num_kv_heads, self.block_size
        shape = {"BnNBsD": (num_blocks, n2, bs, width), "BnBsH": (num_blocks, bs, n2 * width),
                 "NZ": (num_blocks, n2, width // nz_width(store_dtype), bs, nz_width(store_dtype))}[self.layout]
        return torch.zeros(shape, dtype=store_dtype, device=device)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def new_sequence(self) -> int:
        """Register an empty sequence; returns its id."""
        seq, self._next_id = self._next_id, self._next_id + 1
        self._blocks[seq], self._lens[seq] = [], 0
        return seq

    def free(self, seq: int) -> None:
        """Release a sequence and its blocks."""
        self._check_seq(seq)
        self._free.extend(reversed(self._blocks.pop(seq)))
        del self._lens[seq]

    def append(self, seq: int, key: Tensor, value: Tensor) -> None:
        """Append keys ``[T, N2, D]`` and values ``[T, N2, Dv]`` (float) to sequence ``seq``, allocating blocks as
        needed."""
        self._check_seq(seq)
        check_tensor("key", key, shape=(None, self.num_kv_heads, self.head_dim))
        check_tensor("value", value, shape=(key.shape[0], self.num_kv_heads, self.value_head_dim))
        start, count = self._lens[seq], key.shape[0]
        need = math.ceil((start + count) / self.block_size) - len(self._blocks[seq])
        require(need <= len(self._free), "key", f"at most {len(self._free)} more blocks of {self.block_size} tokens "
                "(free blocks of the cache)", Described(f"{count} tokens needing {need} blocks"))
        self._blocks[seq] += [self._free.pop() for _ in range(need)]
        for x, cache, scales in ((key, self.key_cache, self.key_scale), (value, self.value_cache, self.value_scale)):
            data, s = self._encode(x)
            for t0, t1 in self._chunks(start, count):
                blk, off = self._blocks[seq][t0 // self.block_size], t0 % self.block_size
                rows = slice(t0 - start, t1 - start)
                self._write(cache, blk, off, data[rows])
                if scales is not None:
                    scales[blk, :, off:off + t1 - t0] = s[rows].transpose(0, 1)
        self._lens[seq] = start + count

    def block_table(self, seqs=None) -> Tensor:
        """int32 ``[B, max blocks]`` of the sequences (all, in creation order, by default), padded with -1."""
        seqs = self._seqs(seqs)
        width = max((len(self._blocks[s]) for s in seqs), default=0)
        table = torch.full((len(seqs), max(width, 1)), -1, dtype=torch.int32)
        for i, s in enumerate(seqs):
            table[i, :len(self._blocks[s])] = torch.tensor(self._blocks[s], dtype=torch.int32)
        return table

    def seq_lens(self, seqs=None) -> list[int]:
        """Token counts of the sequences (``actual_seq_lengths_kv``)."""
        return [self._lens[s] for s in self._seqs(seqs)]

    def attention_kwargs(self, seqs=None) -> dict:
        """``block_table``, ``actual_seq_lengths_kv``, ``block_size`` and, for quantized caches, the page-managed
        antiquant parameters: the keywords of :func:`attnops.fused_infer_attention` for these sequences."""
        kw = dict(block_table=self.block_table(seqs), actual_seq_lengths_kv=self.seq_lens(seqs),
                  block_size=self.block_size)
        if self.quant is not None:
            kw.update(key_antiquant_scale=self.key_scale, value_antiquant_scale=self.value_scale,
                      key_antiquant_mode=5, value_antiquant_mode=5)
        return kw

    def _check_seq(self, seq) -> None:
        if seq not in self._lens:
            fail("seq", f"a sequence id of this cache (one of {sorted(self._lens)})", seq)

    def _seqs(self, seqs) -> list[int]:
        seqs = sorted(self._lens) if seqs is None else list(seqs)
        for s in seqs:
            self._check_seq(s)
        return seqs

    def _chunks(self, start: int, count: int):
        """``(t0, t1)`` token ranges of one block each."""
        t = start
        while t < start + count:
            t1 = min(start + count, (t // self.block_size + 1) * self.block_size)
            yield t, t1
            t = t1

    def _encode(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """Tokens ``[T, N2, D]`` in the cache's storage form (and the per-token, per-head scales ``[T, N2]``)."""
        if self.quant is None:
            return x.to(self.key_cache.dtype), None
        qmax = 127.0 if self.quant == "int8" else 7.0
        amax = x.float().abs().amax(-1)
        s = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
        q = quantize_int8(x.float() / s.unsqueeze(-1))
        return (q if self.quant == "int8" else pack_int4(q)), s

    def _write(self, cache: Tensor, blk: int, off: int, data: Tensor) -> None:
        """Write tokens ``[t, N2, W]`` at ``off`` of block ``blk``."""
        if cache.dim() == 5:  # NZ
            cache[blk, :, :, off:off + data.shape[0]] = data.unflatten(-1, (-1, cache.shape[-1])).permute(1, 2, 0, 3)
        elif cache.dim() == 4:
            cache[blk, :, off:off + data.shape[0]] = data.transpose(0, 1)
        else:
            cache[blk, off:off + data.shape[0]] = data.flatten(1)
