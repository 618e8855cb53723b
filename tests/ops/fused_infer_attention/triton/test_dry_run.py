"""FIA decode on the GPU hot path, checked on ``meta`` tensors with :func:`attnops.testing.gpu_dry_run`: every entry
(Pythonic, aclnn and its two-phase form, torch_npu's FIA, v2, IFA and PFA, the plan/run API) takes the Triton
decode kernels for dense, paged ND/NZ and int8/int4 KV, masks, pse, left padding, lse and int8 output, records its
launches, reads no device value on the host and makes no blocking upload."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops import torch_npu
from attnops.testing import gpu_dry_run
from tests.ops.fused_infer_attention.fia_helpers import run_aclnn, run_aclnn_two_phase

M = torch.device("meta")
F16, BF16, F32, I8, I32 = torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.int32
B, N, NKV, D, BS, BLOCKS = 4, 8, 2, 64, 16, 40
KERNELS = ["split_kernel", "merge_kernel"]


def empty(*shape, dtype=F16):
    return torch.empty(*shape, dtype=dtype, device=M)


def _dry(call):
    """Run ``call`` in a dry run; returns its result and the kernels launched."""
    with gpu_dry_run() as launches:
        result = call()
    return result, [launch.kernel for launch in launches]


def _cache(layout, dtype=F16):
    if layout == "BnBsH":
        return empty(BLOCKS, BS, NKV * D, dtype=dtype)
    if layout == "BnNBsD":
        return empty(BLOCKS, NKV, BS, D, dtype=dtype)
    x = 32 // dtype.itemsize
    return empty(BLOCKS, NKV, D // x, BS, x, dtype=dtype)


def _paged(layout="BnNBsD", dtype=F16, lengths=None):
    q = empty(B, 1, N * D, dtype=dtype) if layout == "BnBsH" else empty(B, N, 1, D, dtype=dtype)
    kw = dict(block_table=empty(B, 10, dtype=I32), block_size=BS, num_heads=N, num_key_value_heads=NKV,
              actual_seq_lengths_kv=[100, 3, 0, 160] if lengths is None else lengths)
    return q, _cache(layout, dtype), _cache(layout, dtype), kw, "BSH" if layout == "BnBsH" else "BNSD"


def _check(result, kernels, shape, dtype=F16):
    assert kernels == KERNELS, kernels
    out = result[0] if isinstance(result, tuple) else result
    assert out.device == M and tuple(out.shape) == shape and out.dtype == dtype


@pytest.mark.parametrize("layout", ["BnBsH", "BnNBsD", "NZ"])
@pytest.mark.parametrize("lengths", ["list", "device"])
def test_pythonic_paged(layout, lengths):
    q, kc, vc, kw, qlayout = _paged(layout, lengths=empty(B, dtype=I32) if lengths == "device" else None)
    (out, lse), kernels = _dry(lambda: attnops.fused_infer_attention(q, kc, vc, layout=qlayout, return_lse=True,
                                                                     **kw))
    _check(out, kernels, tuple(q.shape))
    assert tuple(lse.shape) == (B, N, 1, 1) and lse.dtype == F32


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("mode", [0, 1, 5])
def test_pythonic_quantized_paged(quant, mode):
    q, _, _, kw, _ = _paged("BnNBsD")
    dtype = I8 if quant == "int8" else I32
    width = D if quant == "int8" else D // 8
    kc, vc = empty(BLOCKS, NKV, BS, width, dtype=dtype), empty(BLOCKS, NKV, BS, width, dtype=dtype)
    shape = {0: (NKV, 1, D), 1: (B, 160), 5: (BLOCKS, NKV, BS)}[mode]
    pdtype = F16 if mode == 0 else F32
    params = {f"{x}_antiquant_{y}": empty(*shape, dtype=pdtype) for x in ("key", "value") for y in ("scale", "offset")}
    out, kernels = _dry(lambda: attnops.fused_infer_attention(q, kc, vc, key_antiquant_mode=mode,
                                                             value_antiquant_mode=mode, **params, **kw))
    _check(out, kernels, tuple(q.shape))


def test_pythonic_dense_mask_pse_left_padding_int8_output():
    q, k = empty(B, 1, N, D), empty(B, 120, NKV, D)
    out, kernels = _dry(lambda: attnops.fused_infer_attention(
        q, k, k, layout="BSND", num_key_value_heads=NKV, atten_mask=empty(B, 120, dtype=torch.bool),
        pse_shift=empty(B, N, 1, 120), actual_seq_lengths_kv=empty(B, dtype=torch.int64),
        kv_padding_size=empty(1, dtype=torch.int64), quant_scale2=empty(1, dtype=F32),
        quant_offset2=empty(1, dtype=F32)))
    _check(out, kernels, (B, 1, N, D), I8)


def test_pythonic_speculative_rows_causal_and_tnd():
    q, k = empty(B, 4, N, D), empty(B, 120, NKV, D)
    out, kernels = _dry(lambda: attnops.fused_infer_attention(q, k, k, layout="BSND", num_key_value_heads=NKV,
                                                             causal=True, actual_seq_lengths_kv=[120, 7, 64, 4]))
    _check(out, kernels, (B, 4, N, D))
    q, k = empty(9, N, D), empty(200, NKV, D)
    out, kernels = _dry(lambda: attnops.fused_infer_attention(
        q, k, k, layout="TND", num_key_value_heads=NKV, actual_seq_lengths=[3, 4, 9],
        actual_seq_lengths_kv=[50, 120, 200], atten_mask=empty(16, 256, dtype=torch.bool), sparse_mode=0,
        pre_tokens=40, next_tokens=0))
    _check(out, kernels, (9, N, D))


@pytest.mark.parametrize("two_phase", [False, True])
def test_aclnn(two_phase):
    q, kc, vc, kw, layout = _paged("BnBsH", BF16)
    run = run_aclnn_two_phase if two_phase else run_aclnn
    (out, lse), kernels = _dry(lambda: run(q, kc, vc, input_layout=layout, softmax_lse_flag=True, scale_value=0.1,
                                           atten_mask=empty(B, 160, dtype=torch.bool), **kw))
    _check(out, kernels, tuple(q.shape), BF16)


def test_aclnn_int8_kv_combined_antiquant():
    q, k = empty(B, 1, N * D), empty(B, 64, NKV * D, dtype=I8)
    (out, _), kernels = _dry(lambda: run_aclnn(q, k, k, antiquant_scale=empty(2, NKV * D), num_heads=N,
                                               num_key_value_heads=NKV, input_layout="BSH", scale_value=0.1))
    _check(out, kernels, (B, 1, N * D))


def test_torch_npu_entries():
    q, kc, vc, kw, layout = _paged("BnBsH")
    lengths = empty(B, dtype=torch.int64)
    kw.pop("actual_seq_lengths_kv")
    common = dict(block_table=kw["block_table"], block_size=BS, num_key_value_heads=NKV, input_layout=layout)
    (out, lse), kernels = _dry(lambda: torch_npu.npu_fused_infer_attention_score(
        q, kc, vc, actual_seq_lengths_kv=lengths, num_heads=N, softmax_lse_flag=True, **common))
    _check(out, kernels, tuple(q.shape))
    (out, _), kernels = _dry(lambda: torch_npu.npu_fused_infer_attention_score_v2(
        q, kc, vc, actual_seq_kvlen=lengths, num_query_heads=N, learnable_sink=empty(N, dtype=F32), **common))
    _check(out, kernels, tuple(q.shape))
    out, kernels = _dry(lambda: torch_npu.npu_incre_flash_attention(q, kc, vc, actual_seq_lengths=[100, 3, 0, 160],
                                                                     num_heads=N, **common))
    _check(out, kernels, tuple(q.shape))
    q4, k = empty(B, 4, N * D), empty(B, 64, NKV * D)
    out, kernels = _dry(lambda: torch_npu.npu_prompt_flash_attention(
        q4, k, k, num_heads=N, num_key_value_heads=NKV, input_layout="BSH", sparse_mode=3,
        atten_mask=empty(2048, 2048, dtype=torch.bool), actual_seq_lengths_kv=[64, 10, 64, 5]))
    _check(out, kernels, (B, 4, N * D))


@pytest.mark.parametrize("lengths", ["list", "device"])
def test_plan_and_run(lengths):
    lens = empty(B, dtype=I32) if lengths == "device" else [100, 3, 0, 160]
    q, kc, vc, kw, layout = _paged("NZ", lengths=lens)
    plan, kernels = _dry(lambda: attnops.fused_infer_attention_plan(q, kc, vc, layout=layout, return_lse=True,
                                                                    **kw))
    assert plan.kernels and kernels == []
    (out, lse), kernels = _dry(lambda: plan.run(q, kc, vc, block_table=kw["block_table"],
                                                actual_seq_lengths_kv=lens))
    _check(out, kernels, tuple(q.shape))
    _, kernels = _dry(lambda: plan.run(q, kc, vc, block_table=kw["block_table"], actual_seq_lengths_kv=[5, 6, 7, 8]))
    assert kernels == KERNELS
