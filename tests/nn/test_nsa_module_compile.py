"""A training step of attnops.nn.NativeSparseAttention under torch.compile: the loss and every parameter's gradient
equal eager mode's (batched and packed input; the forward as one graph, and the whole step compiled)."""
from __future__ import annotations

import pytest
import torch

from attnops.nn import NativeSparseAttention

HIDDEN = 16


def _module():
    torch.manual_seed(0)
    return NativeSparseAttention(HIDDEN, 4, 2, 8, compress_block_size=8, compress_stride=4, select_block_size=8,
                                 select_block_count=3, window_size=6)


def _step(forward, module, x, kwargs):
    """Forward, loss, backward; returns the loss and the gradients by parameter name."""
    module.zero_grad(set_to_none=True)
    loss = forward(x, **kwargs).square().mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in module.named_parameters()}


@pytest.mark.parametrize("packed", [False, True])
def test_compiled_training_step_equals_eager(packed):
    torch._dynamo.reset()
    eager, compiled = _module(), _module()
    x = torch.randn(2, 29, HIDDEN, generator=torch.Generator().manual_seed(1))
    kwargs = {}
    if packed:
        x, kwargs = x.flatten(0, 1)[:45], dict(cu_seqlens=[0, 29, 45])
    want_loss, want = _step(eager, eager, x, kwargs)
    graph = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    whole_step = torch.compile(lambda inp: _step(compiled, compiled, inp, kwargs), backend="aot_eager")
    for loss, grads in (_step(graph, compiled, x, kwargs), whole_step(x)):
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-7)
        assert grads.keys() == want.keys()
        for name, g in want.items():
            assert g.abs().sum() > 0, name
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_compiled_decoding_step_equals_eager():
    """``torch.compile(fullgraph=True)`` of the module's cached decoding step: token after token equal to eager, the
    cache's lengths read on the device by the operators (at most one recompilation, when the position becomes
    dynamic)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    m = NativeSparseAttention(256, 8, 2, 64, compress_block_size=32, compress_stride=16, select_block_size=64,
                              select_block_count=4, window_size=128)
    x = torch.randn(2, 170, 256)
    eager_cache, compiled_cache = m.new_cache(2, max_seq_len=256), m.new_cache(2, max_seq_len=256)
    step = torch.compile(lambda t, cache: m(t, cache=cache), fullgraph=True)
    with torch.no_grad():
        m(x[:, :150], cache=eager_cache)
        m(x[:, :150], cache=compiled_cache)
        for i in range(150, 170):
            torch.testing.assert_close(step(x[:, i:i + 1], compiled_cache), m(x[:, i:i + 1], cache=eager_cache),
                                       rtol=1e-5, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2
