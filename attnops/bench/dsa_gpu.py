"""Benchmark builders for DeepSeek sparse attention on the GPU (DeepSeek-V3.2 shapes; the indexer cases use
:mod:`.dsa`'s ``dsa_indexer``).

``dsa_prefill``: ``attnops.sparse_flash_attention`` over one causal sequence (MLA absorbed: 128 query heads, latent
512 + rope 64 shared by every head), each token attending to ``topk`` positions (its own and the preceding ones:
the densest causal selection); ``dsa_decode``: one token per request over a paged latent cache (blocks of 64), the
last ``topk`` positions; ``dsa_kl_loss``: ``attnops.lightning_indexer_kl_loss`` (the fused loss and indexer gradients)
of the prefill's tokens and selection (``params["index_heads"]`` heads of 128, the statistics from one sparse
attention call made with the inputs). Baseline ``attnops-dense-mha``: the dense causal ``attnops.flash_attention``
of the same tokens in DeepSeek's non-absorbed prefill form (128 heads, D=192, Dv=128), the attention DSA replaces.
"""
from __future__ import annotations

import torch

from .types import Case, Inputs, Runnable, randn_on as _randn

LATENT, ROPE, PAGE, INDEX_DIM = 512, 64, 64, 128
MHA_D, MHA_DV = 192, 128


def _window(rows: torch.Tensor, limit: torch.Tensor, topk: int, device) -> torch.Tensor:
    """int32 ``[R, 1, topk]``: positions ``limit - 1, limit - 2, ...`` (at most ``topk``), then -1."""
    pos = (limit[:, None] - 1 - torch.arange(topk, device=device)[None, :])
    return torch.where(pos >= 0, pos, -1).to(torch.int32).view(rows.numel(), 1, topk)


def dsa_inputs(case: Case, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    dt, topk = getattr(torch, case.dtype), case.params["topk"]
    none = torch.empty(0, device=device)
    scale = (LATENT + ROPE) ** -0.5
    if case.op in ("dsa_prefill", "dsa_kl_loss"):
        t = case.sq
        q = _randn(gen, 1, t, case.heads, LATENT, dtype=dt, device=device)
        q_rope = _randn(gen, 1, t, case.heads, ROPE, dtype=dt, device=device)
        latent = _randn(gen, 1, t, 1, LATENT, dtype=dt, device=device)
        rope = _randn(gen, 1, t, 1, ROPE, dtype=dt, device=device)
        rows = torch.arange(t, device=device)
        idx = _window(rows, rows + 1, topk, device).view(1, t, 1, topk)
        kw = dict(sparse_indices=idx, query_rope=q_rope, key_rope=rope)
        if case.op == "dsa_kl_loss":
            kw.update(_indexer_side(case, gen, dt, device, q, latent, kw, scale))
        return Inputs(q, latent, latent, none, kw, scale)
    b, ctx = case.batch, case.skv
    blocks = b * -(-ctx // PAGE)
    q = _randn(gen, b, case.heads, LATENT, dtype=dt, device=device)
    q_rope = _randn(gen, b, case.heads, ROPE, dtype=dt, device=device)
    latent = _randn(gen, blocks, PAGE, 1, LATENT, dtype=dt, device=device)
    rope = _randn(gen, blocks, PAGE, 1, ROPE, dtype=dt, device=device)
    table = torch.randperm(blocks, generator=gen).to(device=device, dtype=torch.int32).view(b, -1)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
    idx = _window(torch.arange(b, device=device), lens.long(), topk, device)
    return Inputs(q, latent, latent, none, dict(sparse_indices=idx, query_rope=q_rope, key_rope=rope,
                                                block_table=table, layout="TND", layout_kv="PA_BSND",
                                                actual_seq_lengths_query=torch.arange(1, b + 1, dtype=torch.int32,
                                                                                      device=device),
                                                actual_seq_lengths_kv=lens), scale)


def _indexer_side(case: Case, gen: torch.Generator, dt: torch.dtype, device, q, latent, kw: dict, scale: float) -> dict:
    """The KL loss's indexer tensors (``[1, T, Ni, 128]`` query, ``[1, T, 1, 128]`` key, fp32 weights) and the main
    attention's statistics."""
    import attnops

    t, heads = case.sq, case.params["index_heads"]
    with torch.no_grad():
        stats = attnops.sparse_flash_attention(q, latent, latent, kw["sparse_indices"], scale=scale,
                                               query_rope=kw["query_rope"], key_rope=kw["key_rope"])
    return dict(query_index=_randn(gen, 1, t, heads, INDEX_DIM, dtype=dt, device=device),
                key_index=_randn(gen, 1, t, 1, INDEX_DIM, dtype=dt, device=device),
                weights=_randn(gen, 1, t, heads, dtype=torch.float32, device=device) * heads ** -0.5,
                softmax_max=stats.softmax_max, softmax_sum=stats.softmax_sum)


def build_kl_loss(case: Case, inp, device):
    """The indexer KL loss and its gradients (one fused op, no autograd graph)."""
    import attnops

    kw = dict(inp.kwargs)
    tensors = [kw.pop(name) for name in ("query_index", "key_index", "weights", "sparse_indices", "softmax_max",
                                         "softmax_sum")]

    def loss():
        with torch.no_grad():
            return attnops.lightning_indexer_kl_loss(inp.q, inp.k, *tensors, scale=inp.scale, **kw)

    return Runnable(loss)


def build_dsa(case: Case, inp, device):
    """Sparse attention, forward only (no grad)."""
    import attnops

    kw = dict(inp.kwargs)
    idx = kw.pop("sparse_indices")

    def attend():
        with torch.no_grad():
            return attnops.sparse_flash_attention(inp.q, inp.k, inp.v, idx, scale=inp.scale, **kw).attention_out

    return Runnable(attend)


def build_dense_mha(case: Case, inp, device):
    """Dense causal FlashAttention of the prefill's tokens, non-absorbed MLA shape (128 heads, D=192, Dv=128)."""
    import attnops

    gen = torch.Generator().manual_seed(1)
    t, dt = case.sq, getattr(torch, case.dtype)
    q, k = (_randn(gen, t, case.heads, MHA_D, dtype=dt, device=device) for _ in range(2))
    v = _randn(gen, t, case.heads, MHA_DV, dtype=dt, device=device)

    def run():
        with torch.no_grad():
            return attnops.flash_attention(q, k, v, layout="TND", causal=True, actual_seq_qlen=[t],
                                           actual_seq_kvlen=[t])

    return Runnable(run)
