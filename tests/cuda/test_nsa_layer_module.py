"""The NSA layer and the NativeSparseAttention module on CUDA (the Triton path end to end): outputs and gradients vs
the fp64 golden with the tolerance rule and vs the CPU result, and a CUDA graph of the module's cached decoding step
(captured after a prefill, replayed for the following tokens) equal to eager decoding."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.nn import NativeSparseAttention
from attnops.testing import golden_nsa_layer as gold
from attnops.testing.compare import assert_close_to_golden, nsa_layer_reduction
from tests.ops.nsa.nsa_helpers import baseline_dtype, randn

LAYER = dict(block=32, stride=16, select_block=64, count=4, window=128, local_blocks=2)
ARGS = dict(compress_block_size=32, compress_stride=16, select_block_size=64, select_block_count=4, window_size=128,
            local_blocks=2)


def _layer_inputs(lens, n1, n2, d, dv, dtype):
    t = sum(lens)
    q, k, v = randn(t, n1, d, dtype=dtype, seed=1), randn(t, n2, d, dtype=dtype, seed=2), randn(t, n2, dv, dtype=dtype,
                                                                                              seed=3)
    gates = torch.sigmoid(randn(t, n1, 3, seed=4)).to(dtype)
    wk, wv = (randn(32, n2, dtype=dtype, seed=s, scale=32 ** -0.5) for s in (5, 6))
    return q, k, v, gates, wk, wv


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("layout", ["TND", "BSND"])
def test_layer_forward_and_backward_on_cuda(layout, dtype):
    """Two sequences of 512 tokens, GQA 16 / 1, D 192 / Dv 128: golden and CPU agree with the CUDA result."""
    lens, n1, n2, d, dv = [512, 512], 16, 1, 192, 128
    inputs = _layer_inputs(lens, n1, n2, d, dv, dtype)
    dy = randn(sum(lens), n1, dv, dtype=dtype, seed=7)
    shape = (2, 512) if layout == "BSND" else (sum(lens),)
    kw = dict(layout="BSND") if layout == "BSND" else dict(cu_seqlens=[0, 512, 1024])
    results = {}
    for device in ("cuda", "cpu"):
        leaves = [x.to(device).unflatten(0, shape).requires_grad_() for x in inputs[:4]] + [
            x.to(device).requires_grad_() for x in inputs[4:]]
        out = attnops.native_sparse_attention(*leaves, **kw, **ARGS, scale=d ** -0.5)
        out.backward(dy.to(device).unflatten(0, shape))
        results[device] = [out.detach().flatten(0, len(shape) - 1).cpu()] + [
            x.grad.flatten(0, len(shape) - 1).cpu() if x.dim() > 2 else x.grad.cpu() for x in leaves]
    golden = gold.native_sparse_attention(*inputs, lens, **LAYER, scale=d ** -0.5)
    base = gold.native_sparse_attention(*inputs, lens, **LAYER, scale=d ** -0.5, dtype=baseline_dtype(dtype))
    for device, (out, *_) in results.items():
        assert_close_to_golden(f"layer.out ({device})", out, golden, base, factor=2,
                               reduction=nsa_layer_reduction(max(lens), d, **LAYER))
    for name, a, b in zip(("out", "dq", "dk", "dv", "dgates", "dwk", "dwv"), results["cuda"], results["cpu"]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=name)


def test_layer_with_given_block_indices_on_cuda():
    """Given indices with -1 slots and block_counts: the device skips what the CPU points at its padding block."""
    lens, n1, n2, d, dv = [300, 212], 8, 2, 64, 64
    q, k, v, gates, wk, wv = _layer_inputs(lens, n1, n2, d, dv, torch.float32)
    own = torch.cat([torch.arange(n) for n in lens]) // 64
    idx = torch.stack([own, own - 1, torch.zeros_like(own)], -1).clamp(min=-1)[:, None].expand(-1, n2, -1)
    counts = torch.full((sum(lens), n2), 2)
    outs = [attnops.native_sparse_attention(*(x.to(device) for x in (q, k, v, gates, wk, wv)),
                                            cu_seqlens=[0, 300, 512], block_indices=idx.to(device),
                                            block_counts=counts.to(device), **ARGS).cpu()
            for device in ("cuda", "cpu")]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def _module(dtype):
    torch.manual_seed(0)
    return NativeSparseAttention(256, 8, 2, 64, **ARGS).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_module_and_cached_decoding_on_cuda(dtype):
    """The forward vs the golden and the CPU; a prefill then token-by-token decoding equals the full forward."""
    m = _module(dtype)
    x = randn(2, 320, 256, dtype=dtype, seed=8)
    with torch.no_grad():
        cpu = m(x)
        mc = m.cuda()
        full = mc(x.cuda())
        cache = mc.new_cache(2, max_seq_len=320)
        decoded = torch.cat([mc(x[:, :256].cuda(), cache=cache)] + [mc(x[:, i:i + 1].cuda(), cache=cache)
                                                                     for i in range(256, 320)], 1)
    golden, base = gold.nsa_module(m.cpu(), x), gold.nsa_module(m.cpu(), x, dtype=baseline_dtype(dtype))
    # the input projections over the hidden size, the layer, the output projection over the heads
    red = m.hidden_size + nsa_layer_reduction(x.shape[1], m.head_dim, **LAYER) + m.num_heads * m.head_dim
    assert_close_to_golden("module.out (cuda)", full.cpu(), golden, base, factor=2, reduction=red)
    torch.testing.assert_close(full.cpu().float(), cpu.float(), rtol=2e-2, atol=2e-2)
    assert_close_to_golden("module.decode (cuda)", decoded.cpu(), golden, base, factor=2, reduction=red)


def test_cuda_graph_of_the_decoding_step_equals_eager():
    """A decoding step captured once (after a prefill and a warm-up step) and replayed with a new token each time
    gives the eager outputs, token after token (the replays advance the cache's lengths on the device)."""
    m = _module(torch.float32).cuda()
    x = randn(2, 200, 256, seed=9).cuda()
    eager_cache, graph_cache = m.new_cache(2, max_seq_len=256), m.new_cache(2, max_seq_len=256)
    with torch.no_grad():
        for cache in (eager_cache, graph_cache):
            m(x[:, :150], cache=cache)
        static_x = x[:, 150:151].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm = m(static_x, cache=graph_cache)  # token 150, eagerly: fills every per-shape cache
        torch.cuda.current_stream().wait_stream(side)
        eager = [m(x[:, 150:151], cache=eager_cache)]
        torch.testing.assert_close(warm, eager[0], rtol=0, atol=0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = m(static_x, cache=graph_cache)
        replayed = []
        for i in range(151, 200):
            static_x.copy_(x[:, i:i + 1])
            graph.replay()
            replayed.append(static_out.clone())
            eager.append(m(x[:, i:i + 1], cache=eager_cache))
        graph_cache.advance(200 - 152)  # the replays' tokens beyond the one the capture call counted
    torch.testing.assert_close(torch.cat(replayed, 1), torch.cat(eager[1:], 1), rtol=1e-5, atol=1e-5)
    assert graph_cache.seq_len == eager_cache.seq_len == 200
    assert graph_cache.lengths.tolist() == eager_cache.lengths.tolist() == [200, 200]


def test_reduce_overhead_compile_of_the_decoding_step_equals_eager():
    """``torch.compile(mode="reduce-overhead")`` (CUDA graphs under the compiler) of the decoding step, token after
    token, equals eager."""
    torch._dynamo.reset()
    m = _module(torch.float32).cuda()
    x = randn(2, 180, 256, seed=10).cuda()
    eager_cache, compiled_cache = m.new_cache(2, max_seq_len=256), m.new_cache(2, max_seq_len=256)
    step = torch.compile(lambda t, cache: m(t, cache=cache), mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        m(x[:, :150], cache=eager_cache)
        m(x[:, :150], cache=compiled_cache)
        for i in range(150, 180):
            got = step(x[:, i:i + 1].clone(), compiled_cache).clone()
            torch.testing.assert_close(got, m(x[:, i:i + 1], cache=eager_cache), rtol=1e-5, atol=1e-5)
