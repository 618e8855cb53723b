"""Benchmark builders for DeepSeek sparse attention on the CPU.

``dsa_sparse``: :func:`attnops.sparse_flash_attention` over one causal sequence of ``S`` tokens (TND), MLA shapes
(latent ``d - rope`` + rope ``params["rope"]`` for q.k, value = the latent), every query row reading
``min(params["topk"], i + 1)`` keys spread evenly over its causal prefix; baseline ``attnops-dense-rows`` is dense
causal :func:`attnops.flash_attention` on the same tokens (``q = [q_nope | q_rope]``, ``k = [latent | rope]``,
``v = latent``). With ``params["sample"] = (chunks, rows)`` both time the same query-row chunks
(:func:`~attnops.bench.types.sampled_row_chunks`): chunk ``[lo, hi)`` is one call with queries ``lo..hi-1`` over keys
``0..hi-1`` (bottom-right causal, so each row sees exactly its prefix). ``dsa_indexer``:
:func:`attnops.lightning_indexer` (``params["index_heads"]`` heads of ``d``, causal top-``params["topk"]``), timed
with its peak memory (no ``[S, S]`` score matrix).
"""
from __future__ import annotations

import math

import torch

from .types import Case, Inputs, Runnable, randn_on as _randn, sampled_row_chunks


def spread_over(allowed: torch.Tensor, topk: int) -> torch.Tensor:
    """``[R, topk]`` int64: row ``r`` lists ``min(topk, allowed[r])`` distinct positions spread evenly over
    ``0..allowed[r] - 1``, then -1."""
    allowed, slot = allowed[:, None], torch.arange(topk)[None]
    pos = torch.where(allowed <= topk, slot, slot * allowed // topk)
    return pos.masked_fill(slot >= allowed, -1)


def spread_indices(s: int, topk: int, device, lo: int = 0) -> torch.Tensor:
    """``[S - lo, 1, topk]`` int32: row ``i`` (of ``lo..S-1``) lists ``min(topk, i + 1)`` distinct positions spread
    over ``0..i``."""
    return spread_over(torch.arange(lo, s) + 1, topk).to(device=device, dtype=torch.int32)[:, None]


def dsa_inputs(case: Case, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, case.dtype)
    s, n, rope = case.sq, case.heads, case.params["rope"]
    if case.op == "dsa_indexer":
        q, k = _randn(gen, 1, s, n, case.d, dtype=dt, device=device), _randn(gen, 1, s, 1, case.d, dtype=dt,
                                                                                device=device)
        w = _randn(gen, 1, s, n, dtype=dt, device=device).abs()
        return Inputs(q, k, w, None, {}, 1.0)
    chunks = sampled_row_chunks(s, case.params.get("sample"))
    rows = sum(hi - lo for lo, hi in chunks)
    q = _randn(gen, rows, n, case.d, dtype=dt, device=device)  # [q_nope | q_rope] of the timed rows
    k = _randn(gen, s, 1, case.d, dtype=dt, device=device)  # [latent | rope]
    indices = torch.cat([spread_indices(hi, case.params["topk"], device, lo) for lo, hi in chunks])
    return Inputs(q, k, k[..., :case.dv], None, dict(chunks=chunks, indices=indices, rope=rope),
                  1.0 / math.sqrt(case.d))


def _per_chunk(inp, call):
    """Runs ``call(q_rows, key_len, row_slice)`` for every timed chunk (query rows ``lo..hi-1`` over keys ``0..hi-1``)
    and concatenates the outputs."""
    outs, first = [], 0
    for lo, hi in inp.kwargs["chunks"]:
        rows = slice(first, first + hi - lo)
        outs.append(call(rows, hi))
        first = rows.stop
    return torch.cat(outs)


def build_dense_rows(case: Case, inp, device):
    """Dense causal :func:`attnops.flash_attention` (``sparse_mode`` 3) over the same query-row chunks."""
    import attnops

    mask = torch.ones(2048, 2048, dtype=torch.bool, device=device).triu(1)
    state: dict = {}

    def dense():
        with torch.no_grad():
            state["out"] = _per_chunk(inp, lambda rows, hi: attnops.flash_attention(
                inp.q[rows], inp.k[:hi], inp.v[:hi], layout="TND", actual_seq_qlen=[rows.stop - rows.start],
                actual_seq_kvlen=[hi], atten_mask=mask, sparse_mode=3, scale=inp.scale))
    return Runnable(dense)


def build_dsa(case: Case, inp, device):
    """The sparse attention (forward) or the indexer."""
    import attnops

    state: dict = {}
    if case.op == "dsa_indexer":
        def index():
            state["out"] = attnops.lightning_indexer(inp.q, inp.k, inp.v, sparse_count=case.params["topk"])
        return Runnable(index)
    d = case.d - inp.kwargs["rope"]
    q_nope, q_rope = inp.q[..., :d].contiguous(), inp.q[..., d:].contiguous()
    latent, k_rope = inp.k[..., :d].contiguous(), inp.k[..., d:].contiguous()
    indices = inp.kwargs["indices"]

    def sparse():
        with torch.no_grad():
            state["out"] = _per_chunk(inp, lambda rows, hi: attnops.sparse_flash_attention(
                q_nope[rows], latent[:hi], latent[:hi], indices[rows], scale=inp.scale, query_rope=q_rope[rows],
                key_rope=k_rope[:hi], layout="TND", actual_seq_lengths_query=[rows.stop - rows.start],
                actual_seq_lengths_kv=[hi]).attention_out)
    return Runnable(sparse)
