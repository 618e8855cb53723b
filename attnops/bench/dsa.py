"""Benchmark builders for DeepSeek sparse attention on the CPU.

``dsa_sparse``: :func:`attnops.sparse_flash_attention` over one causal sequence of ``S`` tokens (TND), MLA shapes
(latent ``d - rope`` + rope ``params["rope"]`` for q.k, value = the latent), every query row reading
``min(params["topk"], i + 1)`` keys spread evenly over its causal prefix; baseline ``attnops-dense`` is dense causal
:func:`attnops.flash_attention` on the same tokens (``q = [q_nope | q_rope]``, ``k = [latent | rope]``,
``v = latent``). ``dsa_indexer``: :func:`attnops.lightning_indexer` (``params["index_heads"]`` heads of
``d``, causal top-``params["topk"]``), timed with its peak memory (no ``[S, S]`` score matrix).
"""
from __future__ import annotations

import math

import torch

from .cases import Case


def _randn(gen, *shape, dtype, device):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def spread_indices(s: int, topk: int, device) -> torch.Tensor:
    """``[S, 1, topk]`` int32: row ``i`` lists ``min(topk, i + 1)`` distinct positions spread over ``0..i``."""
    i = torch.arange(s)[:, None]
    allowed = i + 1
    slot = torch.arange(topk)[None]
    pos = torch.where(allowed <= topk, slot, slot * allowed // topk)
    return pos.masked_fill(slot >= allowed, -1).to(device=device, dtype=torch.int32)[:, None]


def dsa_inputs(case: Case, device: torch.device, seed: int):
    from .impls import Inputs

    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, case.dtype)
    s, n, rope = case.sq, case.heads, case.params["rope"]
    if case.op == "dsa_indexer":
        q, k = _randn(gen, 1, s, n, case.d, dtype=dt, device=device), _randn(gen, 1, s, 1, case.d, dtype=dt,
                                                                                device=device)
        w = _randn(gen, 1, s, n, dtype=dt, device=device).abs()
        return Inputs(q, k, w, None, {}, 1.0)
    q = _randn(gen, s, n, case.d, dtype=dt, device=device)  # [q_nope | q_rope]
    k = _randn(gen, s, 1, case.d, dtype=dt, device=device)  # [latent | rope]
    cum = [s]
    kw = dict(actual_seq_qlen=cum, actual_seq_kvlen=cum, indices=spread_indices(s, case.params["topk"], device),
              rope=rope)
    return Inputs(q, k, k[..., :case.dv], None, kw, 1.0 / math.sqrt(case.d))


def build_dsa(case: Case, inp, device):
    """The sparse attention (forward) or the indexer."""
    import attnops

    from .impls import Runnable

    state: dict = {}
    if case.op == "dsa_indexer":
        def index():
            state["out"] = attnops.lightning_indexer(inp.q, inp.k, inp.v, sparse_count=case.params["topk"])
        return Runnable(index)
    d = case.d - inp.kwargs["rope"]
    q_nope, q_rope = inp.q[..., :d].contiguous(), inp.q[..., d:].contiguous()
    latent, k_rope = inp.k[..., :d].contiguous(), inp.k[..., d:].contiguous()
    lens = torch.tensor([case.sq], dtype=torch.int32)

    def sparse():
        with torch.no_grad():
            state["out"] = attnops.sparse_flash_attention(
                q_nope, latent, latent, inp.kwargs["indices"], scale=inp.scale, query_rope=q_rope, key_rope=k_rope,
                layout="TND", actual_seq_lengths_query=lens, actual_seq_lengths_kv=lens).attention_out
    return Runnable(sparse)
