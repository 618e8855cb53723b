"""Paged FusedInferAttention with block ids outside the cache: a named error with validation on (CPU tables, the
default), and with ``ATTNOPS_VALIDATE=0`` the documented effect, the keys of such a block masked out (compared with
the fp64 attention over the other keys), on the CPU paths and, under ``tests/.../triton``, the kernels."""
from __future__ import annotations

import pytest
import torch

from attnops import torch_npu
from attnops._core.errors import ParamInvalidError
from attnops.testing.compare import assert_close_to_golden

N, NKV, D, BS, BLOCKS = 4, 2, 16, 16, 5


def paged_case(sq: int, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, N, sq, D, generator=g).to(dtype)  # BNSD
    kc = torch.randn(BLOCKS, BS, NKV * D, generator=g).to(dtype)
    vc = torch.randn(BLOCKS, BS, NKV * D, generator=g).to(dtype)
    return q, kc, vc


def fia(q, kc, vc, table, lens, device="cpu"):
    return torch_npu.npu_fused_infer_attention_score(
        q.to(device), kc.to(device), vc.to(device), num_heads=N, num_key_value_heads=NKV, input_layout="BNSD",
        scale=0.25, block_table=torch.tensor(table, dtype=torch.int32, device=device), block_size=BS,
        actual_seq_lengths_kv=lens)[0].cpu()


def golden_masked(q, kc, vc, table, lens, dtype=torch.float64):
    """Per batch, full attention over the tokens whose block id is in the cache (the others are not attended)."""
    outs = []
    for b, n in enumerate(lens):
        keep = [t for t in range(n) if 0 <= table[b][t // BS] < BLOCKS]
        rows = torch.tensor([table[b][t // BS] * BS + t % BS for t in keep], dtype=torch.long)
        k = kc.reshape(-1, NKV, D)[rows].to(dtype).transpose(0, 1).repeat_interleave(N // NKV, 0)
        v = vc.reshape(-1, NKV, D)[rows].to(dtype).transpose(0, 1).repeat_interleave(N // NKV, 0)
        p = torch.softmax(q[b].to(dtype) @ k.transpose(1, 2) * 0.25, -1)
        outs.append(p @ v)
    return torch.stack(outs)


TABLE, LENS = [[3, -1, 1], [0, 2, 4]], [40, 20]  # batch 0 uses 3 blocks, the second of them -1
REDUCTION = D + max(LENS)  # the scores over D, then P V over the longest sequence


@pytest.mark.parametrize("bad", [-1, -9, BLOCKS, 1 << 30])
def test_block_id_outside_the_cache_is_an_error(bad):
    q, kc, vc = paged_case(1)
    table = [[3, bad, 1], [0, 2, 4]]
    with pytest.raises(ParamInvalidError, match=r"^block_table: expected a block id in \[0, 5\) \(the "
                                                r"cache's blocks\), got "
                                                rf"block_table\[0, 1\] = {bad}, but batch 0 has 40 tokens "
                                                r"\(actual_seq_lengths_kv\), which need 3 blocks of 16$"):
        fia(q, kc, vc, table, LENS)


def test_entries_past_the_length_are_not_read():
    q, kc, vc = paged_case(1)
    assert torch.equal(fia(q, kc, vc, [[3, 0, 1], [0, 2, -1]], LENS), fia(q, kc, vc, [[3, 0, 1], [0, 2, 99]], LENS))


@pytest.mark.parametrize("sq", [1, 5])
def test_unvalidated_block_outside_the_cache_is_masked_out(monkeypatch, sq):
    monkeypatch.setenv("ATTNOPS_VALIDATE", "0")
    q, kc, vc = paged_case(sq)
    got = fia(q, kc, vc, TABLE, LENS)
    assert_close_to_golden("out", got, golden_masked(q, kc, vc, TABLE, LENS),
                           golden_masked(q, kc, vc, TABLE, LENS, torch.float32), reduction=REDUCTION)
