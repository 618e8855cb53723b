"""FIA on sequences long enough to cross the implementation's row tiles (prefill rows > 256, band rows > 128) and
the int8 tile, vs the fp64 golden: sparse modes, user masks with pre/next, pse, prefix, left padding, paged KV."""
from __future__ import annotations

import pytest
import torch

from attnops.testing.golden_fia import encode_deq_scale
from tests.helpers import randn
from tests.ops.fused_infer_attention.fia_helpers import (TRIU2048, check_fia, layout_of, make_inputs, rand_mask,
                                                         randint8, to_paged)

F16, BF16 = torch.float16, torch.bfloat16


@pytest.mark.parametrize("mode,pre,nxt", [(0, 2147483647, 2147483647), (1, 0, 0), (2, 0, 0), (3, 0, 0),
                                          (4, 100, 7), (0, 150, 20)])
def test_long_prefill_sparse_modes(mode, pre, nxt):
    b, n, nkv, sq, skv = 2, 4, 2, 300, 333
    q, k, v = make_inputs("BSND", b=b, n=n, nkv=nkv, sq=sq, skv=skv, d=16, dtype=F16, scale=0.5)
    mask = TRIU2048 if mode in (2, 3, 4) else (rand_mask(b, sq, skv, seed=1, p=0.3) if mode == 1 or pre < 1000
                                              else None)
    check_fia(q, k, v, atten_mask=mask, sparse_mode=mode, pre_tokens=pre, next_tokens=nxt,
              actual_seq_lengths=[300, 261], actual_seq_lengths_kv=[333, 270], num_heads=n, num_key_value_heads=nkv,
              scale_value=0.25, input_layout="BSND", inner_precise=2, softmax_lse_flag=True)


def test_long_prefill_pse_prefix():
    n, sq, skv, plen = 2, 280, 150, 140
    q, k, v = make_inputs("BNSD", b=2, n=n, sq=sq, skv=skv, d=16, dtype=BF16, scale=0.5)
    kp, vp, _ = make_inputs("BNSD", b=1, n=n, sq=plen, skv=plen, d=16, dtype=BF16, seed=5)
    check_fia(q, k, v, key_shared_prefix=kp, value_shared_prefix=vp, atten_mask=TRIU2048, sparse_mode=3,
              pse_shift=randn(1, n, sq, plen + skv, dtype=BF16, seed=6), actual_seq_lengths_kv=[150, 90],
              num_heads=n, scale_value=0.25, input_layout="BNSD", softmax_lse_flag=True)


def test_long_prefill_left_padding_with_mask():
    n, sq, skv = 2, 270, 300
    q, k, v = make_inputs("BSH", b=2, n=n, sq=sq, skv=skv, d=16, dtype=F16, scale=0.5)
    check_fia(q, k, v, actual_seq_lengths=[260, 140], actual_seq_lengths_kv=[290, 201],
              query_padding_size=torch.tensor([3]), kv_padding_size=torch.tensor([5]),
              atten_mask=rand_mask(2, sq, skv, seed=2, p=0.4), sparse_mode=0, num_heads=n, scale_value=0.25,
              input_layout="BSH", inner_precise=2, softmax_lse_flag=True)


@pytest.mark.parametrize("cache_layout", ["BSH", "BNSD"])
def test_long_paged_prefill(cache_layout):
    n, nkv, bs, lens, sq = 4, 1, 128, [700, 260], 270
    q = randn(2, n, sq, 16, dtype=F16, seed=1, scale=0.5)
    k, v = randn(2, nkv, 700, 16, dtype=F16, seed=2), randn(2, nkv, 700, 16, dtype=F16, seed=3)
    kc, bt = to_paged(k, lens, bs, cache_layout=cache_layout, seed=4)
    vc, _ = to_paged(v, lens, bs, cache_layout=cache_layout, seed=4)
    check_fia(q, kc, vc, block_table=bt, block_size=bs, actual_seq_lengths_kv=lens, atten_mask=TRIU2048,
              sparse_mode=3, num_heads=n, num_key_value_heads=nkv, scale_value=0.25, input_layout="BNSD",
              softmax_lse_flag=True)


def test_long_decode_paged_gqa():
    n, nkv, bs, lens = 8, 2, 64, [1000, 3, 513]
    q = randn(3, 1, n * 32, dtype=BF16, seed=1)
    k, v = randn(3, nkv, 1000, 32, dtype=BF16, seed=2), randn(3, nkv, 1000, 32, dtype=BF16, seed=3)
    kc, bt = to_paged(k, lens, bs, cache_layout="BSH", seed=4)
    vc, _ = to_paged(v, lens, bs, cache_layout="BSH", seed=4)
    check_fia(q, kc, vc, block_table=bt, block_size=bs, actual_seq_lengths_kv=lens, num_heads=n,
              num_key_value_heads=nkv, scale_value=0.125, input_layout="BSH", softmax_lse_flag=True)


def test_long_int8_chain():
    b, n, d, sq, skv = 1, 2, 32, 300, 400
    q = layout_of(randint8(b, sq, n, d, seed=1), "BSH")
    k = layout_of(randint8(b, skv, n, d, seed=2), "BSH")
    v = layout_of(randint8(b, skv, n, d, seed=3), "BSH")
    check_fia(q, k, v, deq_scale1=encode_deq_scale(7.3e-5), quant_scale1=torch.tensor([127.0]),
              deq_scale2=encode_deq_scale(1 / 127), quant_scale2=torch.tensor([0.5]), atten_mask=TRIU2048,
              sparse_mode=3, num_heads=n, scale_value=0.7, input_layout="BSH", softmax_lse_flag=True)
