"""Serving code written the way vllm-ascend and MindSpeed drive torch_npu (cache writes, paged decode, context
loads, numpy metadata, masks on ``torch.npu.current_device()``), run through the shim on attnops and judged against
the fp64 golden (FlashAttention's tolerance rule)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from attnops import torch_npu
from attnops.testing.compare import assert_close_to_golden, fa_reductions
from attnops.testing.golden import fa_forward
from tests.helpers import TRIU2048, randn

N, KVN, D, DV, BLOCK = 4, 2, 16, 16, 4


def _golden(q, k, v, dtype=torch.float64):
    """Bottom-right causal attention of ``q [Sq, N, D]`` over ``k/v [Skv, KVN, D]``, fp64 (or ``dtype``)."""
    kw = dict(head_num=N, input_layout="TND", atten_mask=TRIU2048, sparse_mode=3, scale=D ** -0.5,
              actual_seq_qlen=[q.shape[0]], actual_seq_kvlen=[k.shape[0]])
    return fa_forward(q, k, v, dtype=dtype, **kw)[0]


class ServingLayer:
    """A vllm-ascend-like attention layer: slot mapping from the block table, K/V written with
    ``npu_scatter_pa_kv_cache`` (or ``_npu_reshape_and_cache``), attention with ``npu_fused_infer_attention_score``
    (any number of new tokens) or ``_npu_paged_attention`` (one new token per sequence)."""

    def __init__(self, num_blocks=16, dtype=torch.float32, writer="scatter"):
        self.key_cache = torch.zeros(num_blocks, BLOCK, KVN, D, dtype=dtype)
        self.value_cache = torch.zeros(num_blocks, BLOCK, KVN, DV, dtype=dtype)
        self.block_table = torch.tensor([[3, 7, 1, 12, 5], [0, 9, 14, 2, 8]], dtype=torch.int32)
        self.lens = [0, 0]
        self.writer = writer
        self.history = [[torch.empty(0, KVN, D, dtype=dtype), torch.empty(0, KVN, DV, dtype=dtype)] for _ in range(2)]

    def slot_mapping(self, new: list[int]) -> np.ndarray:
        slots = []
        for b, n in enumerate(new):
            for pos in range(self.lens[b], self.lens[b] + n):
                slots.append(int(self.block_table[b, pos // BLOCK]) * BLOCK + pos % BLOCK)
        return np.array(slots, dtype=np.int32)                                 # numpy metadata, as vllm-ascend

    def write(self, key, value, new):
        slots = torch.from_numpy(self.slot_mapping(new))
        if self.writer == "scatter":
            torch_npu.npu_scatter_pa_kv_cache(key, value, self.key_cache, self.value_cache, slots, cache_mode="Norm")
        else:
            torch_npu._npu_reshape_and_cache(key, value, self.key_cache, self.value_cache, slots)
        start = 0
        for b, n in enumerate(new):
            self.history[b][0] = torch.cat([self.history[b][0], key[start:start + n]])
            self.history[b][1] = torch.cat([self.history[b][1], value[start:start + n]])
            self.lens[b] += n
            start += n

    def attend_fia(self, query, new):
        cu_q = np.cumsum(new)                                                 # TND: cumulative query lengths
        out, _ = torch_npu.npu_fused_infer_attention_score(
            query, self.key_cache.flatten(2), self.value_cache.flatten(2), atten_mask=TRIU2048,
            block_table=self.block_table, actual_seq_lengths=cu_q, actual_seq_lengths_kv=np.array(self.lens),
            num_heads=N, num_key_value_heads=KVN, input_layout="TND", scale=D ** -0.5, sparse_mode=3,
            block_size=BLOCK)
        return out

    def attend_paged(self, query):
        out = torch.empty(query.shape[0], N, DV, dtype=query.dtype)
        workspace = torch_npu._npu_paged_attention_get_workspace(
            query, self.key_cache, self.value_cache, KVN, N, D ** -0.5, self.block_table,
            torch.tensor(self.lens, dtype=torch.int32), out)
        torch_npu._npu_paged_attention(query, self.key_cache, self.value_cache, KVN, N, D ** -0.5, self.block_table,
                                       torch.tensor(self.lens, dtype=torch.int32), out, workspace=workspace)
        return out

    def check(self, name, out, query, new):
        start = 0
        for b, n in enumerate(new):
            q = query[start:start + n]
            k, v = self.history[b]
            assert_close_to_golden(f"{name}[{b}]", out[start:start + n], _golden(q, k, v),
                                   _golden(q, k, v, dtype=query.dtype), reduction=D + k.shape[0])
            start += n


@pytest.mark.parametrize("writer", ["scatter", "reshape_and_cache"])
def test_serving_steps_prefill_decode_chunked_prefill_spec_decode(writer):
    layer = ServingLayer(writer=writer)
    steps = [("prefill", [5, 9]), ("decode", [1, 1]), ("chunked prefill", [4, 1]), ("spec decode", [3, 3]),
             ("decode", [1, 1])]
    for i, (name, new) in enumerate(steps):
        t = sum(new)
        query, key, value = randn(t, N, D, seed=3 * i), randn(t, KVN, D, seed=3 * i + 1), randn(t, KVN, DV, seed=3 * i + 2)
        layer.write(key, value, new)
        layer.check(name, layer.attend_fia(query, new), query, new)
        if max(new) == 1:                                                      # graph-mode decode kernel
            layer.check(f"{name} (_npu_paged_attention)", layer.attend_paged(query), query, new)


def test_context_load_with_gather_merged_by_attention_update():
    """Chunked prefill with a cached context: attend to the context loaded by npu_gather_pa_kv_cache and to the
    new chunk separately, merge with npu_attention_update: equals attention over the whole history."""
    layer = ServingLayer()
    ctx, new = [6, 11], [3, 2]
    layer.write(randn(sum(ctx), KVN, D, seed=40), randn(sum(ctx), KVN, DV, seed=41), ctx)
    key_ctx, value_ctx = torch.zeros(sum(ctx), KVN, D), torch.zeros(sum(ctx), KVN, DV)
    torch_npu.npu_gather_pa_kv_cache(layer.key_cache, layer.value_cache, layer.block_table,
                                     torch.tensor([0, *np.cumsum(ctx)], dtype=torch.int32), key_ctx, value_ctx,
                                     is_seq_lens_cumsum=True)
    query, key, value = randn(sum(new), N, D, seed=42), randn(sum(new), KVN, D, seed=43), randn(sum(new), KVN, DV, seed=44)
    layer.write(key, value, new)
    cq, cctx = np.cumsum(new), np.cumsum(ctx)
    common = dict(num_heads=N, num_key_value_heads=KVN, input_layout="TND", scale=D ** -0.5, softmax_lse_flag=True)
    out_ctx, lse_ctx = torch_npu.npu_fused_infer_attention_score(query, key_ctx, value_ctx, actual_seq_lengths=cq,
                                                                 actual_seq_lengths_kv=cctx, **common)
    out_new, lse_new = torch_npu.npu_fused_infer_attention_score(
        query, key, value, atten_mask=TRIU2048, sparse_mode=3, actual_seq_lengths=cq, actual_seq_lengths_kv=cq,
        **common)
    out, _ = torch_npu.npu_attention_update([lse_ctx.reshape(-1), lse_new.reshape(-1)],
                                            [out_ctx.reshape(-1, DV), out_new.reshape(-1, DV)], 0)
    layer.check("merged", out.reshape(-1, N, DV), query, new)


def test_gather_nz_cache_and_seq_offset():
    key = randn(12, KVN, D, seed=50).half()
    value = randn(12, KVN, DV, seed=51).half()
    kc, vc = torch.zeros(6, KVN * D // 16, BLOCK, 16).half(), torch.zeros(6, KVN * DV // 16, BLOCK, 16).half()
    slots = torch.tensor([2 * BLOCK + i for i in range(4)] + [5 * BLOCK + i for i in range(4)]
                         + [1 * BLOCK + i for i in range(4)], dtype=torch.int64)
    torch_npu.npu_scatter_pa_kv_cache(key, value, kc, vc, slots)                 # NZ (the default cache_mode)
    out_k, out_v = torch.zeros(8, KVN, D).half(), torch.zeros(8, KVN, DV).half()
    table = torch.tensor([[2, 5, 1], [1, -1, 0]], dtype=torch.int32)
    torch_npu.npu_gather_pa_kv_cache(kc, vc, table, torch.tensor([6, 2], dtype=torch.int32), out_k, out_v,
                                     seq_offset=torch.tensor([4, 0], dtype=torch.int32))
    # sequence 0 skips one block (seq_offset 4): blocks 5, 1 -> tokens 4..9; sequence 1: block 1 -> tokens 8, 9
    assert torch.equal(out_k, torch.cat([key[4:10], key[8:10]]))
    assert torch.equal(out_v, torch.cat([value[4:10], value[8:10]]))


def test_scatter_skips_negative_slots_and_rejects_out_of_range():
    kc, vc = torch.zeros(2, BLOCK, KVN, D), torch.zeros(2, BLOCK, KVN, DV)
    key, value = randn(3, KVN, D, seed=60), randn(3, KVN, DV, seed=61)
    torch_npu.npu_scatter_pa_kv_cache(key, value, kc, vc, torch.tensor([0, -1, 7]), cache_mode="Norm")
    assert torch.equal(kc[0, 0], key[0]) and torch.equal(kc[1, 3], key[2]) and int((kc != 0).any(-1).any(-1).sum()) == 2
    with pytest.raises(ValueError, match="slot_mapping"):
        torch_npu.npu_scatter_pa_kv_cache(key, value, kc, vc, torch.tensor([0, 1, 8]), cache_mode="Norm")
    with pytest.raises(ValueError, match="cache_mode"):
        torch_npu.npu_scatter_pa_kv_cache(key, value, kc, vc, torch.tensor([0, 1, 2]), cache_mode="NZ")
    with pytest.raises(ValueError, match="key_cache: expected a paged cache .* ND"):  # an NZ cache, Norm mode
        torch_npu.npu_scatter_pa_kv_cache(key, value, torch.zeros(2, KVN * D // 8, BLOCK, 8), vc,
                                          torch.tensor([0, 1, 2]), cache_mode="Norm")
    with pytest.raises(NotImplementedError, match="compress_lens"):
        torch_npu.npu_scatter_pa_kv_cache(key, value, kc, vc, torch.tensor([0, 1, 2]), cache_mode="Norm",
                                          compress_lens=torch.tensor([1]))


def test_flash_attention_unpad_is_full_attention_per_sequence():
    lens = [5, 8]
    q, k, v = randn(13, N, D, seed=70), randn(13, KVN, D, seed=71), randn(13, KVN, 8, seed=72)
    out = torch.empty(13, N, 8)
    torch_npu._npu_flash_attention_unpad(q, k, v, torch.tensor(lens, dtype=torch.int32), D ** -0.5, N, KVN, out)
    kw = dict(head_num=N, input_layout="TND", scale=D ** -0.5, actual_seq_qlen=[5, 13], actual_seq_kvlen=[5, 13])
    assert_close_to_golden("out", out, fa_forward(q, k, v, **kw)[0], fa_forward(q, k, v, dtype=q.dtype, **kw)[0],
                           reduction=fa_reductions(q, k, v, layout="TND", head_num=N, actual_seq_qlen=[5, 13],
                                                   actual_seq_kvlen=[5, 13])["out"])
