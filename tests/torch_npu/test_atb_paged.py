"""``torch_npu._npu_paged_attention`` (ATB paged decode) with a value head size different from the key's and over
NZ caches, against the FIA fp64 golden."""
from __future__ import annotations

import pytest
import torch

from attnops import torch_npu
from attnops.testing import golden_fia
from attnops.testing.compare import assert_close_to_golden
from tests.helpers import randn

F16 = torch.float16
N, KVN, BLOCK, LENS = 4, 2, 16, [40, 9]
TABLE = torch.tensor([[5, 2, 7], [0, 3, 1]], dtype=torch.int32)


def _golden(query, key_cache, value_cache, dtype):
    """Golden decode: ``query [B, N, D]``, ND caches ``[nb, bs, KVN, D]`` read as ``(blocknum, blocksize, H)``."""
    return golden_fia.fia_forward(query.unsqueeze(1), key_cache.flatten(2), value_cache.flatten(2), dtype=dtype,
                                  block_table=TABLE, block_size=BLOCK, actual_seq_lengths_kv=LENS, num_heads=N,
                                  num_key_value_heads=KVN, input_layout="BSND", scale_value=0.25)[0].squeeze(1)


@pytest.mark.parametrize("head_size,head_size_v", [(48, 32), (16, 32)])
def test_value_head_size_differs(head_size, head_size_v):
    query = randn(2, N, head_size, dtype=F16, seed=1)
    key_cache = randn(8, BLOCK, KVN, head_size, dtype=F16, seed=2)
    value_cache = randn(8, BLOCK, KVN, head_size_v, dtype=F16, seed=3)
    out = torch.empty(2, N, head_size_v, dtype=F16)
    torch_npu._npu_paged_attention(query, key_cache, value_cache, KVN, N, 0.25, TABLE,
                                   torch.tensor(LENS, dtype=torch.int32), out)
    g, base = (_golden(query, key_cache, value_cache, dt) for dt in (torch.float64, F16))
    assert_close_to_golden("out", out, g, base, reduction=head_size + max(LENS))


@pytest.mark.parametrize("head_size,head_size_v", [(32, 32), (48, 32)])
def test_nz_cache(head_size, head_size_v):
    """ATB's NZ caches ``[num_blocks, num_kv_heads*D/16, block_size, 16]``: element (n, t, d) at
    ``[blk, (n*D + d) // 16, t, d % 16]``."""
    query = randn(2, N, head_size, dtype=F16, seed=1)
    key_cache = randn(8, BLOCK, KVN, head_size, dtype=F16, seed=2)
    value_cache = randn(8, BLOCK, KVN, head_size_v, dtype=F16, seed=3)
    key_nz, value_nz = (c.flatten(2).unflatten(-1, (-1, 16)).transpose(1, 2).contiguous()
                        for c in (key_cache, value_cache))
    out = torch.empty(2, N, head_size_v, dtype=F16)
    torch_npu._npu_paged_attention(query, key_nz, value_nz, KVN, N, 0.25, TABLE,
                                   torch.tensor(LENS, dtype=torch.int32), out)
    g, base = (_golden(query, key_cache, value_cache, dt) for dt in (torch.float64, F16))
    assert_close_to_golden("out", out, g, base, reduction=head_size + max(LENS))
