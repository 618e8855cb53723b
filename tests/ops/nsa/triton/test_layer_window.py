"""The sliding-window branch of ``native_sparse_attention`` runs on the attention engine's Triton kernels: its
problem (FlashAttention's ``causal=True, window_size=(w - 1, 0)``) is a band (sparse mode 4 in normal form, no
explicit mask tile), which the engine's verifier accepts; the result matches the fp64 golden."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops._core.triton.launch import KernelFamily
from attnops.testing.compare import assert_close_to_golden
from attnops.testing.golden import fa_forward

from ..nsa_helpers import baseline_dtype, cum, randn

pytest.importorskip("triton")

TRIU = torch.ones(2048, 2048, dtype=torch.bool).triu(1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_window_branch_runs_the_flash_attention_band_kernel(monkeypatch, dtype):
    monkeypatch.setenv("ATTNOPS_BACKEND", "triton")
    monkeypatch.setenv("ATTNOPS_TRITON_INTERPRET", "1")
    launches = []
    run = KernelFamily.run
    monkeypatch.setattr(KernelFamily, "run", lambda self, launch, device: launches.append(launch) or run(
        self, launch, device))
    lens, n1, n2, d, window, scale = [21, 35], 4, 2, 16, 9, 0.3
    t = sum(lens)
    q, k, v = (randn(t, n, d, dtype=dtype, seed=s) for s, n in ((1, n1), (2, n2), (3, n2)))
    g_swa = torch.ones(t, n1, dtype=dtype)
    out = attnops.native_sparse_attention(q, k, v, g_swa=g_swa, actual_seq_len=cum(lens), compress_block_size=8,
                                          compress_stride=4, select_block_size=8, select_block_count=2,
                                          window_size=window, scale=scale)
    assert [x.kernel for x in launches] == ["fwd_kernel"]
    assert launches[0].kwargs["HAS_EXPLICIT"] is False  # the band, no mask tile
    golden_args = dict(head_num=n1, input_layout="TND", atten_mask=TRIU, scale=scale, pre_tokens=window - 1,
                       next_tokens=0, actual_seq_qlen=cum(lens), actual_seq_kvlen=cum(lens), sparse_mode=4)
    golden = fa_forward(q, k, v, **golden_args)[0]
    baseline = fa_forward(q, k, v, dtype=baseline_dtype(dtype), **golden_args)[0]
    assert_close_to_golden("native_sparse_attention.window", out, golden, baseline, factor=2,
                           reduction=d + window)  # the scores over D, then P V over the window's keys
