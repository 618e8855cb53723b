"""The FusedInferAttention kernels (decode and prefill) with an unvalidated block table (``ATTNOPS_VALIDATE=0``): a
block id outside the cache masks its keys out, as the CPU path does (compared with the fp64 attention over the other
keys); fp16 and fp32 under Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

from attnops.ops.fused_infer_attention import problem as fia_problem
from attnops.testing.compare import assert_close_to_golden
from tests.ops.fused_infer_attention.test_fia_block_table_validation import (LENS, REDUCTION, fia, golden_masked,
                                                                             paged_case)
from tests.triton_backend import DEVICE

pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("sq", [1, 5])
@pytest.mark.parametrize("bad", [-1, 7])
def test_kernel_masks_blocks_outside_the_cache(triton_backend, monkeypatch, dtype, sq, bad):
    monkeypatch.setenv("ATTNOPS_VALIDATE", "0")
    # the host mask of a CPU table off: the kernels' own masking alone (as with a table on the GPU)
    monkeypatch.setattr(fia_problem, "unaddressable_columns", lambda *args: None)
    table = [[3, bad, 1], [0, 2, 4]]
    q, kc, vc = paged_case(sq, dtype)
    got = fia(q, kc, vc, table, LENS, DEVICE)
    assert triton_backend, "the kernels did not run"
    assert_close_to_golden("out", got, golden_masked(q, kc, vc, table, LENS),
                           golden_masked(q, kc, vc, table, LENS, dtype), reduction=REDUCTION)
