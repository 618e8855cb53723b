"""Benchmark builders for DeepSeek-V4 attention (:func:`attnops.sparse_flash_mla`) on the CPU.

``dsv4_decode``: one layer's decode step at a context of ``skv`` tokens, ``N1`` query heads of ``D`` (one shared KV
head), paged caches in shuffled ``params["block"]``-token blocks: the ``params["window"]`` latest tokens plus, for
``params["cmp_ratio"]`` 4 (CSA), ``params["topk"]`` random distinct rows of the ``skv / 4`` C4A rows, or for 128
(HCA) every one of the ``skv / 128`` C128A rows. Baseline ``sdpa-dense-folded``: one dense decode step of PyTorch's
SDPA over all ``skv`` keys (= values) with the query heads folded into query rows of the single KV head (no mask:
every key precedes the new token).

``dsv4_prefill``: a CSA layer's causal prefill of ``sq`` tokens (BSND), each token reading its window and
``min(params["topk"], completed C4A rows)`` rows spread over them; timed with its peak memory.
"""
from __future__ import annotations

import torch

from .dsa import spread_over
from .types import Case, Inputs, Runnable, Unavailable


def _randn(gen, *shape, dtype, device):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def _paged(gen, rows: int, block: int, d: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A store of ``rows`` random rows in shuffled ``block``-row blocks, and its ``[1, blocks]`` table."""
    blocks = -(-rows // block)
    table = torch.randperm(blocks, generator=gen).to(device=device, dtype=torch.int32)[None]
    return _randn(gen, blocks, block, 1, d, dtype=dtype, device=device), table


def dsv4_inputs(case: Case, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    dt, p, s, n, d = getattr(torch, case.dtype), case.params, case.skv, case.heads, case.d
    if case.op == "dsv4_prefill":
        allowed = (torch.arange(s) + 1) // 4
        picks = spread_over(allowed, p["topk"]).to(device=device, dtype=torch.int32).view(1, s, 1, -1)
        kw = {"cmp": _randn(gen, 1, s // 4, 1, d, dtype=dt, device=device), "picks": picks}
        return Inputs(_randn(gen, 1, s, n, d, dtype=dt, device=device), _randn(gen, 1, s, 1, d, dtype=dt,
                                                                                 device=device), None, None, kw,
                      d ** -0.5)
    window, window_table = _paged(gen, s, p["block"], d, dt, device)
    ratio = p["cmp_ratio"]
    cmp, cmp_table = _paged(gen, s // ratio, p["block"], d, dt, device)
    kw = dict(window_table=window_table, cmp=cmp, cmp_table=cmp_table, dense=_randn(gen, 1, 1, s, d, dtype=dt,
                                                                                    device=device))
    if ratio == 4:
        kw["picks"] = torch.randperm(s // 4, generator=gen)[:p["topk"]].to(device=device, dtype=torch.int32).view(
            1, 1, 1, -1)
    return Inputs(_randn(gen, 1, 1, n, d, dtype=dt, device=device), window, None, None, kw, d ** -0.5)


def build_dsv4(case: Case, inp, device):
    """The decode step or the CSA prefill."""
    import attnops

    kw, p, sinks = inp.kwargs, case.params, torch.zeros(case.heads, device=device)
    common = dict(sinks=sinks, scale=inp.scale, ori_win_left=p["window"] - 1)
    if case.op == "dsv4_prefill":
        return Runnable(lambda: attnops.sparse_flash_mla(inp.q, inp.k, cmp_kv=kw["cmp"],
                                                         cmp_sparse_indices=kw["picks"], cmp_ratio=4, **common))
    paged = dict(layout_kv="PA_BBND", ori_block_table=kw["window_table"], seqused_ori_kv=[case.skv],
                 cmp_residual_kv=[0], cmp_block_table=kw["cmp_table"], cmp_sparse_indices=kw.get("picks"), **common)

    state: dict = {}

    def step():
        with torch.no_grad():
            state["out"] = attnops.sparse_flash_mla(inp.q, inp.k, cmp_kv=kw["cmp"], cmp_ratio=p["cmp_ratio"],
                                                    **paged).attn_out
    return Runnable(step, output=lambda: state.get("out"))


def build_dense_folded(case: Case, inp, device):
    """SDPA over all ``skv`` keys, the query heads folded into query rows of the one KV head (decode steps only)."""
    if case.op != "dsv4_decode":
        raise Unavailable("the dense baseline of a decode step")
    q, k = inp.q.reshape(1, 1, case.heads, case.d), inp.kwargs["dense"]
    return Runnable(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k, scale=inp.scale))
