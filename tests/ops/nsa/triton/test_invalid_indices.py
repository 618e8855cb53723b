"""The NSA selected-attention kernels (forward and backward, Triton's interpreter on the CPU) with unvalidated
out-of-range indices (``ATTNOPS_VALIDATE=0``): such an index selects nothing, as on the CPU path (fp64 golden)."""
from __future__ import annotations

import pytest
import torch

from tests.ops.nsa.nsa_helpers import check_selected, random_topk
from tests.ops.nsa.test_selected import _inputs

pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_selected_kernels_skip_out_of_range_indices(triton_backend, monkeypatch, dtype):
    monkeypatch.setenv("ATTNOPS_VALIDATE", "0")
    q_lens, kv_lens, bs = [5, 6], [32, 32], 16
    q, k, v = _inputs(q_lens, kv_lens, 2, 1, 16, 16, dtype, seed=24)
    topk = random_topk(q_lens, kv_lens, 1, 2, bs, seed=25)
    topk[1, 0, 1], topk[7, 0, 0], topk[9, 0, 1] = -1, 2, -3  # batch 1 has two blocks of 16
    check_selected(q, k, v, topk, block=bs, q_lens=q_lens, kv_lens=kv_lens, causal=True)
    assert triton_backend, "the kernels did not run"
