"""The names added for op-plugin's tests on the GPU path, on ``meta`` tensors inside ``gpu_dry_run()``: lengths
given on the host are read, device tensors never are; the attention ones record their operator's launches, the
cache reads and writes their kernel launch."""
from __future__ import annotations

import torch

from attnops import torch_npu
from attnops.testing import gpu_dry_run

from .test_dry_run import BLOCK, BLOCKS, DV, KVN, N, D, meta, nd_caches

LENS = [5, 8]
TABLE = meta(2, 3, dtype=torch.int32)


def _launches(call):
    with gpu_dry_run() as launches:
        call()
    assert launches
    return launches


def test_self_attention_v2_and_prefix_v2():
    q, k, v, out = meta(13, N, D), meta(13, KVN, D), meta(13, KVN, DV), meta(13, N, DV)
    slopes = meta(N, dtype=torch.float32)
    for mask_type in (3, 4, 5):
        _launches(lambda: torch_npu._npu_flash_attention_v2(q, k, v, LENS, mask=meta(128, 128), slopes=slopes,
                                                            mask_type=mask_type, num_heads=N, num_kv_heads=KVN,
                                                            out=out))
    _launches(lambda: torch_npu._npu_flash_attention_v2(q, k, v, LENS, mask=meta(N, 8, 8), mask_type=2, num_heads=N,
                                                        num_kv_heads=KVN, out=out))
    key_cache, value_cache = (c.flatten(2) for c in nd_caches())
    _launches(lambda: torch_npu._npu_flash_attention_prefix_v2(meta(5, N, D), key_cache, value_cache, TABLE,
                                                               meta(128, 128), [3, 2], [40, 9], slopes=slopes,
                                                               mask_type=4, num_kv_heads=KVN, num_heads=N,
                                                               out=meta(5, N, DV)))


def test_paged_decode_forms():
    caches, lens = nd_caches(), torch.tensor([40, 9], dtype=torch.int32)
    _launches(lambda: torch_npu._npu_paged_attention_v2(meta(2, N, D), caches[0], TABLE, lens, value_cache=caches[1],
                                                        mask=meta(2, N, 1, 48), num_kv_heads=KVN, num_heads=N,
                                                        mask_type=2, out=meta(2, N, DV)))
    ctkv, k_rope = meta(BLOCKS, BLOCK, 1, 64), meta(BLOCKS, BLOCK, 1, 16)
    _launches(lambda: torch_npu.npu_multi_head_latent_attention(meta(2, N, 64), meta(2, N, 16), ctkv, k_rope, TABLE,
                                                                lens, N, 0.1, 1, True))
    quant = nd_caches(dtype=torch.int8)
    with gpu_dry_run():  # plain tensor arithmetic after the cache read: no attention kernel
        torch_npu._npu_paged_attention_quant(meta(2, N, D, dtype=torch.int8), quant[0], quant[0], KVN, N, 0.1, TABLE,
                                             lens, 3, 27, meta(N, dtype=torch.float32),
                                             meta(N, dtype=torch.float32), meta(2, N, D, dtype=torch.bfloat16))


def test_cache_load_and_single_cache_write():
    caches = nd_caches()
    launches = _launches(lambda: torch_npu.npu_paged_cache_load(*caches, TABLE, meta(2, dtype=torch.int32),
                                                                seq_starts=meta(2, dtype=torch.int32),
                                                                key=meta(49, KVN, D), value=meta(49, KVN, DV)))
    assert launches[0].kernel == "gather_kv_kernel"
    launches = _launches(lambda: torch_npu._npu_reshape_and_cache_siso(meta(6, KVN, D), caches[0],
                                                                       meta(6, dtype=torch.int32)))
    assert launches[0].kernel == "scatter_kv_kernel"


def test_block_sparse_attention_forward_and_backward():
    q, k, v = meta(13, N, D), meta(13, KVN, D), meta(13, KVN, D)
    mask = meta(2, N, 1, 1, dtype=torch.int8)
    kw = dict(q_input_layout="TND", kv_input_layout="TND", num_key_value_heads=KVN, actual_seq_lengths=[5, 13],
              actual_seq_lengths_kv=[5, 13])
    _launches(lambda: torch_npu.npu_block_sparse_attention(q, k, v, mask, [16, 16], **kw))
    _launches(lambda: torch_npu.npu_block_sparse_attention_backward(
        meta(13, N, D), q, k, v, meta(13, N, D), meta(13, N, 1, dtype=torch.float32), mask, [16, 16], [5, 13],
        [5, 13], "TND", "TND", KVN, 0.0))


def test_infer_and_quant_fusion_attention():
    q, k, v = meta(1, N, 2, D), meta(1, KVN, 9, D), meta(1, KVN, 9, D)
    _launches(lambda: torch_npu.npu_fused_infer_attention_v2(q, k, v, num_query_heads=N, num_key_value_heads=KVN,
                                                             input_layout="BNSD",
                                                             quant_scale_out=meta(1, dtype=torch.float32),
                                                             out_dtype=torch.float8_e5m2))
    fp8 = [meta(1, N, 9, D, dtype=torch.float8_e4m3fn) for _ in range(3)]
    scale = meta(1, N, 1, 1, dtype=torch.float32)
    with gpu_dry_run():  # plain tensor arithmetic: no attention kernel
        torch_npu.npu_quant_fusion_attention(*fp8, N, "BNSD", d_scale_q=scale, d_scale_k=scale, d_scale_v=scale)


def test_format_cast_and_dropout_mask():
    with gpu_dry_run():
        x = meta(2, 16)
        assert torch_npu.get_npu_format(torch_npu.npu_format_cast(x, 29)) == 29
        assert torch_npu.get_npu_format(torch_npu.npu_format_cast_(x, 29)) == 29
        assert torch_npu._npu_dropout_gen_mask(x, [2, 64], p=0.1, seed=1, offset=0).shape == (16,)
