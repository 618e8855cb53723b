"""The MLA helpers on the GPU path, on ``meta`` tensors inside ``gpu_dry_run()``: interleaved RoPE, the KV
RMSNorm-RoPE cache write in every cache mode (V1, V2, NZ, int8) and the MLA prolog (every cache mode, the int8
modes) read no device value on the host and make no blocking upload (``HostSyncError`` otherwise), in the
torch_npu names and the aclnn two-phase names. They run as PyTorch on the device: no Triton launch."""
from __future__ import annotations

import pytest
import torch

from attnops import aclnn, torch_npu
from attnops.testing import gpu_dry_run

F16, I32, I8 = torch.float16, torch.int32, torch.int8
B, S, BLOCKS, BLOCK = 2, 3, 4, 16
HE, HCQ, N, D, HCKV, DR = 32, 16, 2, 8, 32, 16


def meta(*shape, dtype=F16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def test_interleave_rope():
    x, cos = meta(B, 4, S, 64), meta(B, 1, S, 64)
    with gpu_dry_run() as launches:
        out = torch_npu.npu_interleave_rope(x, cos, cos)
        size, executor = aclnn.interleave_rope_get_workspace_size(x, cos, cos)
        two_phase = aclnn.interleave_rope(None, size, executor, None)
    assert out.shape == two_phase.shape == x.shape and launches == []


def _index(mode):
    """``index`` of ``cache_mode`` for ``[B, ., S, .]`` tokens, on the device."""
    if mode == "Norm":
        return meta(B, S, dtype=I32)
    return meta(B * -(-S // BLOCK) if mode.startswith("PA_BLK") else B * S, dtype=torch.int64)


def _caches(mode, heads, dk, dv, dtype=F16):
    shape = (lambda d: (B, heads, 8, d)) if mode == "Norm" else (lambda d: (BLOCKS, BLOCK, heads, d))
    return meta(*shape(dk), dtype=dtype), meta(*shape(dv), dtype=dtype)


@pytest.mark.parametrize("mode", ["Norm", "PA", "PA_BNSD", "PA_NZ", "PA_BLK_BNSD", "PA_BLK_NZ"])
def test_kv_rmsnorm_rope_cache_every_mode(mode):
    kv, cos = meta(B, 1, S, 512 + 64), meta(B, 1, S, 64)
    k_cache, ckv_cache = _caches(mode, 1, 64, 512)
    with gpu_dry_run() as launches:
        out = torch_npu.npu_kv_rmsnorm_rope_cache(kv, meta(512), cos, cos, _index(mode), k_cache, ckv_cache,
                                                  cache_mode=mode, is_output_kv=True)
    assert out[0] is k_cache and out[1] is ckv_cache and launches == []
    assert out[2].shape == (B, 1, S, 64) and out[3].shape == (B, 1, S, 512)


@pytest.mark.parametrize("mode", ["Norm", "PA_NZ"])
def test_kv_rmsnorm_rope_cache_v2_int8(mode):
    kv, v, cos = meta(B, N, S, 64), meta(B, N, S, 32), meta(B, 1, S, 16)
    k_cache, v_cache = _caches(mode, N, 64, 32, dtype=I8)
    scales = dict(k_rope_scale=meta(N, 64, dtype=torch.float32), c_kv_scale=meta(32, dtype=torch.float32),
                  k_rope_offset=meta(N, 64, dtype=torch.float32), c_kv_offset=meta(32, dtype=torch.float32))
    with gpu_dry_run():
        _, _, k_rows, v_rows = torch_npu.npu_kv_rmsnorm_rope_cache(kv, meta(64), cos, cos, _index(mode), k_cache,
                                                                   v_cache, v=v, cache_mode=mode, **scales)
    assert k_rows.shape == kv.shape and v_rows.shape == v.shape


def test_kv_rms_norm_rope_cache_two_phase():
    kv, cos = meta(B, 1, S, 576), meta(B, 1, S, 64)
    caches = _caches("PA", 1, 64, 512)
    with gpu_dry_run():
        size, executor = aclnn.kv_rms_norm_rope_cache_get_workspace_size(
            kv, meta(512), cos, cos, _index("PA"), *caches, None, None, None, None, 1e-5, "PA", True)
        k_rope, c_kv = aclnn.kv_rms_norm_rope_cache(None, size, executor, None)
    assert k_rope.shape == (B, 1, S, 64) and c_kv.shape == (B, 1, S, 512)


def _weights(int8=False, tokens=(B * S,)):
    w = I8 if int8 else F16
    return (meta(HE, HCQ, dtype=w), meta(HCQ, N * (D + DR), dtype=w), meta(N, D, HCKV), meta(HE, HCKV + DR, dtype=w),
            meta(HCQ), meta(HCKV), meta(*tokens, DR), meta(*tokens, DR))


def _prolog_caches(mode, tokens=(B * S,), kv_dtype=F16):
    if mode in ("BSND", "TND"):
        return meta(*tokens, 1, HCKV, dtype=kv_dtype), meta(*tokens, 1, DR)
    return meta(BLOCKS, BLOCK, 1, HCKV, dtype=kv_dtype), meta(BLOCKS, BLOCK, 1, DR)


@pytest.mark.parametrize("mode,tokens,lengths", [
    ("PA_BSND", (B * S,), False), ("PA_NZ", (B, S), False), ("PA_BLK_BSND", (B * S,), True),
    ("PA_BLK_BSND", (B * S,), False), ("PA_BLK_NZ", (B, S), False), ("BSND", (B, S), False),
    ("TND", (B * S,), False)])
def test_mla_prolog_v3_every_cache_mode(mode, tokens, lengths):
    """``PA_BLK_*`` with ``actual_seq_len`` on the device: the tokens' pages are found on the device."""
    index = meta(B, dtype=torch.int64) if mode.startswith("PA_BLK") else meta(B * S, dtype=torch.int64)
    with gpu_dry_run() as launches:
        q, qr, _, qn, _ = torch_npu.npu_mla_prolog_v3(
            meta(*tokens, HE), *_weights(tokens=tokens), *_prolog_caches(mode, tokens), cache_index=index,
            actual_seq_len=meta(B, dtype=I32) if lengths else None, cache_mode=mode, query_norm_flag=True)
    assert q.shape == (*tokens, N, HCKV) and qr.shape == (*tokens, N, DR) and qn.shape == (*tokens, HCQ)
    assert launches == []


def _int8_scales(tokens=B * S):
    f32 = torch.float32
    return dict(dequant_scale_x=meta(tokens, 1, dtype=f32), dequant_scale_w_dq=meta(1, HCQ, dtype=f32),
                dequant_scale_w_uq_qr=meta(1, N * (D + DR), dtype=f32),
                dequant_scale_w_dkv_kr=meta(1, HCKV + DR, dtype=f32), smooth_scales_cq=meta(1, HCQ, dtype=f32),
                quant_scale_ckv=meta(1, dtype=f32))


def test_mla_prolog_v3_int8_modes_and_functional():
    index = meta(B * S, dtype=torch.int64)
    with gpu_dry_run():
        q, _, scale_q, qn, scale_n = torch_npu.npu_mla_prolog_v3(
            meta(B * S, HE, dtype=I8), *_weights(int8=True), *_prolog_caches("PA_BSND", kv_dtype=I8),
            cache_index=index, query_norm_flag=True, weight_quant_mode=2, kv_cache_quant_mode=1, query_quant_mode=1,
            **_int8_scales())
        outs = torch_npu.npu_mla_prolog_v3_functional(meta(B * S, HE), *_weights(), *_prolog_caches("PA_NZ"),
                                                      cache_index=index, cache_mode="PA_NZ")
    assert q.dtype == qn.dtype == I8 and scale_q.shape == (B * S, N, 1) and scale_n.shape == (B * S, 1)
    assert len(outs) == 7 and outs[5].shape == (BLOCKS, BLOCK, 1, HCKV)


def test_mla_prolog_v2_and_the_two_phase_prologs():
    index = meta(B * S, dtype=torch.int64)
    scales = _int8_scales()
    with gpu_dry_run():
        v2 = torch_npu.npu_mla_prolog_v2(meta(B * S, HE, dtype=I8), *_weights(int8=True), index,
                                         *_prolog_caches("PA_BSND", kv_dtype=I8), **scales)
        size, executor = aclnn.mla_prolog_v3_weight_nz_get_workspace_size(
            meta(B * S, HE), *_weights(), *_prolog_caches("PA_BSND"), index, *[None] * 9, 1e-5, 1e-5, "PA_BSND",
            0, 0, 0, 0, 0, 128, 1.0, 1.0)
        v3 = aclnn.mla_prolog_v3_weight_nz(None, size, executor, None)
        size, executor = aclnn.mla_prolog_v2_weight_nz_get_workspace_size(
            meta(B * S, HE), *_weights(), index, *_prolog_caches("PA_BSND"), *[None] * 7, 1e-5, 1e-5, "PA_BSND")
        two_phase_v2 = aclnn.mla_prolog_v2_weight_nz(None, size, executor, None)
    assert v2[0].dtype == I8 and v2[4].shape == (B * S, N, 1)
    assert len(v3) == 5 and v3[0].shape == two_phase_v2[0].shape == (B * S, N, HCKV)
