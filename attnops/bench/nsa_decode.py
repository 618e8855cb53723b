"""Benchmark builders for decoding with :class:`attnops.nn.NativeSparseAttention` and its :class:`NSACache`.

``nsa_decode``: one new token at context ``skv`` through a cache prefilled with ``skv`` tokens (the prefill is
part of the inputs, untimed; before every timed call the cache is truncated back to ``skv`` tokens); baseline
``nsa-recompute``: the module's forward over the whole ``skv + 1`` tokens (the cost of decoding without a cache),
its last output compared. ``nsa_prefill_decode``: a fresh cache, a prefill of ``skv - params["steps"]`` tokens in
chunks of ``params["chunk"]``, then ``params["steps"]`` tokens one at a time (time and peak memory, which grows
linearly with the context; the cache's bytes per token are in :func:`cache_bytes_per_token`).

``nsa_selected_infer`` / ``nsa_compress_infer``: the decode operators alone (``attnops.nsa_selected_attention_infer``,
``attnops.nsa_compress_attention_infer``) on paged caches in shuffled pages of ``params["block"]`` tokens, beside the
read bandwidth over the bytes they read (:meth:`Case.decode_keys` keys and values per request and KV head).
"""
from __future__ import annotations

import torch

from .types import Case, Inputs, Runnable


def module_for(case: Case, device: torch.device):
    """The case's module (seeded), in the case's dtype, on ``device``."""
    from ..nn import NativeSparseAttention

    p = case.params
    torch.manual_seed(0)
    m = NativeSparseAttention(p["hidden"], case.heads, case.kv_heads, case.d, compress_block_size=2 * p["stride"],
                              compress_stride=p["stride"], select_block_size=p["block"], select_block_count=p["count"],
                              window_size=p["window"])
    return m.to(device=device, dtype=getattr(torch, case.dtype)).eval()


def decode_inputs(case: Case, device: torch.device, seed: int):
    """``x [B, skv + 1, hidden]`` and the module; ``nsa_decode`` also gets the cache of the first ``skv`` tokens."""
    m = module_for(case, device)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(case.batch, case.skv + 1, case.params["hidden"], generator=gen).to(device=device,
                                                                                     dtype=getattr(torch, case.dtype))
    kw = {"module": m}
    if case.op == "nsa_decode":
        with torch.no_grad():
            cache = m.new_cache(case.batch)
            m(x[:, :case.skv], cache=cache)
        kw["cache"] = cache
    return Inputs(x, None, None, None, kw, case.d ** -0.5)


def _bnsd(out: torch.Tensor) -> torch.Tensor:
    return out.unsqueeze(1)  # [B, 1, T, hidden]: one "head" for the runner's output comparison


def build_decode(case: Case, inp, device):
    m, cache, x = inp.kwargs["module"], inp.kwargs["cache"], inp.q
    state = {}

    def run():
        with torch.no_grad():
            state["out"] = m(x[:, case.skv:], cache=cache)
    return Runnable(run, lambda: cache.truncate(case.skv), output=lambda: _bnsd(state["out"]) if "out" in state
                    else None)


def build_recompute(case: Case, inp, device):
    m, x = inp.kwargs["module"], inp.q
    state = {}

    def run():
        with torch.no_grad():
            state["out"] = m(x)[:, case.skv:]
    return Runnable(run, output=lambda: _bnsd(state["out"]) if "out" in state else None)


def build_prefill_decode(case: Case, inp, device):
    m, x, steps, chunk = inp.kwargs["module"], inp.q, case.params["steps"], case.params["chunk"]

    def run():
        with torch.no_grad():
            cache = m.new_cache(case.batch)
            for start in range(0, case.skv - steps, chunk):
                m(x[:, start:min(start + chunk, case.skv - steps)], cache=cache)
            for i in range(case.skv - steps, case.skv):
                m(x[:, i:i + 1], cache=cache)
    return Runnable(run)


def cache_bytes_per_token(case: Case, device: torch.device = torch.device("cpu")) -> float:
    """Bytes an :class:`NSACache` holds per cached token after ``skv`` tokens (pages of ``select_block_size``
    tokens, ``max_seq_len`` given: no over-allocation): ``2 * N2 * D * itemsize * (1 + 1/stride)`` plus the
    block table."""
    m = module_for(case, device)
    x = torch.randn(case.batch, case.skv, case.params["hidden"]).to(device=device, dtype=getattr(torch, case.dtype))
    with torch.no_grad():
        cache = m.new_cache(case.batch, max_seq_len=case.skv)
        m(x, cache=cache)
    return cache.nbytes() / (case.batch * case.skv)


def infer_inputs(case: Case, device: torch.device, seed: int):
    """``query [B, N1, D]`` and paged caches (pages of ``params["block"]`` tokens, shuffled) holding every request's
    ``skv`` keys (selected) or ``skv // stride`` compressed keys; ``nsa_selected_infer`` also gets ``count``
    distinct random blocks per request and KV head."""
    p, b, kvn = case.params, case.batch, case.kv_heads
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, case.dtype)
    page = p["block"]
    tokens = case.skv if case.op == "nsa_selected_infer" else case.skv // p["stride"]
    per_seq = tokens // page

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dt)

    kw = {"table": torch.randperm(b * per_seq, generator=gen).view(b, per_seq).to(device=device, dtype=torch.int32),
          "lens": [tokens] * b}
    if case.op == "nsa_selected_infer":
        kw["topk"] = torch.stack([torch.randperm(per_seq, generator=gen)[:p["count"]] for _ in range(b * kvn)]).view(
            b, kvn, p["count"]).to(device=device, dtype=torch.int32)
    return Inputs(randn(b, case.heads, case.d), randn(b * per_seq, page, kvn, case.d),
                  randn(b * per_seq, page, kvn, case.dv), None, kw, case.d ** -0.5)


def build_infer(case: Case, inp, device):
    import attnops

    from .nsa_peers import output_of_attnops

    p, kw = case.params, inp.kwargs
    state = {}

    def run():
        if case.op == "nsa_selected_infer":
            state["out"] = attnops.nsa_selected_attention_infer(inp.q, inp.k, inp.v, kw["topk"], kw["table"],
                                                                kw["lens"], select_block_size=p["block"])
        else:
            state["out"] = attnops.nsa_compress_attention_infer(
                inp.q, inp.k, inp.v, kw["table"], kw["lens"], compress_block_size=2 * p["stride"],
                compress_stride=p["stride"], select_block_size=p["block"], select_block_count=p["count"])
    return Runnable(run, output=lambda: output_of_attnops(case, state["out"]) if "out" in state else None)
