"""Benchmark builders for decoding with :class:`attnops.nn.NativeSparseAttention` and its :class:`NSACache`.

``nsa_decode``: one new token at context ``skv`` through a cache prefilled with ``skv`` tokens (the prefill is
part of the inputs, untimed; before every timed call the cache is truncated back to ``skv`` tokens); baseline
``nsa-recompute``: the module's forward over the whole ``skv + 1`` tokens (the cost of decoding without a cache),
its last output compared. ``nsa_prefill_decode``: a fresh cache, a prefill of ``skv - params["steps"]`` tokens in
chunks of ``params["chunk"]``, then ``params["steps"]`` tokens one at a time (time and peak memory, which grows
linearly with the context; the cache's bytes per token are in :func:`cache_bytes_per_token`).
"""
from __future__ import annotations

import torch

from .cases import Case


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
    from .impls import Inputs

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
    from .impls import Runnable

    m, cache, x = inp.kwargs["module"], inp.kwargs["cache"], inp.q
    state = {}

    def run():
        with torch.no_grad():
            state["out"] = m(x[:, case.skv:], cache=cache)
    return Runnable(run, lambda: cache.truncate(case.skv), output=lambda: _bnsd(state["out"]) if "out" in state
                    else None)


def build_recompute(case: Case, inp, device):
    from .impls import Runnable

    m, x = inp.kwargs["module"], inp.q
    state = {}

    def run():
        with torch.no_grad():
            state["out"] = m(x)[:, case.skv:]
    return Runnable(run, output=lambda: _bnsd(state["out"]) if "out" in state else None)


def build_prefill_decode(case: Case, inp, device):
    from .impls import Runnable

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
