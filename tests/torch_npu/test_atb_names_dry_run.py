"""The new ATB names and ``npu_scatter_nd_update(_)`` on the GPU path, on ``meta`` tensors inside
``gpu_dry_run()``: host lengths are read, device tensors (caches, tables, indices) never are, and each attention
call records its operator's launches."""
from __future__ import annotations

import pytest
import torch

from attnops import ParamInvalidError, torch_npu
from attnops.testing import gpu_dry_run

from .test_dry_run import BLOCK, DV, KVN, N, D, meta, nd_caches

TABLE = (2, 3)
NEW, CTX = torch.tensor([3, 2], dtype=torch.int32), torch.tensor([40, 9], dtype=torch.int32)


def _launches(call):
    with gpu_dry_run() as launches:
        call()
    assert launches


@pytest.mark.parametrize("name", ["_npu_flash_attention_qlens", "_npu_paged_attention_splitfuse",
                                  "_npu_paged_attention_splitfuse_v2"])
def test_paged_prefill(name):
    table, out = meta(*TABLE, dtype=torch.int32), meta(5, N, DV)
    mask = meta(5, TABLE[1] * BLOCK) if name == "_npu_paged_attention_splitfuse" else meta(128, 128)
    if name == "_npu_flash_attention_qlens":
        call = lambda: torch_npu._npu_flash_attention_qlens(meta(5, N, D), *nd_caches(), table, mask, NEW, CTX, KVN,
                                                            N, 0.25, out)
    elif name == "_npu_paged_attention_splitfuse":
        call = lambda: torch_npu._npu_paged_attention_splitfuse(meta(5, N, D), *nd_caches(), table, CTX, mask, NEW,
                                                                KVN, N, 0.25, out)
    else:
        call = lambda: torch_npu._npu_paged_attention_splitfuse_v2(meta(5, N, D), *nd_caches(), table, CTX, mask,
                                                                   NEW, KVN, N, 0.25, out=out)
    _launches(call)


def test_paged_prefill_refuses_device_lengths():
    with gpu_dry_run(), pytest.raises(ParamInvalidError, match="seq_len: expected a CPU tensor or a list"):
        torch_npu._npu_flash_attention_qlens(meta(5, N, D), *nd_caches(), meta(*TABLE, dtype=torch.int32),
                                             meta(128, 128), meta(2, dtype=torch.int32), CTX, KVN, N, 0.25,
                                             meta(5, N, DV))


def test_paged_attention_mla():
    cache = meta(8, BLOCK, 1, D)
    _launches(lambda: torch_npu._npu_paged_attention_mla(meta(2, N, D), cache, 1, N, 0.25,
                                                         meta(*TABLE, dtype=torch.int32), CTX, DV, meta(2, N, DV)))


@pytest.mark.parametrize("seq_len", [torch.tensor([5, 8], dtype=torch.int32), meta(2, dtype=torch.int32)],
                         ids=["host", "device"])
def test_packed_self_attention(seq_len):
    q, k, v, out = meta(13, N, D), meta(13, KVN, D), meta(13, KVN, DV), meta(13, N, DV)
    _launches(lambda: torch_npu._npu_flash_attention_unpad_v2(q, k, v, seq_len, 0.25, N, KVN, out=out))
    _launches(lambda: torch_npu._npu_flash_attention_v3(q, k, v, meta(128, 128), seq_len, 0.25, N, KVN, out=out))
    _launches(lambda: torch_npu._npu_flash_attention(q, k, v, meta(16, 16), seq_len, 0.25, N, KVN, out))


def test_scatter_nd_update_reads_no_device_index():
    with gpu_dry_run():
        cache = meta(64, 1, KVN, D)
        assert torch_npu.npu_scatter_nd_update_(cache, meta(5, 1, dtype=torch.int64), meta(5, 1, KVN, D)) is cache
        assert torch_npu.npu_scatter_nd_update(cache, meta(5, 1, dtype=torch.int32), meta(5, 1, KVN, D)).shape == \
            cache.shape
