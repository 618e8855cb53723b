"""``torch.compile(fullgraph=True, dynamic=True)`` of a paged decode step with the KV lengths as a tensor, through the
Pythonic API and through torch_npu: one graph for every length set (the call is the custom op, whose length values
are never traced), equal to eager."""
import pytest
import torch

import attnops
from attnops import torch_npu
from tests.helpers import randn
from tests.ops.fused_infer_attention.fia_helpers import to_paged

N, NKV, D, BS = 4, 2, 16, 16


def _pythonic(q, key_cache, value_cache, block_table, lengths):
    return attnops.fused_infer_attention(q, key_cache, value_cache, num_key_value_heads=NKV, block_table=block_table,
                                         block_size=BS, actual_seq_lengths_kv=lengths, scale=0.25, return_lse=True)


def _torch_npu(q, key_cache, value_cache, block_table, lengths):
    return torch_npu.npu_fused_infer_attention_score(
        q, key_cache, value_cache, block_table=block_table, actual_seq_lengths_kv=lengths, num_heads=N,
        num_key_value_heads=NKV, input_layout="BNSD", block_size=BS, scale=0.25, softmax_lse_flag=True)


@pytest.mark.parametrize("decode", [_pythonic, _torch_npu], ids=["pythonic", "torch_npu"])
def test_compile_traces_one_graph_for_tensor_lengths(decode):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    lens = [60, 33, 17]
    kc, bt = to_paged(randn(3, NKV, max(lens), D, seed=1), lens, BS, cache_layout="BNSD", seed=3)
    vc, _ = to_paged(randn(3, NKV, max(lens), D, seed=2), lens, BS, cache_layout="BNSD", seed=3)
    q = randn(3, N, 1, D, seed=4)
    compiled = torch.compile(decode, fullgraph=True, dynamic=True, backend="aot_eager")
    for new in ([60, 33, 17], [1, 2, 3], [64, 0, 5], [33, 48, 16], [10, 20, 30]):
        lengths = torch.tensor(new, dtype=torch.int32)
        for got, want in zip(compiled(q, kc, vc, bt, lengths), decode(q, kc, vc, bt, lengths)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
