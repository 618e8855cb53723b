"""Check cases of the torch_npu ATB names beyond vllm-ascend's decode (SelfAttention over packed K/V, the prefill and
MLA forms of PagedAttention) and ``npu_scatter_nd_update_``, called as vllm-ascend and sglang call them and judged
against the FA golden on the dense K/V (bottom-right causal is sparse_mode 3)."""
from __future__ import annotations

import itertools

import torch

from .. import torch_npu as npu
from ..testing import golden, golden_fia
from ..testing.compare import fia_reduction
from .case import CheckCase, Comparison
from .fused_infer_attention import CAUSAL_2048, _randn

F16 = torch.float16
N, NKV, D = 4, 2, 32


def _fa_golden(q, k, v, q_lens, kv_lens, **mask) -> tuple[torch.Tensor, torch.Tensor]:
    kw = dict(head_num=N, input_layout="TND", scale=D ** -0.5, actual_seq_qlen=list(itertools.accumulate(q_lens)),
              actual_seq_kvlen=list(itertools.accumulate(kv_lens)), **mask)
    return golden.fa_forward(q, k, v, **kw)[0], golden.fa_forward(q, k, v, dtype=F16, **kw)[0]


def _packed(name: str):
    """``_npu_flash_attention`` (explicit causal mask), ``_v3`` (compressed causal mask), ``_unpad_v2`` (none)."""
    def run(_backend) -> list[Comparison]:
        lens = [21, 9, 34]
        t = sum(lens)
        q, k, v = _randn(t, N, D, dtype=F16, seed=60), _randn(t, NKV, D, dtype=F16, seed=61), \
            _randn(t, NKV, D, dtype=F16, seed=62)
        out, seq_len = torch.empty(t, N, D, dtype=F16), torch.tensor(lens, dtype=torch.int32)
        causal = torch.zeros(64, 64, dtype=F16).masked_fill(CAUSAL_2048[:64, :64], float("-inf"))
        if name == "_npu_flash_attention":
            npu._npu_flash_attention(q, k, v, causal, seq_len, D ** -0.5, N, NKV, out)
        elif name == "_npu_flash_attention_v3":
            npu._npu_flash_attention_v3(q, k, v, causal[:128, :128], seq_len, D ** -0.5, N, NKV, out=out)
        else:
            npu._npu_flash_attention_unpad_v2(q, k, v, seq_len, D ** -0.5, N, NKV, out=out)
        mask = {} if name.endswith("unpad_v2") else dict(atten_mask=CAUSAL_2048, sparse_mode=3)
        return [Comparison("out", out, *_fa_golden(q, k, v, lens, lens, **mask), reduction=D + max(lens))]
    return run


def _paged_prefill(name: str):
    """sglang's extend step: each request's new K/V written into a ``[pages, page, N_kv, D]`` pool with
    ``npu_scatter_nd_update_`` at its slots, then the new tokens attend causally to prefix + new tokens."""
    def run(_backend) -> list[Comparison]:
        ctx, new, page, pages = [40, 7, 19], [8, 7, 1], 16, 12
        table = torch.tensor([[5, 2, 9], [0, 0, 0], [11, 3, 0]], dtype=torch.int32)
        k, v = _randn(sum(ctx), NKV, D, dtype=F16, seed=63), _randn(sum(ctx), NKV, D, dtype=F16, seed=64)
        slots = torch.tensor([int(table[b, t // page]) * page + t % page for b, n in enumerate(ctx) for t in range(n)])
        k_pool, v_pool = torch.zeros(pages, page, NKV, D, dtype=F16), torch.zeros(pages, page, NKV, D, dtype=F16)
        npu.npu_scatter_nd_update_(k_pool.view(-1, NKV, D), slots.view(-1, 1), k)
        npu.npu_scatter_nd_update_(v_pool.view(-1, NKV, D), slots.view(-1, 1), v)
        q = _randn(sum(new), N, D, dtype=F16, seed=65)
        out = torch.empty(sum(new), N * D, dtype=F16)
        lens = (torch.tensor(new, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32))
        if name == "_npu_paged_attention_splitfuse":  # vllm-ascend: rows of the causal mask at each token's position
            positions = torch.tensor([c - n + i for n, c in zip(new, ctx) for i in range(n)])
            rows = torch.zeros(64, 64, dtype=F16).masked_fill(CAUSAL_2048[:64, :64], float("-inf"))[positions]
            npu._npu_paged_attention_splitfuse(q, k_pool, v_pool, table, lens[1], rows, lens[0], NKV, N, D ** -0.5,
                                               out.view(-1, N, D))
        elif name == "_npu_paged_attention_splitfuse_v2":
            npu._npu_paged_attention_splitfuse_v2(q, k_pool, v_pool, table, lens[1], torch.ones(128, 128, dtype=F16),
                                                  lens[0], NKV, N, D ** -0.5, out=out.view(-1, N, D))
        else:
            npu._npu_flash_attention_qlens(q.flatten(1), k_pool, v_pool, table, torch.ones(128, 128, dtype=F16),
                                           *lens, NKV, N, D ** -0.5, out)
        g = _fa_golden(q, k, v, new, ctx, atten_mask=CAUSAL_2048, sparse_mode=3)
        return [Comparison("out", out.view(-1, N, D), *g, reduction=D + max(ctx))]
    return run


def _paged_mla(_backend) -> list[Comparison]:
    """MLA decode over one latent cache ``[blocks, page, 1, 48]`` whose first 32 columns are the value."""
    lens, page, dk, dv = [37, 5, 16], 16, 48, 32
    table = torch.tensor([[6, 1, 9], [3, 0, 0], [2, 7, 0]], dtype=torch.int32)
    latent = _randn(3, max(lens), 1, dk, dtype=F16, seed=66)
    cache = torch.zeros(10, page, 1, dk, dtype=F16)
    for b, n in enumerate(lens):
        for t in range(n):
            cache[table[b, t // page], t % page] = latent[b, t]
    q = _randn(3, N, dk, dtype=F16, seed=67)
    out = torch.empty(3, N, dv, dtype=F16)
    npu._npu_paged_attention_mla(q, cache, 1, N, dk ** -0.5, table, torch.tensor(lens, dtype=torch.int32), dv, out)
    kw = dict(num_heads=N, num_key_value_heads=1, scale_value=dk ** -0.5, input_layout="BSND",
              actual_seq_lengths_kv=lens)
    g, base = (golden_fia.fia_forward(q.unsqueeze(1), latent, latent[..., :dv], dtype=dt, **kw)[0].squeeze(1)
               for dt in (torch.float64, F16))
    return [Comparison("out", out, g, base, reduction=fia_reduction(q.unsqueeze(1), latent, **kw))]


def cases() -> list[CheckCase]:
    packed = [("_npu_flash_attention", "explicit causal fp16 mask"), ("_npu_flash_attention_v3", "compressed mask"),
              ("_npu_flash_attention_unpad_v2", "no mask")]
    paged = [("_npu_flash_attention_qlens", "sglang [T, N*D] query"),
             ("_npu_paged_attention_splitfuse", "per-token mask rows"),
             ("_npu_paged_attention_splitfuse_v2", "compressed mask")]
    return ([CheckCase(name, f"TND fp16, three sequences, GQA 2, {what}", _packed(name)) for name, what in packed]
            + [CheckCase(f"npu_scatter_nd_update_ + {name}", f"fp16 prefix + new tokens, paged pool, GQA 2, {what}",
                         _paged_prefill(name)) for name, what in paged]
            + [CheckCase("_npu_paged_attention_mla", "fp16 decode, latent cache 48, value 32", _paged_mla)])
