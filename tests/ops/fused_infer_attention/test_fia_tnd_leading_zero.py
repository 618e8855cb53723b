"""TND ``actual_seq_lengths`` with a leading 0: an empty first batch when the other arguments count that batch
too; otherwise (flash-attn's ``cu_seqlens`` passed whole) the error names ``actual_seq_lengths``, in the Pythonic
and the torch_npu dialects."""
import pytest
import torch

from attnops import torch_npu
from attnops._core.errors import ParamInvalidError
from attnops.ops.fused_infer_attention import fused_infer_attention
from tests.helpers import randn

N, D, BLOCK = 2, 16, 16
I32 = torch.int32


def _paged(q_lens, kv_lens, table, **kw):
    cache = randn(4, BLOCK, N * D, seed=1)
    return fused_infer_attention(randn(6, N, D), cache, cache, layout="TND", num_heads=N, num_key_value_heads=N,
                                 block_size=BLOCK, actual_seq_lengths=q_lens, actual_seq_lengths_kv=kv_lens,
                                 block_table=torch.tensor(table, dtype=I32), **kw)


def test_a_leading_zero_is_an_empty_first_batch():
    q, k = randn(6, N, D), randn(12, N, D, seed=1)
    args = dict(layout="TND", num_heads=N, num_key_value_heads=N)
    expected = fused_infer_attention(q, k, k, actual_seq_lengths=[2, 6], actual_seq_lengths_kv=[5, 12], **args)
    out = fused_infer_attention(q, k, k, actual_seq_lengths=[0, 2, 6], actual_seq_lengths_kv=[0, 5, 12], **args)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    paged = _paged([0, 2, 6], [0, 5, 20], [[0, 1], [0, 1], [2, 3]])
    torch.testing.assert_close(paged, _paged([2, 6], [5, 20], [[0, 1], [2, 3]]), rtol=0, atol=0)


@pytest.mark.parametrize("kv_lens,table,others", [
    ([5, 20], [[0, 1], [2, 3]], "block_table and actual_seq_lengths_kv"),
    ([20], [[0, 1], [2, 3]], "block_table"),
])
def test_a_leading_zero_against_b_minus_one_batches_names_actual_seq_lengths(kv_lens, table, others):
    with pytest.raises(ParamInvalidError) as info:
        _paged([0, 2, 6], kv_lens, table)
    message = str(info.value)
    assert message.startswith(f"actual_seq_lengths: expected B=2 cumulative query lengths like {others}, without a "
                              "leading 0"), message
    assert "got [0, 2, 6]" in message and "cu_seqlens[1:]" in message


def test_the_torch_npu_dialect_names_actual_seq_lengths_too():
    q, k = randn(6, N, D), randn(12, N, D, seed=1)
    with pytest.raises(ParamInvalidError, match=r"^actual_seq_lengths: expected B=2 cumulative query lengths like "
                                                r"actual_seq_lengths_kv, without a leading 0.*got \[0, 2, 6\]"):
        torch_npu.npu_fused_infer_attention_score(q, k, k, num_heads=N, num_key_value_heads=N, input_layout="TND",
                                                  actual_seq_lengths=[0, 2, 6], actual_seq_lengths_kv=[5, 12])
