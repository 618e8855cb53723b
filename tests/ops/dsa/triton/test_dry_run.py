"""DSA on the GPU hot path, checked without a GPU: the operators and the kernels' launchers run inside
:func:`attnops.testing.gpu_dry_run` on ``meta`` tensors, where launches are recorded and any host read of a device
value, blocking upload or tensor built on the host raises. Each case records the expected launches."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.testing import gpu_dry_run

pytest.importorskip("triton")

from attnops.ops.dsa.triton import launch  # noqa: E402
from attnops.ops.dsa.triton.family import KERNELS  # noqa: E402

META = torch.device("meta")
H = torch.float16


def meta(*shape, dtype=H):
    return torch.empty(*shape, device=META, dtype=dtype)


def kernels(launches) -> list[str]:
    assert launches, "no launch recorded"
    return [record.kernel for record in launches]


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_operators_record_their_kernels(layout):
    """The Pythonic operators with host lengths (BSND: none; TND: cumulative lists)."""
    lead, lens = ((2, 64), {}) if layout == "BSND" else ((96,), dict(actual_seq_lengths_query=[40, 96]))
    kv_lens = {} if layout == "BSND" else dict(actual_seq_lengths_kv=[64, 128])
    key_lead = (2, 64) if layout == "BSND" else (128,)
    with gpu_dry_run() as launches:
        idx = attnops.lightning_indexer(meta(*lead, 64, 128), meta(*key_lead, 1, 128), meta(*lead, 64), layout=layout,
                                        sparse_count=2048, **lens,
                                        **{k.replace("kv", "key"): v for k, v in kv_lens.items()}).sparse_indices
        latent = meta(*key_lead, 1, 512)
        attnops.sparse_flash_attention(meta(*lead, 128, 512), latent, latent, idx, query_rope=meta(*lead, 128, 64),
                                       key_rope=meta(*key_lead, 1, 64), layout=layout, **lens, **kv_lens)
    assert kernels(launches) == ["indexer_topk_kernel", "sparse_attention_kernel"]
    assert launches[1].grid[2] == 4  # 128 heads x 512 columns: two head tiles of 64 x two column tiles of 256


def test_paged_launchers_read_device_lengths_and_tables():
    """The launchers with device lengths and a device block table (vllm-ascend's decode step: TND queries over a
    paged cache): nothing is read back, the kernels read them."""
    t, blocks, page = 4, 32, 64
    query, table = meta(t, 128, 512), meta(t, 8, dtype=torch.int32)
    q_lens, kv_lens = meta(t, dtype=torch.int32), meta(t, dtype=torch.int32)
    index_key, latent, rope = meta(blocks, page, 1, 128), meta(blocks, page, 1, 512), meta(blocks, page, 1, 64)
    quant = meta(blocks, page, 1, 656, dtype=torch.int8)
    with gpu_dry_run() as launches:
        g = launch.geometry(query, index_key, "TND", "PA_BSND", q_lens, kv_lens, table)
        (idx, _), plan = launch.indexer_plan(g, meta(t, 64, 128), index_key, meta(t, 64), 2048, True, False,
                                             interpret=False)
        KERNELS.run_all(plan, META)
        for cache in (launch.plain_cache(latent, latent, rope), launch.packed_cache(quant, H)):
            _, plan = launch.attention_plan(g, query, meta(t, 128, 64), cache, idx, 0.1, 1, True, True, None,
                                            interpret=False)
            KERNELS.run_all(plan, META)
    split = ["sparse_attention_kernel", "sparse_attention_merge_kernel"]  # 4 tokens: each row split over programs
    assert kernels(launches) == ["indexer_topk_kernel", *split, *split]
    assert launches[3].constexprs["QUANT"] == 1 and launches[1].constexprs["SPLIT"]
