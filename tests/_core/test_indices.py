"""The shared index checks: the validation switch and the errors' form (one vectorized pass, the first bad entry
named with its argument, expected range and received value)."""
from __future__ import annotations

import pytest
import torch

from attnops._core.errors import ParamInvalidError
from attnops._core.indices import (check_block_table, check_index_rows, check_room, check_slots, entries_read,
                                   validation_enabled)


@pytest.mark.parametrize("value, cpu, cuda", [(None, True, False), ("1", True, True), ("0", False, False)])
def test_switch(monkeypatch, value, cpu, cuda):
    if value is None:
        monkeypatch.delenv("ATTNOPS_VALIDATE", raising=False)
    else:
        monkeypatch.setenv("ATTNOPS_VALIDATE", value)
    assert validation_enabled("cpu") is cpu and validation_enabled(torch.device("cuda")) is cuda
    assert validation_enabled("meta") is cuda  # the GPU dry run's tensors are never read by default


def test_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv("ATTNOPS_VALIDATE", "yes")
    with pytest.raises(ParamInvalidError, match=r"^ATTNOPS_VALIDATE: expected '1' .*, got 'yes'"):
        validation_enabled("cpu")


def test_block_table_reads_only_the_blocks_in_use():
    table = torch.tensor([[3, -1, 99], [0, 1, -1]])
    check_block_table(table, [16, 17], 16, 4)  # batch 0 uses one block, batch 1 two
    with pytest.raises(ParamInvalidError, match=r"got block_table\[0, 1\] = -1, but batch 0 has 17 tokens"):
        check_block_table(table, [17, 17], 16, 4)
    with pytest.raises(ParamInvalidError, match=r"^block_table: expected at least 4 columns: batch 1 has 49 tokens"):
        check_block_table(table, [0, 49], 16, 4)


def test_index_rows_stop_at_the_padding():
    idx = torch.tensor([[0, 4, -1, 9], [1, -1, -1, -1]])
    read = entries_read(idx, torch.tensor([4, 4]))
    assert read.tolist() == [[True, True, False, False], [True, False, False, False]]
    check_index_rows("sparse_indices", idx, read, torch.tensor([5, 2]))  # 9 is after the -1: never read
    with pytest.raises(ParamInvalidError, match=r"expected an index in \[0, 2\) .*, got sparse_indices\[0, 1\] = 4$"):
        check_index_rows("sparse_indices", idx, read, torch.tensor([5, 8]), unit=4)


def test_slots_and_room():
    check_slots("slot_mapping", torch.tensor([0, -1, 7]), 8, what="the cache")
    with pytest.raises(ParamInvalidError, match=r"got slot_mapping\[0\] = -2$"):
        check_slots("slot_mapping", torch.tensor([-2, 8]), 8, what="the cache")
    with pytest.raises(ParamInvalidError, match=r"^key: expected at least 5 rows along dim 0"):
        check_room("key", torch.zeros(4, 2), 0, 5, "the tokens")
