"""attnops.native_sparse_attention under torch.compile(fullgraph=True), forward and backward, equals eager mode."""
from __future__ import annotations

import pytest
import torch

import attnops

from .nsa_helpers import randn

LENS_CUM = [16, 48]


def _inputs():
    t, n1, n2 = LENS_CUM[-1], 2, 1
    return (randn(t, n1, 8, seed=1), randn(t, n2, 8, seed=2), randn(t, n2, 4, seed=3),
            torch.sigmoid(randn(t, n1, 3, seed=4)), randn(8, n2, seed=5), randn(8, n2, seed=6))


def _layer(q, k, v, gates, wk, wv, **lengths):
    return attnops.native_sparse_attention(q, k, v, gates, wk, wv, compress_block_size=8, compress_stride=4,
                                           select_block_size=8, select_block_count=2, window_size=5, scale=0.4,
                                           **lengths)


@pytest.mark.parametrize("lengths", [dict(actual_seq_len=LENS_CUM), dict(cu_seqlens=[0, *LENS_CUM])])
def test_native_sparse_attention_compile_fullgraph_fwd_bwd_equals_eager(lengths):
    torch._dynamo.reset()
    inputs = _inputs()
    dy = randn(LENS_CUM[-1], 2, 4, seed=7)
    eager = [x.clone().requires_grad_() for x in inputs]
    compiled = [x.clone().requires_grad_() for x in inputs]
    ye = _layer(*eager, **lengths)
    yc = torch.compile(lambda *a: _layer(*a, **lengths), fullgraph=True, backend="aot_eager")(*compiled)
    ye.backward(dy)
    yc.backward(dy)
    torch.testing.assert_close(yc, ye, rtol=0, atol=0)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_tensor_lengths_work_in_eager_and_compiled():
    """A cu_seqlens tensor: read in eager mode; under compilation the layer is one op (tests/ops/nsa/
    test_layer_compile.py checks one graph for many length sets)."""
    torch._dynamo.reset()
    inputs = _inputs()
    cu = torch.tensor([0, *LENS_CUM])
    want = _layer(*inputs, actual_seq_len=LENS_CUM)
    torch.testing.assert_close(_layer(*inputs, cu_seqlens=cu), want, rtol=0, atol=0)
    compiled = torch.compile(lambda *a: _layer(*a, cu_seqlens=cu), fullgraph=True, backend="aot_eager")(*inputs)
    torch.testing.assert_close(compiled, want, rtol=0, atol=0)


def test_operator_tensor_lengths_under_compile_raise_a_clear_error():
    """The NSA operators' output shapes depend on their lengths: a tensor under compilation names the argument."""
    torch._dynamo.reset()
    x, w = randn(48, 1, 8, seed=1), randn(8, 1, seed=2)
    with pytest.raises(Exception, match="actual_seq_len: expected a list of ints"):
        torch.compile(lambda x, w: attnops.nsa_compress(x, w, block_size=8, stride=4,
                                                         actual_seq_len=torch.tensor(LENS_CUM)),
                      fullgraph=True, backend="aot_eager")(x, w)


def test_eager_validation_kept():
    with pytest.raises(ValueError, match="actual_seq_len"):
        _layer(*_inputs(), actual_seq_len=[16, 8])
