"""Benchmark builders for the DeepSeek-V4 compressor and lightning indexer v2 (:func:`attnops.compressor`,
:func:`attnops.lightning_indexer_v2`).

``dsv4_compressor``: a C4A prefill of ``skv`` new tokens (hidden size ``case.d``, ``params["dim"]`` = D, ``coff`` 2,
ratio 4) into a paged fp32 state (``params["block"]``-slot blocks), one request from position 0. The work is the
projection (``2 * T * H * 2 * coff * D`` FLOPs); the pooling and the state writes are memory traffic.

``dsv4_indexer_v2``: one request's ``sq`` query tokens (``case.heads`` heads of ``case.d``) over its ``sq / 4``
compressed keys (mask mode 3, ratio 4, residual 0), top-``params["topk"]``.
"""
from __future__ import annotations

import torch

from .types import Case, Inputs, Runnable

RATIO, COFF = 4, 2


def _randn(gen, *shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def kernel_inputs(case: Case, device: torch.device, seed: int) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, case.dtype)
    if case.op == "dsv4_compressor":
        t, hidden, dim, block = case.skv, case.d, case.params["dim"], case.params["block"]
        w = [_randn(gen, COFF * dim, hidden, dtype=dt, device=device, scale=hidden ** -0.5) for _ in range(2)]
        blocks = -(-t // block)
        kw = dict(wkv=w[0], wgate=w[1], ape=_randn(gen, RATIO, COFF * dim, dtype=torch.float32, device=device),
                  state=torch.zeros(blocks + 1, block, 2 * COFF * dim, device=device),
                  table=torch.arange(1, blocks + 1, dtype=torch.int32, device=device)[None])
        return Inputs(_randn(gen, 1, t, hidden, dtype=dt, device=device), None, None, None, kw, 1.0)
    s, n = case.sq, case.heads
    q = _randn(gen, 1, s, n, case.d, dtype=dt, device=device)
    k = _randn(gen, 1, s // RATIO, 1, case.d, dtype=dt, device=device)
    w = _randn(gen, 1, s, n, dtype=torch.float32, device=device).abs()
    return Inputs(q, k, w, None, {"residual": torch.zeros(1, dtype=torch.int32, device=device)}, 1.0)


def build_kernel_case(case: Case, inp: Inputs, device):
    """The compressor's prefill or the indexer."""
    import attnops

    state: dict = {}
    kw = inp.kwargs
    if case.op == "dsv4_compressor":
        def compress():
            state["out"] = attnops.compressor(inp.q, kw["wkv"], kw["wgate"], kw["state"], kw["ape"], cmp_ratio=RATIO,
                                              coff=COFF, state_block_table=kw["table"])
        return Runnable(compress, output=lambda: state.get("out"))

    def index():
        state["out"] = attnops.lightning_indexer_v2(inp.q, inp.k, inp.v, topk=case.params["topk"], mask_mode=3,
                                                    cmp_ratio=RATIO, cmp_residual_k=kw["residual"]).sparse_indices
    return Runnable(index, output=lambda: state.get("out"))

