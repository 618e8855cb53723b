"""A decode step (fewer chunks than threads) splits its heads into groups on the workers: every group's output, lse
and sink match the chunk computed whole."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.ops.dsv4 import reference


@pytest.mark.parametrize("sparse", [True, False], ids=["csa", "hca"])
def test_head_groups_equal_the_whole_chunk(monkeypatch, sparse):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 5, 16, generator=g)                     # B=2 decode rows, 5 heads: groups of 2, 2, 1
    ori = torch.randn(2, 40, 1, 16, generator=g)
    cmp = torch.randn(2, 10, 1, 16, generator=g)
    sinks = torch.randn(5, generator=g)
    kw = dict(cmp_kv=cmp, cmp_ratio=4, sinks=sinks, ori_win_left=7)
    if sparse:
        kw["cmp_sparse_indices"] = torch.tensor([[3, 0, 7, -1], [9, 2, 5, 1]], dtype=torch.int32).view(2, 1, 1, 4)

    jobs = []

    def spy(job, items, device):
        jobs.append([item[-1] for item in items])
        for item in items:
            job(item)

    monkeypatch.setattr(reference, "run_jobs", spy)

    def run(threads):
        monkeypatch.setattr(reference, "job_threads", lambda device: threads)
        return attnops.sparse_flash_mla(q, ori, **kw)

    whole, grouped = run(1), run(3)
    assert jobs == [[slice(0, 2), slice(2, 4), slice(4, 5)] * 2]  # threads=1: no workers; 3: each row's 3 groups
    torch.testing.assert_close(grouped.attn_out, whole.attn_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grouped.softmax_lse, whole.softmax_lse, atol=1e-6, rtol=1e-6)
