"""The int64 tables the decode kernel reads (``Run`` and ``ChunkRow`` in ``decode.cpp``): field names, order, dtype
and the K/V dtype codes, for every Python caller.

A run descriptor (:data:`RUN_FIELDS`, one row per run of tokens: :func:`run_columns`) says where ``blocks`` blocks
of ``length`` tokens of the keys and values lie, and where their per-token antiquant scale and offset lie (address
0: none). A chunk row (:data:`CHUNK_FIELDS`: :func:`chunk_row`) is one chunk of a kernel call. The library describes
its own layouts (``attnops_row_layout()``, the text :func:`describe` makes); :func:`mismatch` compares the two
before any table reaches it.
"""
from __future__ import annotations

import torch
from torch import Tensor

VERSION = 1
DTYPE = torch.int64  # every field of every row
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}  # the K/V dtypes it reads
_CODE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int8: "I8"}

KEY = ("k_addr", "k_sr", "k_sn", "k_sl")  # element (r, n, l, d) at addr + (r*sr + n*sn + l*sl + d) * itemsize
VALUE = ("v_addr", "v_sr", "v_sn", "v_sl")
KEY_FACTORS = ("ks_addr", "ko_addr", "ks_sr", "ks_sn", "ks_sl")  # fp32 scale (and offset) of token (r, l), head n
VALUE_FACTORS = ("vs_addr", "vo_addr", "vs_sr", "vs_sn", "vs_sl")
RUN_FIELDS = KEY + VALUE + ("blocks", "length") + KEY_FACTORS + VALUE_FACTORS
NO_FACTORS = (0,) * len(KEY_FACTORS)  # no per-token antiquant

CHUNK_FIELDS = ("q", "heads", "rows", "d", "dv", "kt", "vt", "runs", "nruns", "tokens", "m_out", "l_out", "o_out",
                "p_out")


def run_columns(key, value, blocks, length, key_factors=NO_FACTORS, value_factors=NO_FACTORS) -> list:
    """One run descriptor in :data:`RUN_FIELDS` order (ints, or tensors of one value per run): ``key``/``value``:
    ``(addr, sr, sn, sl)``; ``key_factors``/``value_factors``: ``(scale addr, offset addr, sr, sn, sl)``."""
    return [*key, *value, blocks, length, *key_factors, *value_factors]


def chunk_row(q: Tensor, runs: tuple[int, int], tokens: int, dtypes: tuple[torch.dtype, torch.dtype], dv: int,
              outputs: tuple[int, int, int], probabilities: int = 0) -> list[int]:
    """One chunk row (:data:`CHUNK_FIELDS` order): a chunk of ``tokens`` keys and values (``runs``: the address and
    count of its run descriptors; ``dtypes``: of the keys and of the values) for the scaled fp32 query
    ``q [heads, rows, D]`` (contiguous), whose row max ``m [heads, rows]``, row sum ``l`` of ``exp(s - m)`` and
    un-normalised output ``[heads, rows, dv]`` go to the contiguous fp32 memory at the ``outputs`` addresses, and
    ``exp(s - m) [heads, rows, tokens]`` to the address ``probabilities`` (0: not kept)."""
    heads, rows, d = q.shape
    return [q.data_ptr(), heads, rows, d, dv, DTYPE_CODES[dtypes[0]], DTYPE_CODES[dtypes[1]], *runs, tokens,
            *outputs, probabilities]


def describe() -> str:
    """The layouts as ``attnops_row_layout()`` reports them: version, each table's fields with their int64 offset,
    the dtype codes."""
    def fields(names):
        return " ".join(f"{name}:{i}" for i, name in enumerate(names))
    codes = " ".join(f"{_CODE_NAMES[dtype]}:{code}" for dtype, code in DTYPE_CODES.items())
    return f"version {VERSION}; Run {fields(RUN_FIELDS)}; ChunkRow {fields(CHUNK_FIELDS)}; DType {codes}"


def mismatch(library_layout: str) -> str | None:
    """Where the library's layout differs from :func:`describe` (None: it does not)."""
    expected = describe()
    if library_layout == expected:
        return None
    for ours, theirs in zip(expected.split("; "), library_layout.split("; ")):
        if ours != theirs:
            return f"the library's row layout has '{theirs}' where attnops expects '{ours}'"
    return f"the library's row layout is '{library_layout}', attnops expects '{expected}'"
