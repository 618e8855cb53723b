"""Built-in torch_npu dialect check cases: the ``attnops.torch_npu`` functions called exactly as Ascend code calls
them (argument names, keyword-only options, output tuples), judged against the fp64 goldens. The inputs and the
judging come from the operator modules (:mod:`.flash_attention`, :mod:`.nsa`, :mod:`.fused_infer_attention`);
this module holds the torch_npu calls and the merge helpers' cases. Reference only: these functions dispatch
through the same custom ops as the aclnn rows."""
from __future__ import annotations

import torch

from .. import torch_npu as npu
from ..testing import golden, golden_fia, golden_nsa
from ..testing.compare import fa_reductions, fia_reduction
from .case import CheckCase, Comparison
from . import flash_attention as fa
from . import fused_infer_attention as fia
from . import nsa

F16 = torch.float16


def _call_fusion_attention(case: fa.FACase, _backend, q, k, v, dy, scale, drop_mask, o):
    """``npu_fusion_attention(_v2)`` then ``npu_fusion_attention_grad(_v2)`` with the forward's outputs."""
    v2 = case.api == "npu_v2"
    kw = dict(pse=o.get("pse"), atten_mask=o.get("atten_mask"), keep_prob=case.keep_prob, prefix=o.get("prefix"),
              actual_seq_qlen=o.get("actual_seq_qlen"), actual_seq_kvlen=o.get("actual_seq_kvlen"),
              sparse_mode=o.get("sparse_mode", 0))
    tokens = ("pre_tokens", "next_tokens") if v2 else ("pre_tockens", "next_tockens")
    kw.update({name: o.get(key, fa.INT_MAX) for name, key in zip(tokens, ("pre_tokens", "next_tokens"))})
    if v2:
        kw.update(pse_type=o.get("pse_type", 1), q_start_idx=[o.get("q_start_idx", 0)],
                  kv_start_idx=[o.get("kv_start_idx", 0)])
        out, smax, ssum, _, seed, offset, numels = npu.npu_fusion_attention_v2(
            q, k, v, case.head_num, case.layout, scale=scale, **kw)
        grads = npu.npu_fusion_attention_grad_v2(
            q, k, v, dy, case.head_num, case.layout, softmax_max=smax, softmax_sum=ssum, attention_in=out,
            scale_value=scale, seed=seed, offset=offset, numels=numels, **kw)
    else:
        out, smax, ssum, _, seed, offset, numels = npu.npu_fusion_attention(
            q, k, v, case.head_num, case.layout, scale=scale, **kw)
        grads = npu.npu_fusion_attention_grad(
            q, k, v, dy, case.head_num, case.layout, softmax_max=smax, softmax_sum=ssum, attention_in=out,
            scale_value=scale, seed=seed, offset=offset, numels=numels, **kw)
    return (out, smax, ssum), grads[:4]


def _fa_cases() -> list[CheckCase]:
    lens_q, lens_kv = [0, 17, 64, 100], [0, 20, 64, 130]  # cumulative: an empty batch, then 17, 47, 36 / 20, 44, 66
    items = [
        ("npu_fusion_attention(+_grad)", fa.FACase(
            "BSND causal fp16", "npu", "BSND", (2, 64, 4, 32), (2, 64, 4, 32), (2, 64, 4, 32), 4, F16,
            dict(atten_mask=fa.CAUSAL_2048, sparse_mode=2))),
        ("npu_fusion_attention(+_grad)", fa.FACase(
            "TND varlen causal, GQA 4", "npu", "TND", (100, 8, 32), (130, 2, 32), (130, 2, 32), 8,
            opts=dict(atten_mask=fa.CAUSAL_2048, sparse_mode=3, actual_seq_qlen=lens_q[1:],
                      actual_seq_kvlen=lens_kv[1:]))),
        ("npu_fusion_attention_v2(+_grad_v2)", fa.FACase(
            "BNSD ALiBi pse_type 2, start idx, band", "npu_v2", "BNSD", (2, 4, 32, 16), (2, 4, 32, 16),
            (2, 4, 32, 16), 4, opts=dict(pse=torch.tensor([0.5, 0.25, 0.125, 0.0625]), pse_type=2, q_start_idx=8,
                                         kv_start_idx=0, atten_mask=fa.CAUSAL_2048, sparse_mode=4, pre_tokens=12,
                                         next_tokens=8))),
    ]
    return [CheckCase(op, c.name, (lambda backend, c=c: fa._run(c, backend, _call_fusion_attention)))
            for op, c in items]


def _npu_fia(q, k, v, kw):
    renamed = dict(deq_scale1="dequant_scale1", deq_scale2="dequant_scale2", scale_value="scale")
    return npu.npu_fused_infer_attention_score(q, k, v, softmax_lse_flag=True,
                                               **{renamed.get(name, name): x for name, x in kw.items()})


def _npu_pfa(q, k, v, kw):
    return npu.npu_prompt_flash_attention(q, k, v, **kw), None


def _npu_ifa(q, k, v, kw):
    kw = dict(kw)
    return npu.npu_incre_flash_attention(q, k, v, actual_seq_lengths=kw.pop("actual_seq_lengths_kv"), **kw), None


def _decode_gqa_lengths():
    q = fia._randn(3, 1, 8 * 32, dtype=F16, seed=1)
    k, v = (fia._randn(3, 40, 2 * 32, dtype=F16, seed=s) for s in (2, 3))
    return q, k, v, dict(num_heads=8, num_key_value_heads=2, scale_value=32 ** -0.5, input_layout="BSH",
                         actual_seq_lengths_kv=[40, 17, 3])


def _fia_cases() -> list[CheckCase]:
    return [
        CheckCase("npu_fused_infer_attention_score", "BNSD decode bf16, paged cache, mask + pse",
                  fia._case("npu", fia._decode_paged_mask_pse, _npu_fia)),
        CheckCase("npu_fused_infer_attention_score", "TND prefill fp32, sparse_mode 3, GQA",
                  fia._case("npu", fia._tnd_causal, _npu_fia)),
        CheckCase("npu_prompt_flash_attention", "BSH prefill fp16, GQA 4, mask + pre/next, actual lengths",
                  fia._case("npu", fia._prefill_mask_gqa, _npu_pfa, with_lse=False)),
        CheckCase("npu_incre_flash_attention", "BSH decode fp16, GQA 4, per-batch KV lengths",
                  fia._case("npu", _decode_gqa_lengths, _npu_ifa, with_lse=False)),
        CheckCase("npu_fused_infer_attention_score", "TND MLA prefill fp16, query_rope/key_rope, causal",
                  _mla_prefill),
    ]


def _mla_prefill(_backend) -> list[Comparison]:
    """vllm-ascend's MLA prefill call (TND, ``query_rope``/``key_rope``, causal, lse) against the FIA golden on
    ``[q | q_rope]``, ``[k | k_rope]`` and ``[v | 0]`` (zero columns add nothing), cut back to Dv."""
    lens, n, d, dr = [9, 23], 4, 32, 16
    t = sum(lens)
    q, qr, k, kr, v = (fia._randn(t, n, e, dtype=F16, seed=20 + i) for i, e in enumerate((d, dr, d, dr, d)))
    cum = [lens[0], t]
    kw = dict(num_heads=n, input_layout="TND", actual_seq_lengths=cum, actual_seq_lengths_kv=cum, sparse_mode=3,
              atten_mask=fia.CAUSAL_2048, softmax_lse_flag=True)
    out, lse = npu.npu_fused_infer_attention_score(q, k, v, query_rope=qr, key_rope=kr, scale=(d + dr) ** -0.5, **kw)
    qq, kk, vv = torch.cat([q, qr], -1), torch.cat([k, kr], -1), torch.cat([v, torch.zeros_like(kr)], -1)
    g = golden_fia.fia_forward(qq, kk, vv, scale_value=(d + dr) ** -0.5, **kw)
    base = golden_fia.fia_forward(qq, kk, vv, scale_value=(d + dr) ** -0.5, dtype=F16, **kw)
    red = fia_reduction(q, k, query_rope=qr, **kw)
    return [Comparison("attention_out", out, g[0][..., :d], base[0][..., :d], reduction=red),
            Comparison("softmax_lse", lse, g[1], base[1], reduction=red)]


def _nsa_select_infer(_backend) -> list[Comparison]:
    """One decode token per request over a shuffled paged cache, blocks cut at the length, -1 padding."""
    b, n, n2, d, dv, page, block, count = 3, 4, 2, 32, 16, 16, 32, 3
    lens, blocks = [70, 33, 96], 20
    table = torch.stack([torch.randperm(blocks, generator=torch.Generator().manual_seed(i))[:6] for i in range(b)])
    topk = torch.tensor([[[2, 0, -1], [1, 2, 0]], [[1, 1, 0], [0, -1, -1]], [[2, 1, 0], [0, 2, -1]]])
    q = fia._randn(b, n, d, dtype=F16, seed=30)
    kc, vc = fia._randn(blocks, page, n2, d, dtype=F16, seed=31), fia._randn(blocks, page, n2, dv, dtype=F16, seed=32)
    out = npu.npu_nsa_select_attention_infer(q.unsqueeze(1), kc, vc, topk.int(), d ** -0.5, n, n2, block, count, page,
                                             layout="BSND", block_table=table.int(), actual_seq_kvlen=lens)
    g = golden_nsa.nsa_select_attention_infer(q, kc, vc, topk, table, lens, d ** -0.5, block)
    base = golden_nsa.nsa_select_attention_infer(q, kc, vc, topk, table, lens, d ** -0.5, block, dtype=F16)
    return [Comparison("attention_out", out.squeeze(1), g, base, reduction=d + count * block)]  # over the selected keys


def _nsa_compress_attention_infer(_backend) -> list[Comparison]:
    """One decode token per request over a shuffled paged cache of compressed keys: output and top-k blocks."""
    b, n, n2, d, dv, page, blocks = 2, 4, 2, 32, 16, 16, 12
    lens, cmp_block, stride, sel, count = [70, 45], 32, 16, 64, 6
    table = torch.stack([torch.randperm(blocks, generator=torch.Generator().manual_seed(i))[:5] for i in range(b)])
    q = fia._randn(b, n, d, dtype=F16, seed=40)
    kc, vc = fia._randn(blocks, page, n2, d, dtype=F16, seed=41), fia._randn(blocks, page, n2, dv, dtype=F16, seed=42)
    out, topk = npu.npu_nsa_compress_attention_infer(q, kc.flatten(-2), vc.flatten(-2), d ** -0.5, n, n2, sel, count,
                                                     page, cmp_block, stride, block_table=table.int(),
                                                     actual_cmp_seq_kvlen=lens)
    args = (q, kc, vc, table, lens, d ** -0.5, cmp_block, stride, sel, count)
    g_out, g_topk = golden_nsa.nsa_compress_attention_infer(*args)
    base, _ = golden_nsa.nsa_compress_attention_infer(*args, dtype=F16)
    return [Comparison("attention_out", out, g_out, base, reduction=d + max(lens)),
            Comparison("topk_indices (equal)", topk.double(), g_topk.double(), g_topk.double())]


def _nsa_compress_infer(_backend) -> list[Comparison]:
    """Compressing the last block of each request into a cache; a request that ends no block keeps its row."""
    kv, w = fia._randn(10, 16, 2, 32, dtype=F16, seed=50), fia._randn(32, 2, dtype=F16, seed=51) / 32
    table = torch.tensor([[3, 7, 0, 9], [5, 1, 8, 2], [4, 6, 1, 0]])
    slots, lens = torch.tensor([2, 0, 1]), [48, 43, 64]
    cache = fia._randn(4, 2, 32, dtype=F16, seed=52)
    before = cache.clone()
    npu.npu_nsa_compress_infer(kv, w, slots, 32, 16, 16, block_table=table, actual_seq_len=lens, cache=cache)
    golden = golden_nsa.nsa_compress_infer_cache(kv, w, slots, table, lens, 32, 16, before)
    base = golden_nsa.nsa_compress_infer_cache(kv, w, slots, table, lens, 32, 16, before, dtype=F16)
    return [Comparison("cache", cache, golden, base, reduction=32)]  # one compression block


def _nsa_cases() -> list[CheckCase]:
    return [
        CheckCase("npu_nsa_compress(+_grad)", "fp16 varlen, short seq", nsa._compress(F16, "npu", [128, 20, 144])),
        CheckCase("npu_nsa_select_attention(+_grad)", "fp32 GQA 2, causal",
                  nsa._selected(torch.float32, "npu", [12, 20], [32, 48], 4, 2, 32, 16, 16, 2, True)),
        CheckCase("npu_nsa_compress_attention", "fp16 top-k, GQA 2",
                  nsa._compress_attention(F16, [40, 33], [18, 15], 4, 2, 32, 16, 32, 16, 64, 2, via="npu")),
        CheckCase("npu_nsa_select_attention_infer", "BSND decode fp16, paged cache, GQA 2, -1 padding",
                  _nsa_select_infer),
        CheckCase("npu_nsa_compress_infer.cache", "fp16, blocks over two pages, a request that ends no block",
                  _nsa_compress_infer),
        CheckCase("npu_nsa_compress_attention_infer", "TND decode fp16, paged (blocknum, page, H) cache, top-6",
                  _nsa_compress_attention_infer),
    ]


def _ring_attention_update(_backend) -> list[Comparison]:
    """Two halves of the keys through ``npu_fusion_attention`` (SBH), merged by ``npu_ring_attention_update``,
    against the golden of attention over all keys."""
    s, b, n, d, skv = 24, 2, 4, 16, 40
    q = fia._randn(s, b, n * d, dtype=F16, seed=1)
    k, v = (fia._randn(skv, b, n * d, dtype=F16, seed=i) for i in (2, 3))
    halves = [npu.npu_fusion_attention(q, k[part], v[part], n, "SBH", scale=d ** -0.5)[:3]
              for part in (slice(0, skv // 2), slice(skv // 2, skv))]
    merged = npu.npu_ring_attention_update(*halves[0], *halves[1], input_layout="SBH")
    kw = dict(head_num=n, input_layout="SBH", scale=d ** -0.5)
    gold, base = golden.fa_forward(q, k, v, **kw), golden.fa_forward(q, k, v, dtype=F16, **kw)
    red = fa_reductions(q, k, v, layout="SBH", head_num=n)["out"]
    return [Comparison(name, a, g, bl, reduction=red)
            for name, a, g, bl in zip(("attn_out", "softmax_max", "softmax_sum"), merged, gold, base)]


def _attention_update(_backend) -> list[Comparison]:
    """Decode against two halves of the KV through ``npu_fused_infer_attention_score`` (BSND, lse on), merged by
    ``npu_attention_update``, against the golden of decoding over the whole KV."""
    b, n, nkv, d, skv = 3, 4, 2, 32, 48
    q = fia._randn(b, 1, n, d, dtype=F16, seed=1)
    k, v = (fia._randn(b, skv, nkv, d, dtype=F16, seed=i) for i in (2, 3))
    kw = dict(num_heads=n, num_key_value_heads=nkv, scale_value=d ** -0.5, input_layout="BSND")
    parts = [_npu_fia(q, k[:, part], v[:, part], kw) for part in (slice(0, 20), slice(20, skv))]
    out, lse = npu.npu_attention_update([p[1].reshape(-1) for p in parts], [p[0].reshape(b * n, d) for p in parts], 1)
    g = golden_fia.fia_forward_detail(q, k, v, **kw, softmax_lse_flag=True)
    base = golden_fia.fia_forward_detail(q, k, v, **kw, softmax_lse_flag=True, dtype=F16)
    red = fia_reduction(q, k, **kw)
    return [Comparison("out", out, g.out.reshape(b * n, d), base.out.reshape(b * n, d), reduction=red),
            Comparison("lse_out", lse, g.lse.reshape(-1), base.lse.reshape(-1), reduction=red)]


def _paged_cache_write_and_decode(_backend) -> list[Comparison]:
    """vllm-ascend's decode step: K/V written with ``npu_scatter_pa_kv_cache`` (ND cache) at a slot mapping, one new
    token per request attended with ``_npu_paged_attention``, against the FIA golden on the gathered K/V."""
    b, n, nkv, d, page, blocks = 3, 8, 2, 32, 16, 12
    lens = [37, 5, 16]
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(40))[:9].view(b, 3).int()
    kc, vc = torch.zeros(blocks, page, nkv, d, dtype=F16), torch.zeros(blocks, page, nkv, d, dtype=F16)
    k, v = (fia._randn(b, max(lens), nkv, d, dtype=F16, seed=i) for i in (41, 42))
    slots = torch.tensor([int(table[i, t // page]) * page + t % page for i in range(b) for t in range(lens[i])])
    tokens = [torch.cat([x[i, :lens[i]] for i in range(b)]) for x in (k, v)]
    npu.npu_scatter_pa_kv_cache(tokens[0], tokens[1], kc, vc, slots, cache_mode="Norm")
    q = fia._randn(b, n, d, dtype=F16, seed=43)
    out = torch.empty(b, n, d, dtype=F16)
    npu._npu_paged_attention(q, kc, vc, nkv, n, d ** -0.5, table, torch.tensor(lens, dtype=torch.int32), out)
    kw = dict(num_heads=n, num_key_value_heads=nkv, scale_value=d ** -0.5, input_layout="BSND",
              actual_seq_lengths_kv=lens)
    g = golden_fia.fia_forward(q.unsqueeze(1), k, v, **kw)[0].squeeze(1)
    base = golden_fia.fia_forward(q.unsqueeze(1), k, v, dtype=F16, **kw)[0].squeeze(1)
    return [Comparison("out", out, g, base, reduction=fia_reduction(q.unsqueeze(1), k, **kw))]


def _gather_and_unpad(_backend) -> list[Comparison]:
    """A context load with ``npu_gather_pa_kv_cache`` (NZ cache, cumulative lengths) then encoder attention with
    ``_npu_flash_attention_unpad`` on the loaded K/V, against the FA golden on the original K/V."""
    n, nkv, d, page, lens = 4, 2, 16, 16, [20, 11]
    t = sum(lens)
    k, v, q = fia._randn(t, nkv, d, dtype=F16, seed=50), fia._randn(t, nkv, d, dtype=F16, seed=51), \
        fia._randn(t, n, d, dtype=F16, seed=52)
    kc, vc = (torch.zeros(6, nkv * d // 16, page, 16, dtype=F16) for _ in range(2))
    table = torch.tensor([[4, 1], [5, 0]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, i // page]) * page + i % page for i in range(lens[0])]
                         + [int(table[1, i // page]) * page + i % page for i in range(lens[1])])
    npu.npu_scatter_pa_kv_cache(k, v, kc, vc, slots)
    kk, vv = torch.zeros_like(k), torch.zeros_like(v)
    npu.npu_gather_pa_kv_cache(kc, vc, table, torch.tensor([0, lens[0], t], dtype=torch.int32), kk, vv,
                               is_seq_lens_cumsum=True)
    out = torch.empty(t, n, d, dtype=F16)
    npu._npu_flash_attention_unpad(q, kk, vv, torch.tensor(lens, dtype=torch.int32), d ** -0.5, n, nkv, out)
    kw = dict(head_num=n, input_layout="TND", scale=d ** -0.5, actual_seq_qlen=[lens[0], t],
              actual_seq_kvlen=[lens[0], t])
    return [Comparison("out", out, golden.fa_forward(q, k, v, **kw)[0],
                       golden.fa_forward(q, k, v, dtype=F16, **kw)[0],
                       reduction=fa_reductions(q, k, v, layout="TND", head_num=n, actual_seq_qlen=[lens[0], t],
                                               actual_seq_kvlen=[lens[0], t])["out"])]


def cases() -> list[CheckCase]:
    return _fa_cases() + _fia_cases() + _nsa_cases() + [
        CheckCase("npu_scatter_pa_kv_cache + _npu_paged_attention", "BSND decode fp16, ND paged cache, GQA 4",
                  _paged_cache_write_and_decode),
        CheckCase("npu_gather_pa_kv_cache + _npu_flash_attention_unpad", "fp16 NZ cache, two packed sequences",
                  _gather_and_unpad),
        CheckCase("npu_ring_attention_update", "SBH fp16, two KV halves vs all keys", _ring_attention_update),
        CheckCase("npu_attention_update", "BSND decode fp16, two KV halves (FIA lse) vs whole KV", _attention_update),
    ]
