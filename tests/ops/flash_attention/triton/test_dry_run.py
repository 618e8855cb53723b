"""The FlashAttention GPU hot path under :func:`attnops.testing.gpu_dry_run` on ``meta`` tensors: every layout, mask,
pse and dropout kind, host and device lengths, and the aclnn and torch_npu entries plan their launches without a
host read of a device value, a blocking upload or a fallback to the reference (any of them raises)."""
import pytest
import torch

import attnops
from attnops import aclnn
from attnops import torch_npu as tnpu
from attnops.testing import gpu_dry_run

META = "meta"
INT_MAX = 2147483647
B, N1, N2, S, D, DV = 2, 4, 2, 64, 32, 16
T_Q, T_KV = 100, 90
Q_CUM, KV_CUM = [40, 97], [50, 90]  # 3 query tokens past the last sequence


def t(*shape, dtype=torch.float16):
    return torch.empty(*shape, device=META, dtype=dtype)


def dense(layout, kv_heads=N2, dv=DV):
    """q, k, v in a dense layout (GQA, Dv < D)."""
    shapes = {"BNSD": lambda n, d: (B, n, S, d), "BSND": lambda n, d: (B, S, n, d),
              "BSH": lambda n, d: (B, S, n * d), "SBH": lambda n, d: (S, B, n * d)}[layout]
    return t(*shapes(N1, D)), t(*shapes(kv_heads, D)), t(*shapes(kv_heads, dv))


def tnd():
    return t(T_Q, N1, D), t(T_KV, N2, D), t(T_KV, N2, DV)


def cu(values):
    return torch.empty(len(values), dtype=torch.int32, device=META)


TRIU = torch.empty(2048, 2048, dtype=torch.bool, device=META)
PREFIX = torch.empty(3072, 2048, dtype=torch.bool, device=META)
FULL = torch.empty(B, 1, S, S, dtype=torch.bool, device=META)
HOST_TND = dict(layout="TND", actual_seq_qlen=Q_CUM, actual_seq_kvlen=KV_CUM)
DEVICE_TND = dict(layout="TND", cu_seqlens_q=cu([0] + Q_CUM), cu_seqlens_k=cu([0] + KV_CUM))

CASES = {
    "BNSD": (dense("BNSD"), {}),
    "BSND causal": (dense("BSND"), dict(layout="BSND", causal=True)),
    "BSH window": (dense("BSH"), dict(layout="BSH", head_num=N1, window_size=(8, 4))),
    "SBH causal window": (dense("SBH"), dict(layout="SBH", head_num=N1, causal=True, window_size=(16, -1))),
    "mode 0 full mask": (dense("BNSD"), dict(atten_mask=FULL, sparse_mode=0, pre_tokens=20, next_tokens=2)),
    "mode 1": (dense("BNSD"), dict(atten_mask=FULL, sparse_mode=1)),
    "mode 2": (dense("BNSD"), dict(atten_mask=TRIU, sparse_mode=2)),
    "mode 3": (dense("BNSD"), dict(atten_mask=TRIU, sparse_mode=3)),
    "mode 4": (dense("BNSD"), dict(atten_mask=TRIU, sparse_mode=4, pre_tokens=9, next_tokens=1)),
    "mode 5 prefix": (dense("BNSD"), dict(atten_mask=FULL, sparse_mode=5, prefix=[10, 40])),
    "mode 6 prefix": (dense("BNSD"), dict(atten_mask=PREFIX, sparse_mode=6, prefix=[10, 40])),
    "TND mode 7": (tnd(), dict(HOST_TND, atten_mask=TRIU, sparse_mode=7, pre_tokens=5, next_tokens=0)),
    "TND mode 8": (tnd(), dict(HOST_TND, atten_mask=TRIU, sparse_mode=8, pre_tokens=5, next_tokens=0)),
    "pse full": (dense("BNSD"), dict(pse=t(1, N1, S, S), pse_type=1)),
    "pse row": (dense("BNSD"), dict(pse=t(B, N1, 1, S), pse_type=0)),
    "pse ALiBi compressed": ((t(1, N1, 1100, D),) * 3, dict(pse=t(1, N1, 1024, 1100), causal=True)),
    "pse slopes 2": (dense("BNSD"), dict(pse=t(B, N1, dtype=torch.float32), pse_type=2)),
    "pse slopes 3": (dense("BNSD"), dict(pse=t(N1, dtype=torch.float32), pse_type=3, q_start_idx=4)),
    "dropout seed": (dense("BNSD"), dict(keep_prob=0.9, seed=1, offset=8)),
    "dropout mask": (dense("BNSD"), dict(keep_prob=0.9, drop_mask=t(B * N1 * S * S // 8, dtype=torch.uint8))),
    "TND host lengths": (tnd(), dict(HOST_TND, causal=True, softmax_layout="TND")),
    "TND flattened pse": (tnd(), dict(HOST_TND, pse=t(N1 * (40 * 50 + 57 * 40)), pse_type=0)),
    "TND mode 6": (tnd(), dict(HOST_TND, atten_mask=PREFIX, sparse_mode=6, prefix=[20, 30])),
    "TND device lengths": (tnd(), dict(DEVICE_TND, causal=True)),
    "TND device lengths, max_seqlen": (tnd(), dict(DEVICE_TND, max_seqlen_q=57, max_seqlen_k=50,
                                                   window_size=(8, 0), softmax_layout="TND")),
    "TND device lengths, modes": (tnd(), dict(DEVICE_TND, atten_mask=TRIU, sparse_mode=8, pre_tokens=5,
                                              next_tokens=0, keep_prob=0.8, seed=3)),
    "TND device lengths, mask": (tnd(), dict(DEVICE_TND, atten_mask=torch.empty(64, 64, dtype=torch.bool,
                                                                                  device=META), sparse_mode=0)),
    "TND device lengths, prefix": (tnd(), dict(DEVICE_TND, atten_mask=PREFIX, sparse_mode=6, prefix=[20, 30])),
    "TND device lengths, pse": (tnd(), dict(DEVICE_TND, pse=t(1, N1, 64, 64), pse_type=1)),
    "TND device lengths, slopes": (tnd(), dict(DEVICE_TND, pse=t(N1, dtype=torch.float32), pse_type=2)),
    "TND device lengths, drop mask": (tnd(), dict(DEVICE_TND, keep_prob=0.8, drop_mask=t(1000, dtype=torch.uint8))),
}


def _kernels(launches):
    return [r.kernel for r in launches]


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_backward_plan_without_host_reads(case):
    (q, k, v), kw = CASES[case]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with gpu_dry_run() as launches:
        out = attnops.flash_attention(*leaves, **kw)
        forward = _kernels(launches)
        out.backward(torch.empty_like(out))
    assert "fwd_kernel" in forward and {"dkdv_kernel", "grad_sum_kernel"} <= set(_kernels(launches))
    assert leaves[0].grad.shape == q.shape and leaves[2].grad.shape == v.shape
    if "device lengths" in case:  # the metadata derived on the device, the tokens past every sequence filled
        assert forward[0] == "prepare_kernel" and forward.count("tail_kernel") == 3


def test_explicit_backward_and_statistics():
    q, k, v = tnd()
    with gpu_dry_run() as launches:
        res = attnops.flash_attention(q, k, v, return_stats=True, **DEVICE_TND, causal=True)
        attnops.flash_attention_backward(torch.empty_like(res.out), q, k, v, res.out, res.softmax_max,
                                         res.softmax_sum, **DEVICE_TND, causal=True)
    assert _kernels(launches).count("prepare_kernel") == 2


def test_device_masks_are_not_read():
    """A full mask on the device stays explicit (a CPU one that is a band becomes the band), compressed device
    masks are checked by shape only."""
    q, k, v = dense("BNSD")
    with gpu_dry_run() as launches:
        attnops.flash_attention(q, k, v, atten_mask=FULL, sparse_mode=0)
        attnops.flash_attention(q, k, v, atten_mask=TRIU, sparse_mode=3)
    assert [r.constexprs["HAS_EXPLICIT"] for r in launches] == [True, False]


def test_aclnn_entries():
    q = t(B, S, N1 * D)
    scalars = (0.2, 1.0, INT_MAX, INT_MAX, N1)
    with gpu_dry_run() as launches:
        smax, ssum, _, out = aclnn.flash_attention_score(q, q, q, None, None, None, TRIU, None, *scalars, "BSH", 0, 3)
        aclnn.flash_attention_score_grad(q, q, q, q, None, None, None, TRIU, smax, ssum, None, out, None, *scalars,
                                         "BSH", 0, 3)
        qt = t(T_Q, N1, D)
        lens = ([40, T_Q], [40, T_Q])
        _, executor = aclnn.flash_attention_var_len_score_get_workspace_size(
            qt, qt, qt, None, None, None, TRIU, None, *lens, *scalars, "TND", 0, 3)
        smax, ssum, _, out = aclnn.flash_attention_var_len_score(None, 0, executor, None)
        aclnn.flash_attention_unpadding_score_grad(qt, qt, qt, qt, None, None, None, TRIU, smax, ssum, None, out,
                                                   None, *lens, *scalars, "TND", 0, 3)
        slopes = t(N1, dtype=torch.float32)
        smax, ssum, _, out = aclnn.flash_attention_var_len_score_v2(
            qt, qt, qt, slopes, None, None, TRIU, None, *lens, [0], [0], *scalars, "TND", 0, 3, 2)
        _, executor = aclnn.flash_attention_unpadding_score_grad_v2_get_workspace_size(
            qt, qt, qt, qt, slopes, None, None, TRIU, smax, ssum, None, out, None, *lens, [0], [0], *scalars, "TND",
            0, 3, 2)
        aclnn.flash_attention_unpadding_score_grad_v2(None, 0, executor, None)
    assert _kernels(launches).count("fwd_kernel") == 3 and _kernels(launches).count("dkdv_kernel") == 3


def test_torch_npu_entries():
    q = t(B, S, N1 * D)
    leaves = [x.clone().requires_grad_() for x in (q, q, q)]
    qt = t(T_Q, N1, D)
    lens = dict(actual_seq_qlen=[40, T_Q], actual_seq_kvlen=[40, T_Q])
    with gpu_dry_run() as launches:
        out = tnpu.npu_fusion_attention(*leaves, N1, "BSH", atten_mask=TRIU, scale=0.2, sparse_mode=3, keep_prob=0.9)
        out[0].backward(torch.empty_like(out[0]))
        o, smax, ssum, *_ = tnpu.npu_fusion_attention(q, q, q, N1, "BSH", atten_mask=TRIU, scale=0.2, sparse_mode=3)
        tnpu.npu_fusion_attention_grad(q, q, q, q, N1, "BSH", atten_mask=TRIU, softmax_max=smax, softmax_sum=ssum,
                                       attention_in=o, scale_value=0.2, sparse_mode=3)
        o, smax, ssum, *_ = tnpu.npu_fusion_attention_v2(qt, qt, qt, N1, "TND", atten_mask=TRIU, scale=0.2,
                                                         sparse_mode=3, **lens)
        tnpu.npu_fusion_attention_grad_v2(qt, qt, qt, qt, N1, "TND", atten_mask=TRIU, softmax_max=smax,
                                          softmax_sum=ssum, attention_in=o, scale_value=0.2, sparse_mode=3, **lens)
    assert _kernels(launches).count("fwd_kernel") == 3 and _kernels(launches).count("grad_sum_kernel") == 3


@pytest.mark.parametrize("device_lengths", [False, True])
def test_torch_npu_graph_friendly_v3(device_lengths):
    """v3 takes the cumulative lengths as tensors: on the device the kernels read them (no numels to compute)."""
    qt = t(T_Q, N1, D)
    leaves = [x.clone().requires_grad_() for x in (qt, qt, qt)]
    lengths = (cu([40, T_Q]), cu([40, T_Q])) if device_lengths else ([40, T_Q], [40, T_Q])
    lens = dict(actual_seq_qlen=lengths[0], actual_seq_kvlen=lengths[1])
    with gpu_dry_run() as launches:
        o, smax, ssum, _, seed, offset = tnpu.npu_fusion_attention_v3(*leaves, N1, "TND", atten_mask=TRIU, scale=0.2,
                                                                     sparse_mode=3, **lens)
        o.backward(torch.empty_like(o))
        tnpu.npu_fusion_attention_grad_v3(qt, qt, qt, qt, N1, "TND", atten_mask=TRIU, softmax_max=smax,
                                          softmax_sum=ssum, attention_in=o, scale_value=0.2, sparse_mode=3,
                                          seed=seed, offset=offset, **lens)
    kernels = _kernels(launches)
    assert kernels.count("fwd_kernel") == 1 and kernels.count("grad_sum_kernel") == 2
    assert ("prepare_kernel" in kernels) == device_lengths


@pytest.mark.parametrize("kw,name", [
    (dict(pse=t(N1 * 4000), pse_type=0), "pse"),  # the 1-D pse's form follows from the lengths
    (dict(pse=t(1, N1, 1024, 64), atten_mask=torch.empty(64, 64, dtype=torch.bool, device=META)), "pse"),
    (dict(cu_seqlens_q=torch.empty(3, device=META)), "cu_seqlens_q"),
    (dict(max_seqlen_q=64), "max_seqlen_k"),
    (dict(prefix=torch.empty(2, dtype=torch.int64, device=META), atten_mask=PREFIX, sparse_mode=6), "prefix"),
])
def test_device_lengths_refuse_what_needs_their_values(kw, name):
    q, k, v = tnd()
    with gpu_dry_run(), pytest.raises(attnops.ParamInvalidError, match=name):
        attnops.flash_attention(q, k, v, **{**DEVICE_TND, **kw})
