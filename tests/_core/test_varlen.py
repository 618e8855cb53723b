"""Sequence-length conventions: CANN cumulative lists (cann_semantics.md §5), FA-style cu_seqlens, SeqInfo."""
import pytest
import torch

from attnops import ParamInvalidError
from attnops._core.varlen import (SeqInfo, as_cu_tensor, cumulative_from_cu_seqlens, lengths_from_cumulative,
                                  seq_info_varlen)


@pytest.mark.parametrize("cum,lens", [
    ([2, 4, 4, 6, 8], [2, 2, 0, 2, 2]),      # VarLenV5 doc: a repeated value is an empty batch
    ([2, 5, 9, 0, 0], [2, 3, 4, 0, 0]),      # torch_npu doc: trailing zeros disable batches
    ([0, 3], [0, 3]),                        # a leading 0 is an empty first batch
    ([0, 0, 0], [0, 0, 0]),
    ([1, 3, 6], [1, 2, 3]),                  # §5 worked example
    ([7], [7]),
])
def test_lengths_from_cumulative(cum, lens):
    assert lengths_from_cumulative("actual_seq_qlen", cum) == lens
    assert lengths_from_cumulative("actual_seq_qlen", torch.tensor(cum, dtype=torch.int64)) == lens
    assert lengths_from_cumulative("actual_seq_qlen", tuple(cum), total=sum(lens)) == lens


@pytest.mark.parametrize("cum", [[3, 2], [2, 5, 4], [2, 0, 3], [4, 4, 3]])
def test_decreasing_cumulative_raises(cum):
    with pytest.raises(ParamInvalidError, match="actual_seq_kvlen") as e:
        lengths_from_cumulative("actual_seq_kvlen", cum)
    assert e.value.status == 161002


def test_cumulative_beyond_total_raises():
    assert lengths_from_cumulative("actual_seq_qlen", [2, 5], total=5) == [2, 3]
    with pytest.raises(ParamInvalidError, match="actual_seq_qlen"):
        lengths_from_cumulative("actual_seq_qlen", [2, 6], total=5)


@pytest.mark.parametrize("bad", [[], None, [1.5, 2.0], torch.tensor([1.0, 2.0]), torch.tensor([[1, 2]]), "12"])
def test_bad_cumulative_values_raise(bad):
    with pytest.raises(ParamInvalidError):
        lengths_from_cumulative("actual_seq_qlen", bad)


@pytest.mark.parametrize("cu,cum", [([0, 2, 5, 5, 9], [2, 5, 5, 9]), ([0, 0], [0])])
def test_cu_seqlens_conversion(cu, cum):
    assert cumulative_from_cu_seqlens("cu_seqlens_q", cu) == cum
    assert cumulative_from_cu_seqlens("cu_seqlens_q", torch.tensor(cu, dtype=torch.int32)) == cum
    lens = lengths_from_cumulative("x", cum)
    assert as_cu_tensor(lens).tolist() == cu and as_cu_tensor(lens).dtype == torch.int32


@pytest.mark.parametrize("cu", [[2, 5], [0], [1, 2, 3], []])
def test_cu_seqlens_needs_a_leading_zero(cu):
    with pytest.raises(ParamInvalidError, match="cu_seqlens_k"):
        cumulative_from_cu_seqlens("cu_seqlens_k", cu)


def test_seq_info_varlen_offsets():
    s = seq_info_varlen([2, 0, 3], [4, 1, 0])
    assert s.packed and s.batch == 3 and s.max_q == 3 and s.max_kv == 4
    assert s.q_starts == (0, 2, 2) and s.kv_starts == (0, 4, 5)
    assert s.score_numel(2) == 2 * (2 * 4 + 0 + 0)
    assert s.score_offsets(2) == [0, 16, 16]
    with pytest.raises(ParamInvalidError, match="actual_seq_kvlen"):
        seq_info_varlen([1, 2], [1])


def test_seq_info_dense():
    s = SeqInfo.dense(3, 4, 5)
    assert not s.packed and s.q_lens == (4, 4, 4) and s.kv_lens == (5, 5, 5)
    assert s.q_starts == (0, 4, 8) and s.kv_starts == (0, 5, 10)
    assert s.score_numel(2) == 3 * 2 * 4 * 5 and s.score_offsets(2) == [0, 40, 80]
    assert as_cu_tensor([]).tolist() == [0]
