"""Where torch_npu differs from aclnn (torch_npu_api.md §12), unsupported arguments, and the shim."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from attnops import torch_npu
from tests.helpers import TRIU2048, cum, randn

REPO = Path(__file__).resolve().parents[2]


def test_fusion_attention_output_shapes_and_types():
    q, k, v = randn(6, 2, 4 * 16), randn(9, 2, 2 * 16, seed=1), randn(9, 2, 2 * 8, seed=2)  # SBH, GQA, Dv < D
    out, smax, ssum, soft, seed, offset, numels = torch_npu.npu_fusion_attention(q, k, v, 4, "SBH", scale=0.25,
                                                                                 seed=7, offset=3)
    assert out.shape == (6, 2, 4 * 8) and out.dtype == q.dtype
    assert smax.shape == ssum.shape == (2, 4, 6, 8) and smax.dtype == torch.float32
    assert soft.shape == (0,) and soft.dtype == q.dtype
    assert (seed, offset, numels) == (7, 3, 2 * 4 * 6 * 9)  # keep_prob 1: the inputs come back
    assert torch.equal(smax[..., :1].expand_as(smax), smax)  # one value replicated over the 8 lanes


def test_tnd_statistics_blocked_by_default_and_token_major_with_softmax_layout_tnd():
    lens = [3, 5]
    q, k, v = randn(8, 2, 8), randn(8, 2, 8, seed=1), randn(8, 2, 8, seed=2)
    kw = dict(actual_seq_qlen=cum(lens), actual_seq_kvlen=cum(lens), scale=0.3)
    _, blocked, _, _, _, _, numels = torch_npu.npu_fusion_attention(q, k, v, 2, "TND", **kw)
    _, tnd, _, _, _, _, _ = torch_npu.npu_fusion_attention(q, k, v, 2, "TND", softmax_layout="TND", **kw)
    assert blocked.shape == tnd.shape == (8, 2, 8)
    assert numels == 2 * (3 * 3 + 5 * 5)
    flat = blocked.reshape(-1, 8)
    first = flat[:6].view(2, 3, 8).transpose(0, 1)  # batch 0: [N, S_0, 8] block
    second = flat[6:].view(2, 5, 8).transpose(0, 1)
    assert torch.equal(torch.cat([first, second]), tnd)


def test_dense_layouts_ignore_actual_seq_lists():
    q = randn(1, 2, 4, 8)
    a = torch_npu.npu_fusion_attention(q, q, q, 2, "BNSD", actual_seq_qlen=[1], actual_seq_kvlen=[1])[0]
    assert torch.equal(a, torch_npu.npu_fusion_attention(q, q, q, 2, "BNSD")[0])


def test_fused_infer_attention_lse_is_empty_unless_requested():
    q, k = randn(1, 2, 4, 16), randn(1, 2, 6, 16, seed=1)
    _, lse = torch_npu.npu_fused_infer_attention_score(q, k, k, num_heads=2, input_layout="BNSD")
    assert lse.shape == (0,) and lse.dtype == torch.float32
    _, lse = torch_npu.npu_fused_infer_attention_score(q, k, k, num_heads=2, input_layout="BNSD",
                                                       softmax_lse_flag=True)
    assert lse.shape == (1, 2, 4, 1)


def test_prompt_flash_attention_modes_10_to_14_are_modes_0_to_4():
    q, k = randn(2, 5, 32), randn(2, 7, 32, seed=1)
    kw = dict(num_heads=2, scale_value=0.25, atten_mask=TRIU2048)
    high = torch_npu.npu_prompt_flash_attention(q, k, k, sparse_mode=13, **kw)
    plain = torch_npu.npu_prompt_flash_attention(q, k, k, sparse_mode=3, **kw)
    fia = torch_npu.npu_fused_infer_attention_score(q, k, k, num_heads=2, scale=0.25, atten_mask=TRIU2048,
                                                    sparse_mode=3)[0]
    assert torch.equal(high, plain) and torch.equal(plain, fia)


def test_prompt_flash_attention_next_tokens_defaults_to_zero():
    q, k = randn(1, 4, 16), randn(1, 4, 16, seed=1)
    mask = torch.zeros(4, 4, dtype=torch.bool)
    band = torch_npu.npu_prompt_flash_attention(q, k, k, atten_mask=mask, scale_value=0.25)
    causal = torch_npu.npu_fused_infer_attention_score(q, k, k, atten_mask=TRIU2048, sparse_mode=2, scale=0.25)[0]
    torch.testing.assert_close(band, causal, rtol=0, atol=0)


def test_incre_flash_attention_actual_seq_lengths_are_kv_lengths():
    q, k = randn(2, 1, 32), randn(2, 9, 32, seed=1)
    ifa = torch_npu.npu_incre_flash_attention(q, k, k, num_heads=2, scale_value=0.25, actual_seq_lengths=[9, 4])
    fia = torch_npu.npu_fused_infer_attention_score(q, k, k, num_heads=2, scale=0.25, actual_seq_lengths_kv=[9, 4])
    assert torch.equal(ifa, fia[0])
    with pytest.raises(ValueError, match="query"):
        torch_npu.npu_incre_flash_attention(randn(2, 3, 32), k, k, num_heads=2)


@pytest.mark.parametrize("call, argument", [
    (lambda q: torch_npu.npu_fusion_attention(q, q, q, 2, "BNSD", padding_mask=q), "padding_mask"),
    (lambda q: torch_npu.npu_fused_infer_attention_score(q, q, q, num_heads=2, input_layout="BNSD",
                                                         key_rope_antiquant_scale=q), "key_rope_antiquant_scale"),
    (lambda q: torch_npu.npu_prompt_flash_attention(q, q, q, num_heads=2, input_layout="BNSD", padding_mask=q),
     "padding_mask"),
])
def test_unsupported_arguments_raise_not_implemented_naming_them(call, argument):
    with pytest.raises(NotImplementedError, match=argument):
        call(randn(1, 2, 4, 8))


def test_gen_mask_parallel_and_sync_have_no_numerical_effect():
    q = randn(1, 2, 4, 8)
    a = torch_npu.npu_fusion_attention(q, q, q, 2, "BNSD", gen_mask_parallel=False, sync=True)[0]
    assert torch.equal(a, torch_npu.npu_fusion_attention(q, q, q, 2, "BNSD")[0])


SCRIPT = textwrap.dedent("""
    # a script written for torch_npu; only `.npu()` became `.to(device)`
    import attnops.torch_npu
    assert attnops.torch_npu.install("cpu")

    import torch
    import torch_npu
    from attnops.testing.golden import fa_forward

    device = torch.npu.device
    torch.npu.set_device(0)
    torch.npu.manual_seed(0)
    q = torch.randn(16, 2, 4 * 32).to(device)
    k = torch.randn(16, 2, 2 * 32).to(device)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1).to(device)
    out = torch_npu.npu_fusion_attention(q, k, k, 4, "SBH", pse=None, padding_mask=None, atten_mask=mask,
                                         scale=32 ** -0.5, keep_prob=1.0, pre_tockens=65536, next_tockens=0,
                                         inner_precise=0, sparse_mode=2)[0]
    torch.npu.synchronize()
    gold = fa_forward(q, k, k, head_num=4, input_layout="SBH", atten_mask=mask, sparse_mode=2, scale=32 ** -0.5)[0]
    assert (out.double() - gold).abs().max() < 1e-5
    decode = torch.ops.npu.npu_fused_infer_attention_score(q[:1].transpose(0, 1), k.transpose(0, 1),
                                                           k.transpose(0, 1), num_heads=4, num_key_value_heads=2,
                                                           input_layout="BSH", scale=32 ** -0.5)[0]
    assert decode.shape == (2, 1, 128)
    assert torch.ops.npu.npu_fused_infer_attention_score.out is torch_npu.npu_fused_infer_attention_score.out
    assert torch.npu.is_available() and torch.npu.device_count() == 1 and torch.npu.current_device() == 0
    print("ok")
""")


def test_shim_runs_an_unmodified_torch_npu_script():
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
