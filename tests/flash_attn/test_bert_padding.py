"""``flash_attn.bert_padding``: packing follows the mask token by token (checked against a Python loop), pad_input
inverts it, gradients flow, concatenated sequences get one cu_seqlens entry each, bad shapes raise."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.flash_attn.bert_padding import (index_first_axis, index_put_first_axis, pad_input, unpad_input,
                                             unpad_input_for_concatenated_sequences)
from tests.helpers import randn

MASK = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 1]], dtype=torch.bool)


def test_unpad_input_packs_the_masked_tokens_in_order():
    x = randn(3, 4, 2, 5)
    packed, indices, cu, max_len, used = unpad_input(x, MASK)
    rows = [(b, s) for b in range(3) for s in range(4) if MASK[b, s]]
    assert torch.equal(packed, torch.stack([x[b, s] for b, s in rows]))
    assert indices.tolist() == [b * 4 + s for b, s in rows] and indices.dtype == torch.int64
    assert cu.tolist() == [0, 3, 3, 6] and cu.dtype == torch.int32
    assert max_len == 3 and isinstance(max_len, int)
    assert used.tolist() == [3, 0, 3] and used.dtype == torch.int32


def test_unused_tokens_are_packed_but_not_used():
    unused = torch.zeros_like(MASK)
    unused[1, :2] = True
    packed, indices, cu, max_len, used = unpad_input(randn(3, 4, 6), MASK.int(), unused)
    assert cu.tolist() == [0, 3, 5, 8] and used.tolist() == [3, 0, 3] and packed.shape == (8, 6)


def test_pad_input_inverts_unpad_input_and_gradients_flow():
    x = randn(3, 4, 6).requires_grad_()
    packed, indices, *_ = unpad_input(x, MASK)
    padded = pad_input(packed, indices, 3, 4)
    assert torch.equal(padded, x.detach() * MASK.unsqueeze(-1))
    padded.sum().backward()
    assert torch.equal(x.grad, MASK.unsqueeze(-1).float().expand_as(x))
    assert torch.equal(index_first_axis(x.detach().flatten(0, 1), indices), packed.detach())
    assert torch.equal(index_put_first_axis(packed.detach(), indices, 12).view(3, 4, 6), padded.detach())


def test_concatenated_sequences():
    lengths = torch.tensor([[2, 1, 0, 0], [4, 0, 0, 0]])
    x = randn(2, 4, 3)
    packed, indices, cu, max_len = unpad_input_for_concatenated_sequences(x, lengths)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6, 7] and torch.equal(packed, x.flatten(0, 1)[indices])
    assert cu.tolist() == [0, 2, 3, 7] and max_len == 4


@pytest.mark.parametrize("call,message", [
    (lambda: unpad_input(torch.ones(3, 5, 2), MASK), r"hidden_states: expected \[B, S, \.\.\.\] with \[B, S\] = "
                                                      r"\[3, 4\]"),
    (lambda: pad_input(torch.ones(2, 3), torch.tensor([0]), 1, 2), r"indices: expected shape \[2\]"),
    (lambda: index_first_axis(torch.ones(4), torch.tensor([0])), r"input: expected a tensor of at least 2 dims"),
])
def test_bad_arguments_raise_naming_them(call, message):
    with pytest.raises(attnops.ParamInvalidError, match=message):
        call()
