"""The DeepSeek-V4 dialects against the fp64 goldens: ops-transformer's ``cann_ops_transformer`` ops, vllm-ascend's
``torch.ops._C_ascend`` ops (through the shim) and the aclnn operators; their exact signatures, the names errors use
and the ops whose math is not public."""
from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch

from attnops import AclnnError, aclnn, cann_ops_transformer as cot
from attnops.testing import golden_compressor as GC
from attnops.testing import golden_indexer_v2 as GI
from attnops.torch_npu import dsv4 as va

from ..ops.dsv4.helpers import Case, expected, golden, hca, make_parts, pack, rows_of

INT64_MAX = 2**63 - 1
CASES = {"swa": Case([5, 9], [12, 9]), "hca": hca([5, 9], [13, 9]), "csa": hca([5, 9], [13, 9], topk=3)}
LAYOUTS = [("BSND", "BSND"), ("TND", "TND"), ("TND", "PA_BBND")]


def _ot_kwargs(kw: dict) -> dict:
    """The core's arguments (helpers.pack) under ops-transformer's names."""
    kw = dict(kw)
    kw["softmax_scale"] = kw.pop("scale")
    return kw


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def _check_attention(case, parts, starts, out, lse):
    got_out, got_lse = rows_of(out, lse)
    want_out, want_lse = expected(case, parts, starts, got_out.shape[0])
    torch.testing.assert_close(got_out.double(), want_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(got_lse.double(), want_lse, atol=1e-12, rtol=0)


@pytest.mark.parametrize("layouts", LAYOUTS)
@pytest.mark.parametrize("branch", sorted(CASES))
def test_ot_sparse_flash_mla_matches_golden(branch, layouts):
    case = CASES[branch]
    parts = make_parts(case)
    kw, starts = pack(case, parts, *layouts)
    kw = _ot_kwargs(kw)
    out, lse = cot.sparse_flash_mla(kw.pop("q"), return_softmax_lse=True, **kw)
    _check_attention(case, parts, starts, out, lse)


def test_ot_sparse_flash_mla_ignores_kv_prefix_sums_with_paged_caches():
    """ops-transformer's own test passes cu_seqlens_ori_kv / _cmp_kv with PA_BBND (the NPU ignores them): the paged
    lengths are seqused_*, whatever the prefix sums say."""
    case = CASES["csa"]
    parts = make_parts(case)
    kw, starts = pack(case, parts, "TND", "PA_BBND")
    kw = _ot_kwargs(kw)
    out, lse = cot.sparse_flash_mla(kw.pop("q"), return_softmax_lse=True, cu_seqlens_ori_kv=_i32([0, 100, 250]),
                                    cu_seqlens_cmp_kv=_i32([0, 1, 2]), **kw)
    _check_attention(case, parts, starts, out, lse)


def test_metadata_hints_bound_the_valid_lengths():
    """A segment longer than its seqused (ops-transformer's padding case): max_seqlen_* bounds seqused_*."""
    lengths = dict(cu_seqlens_ori_kv=_i32([0, 38]), seqused_ori_kv=_i32([22]))
    assert cot.sparse_flash_mla_metadata(128, 1, 512, max_seqlen_ori_kv=22, **lengths).shape == (1024,)
    with pytest.raises(ValueError, match="^seqused_ori_kv: expected per-batch lengths <= max_seqlen_ori_kv=21"):
        cot.sparse_flash_mla_metadata(128, 1, 512, max_seqlen_ori_kv=21, **lengths)
    with pytest.raises(ValueError, match="^cu_seqlens_ori_kv: expected per-batch lengths <= max_seqlen_ori_kv=22"):
        cot.sparse_flash_mla_metadata(128, 1, 512, max_seqlen_ori_kv=22, cu_seqlens_ori_kv=_i32([0, 38]))


def test_ot_sparse_flash_mla_lse_placeholder_and_reserved_arguments():
    case = CASES["swa"]
    kw, _ = pack(case, make_parts(case), "BSND", "BSND")
    kw = _ot_kwargs(kw)
    q = kw.pop("q")
    out, lse = cot.sparse_flash_mla(q, metadata=cot.sparse_flash_mla_metadata(3, 1, 8), **kw)
    assert out.shape == q.shape and lse.shape == () and lse.dtype == torch.float32
    for name in ("ori_sparse_indices", "ori_topk_length", "cmp_topk_length"):
        with pytest.raises(ValueError, match=f"^{name}: expected None"):
            cot.sparse_flash_mla(q, **{name: torch.zeros(2, dtype=torch.int32)}, **kw)
    with pytest.raises(ValueError, match="^topk_value_mode: "):
        cot.sparse_flash_mla(q, topk_value_mode=2, **kw)


def test_ot_sparse_flash_mla_grad_matches_autograd_of_the_golden():
    case = hca([4, 6], [9, 6], topk=2)
    parts = make_parts(case)
    kw, starts = pack(case, parts, "TND", "TND")
    kw = _ot_kwargs(kw)
    q = kw.pop("q")
    out, lse = cot.sparse_flash_mla(q, return_softmax_lse=True, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    d_q, d_ori, d_cmp, d_sinks, ori_l1, cmp_l1 = cot.sparse_flash_mla_grad(q, dout, out, lse, **kw)
    leaves = [q.clone().requires_grad_(), kw["ori_kv"].clone().requires_grad_(),
              kw["cmp_kv"].clone().requires_grad_(), kw["sinks"].clone().requires_grad_()]
    args = {**kw, "ori_kv": leaves[1], "cmp_kv": leaves[2], "sinks": leaves[3]}
    ref = cot.sparse_flash_mla(leaves[0], **args)[0]
    want = torch.autograd.grad(ref, leaves, dout)
    for got, w in zip((d_q, d_ori, d_cmp, d_sinks), want):
        torch.testing.assert_close(got, w, atol=1e-12, rtol=0)
    assert ori_l1 is None and cmp_l1.shape == kw["cmp_sparse_indices"].shape
    golden_out = torch.cat([o for o, _ in golden(case, parts)])
    torch.testing.assert_close(ref.detach(), golden_out, atol=1e-12, rtol=0)


@pytest.mark.parametrize("layouts", [("TND", "PA_ND"), ("BSND", "BSND"), ("TND", "TND")])
@pytest.mark.parametrize("branch", sorted(CASES))
def test_vllm_sharedkv_matches_golden(branch, layouts):
    """One ``seqused_kv`` (ori lengths): the compressed lengths and residuals are derived as on the NPU
    (``seqused_q`` is ignored, as by vllm-ascend's build: BSND queries of equal lengths)."""
    case = CASES[branch]
    if layouts[0] == "BSND":
        case = dataclasses.replace(case, q_lens=[5, 5])
    parts = make_parts(case)
    layout_q, layout_kv = layouts
    kw, starts = pack(case, parts, layout_q, "PA_BBND" if layout_kv == "PA_ND" else layout_kv)
    kw = _ot_kwargs(kw)
    for name in ("seqused_cmp_kv", "cmp_residual_kv"):
        kw.pop(name, None)
    if "seqused_ori_kv" in kw:
        kw["seqused_kv"] = kw.pop("seqused_ori_kv")
    out, lse = va.C_ASCEND_DSV4_OPS["npu_sparse_attn_sharedkv"](kw.pop("q"), return_softmax_lse=True,
                                                                 **{**kw, "layout_kv": layout_kv})
    _check_attention(case, parts, starts, out, lse)


def test_vllm_sharedkv_default_scale_is_inverse_sqrt_head_dim():
    case = Case([3], [7], scale=8 ** -0.5)
    parts = make_parts(case)
    kw, starts = pack(case, parts, "TND", "PA_BBND")
    kw = _ot_kwargs(kw)
    del kw["softmax_scale"]
    kw["seqused_kv"] = kw.pop("seqused_ori_kv")
    kw["cmp_ratio"] = 0
    out, _ = va.npu_sparse_attn_sharedkv(kw.pop("q"), layout_kv="PA_ND", **{k: v for k, v in kw.items()
                                                                             if k != "layout_kv"})
    torch.testing.assert_close(out, expected(case, parts, starts, out.shape[0])[0], atol=1e-12, rtol=0)


def _compressor_inputs(coff, ratio=4, dim=16, hidden=32):
    g = torch.Generator().manual_seed(coff)
    x = torch.randn(2 * ratio + 3, hidden, generator=g, dtype=torch.float64)
    wkv, wgate = (torch.randn(coff * dim, hidden, generator=g, dtype=torch.float64) * hidden ** -0.5
                  for _ in range(2))
    ape = torch.randn(ratio, coff * dim, generator=g)
    state = torch.zeros(4, 16, 2 * coff * dim, dtype=torch.float64)
    table = torch.tensor([[1, 2]], dtype=torch.int32)
    cu = torch.tensor([0, x.shape[0]], dtype=torch.int32)
    return x, wkv, wgate, state, ape, table, cu


@pytest.mark.parametrize("coff", [1, 2])
def test_ot_compressor_matches_golden(coff):
    x, wkv, wgate, state, ape, table, cu = _compressor_inputs(coff)
    out = cot.compressor(x, wkv, wgate, state, ape, 4, state_block_table=table, cu_seqlens=cu, coff=coff)
    want, _ = GC.compress(x, wkv, wgate, ape, coff=coff)
    torch.testing.assert_close(out[:want.shape[0]], want, atol=1e-12, rtol=0)


def test_vllm_compressor_norm_rope_matches_golden():
    x, wkv, wgate, state, ape, table, cu = _compressor_inputs(2)
    rows = min(x.shape[0], x.shape[0] // 4 + 1)
    g = torch.Generator().manual_seed(9)
    weight = torch.randn(16, generator=g, dtype=torch.float64)
    sin, cos = (torch.randn(rows, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out = va.C_ASCEND_DSV4_OPS["compressor"](x, wkv, wgate, state, ape, weight, sin, cos, table, cu, None, None, 8, 4,
                                            2, 1e-6, 2, 1)
    plain, _ = GC.compress(x, wkv, wgate, ape, coff=2)
    n = plain.shape[0]
    want = GC.rms_norm_rope(plain, weight, sin[:n], cos[:n], eps=1e-6, rope_head_dim=8, rotary_mode=2)
    torch.testing.assert_close(out[:n], want, atol=1e-12, rtol=0)


def _indexer_inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 9, 3, 16, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(1, 3, 1, 16, generator=g, dtype=torch.float64).to(dtype)
    w = torch.rand(1, 9, 3, generator=g, dtype=torch.float64)
    return q, k, w


def _indexer_golden(q, k, w, topk, residual):
    idx, vals = GI.lightning_indexer_v2(q[0], k[0, :, 0], w[0], topk, mask_mode=3, cmp_ratio=4, residual=residual)
    return torch.tensor(idx, dtype=torch.int32), torch.tensor(vals, dtype=torch.float64)


def test_ot_lightning_indexer_matches_golden():
    q, k, w = _indexer_inputs()
    idx, vals = cot.lightning_indexer(q, k, w, 2, cmp_residual_k=torch.tensor([1]), mask_mode=3, cmp_ratio=4,
                                      return_value=1, metadata=cot.lightning_indexer_metadata(3, 1, 16, 2))
    want_idx, want_vals = _indexer_golden(q, k, w, 2, 1)
    assert torch.equal(idx[0, :, 0], want_idx)
    torch.testing.assert_close(vals[0, :, 0], want_vals, atol=1e-12, rtol=0)
    assert cot.lightning_indexer(q, k, w, 2)[1].shape == (0,)


def test_vllm_quant_indexer_matches_golden_on_dequantised_inputs():
    """vllm-ascend's call form: TND query with cumulative lengths without a leading 0, ori key lengths."""
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-8, 8, (9, 3, 16), generator=g, dtype=torch.int8)
    k = torch.randint(-8, 8, (2, 4, 1, 16), generator=g, dtype=torch.int8)  # paged: 2 blocks of 4
    sq, sk = torch.rand(9, 3, generator=g) + 0.5, torch.rand(2, 4, 1, generator=g) + 0.5
    w = torch.rand(9, 3, generator=g)
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    idx, vals = va.C_ASCEND_DSV4_OPS["npu_vllm_quant_lightning_indexer"](
        q, k, w, sq, sk, actual_seq_lengths_query=torch.tensor([9]), actual_seq_lengths_key=torch.tensor([22]),
        block_table=table, layout_query="TND", layout_key="PA_BSND", sparse_count=3, cmp_ratio=4, return_value=True)
    keys = torch.cat([k[1], k[0]])[:5, 0].double() * torch.cat([sk[1], sk[0]])[:5].double()
    want_idx, want_vals = GI.lightning_indexer_v2((q.double() * sq.double()[..., None]), keys, w.double(), 3,
                                                  mask_mode=3, cmp_ratio=4, residual=2)
    assert idx[:, 0].tolist() == want_idx
    torch.testing.assert_close(vals[:, 0].double(), torch.tensor(want_vals, dtype=torch.float64), atol=1e-5,
                               rtol=1e-6)


def test_metadata_ops_return_int32_zeros():
    lens = torch.tensor([5, 9], dtype=torch.int32)
    for md in (cot.sparse_flash_mla_metadata(64, 1, 512, seqused_ori_kv=lens),
               cot.sparse_flash_mla_grad_metadata(64, 1, 512, None, None, None, None, lens),
               cot.lightning_indexer_metadata(64, 1, 128, 512, seqused_k=lens),
               va.npu_sparse_attn_sharedkv_metadata(64, 1, 512, seqused_kv=lens, device="npu:0"),
               va.npu_kv_quant_sparse_attn_sharedkv_metadata(64, 1, 512, 1, seqused_kv=lens, tile_size=64,
                                                              rope_head_dim=64),
               va.npu_vllm_quant_lightning_indexer_metadata(64, 1, 128, 0, 0, actual_seq_lengths_key=lens)):
        assert md.dtype == torch.int32 and md.shape == (1024,) and not md.any()


@pytest.mark.parametrize("call,name", [
    (lambda q, kv: cot.sparse_flash_mla(q, ori_kv=kv, softmax_scale=math.inf), "softmax_scale"),
    (lambda q, kv: va.npu_sparse_attn_sharedkv(q, ori_kv=kv, layout_kv="PA_ND",
                                               ori_block_table=torch.zeros(2, 2, dtype=torch.int32)), "seqused_kv"),
    (lambda q, kv: cot.lightning_indexer(q[..., :16], kv[..., :15], torch.rand(2, 4, 3), 2), "k"),
    (lambda q, kv: cot.lightning_indexer(q[..., :16], kv[..., :16], torch.rand(2, 4, 2), 2), "w"),
    (lambda q, kv: va.npu_vllm_quant_lightning_indexer(
        q[..., :16].to(torch.int8), kv[..., :16].to(torch.int8), torch.rand(2, 4, 3), torch.rand(2, 4, 3),
        torch.rand(2, 5, 1), sparse_count=0), "sparse_count"),
    (lambda q, kv: va.npu_vllm_quant_lightning_indexer(
        q[..., :16].to(torch.int8), kv[..., :16].to(torch.int8), torch.rand(2, 4, 3), torch.rand(2, 4, 3),
        torch.rand(2, 5, 1), cmp_ratio=4), "actual_seq_lengths_key"),
    (lambda q, kv: va.npu_sparse_attn_sharedkv_metadata(64, 1, 512, cu_seqlens_q=_i32([0, 3, 5]),
                                                        seqused_kv=_i32([4])), "seqused_kv"),
    (lambda q, kv: va.npu_vllm_quant_lightning_indexer_metadata(64, 1, 128, 0, 0, actual_seq_lengths_query=_i32([3]),
                                                                actual_seq_lengths_key=_i32([4, 5])),
     "actual_seq_lengths_key"),
])
def test_errors_name_the_dialects_arguments(call, name):
    q, kv = torch.randn(2, 4, 3, 32), torch.randn(2, 5, 1, 32)
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        call(q, kv)


def test_unpublished_ops_raise_naming_the_op():
    for name in va.NOT_PUBLIC:
        with pytest.raises(NotImplementedError, match=f"_C_ascend.{name}: .*not"):
            va.C_ASCEND_DSV4_OPS[name](torch.zeros(1))


SIGNATURES = {
    cot.sparse_flash_mla: "(q, *, ori_kv=None, cmp_kv=None, ori_sparse_indices=None, cmp_sparse_indices=None, "
    "ori_block_table=None, cmp_block_table=None, cu_seqlens_q=None, cu_seqlens_ori_kv=None, cu_seqlens_cmp_kv=None, "
    "seqused_q=None, seqused_ori_kv=None, seqused_cmp_kv=None, cmp_residual_kv=None, ori_topk_length=None, "
    "cmp_topk_length=None, sinks=None, metadata=None, softmax_scale=1.0, cmp_ratio=1, ori_mask_mode=4, "
    "cmp_mask_mode=3, ori_win_left=127, ori_win_right=0, layout_q='BSND', layout_kv='BSND', topk_value_mode=1, "
    "return_softmax_lse=False)",
    cot.compressor: "(x, wkv, wgate, state_cache, ape, cmp_ratio=4, *, state_block_table=None, cu_seqlens=None, "
    "seqused=None, start_pos=None, coff=1, cache_mode=1)",
    cot.lightning_indexer: "(q, k, w, topk, *, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, "
    "cmp_residual_k=None, block_table=None, output_idx_offset=None, metadata=None, max_seqlen_q=-1, "
    "layout_q='BSND', layout_k='BSND', mask_mode=0, cmp_ratio=1, return_value=0)",
    va.npu_sparse_attn_sharedkv: "(q, *, ori_kv=None, cmp_kv=None, ori_sparse_indices=None, "
    "cmp_sparse_indices=None, ori_block_table=None, cmp_block_table=None, cu_seqlens_q=None, cu_seqlens_ori_kv=None, "
    "cu_seqlens_cmp_kv=None, seqused_q=None, seqused_kv=None, sinks=None, metadata=None, softmax_scale=0, "
    "cmp_ratio=0, ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=128, ori_win_right=0, layout_q='BSND', "
    "layout_kv='PA_ND', return_softmax_lse=False)",
    va.npu_vllm_quant_lightning_indexer: "(query, key, weights, query_dequant_scale, key_dequant_scale, "
    "query_quant_mode=0, key_quant_mode=0, actual_seq_lengths_query=None, actual_seq_lengths_key=None, "
    f"block_table=None, metadata=None, layout_query='BSND', layout_key='BSND', sparse_count=2048, sparse_mode=3, "
    f"pre_tokens={INT64_MAX}, next_tokens={INT64_MAX}, cmp_ratio=1, return_value=False)",
    cot.sparse_flash_mla_grad: "(q, dout, attn_out, softmax_lse, ori_kv=None, cmp_kv=None, ori_sparse_indices=None, "
    "cmp_sparse_indices=None, cu_seqlens_q=None, cu_seqlens_ori_kv=None, cu_seqlens_cmp_kv=None, seqused_q=None, "
    "seqused_ori_kv=None, seqused_cmp_kv=None, cmp_residual_kv=None, ori_topk_length=None, cmp_topk_length=None, "
    "sinks=None, metadata=None, softmax_scale=None, cmp_ratio=None, ori_mask_mode=0, cmp_mask_mode=0, "
    "ori_win_left=-1, ori_win_right=-1, layout_q='BSND', layout_kv='BSND')",
    cot.sparse_flash_mla_metadata: "(num_heads_q, num_heads_kv, head_dim, *, cu_seqlens_q=None, "
    "cu_seqlens_ori_kv=None, cu_seqlens_cmp_kv=None, seqused_q=None, seqused_ori_kv=None, seqused_cmp_kv=None, "
    "cmp_residual_kv=None, ori_topk_length=None, cmp_topk_length=None, batch_size=None, max_seqlen_q=None, "
    "max_seqlen_ori_kv=None, max_seqlen_cmp_kv=None, ori_topk=None, cmp_topk=None, cmp_ratio=None, "
    "ori_mask_mode=None, cmp_mask_mode=None, ori_win_left=None, ori_win_right=None, layout_q=None, layout_kv=None, "
    "has_ori_kv=None, has_cmp_kv=None)",
    cot.sparse_flash_mla_grad_metadata: "(num_heads_q, num_heads_kv, head_dim, cu_seqlens_q=None, "
    "cu_seqlens_ori_kv=None, cu_seqlens_cmp_kv=None, seqused_q=None, seqused_ori_kv=None, seqused_cmp_kv=None, "
    "cmp_residual_kv=None, ori_topk_length=None, cmp_topk_length=None, batch_size=None, max_seqlen_q=None, "
    "max_seqlen_ori_kv=None, max_seqlen_cmp_kv=None, ori_topk=None, cmp_topk=None, cmp_ratio=None, "
    "ori_mask_mode=0, cmp_mask_mode=0, ori_win_left=-1, ori_win_right=-1, layout_q='BSND', layout_kv='BSND', "
    "has_ori_kv=True, has_cmp_kv=True)",
    cot.lightning_indexer_metadata: "(num_heads_q, num_heads_k, head_dim, topk, *, cu_seqlens_q=None, "
    "cu_seqlens_k=None, seqused_q=None, seqused_k=None, cmp_residual_k=None, batch_size=None, max_seqlen_q=None, "
    "max_seqlen_k=None, layout_q=None, layout_k=None, mask_mode=None, cmp_ratio=None)",
    va.npu_sparse_attn_sharedkv_metadata: "(num_heads_q, num_heads_kv, head_dim, cu_seqlens_q=None, "
    "cu_seqlens_ori_kv=None, cu_seqlens_cmp_kv=None, seqused_q=None, seqused_kv=None, batch_size=0, "
    "max_seqlen_q=0, max_seqlen_kv=0, ori_topk=0, cmp_topk=0, cmp_ratio=4, ori_mask_mode=4, cmp_mask_mode=3, "
    "ori_win_left=128, ori_win_right=0, layout_q='BSND', layout_kv='PA_ND', has_ori_kv=True, has_cmp_kv=True, "
    "device='npu')",
    va.compressor: "(x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, rope_cos, state_block_table, "
    "cu_seqlens, seqused, start_pos, rope_head_dim, cmp_ratio, coff, norm_eps, rotary_mode, cache_mode)",
    va.npu_vllm_quant_lightning_indexer_metadata: "(num_heads_q, num_heads_k, head_dim, query_quant_mode, "
    "key_quant_mode, actual_seq_lengths_query=None, actual_seq_lengths_key=None, batch_size=0, max_seqlen_q=0, "
    "max_seqlen_k=0, layout_query='BSND', layout_key='BSND', sparse_count=2048, sparse_mode=3, "
    f"pre_tokens={INT64_MAX}, next_tokens={INT64_MAX}, cmp_ratio=1, device='npu')",
    va.npu_kv_quant_sparse_attn_sharedkv_metadata: "(num_heads_q, num_heads_kv, head_dim, kv_quant_mode, "
    "cu_seqlens_q=None, cu_seqlens_ori_kv=None, cu_seqlens_cmp_kv=None, seqused_q=None, seqused_kv=None, "
    "batch_size=0, max_seqlen_q=0, max_seqlen_kv=0, ori_topk=0, cmp_topk=0, tile_size=0, rope_head_dim=0, "
    "cmp_ratio=-1, ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=127, ori_win_right=0, layout_q='BSND', "
    "layout_kv='PA_ND', has_ori_kv=True, has_cmp_kv=True, device='npu')",
}


@pytest.mark.parametrize("fn", list(SIGNATURES), ids=lambda f: f.__name__)
def test_signatures_are_the_schemas(fn):
    sig = inspect.signature(fn).replace(return_annotation=inspect.Signature.empty)
    plain = sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()])
    assert str(plain) == SIGNATURES[fn]


def test_shim_registers_the_names():
    import sys

    from attnops import torch_npu

    torch_npu.install()
    import cann_ops_transformer

    from cann_ops_transformer.ops import compressor

    assert cann_ops_transformer is cot and sys.modules["cann_ops_transformer"] is cot
    assert compressor is cot.compressor
    assert isinstance(torch.npu.get_device_properties().name, str)  # Huawei's DSV4 test scripts read it
    for name in cot.OPS:
        assert getattr(torch.ops.cann_ops_transformer, name).__wrapped__ is getattr(cot, name)  # graph-recorded
        assert getattr(sys.modules["cann_ops_transformer.ops"], name) is getattr(cot, name)
    for name, fn in va.C_ASCEND_DSV4_OPS.items():
        assert getattr(torch.ops._C_ascend, name) is fn and fn.default is fn


@pytest.mark.parametrize("branch", sorted(CASES))
def test_aclnn_sparse_flash_mla_two_phase_matches_golden(branch):
    case = CASES[branch]
    parts = make_parts(case)
    kw, starts = pack(case, parts, "TND", "PA_BBND")
    kw = _ot_kwargs(kw)
    names = list(inspect.signature(cot.sparse_flash_mla).parameters)[1:]
    args = [kw.get(n) for n in names if n not in ("softmax_scale", "cmp_ratio", "ori_mask_mode", "cmp_mask_mode",
                                                  "ori_win_left", "ori_win_right", "layout_q", "layout_kv",
                                                  "topk_value_mode", "return_softmax_lse")]
    attrs = [kw["softmax_scale"], kw["cmp_ratio"], kw["ori_mask_mode"], kw["cmp_mask_mode"], kw["ori_win_left"],
             kw["ori_win_right"], "TND", "PA_BBND", 1, True]
    size, executor = aclnn.sparse_flash_mla_get_workspace_size(kw["q"], *args, *attrs)
    out, lse = aclnn.sparse_flash_mla(None, size, executor, None)
    _check_attention(case, parts, starts, out, lse)


def test_aclnn_errors_are_status_coded():
    q, kv = torch.randn(1, 4, 3, 32), torch.randn(1, 4, 1, 32)
    with pytest.raises(AclnnError, match="^softmax_scale: ") as info:
        aclnn.sparse_flash_mla_get_workspace_size(q, kv, *[None] * 16, math.nan, 1, 4, 3, 127, 0, "BSND", "BSND", 1,
                                                  False)
    assert info.value.status == 161002


def test_aclnn_sparse_flash_mla_grad_and_lightning_indexer_v2():
    case = hca([4, 6], [9, 6], topk=2)
    kw, _ = pack(case, make_parts(case), "TND", "TND")
    kw = _ot_kwargs(kw)
    q = kw.pop("q")
    out, lse = cot.sparse_flash_mla(q, return_softmax_lse=True, **kw)
    dout = torch.ones_like(out)
    names = list(inspect.signature(cot.sparse_flash_mla_grad).parameters)[4:]
    args = [kw.get(n) for n in names]
    got = aclnn.sparse_flash_mla_grad(q, dout, out, lse, *args)
    want = cot.sparse_flash_mla_grad(q, dout, out, lse, **kw)
    for g, w in zip(got, want):
        assert (g is None and w is None) or torch.equal(g, w)
    with pytest.raises(AclnnError, match="^d_out: "):
        aclnn.sparse_flash_mla_grad_get_workspace_size(q, dout[:1], out, lse, *args)
    qi, k, w = _indexer_inputs()
    idx, vals = aclnn.lightning_indexer_v2(qi, k, w, None, None, None, None, torch.tensor([1]), None, None, None, 2,
                                           -1, "BSND", "BSND", 3, 4, 1)
    want_idx, want_vals = _indexer_golden(qi, k, w, 2, 1)
    assert torch.equal(idx[0, :, 0], want_idx)
    torch.testing.assert_close(vals[0, :, 0], want_vals, atol=1e-12, rtol=0)


def test_vllm_lightning_indexer_quant_is_the_dsa_indexer_on_dequantised_inputs():
    from attnops.testing import golden_dsa

    g = torch.Generator().manual_seed(30)
    q = torch.randint(-8, 8, (1, 6, 2, 128), generator=g, dtype=torch.int8)
    k = torch.randint(-8, 8, (1, 6, 1, 128), generator=g, dtype=torch.int8)
    sq, sk, w = torch.rand(1, 6, 2, generator=g) + 0.5, torch.rand(1, 6, 1, generator=g) + 0.5, torch.rand(1, 6, 2)
    idx = va.C_ASCEND_DSV4_OPS["npu_lightning_indexer_quant"](q, k, w.half(), sq.half(), sk.half(), sparse_count=3)
    qd, kd = q.double() * sq.half().double()[..., None], k.double() * sk.half().double()[..., None]
    want = golden_dsa.lightning_indexer(qd[0], kd[0, :, 0], w.half().double()[0], 3, 3)
    assert idx[0, :, 0].tolist() == want
