"""Benchmark builders for the NSA selected attention and FusedInferAttentionScore cases.

``nsa_selected``: one causal TND sequence, every token selecting ``count`` blocks of ``block`` keys (its own block
and the preceding ones, block 0 repeated for early tokens); ``nsa_layer``: ``attnops.native_sparse_attention`` on
the same q/k/v (three gated branches); baseline ``attnops-dense``: the dense causal
``attnops.flash_attention`` on the same q/k/v. ``fia_decode`` / ``fia_prefill``: ``attnops.fused_infer_attention``
(decode reads a paged cache with shuffled blocks); baseline ``sdpa-gathered``: SDPA on the same data already
gathered into contiguous ``[B, N, S, D]`` tensors.
"""
from __future__ import annotations

import math

import torch

from .types import NSA_INFER_OPS, Case, Inputs, Runnable, autograd_runnable


def _randn(gen, *shape, dtype, device):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def nsa_inputs(case: Case, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, case.dtype)
    t = sum(case.seq_lens)
    block, count = case.params["block"], case.params["count"]
    q, k, v, dy = (_randn(gen, t, case.heads, case.d, dtype=dt, device=device),
                   _randn(gen, t, case.kv_heads, case.d, dtype=dt, device=device),
                   _randn(gen, t, case.kv_heads, case.dv, dtype=dt, device=device),
                   _randn(gen, t, case.heads, case.dv, dtype=dt, device=device))
    own = torch.arange(t) // block
    topk = (own.view(-1, 1, 1) - torch.arange(count).view(1, 1, -1)).clamp(min=0)
    topk = topk.expand(t, case.kv_heads, count).contiguous().to(device=device, dtype=torch.int32)
    cum = [sum(case.seq_lens[:i + 1]) for i in range(len(case.seq_lens))]
    kw = dict(select_block_size=block, causal=True, actual_seq_qlen=cum, actual_seq_kvlen=cum)
    return Inputs(q, k, v, dy, dict(kw, topk_indices=topk), 1.0 / math.sqrt(case.d))


def build_nsa_selected(case: Case, inp, device):
    import attnops

    kw = dict(inp.kwargs)
    topk = kw.pop("topk_indices")
    leaves = [t.detach().clone().requires_grad_(case.mode != "fwd") for t in (inp.q, inp.k, inp.v)]
    return autograd_runnable(lambda q, k, v: attnops.nsa_selected_attention(q, k, v, topk, **kw), leaves, inp.dy,
                              case.mode)


def build_nsa_layer(case: Case, inp, device):
    """``attnops.native_sparse_attention`` (weighted compression, top-k selection, sliding window; gates in (0, 1))."""
    import attnops

    p = case.params
    gen = torch.Generator().manual_seed(1)
    t, dt = inp.q.shape[0], inp.q.dtype
    gates = torch.rand(t, case.heads, 3, generator=gen).to(device=device, dtype=dt)
    weights = [(torch.rand(2 * p["stride"], case.kv_heads, generator=gen) / (2 * p["stride"])).to(device=device,
                                                                                                  dtype=dt)
               for _ in range(2)]
    kw = dict(cu_seqlens=[0, *inp.kwargs["actual_seq_qlen"]], compress_block_size=2 * p["stride"],
              compress_stride=p["stride"], select_block_size=p["block"], select_block_count=p["count"],
              window_size=p["window"], scale=inp.scale)
    leaves = [t_.detach().clone().requires_grad_(case.mode != "fwd") for t_ in (inp.q, inp.k, inp.v)]
    return autograd_runnable(lambda q, k, v: attnops.native_sparse_attention(q, k, v, gates, *weights, **kw),
                              leaves, inp.dy, case.mode)


def build_dense_causal(case: Case, inp, device):
    import attnops

    cum = inp.kwargs["actual_seq_qlen"]
    mask = torch.ones(2048, 2048, dtype=torch.bool, device=device).triu(1)
    leaves = [t.detach().clone().requires_grad_(case.mode != "fwd") for t in (inp.q, inp.k, inp.v)]
    return autograd_runnable(lambda q, k, v: attnops.flash_attention(
        q, k, v, layout="TND", actual_seq_qlen=cum, actual_seq_kvlen=cum, atten_mask=mask, sparse_mode=3),
        leaves, inp.dy, case.mode)


def fia_inputs(case: Case, device: torch.device, seed: int):
    """BSND query and contiguous K/V (``q``, ``k``, ``v``); decode adds a paged copy of K/V (128-token blocks in
    shuffled order, or ``params["pages"] == "sequential"``) unless ``params["pages"] == "dense"``; int8 KV
    (``params["kv"] == "int8"``) is quantized per channel and passed with its antiquant scales."""
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, case.dtype)
    b, n, kvn, d = case.batch, case.heads, case.kv_heads, case.d
    q = _randn(gen, b, case.sq, n, d, dtype=dt, device=device)
    k = _randn(gen, b, case.skv, kvn, d, dtype=dt, device=device)
    v = _randn(gen, b, case.skv, kvn, case.dv, dtype=dt, device=device)
    kw = dict(layout="BSND", num_heads=n, num_key_value_heads=kvn, scale=1.0 / math.sqrt(d))
    if case.causal:
        kw.update(atten_mask=torch.ones(2048, 2048, dtype=torch.bool, device=device).triu(1), sparse_mode=3)
    kv_k, kv_v = k, v
    if case.params.get("kv") == "int8":
        scale = torch.stack([x.abs().amax((0, 1)).float() / 127 for x in (k, v)])  # [2, KV_N, D] per channel
        kv_k, kv_v = ((x.float() / s).round().clamp(-128, 127).to(torch.int8) for x, s in zip((k, v), scale))
        k, v = (x.to(torch.int8).to(dt) * s.to(dt) for x, s in zip((kv_k, kv_v), scale))  # what SDPA sees
        kw.update(antiquant_scale=scale.to(dt), antiquant_mode=0)
    pages = case.params.get("pages", "shuffled")
    if case.op == "fia_decode" and pages != "dense":
        bs = case.params.get("block_size", 128)
        per_seq = case.skv // bs
        perm = (torch.arange(b * per_seq) if pages == "sequential"
                else torch.randperm(b * per_seq, generator=gen))
        kc = torch.empty(b * per_seq, bs, kvn * d, dtype=kv_k.dtype, device=device)
        vc = torch.empty(b * per_seq, bs, kvn * case.dv, dtype=kv_v.dtype, device=device)
        kc[perm] = kv_k.reshape(b * per_seq, bs, kvn * d)
        vc[perm] = kv_v.reshape(b * per_seq, bs, kvn * case.dv)
        kw.update(block_table=perm.view(b, per_seq).to(device=device, dtype=torch.int32), block_size=bs,
                  actual_seq_lengths_kv=[case.skv] * b, paged=(kc, vc))
    elif kv_k is not k:
        kw.update(paged=(kv_k, kv_v))  # dense int8 K/V
    return Inputs(q, k, v, None, kw, kw["scale"])


def kv_bytes(case: Case) -> int:
    """Bytes of K and V a decode call reads (an NSA decode operator: its :meth:`Case.decode_keys`)."""
    itemsize = 1 if case.params.get("kv") == "int8" else getattr(torch, case.dtype).itemsize
    keys = case.decode_keys() if case.op in NSA_INFER_OPS else case.skv
    return case.batch * keys * case.kv_heads * (case.d + case.dv) * itemsize


def build_read_bandwidth(case: Case, inp, device):
    """The machine's read speed for as many bytes as the case's KV: ``torch.sum`` over an fp32 tensor of that size
    (the ratio ``read-bandwidth / attnops`` is the fraction of the measured read bandwidth the operator reaches)."""
    data = torch.ones(kv_bytes(case) // 4, device=device)
    return Runnable(lambda: data.sum())


def build_fia(case: Case, inp, device):
    import attnops

    if case.mode != "fwd":
        raise ValueError("FusedInferAttentionScore is inference only (mode fwd)")
    kw = dict(inp.kwargs)
    k, v = kw.pop("paged", (inp.k, inp.v))
    state = {}

    def run():
        with torch.no_grad():
            state["out"] = attnops.fused_infer_attention(inp.q, k, v, **kw)
    return Runnable(run, output=lambda: state["out"].transpose(1, 2) if "out" in state else None)


def build_sdpa_gathered(case: Case, inp, device):
    import torch.nn.functional as F

    q, k, v = (t.transpose(1, 2).contiguous() for t in (inp.q, inp.k, inp.v))
    state = {}
    causal = case.causal and case.sq > 1  # bottom-right for prefill with Sq == Skv

    def run():
        with torch.no_grad():
            state["out"] = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=inp.scale,
                                                          enable_gqa=case.heads != case.kv_heads)
    return Runnable(run, output=lambda: state.get("out"))
