"""The NSA operators' eager fast path (``attnops._core.custom_ops.call``): a plain eager call runs the op's
implementation and autograd formula without the dispatcher and ``torch.library``'s autograd wrapper; where something
watches (a dispatch mode: fake tensors, tracing, FLOP counters, the dry run's guard) the ops themselves run. The fast
path gives the outputs and gradients of the ops."""
from __future__ import annotations

import torch
from torch._library.custom_ops import CustomOpDef
from torch.utils._python_dispatch import TorchDispatchMode

import attnops
from attnops._core import custom_ops

from .nsa_helpers import randn

NSA_OPS = {f"attnops::{name}" for name in ("nsa_compress", "nsa_compress_grad", "nsa_compress_attention",
                                           "nsa_selected_attention", "nsa_selected_attention_grad")}


def _layer_step(seed: int):
    """The NSA layer's forward and backward on two sequences (every branch, learned compression): the output and the
    gradients of its seven differentiable inputs."""
    lens, n1, n2 = [40, 24], 4, 2
    t = sum(lens)
    leaves = [randn(t, n1, 16, seed=seed), randn(t, n2, 16, seed=seed + 1), randn(t, n2, 8, seed=seed + 2),
              torch.sigmoid(randn(t, n1, 3, seed=seed + 3)), randn(8, n2, seed=seed + 4, scale=0.3),
              randn(8, n2, seed=seed + 5, scale=0.3)]
    leaves = [x.requires_grad_() for x in leaves]
    out = attnops.native_sparse_attention(*leaves, cu_seqlens=[0, 40, 64], compress_block_size=8, compress_stride=4,
                                          select_block_size=8, select_block_count=2, window_size=6)
    out.backward(randn(*out.shape, seed=seed + 6))
    return [out.detach()] + [x.grad for x in leaves]


def _counting_op_calls(monkeypatch) -> list[str]:
    """The qualified names of the custom ops called from now on (through their ``__call__``)."""
    called = []
    op_call = CustomOpDef.__call__

    def counting(self, *args, **kwargs):
        called.append(self._qualname)
        return op_call(self, *args, **kwargs)

    monkeypatch.setattr(CustomOpDef, "__call__", counting)
    return called


def test_eager_calls_skip_the_ops_with_the_same_results(monkeypatch):
    called = _counting_op_calls(monkeypatch)
    direct = _layer_step(seed=10)
    assert not NSA_OPS & set(called)
    monkeypatch.setattr(custom_ops, "runs_directly", lambda tensors: False)
    through_ops = _layer_step(seed=10)
    assert NSA_OPS <= set(called)
    for a, b in zip(direct, through_ops):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_calls_under_a_dispatch_mode_reach_the_ops(monkeypatch):
    called, seen = _counting_op_calls(monkeypatch), []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.name().split(".")[0])
            return func(*args, **(kwargs or {}))

    with Log():
        _layer_step(seed=10)
    assert NSA_OPS <= set(called) and NSA_OPS <= set(seen)


def test_an_inference_only_op_keeps_its_raising_backward_on_the_eager_path():
    q = randn(2, 4, 16, seed=20).requires_grad_()
    cache = randn(4, 16, 2, 16, seed=21)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    out = attnops.nsa_selected_attention_infer(q, cache, cache, torch.zeros(2, 2, 1, dtype=torch.int32), table,
                                               [20, 9], select_block_size=16)
    try:
        out.sum().backward()
    except attnops.InferenceOnlyError as error:
        assert "nsa_selected_attention_infer" in str(error)
    else:
        raise AssertionError("no InferenceOnlyError")
