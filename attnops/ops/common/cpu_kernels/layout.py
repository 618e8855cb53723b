"""The int64 tables the decode kernel reads (``Run``, ``ChunkRow`` and ``PagedCall`` in ``decode.cpp``): field
names, order, dtype and the K/V dtype codes, for every Python caller.

A run descriptor (:data:`RUN_FIELDS`, one row per run of tokens: :func:`run_columns`) says where ``blocks`` blocks
of ``length`` tokens of the keys and values lie, and where their per-token antiquant scale and offset lie (address
0: none). A chunk row (:data:`CHUNK_FIELDS`: :func:`chunk_row`) is one chunk of a kernel call; a paged call
(:data:`PAGED_CALL_FIELDS`: :func:`paged_call`) is a whole NSA decode call, whose runs the library builds. The
library describes its own layouts (``attnops_row_layout()``, the text :func:`describe` makes); :func:`mismatch`
compares the two before any table reaches it.
"""
from __future__ import annotations

import struct

import torch
from torch import Tensor

VERSION = 3
DTYPE = torch.int64  # every field of every row
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}  # the K/V dtypes it reads
_CODE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int8: "I8"}

KEY = ("k_addr", "k_sr", "k_sn", "k_sl")  # element (r, n, l, d) at addr + (r*sr + n*sn + l*sl + d) * itemsize
VALUE = ("v_addr", "v_sr", "v_sn", "v_sl")
KEY_FACTORS = ("ks_addr", "ko_addr", "ks_sr", "ks_sn", "ks_sl")  # fp32 scale (and offset) of token (r, l), head n
VALUE_FACTORS = ("vs_addr", "vo_addr", "vs_sr", "vs_sn", "vs_sl")
RUN_FIELDS = KEY + VALUE + ("blocks", "length") + KEY_FACTORS + VALUE_FACTORS
NO_FACTORS = (0,) * len(KEY_FACTORS)  # no per-token antiquant

QUERY = ("q", "q_bf16", "scale")  # scaled fp32 query; unscaled bf16 query (0: none) and the fp32 bits of its scale
CHUNK_FIELDS = (*QUERY, "heads", "rows", "d", "dv", "kt", "vt", "runs", "nruns", "tokens", "m_out", "l_out", "o_out",
                "p_out")
# one NSA decode call over paged caches (addresses; strides in elements): the query, the key and value caches, the
# block table, the lengths, the selected block indices (address 0: compressed attention), the outputs
PAGED_CALL_FIELDS = (*QUERY, "batch", "kv_heads", "group", "d", "dv", "k_addr", "k_sb", "k_sp", "k_sn", "kt",
                     "v_addr", "v_sb", "v_sp", "v_sn", "vt", "blocks", "page", "table", "table_sb", "table_si",
                     "table_len", "table_wide", "lengths", "picks", "picks_sb", "picks_sn", "picks_si", "count",
                     "picks_wide", "unit", "out", "probs")


def run_columns(key, value, blocks, length, key_factors=NO_FACTORS, value_factors=NO_FACTORS) -> list:
    """One run descriptor in :data:`RUN_FIELDS` order (ints, or tensors of one value per run): ``key``/``value``:
    ``(addr, sr, sn, sl)``; ``key_factors``/``value_factors``: ``(scale addr, offset addr, sr, sn, sl)``."""
    return [*key, *value, blocks, length, *key_factors, *value_factors]


def query_fields(q: Tensor, unscaled: tuple[Tensor, float] | None) -> list[int]:
    """The :data:`QUERY` fields: the scaled fp32 query ``q``, and ``unscaled``: the same query before scaling in bf16
    (``q``'s shape, contiguous) and its scale, from which the kernel takes bf16 keys' scores on the AMX tile unit
    (None: it takes them from ``q``)."""
    if unscaled is None:
        return [q.data_ptr(), 0, 0]
    raw, scale = unscaled
    if raw.dtype != torch.bfloat16 or raw.shape != q.shape or not raw.is_contiguous():
        raise ValueError(f"unscaled query: expected contiguous bf16 of shape {tuple(q.shape)}, got {raw.dtype} "
                         f"{tuple(raw.shape)} (contiguous: {raw.is_contiguous()})")
    return [q.data_ptr(), raw.data_ptr(), struct.unpack("<I", struct.pack("<f", scale))[0]]


def chunk_row(q: Tensor, runs: tuple[int, int], tokens: int, dtypes: tuple[torch.dtype, torch.dtype], dv: int,
              outputs: tuple[int, int, int], probabilities: int = 0,
              unscaled: tuple[Tensor, float] | None = None) -> list[int]:
    """One chunk row (:data:`CHUNK_FIELDS` order): a chunk of ``tokens`` keys and values (``runs``: the address and
    count of its run descriptors; ``dtypes``: of the keys and of the values) for the scaled fp32 query
    ``q [heads, rows, D]`` (contiguous; ``unscaled``: :func:`query_fields`), whose row max ``m [heads, rows]``, row
    sum ``l`` of ``exp(s - m)`` and un-normalised output ``[heads, rows, dv]`` go to the contiguous fp32 memory at
    the ``outputs`` addresses, and ``exp(s - m) [heads, rows, tokens]`` to the address ``probabilities`` (0: not
    kept)."""
    heads, rows, d = q.shape
    return [*query_fields(q, unscaled), heads, rows, d, dv, DTYPE_CODES[dtypes[0]], DTYPE_CODES[dtypes[1]], *runs,
            tokens, *outputs, probabilities]


def _cache(cache: Tensor) -> list[int]:
    """A paged cache ``[blocks, page, N, D]``: address, strides of a block, a row and a head, dtype code."""
    return [cache.data_ptr(), *cache.stride()[:3], DTYPE_CODES[cache.dtype]]


def _indices(t: Tensor | None) -> list[int]:
    """An int32/int64 index tensor: address and strides (all 0 for None)."""
    return [t.data_ptr(), *t.stride()] if t is not None else [0] * 4


def paged_call(q: Tensor, key: Tensor, value: Tensor, table: Tensor, lengths: Tensor, out: Tensor,
               picks: Tensor | None = None, unit: int = 0, probs: Tensor | None = None,
               unscaled: tuple[Tensor, float] | None = None) -> list[int]:
    """One paged decode call (:data:`PAGED_CALL_FIELDS` order): the scaled fp32 query ``q [B, N2, G, D]``
    (``unscaled``: :func:`query_fields`), caches
    ``[blocks, page, N2, D/Dv]``, block table ``[B, maxBlocks]``, int64 ``lengths [B]``, the fp32 output ``out
    [B, N2, G, Dv]`` (all contiguous); selected attention: the block indices ``picks [B, N2, count]`` of ``unit``
    tokens; compressed attention (``picks`` None): where the probabilities go, per request ``[N2, G, length]`` one
    after another (None: not kept)."""
    batch, kv_heads, group, d = q.shape
    return [*query_fields(q, unscaled), batch, kv_heads, group, d, value.shape[-1], *_cache(key), *_cache(value),
            key.shape[0], key.shape[1], table.data_ptr(), *table.stride(), table.shape[1],
            int(table.dtype == torch.int64), lengths.data_ptr(), *_indices(picks),
            picks.shape[-1] if picks is not None else 0, int(picks is not None and picks.dtype == torch.int64), unit,
            out.data_ptr(),
            probs.data_ptr() if probs is not None else 0]


def describe() -> str:
    """The layouts as ``attnops_row_layout()`` reports them: version, each table's fields with their int64 offset,
    the dtype codes."""
    def fields(names):
        return " ".join(f"{name}:{i}" for i, name in enumerate(names))
    codes = " ".join(f"{_CODE_NAMES[dtype]}:{code}" for dtype, code in DTYPE_CODES.items())
    return (f"version {VERSION}; Run {fields(RUN_FIELDS)}; ChunkRow {fields(CHUNK_FIELDS)}; "
            f"PagedCall {fields(PAGED_CALL_FIELDS)}; DType {codes}")


def mismatch(library_layout: str) -> str | None:
    """Where the library's layout differs from :func:`describe` (None: it does not)."""
    expected = describe()
    if library_layout == expected:
        return None
    for ours, theirs in zip(expected.split("; "), library_layout.split("; ")):
        if ours != theirs:
            return f"the library's row layout has '{theirs}' where attnops expects '{ours}'"
    return f"the library's row layout is '{library_layout}', attnops expects '{expected}'"
