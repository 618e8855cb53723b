"""FlashAttention forward + backward captured in a CUDA graph (no host sync, no host-built metadata on the path) and
replayed with new input values, equal to eager; and ``torch.compile(mode="reduce-overhead")`` (CUDA graphs under
the compiler) of the same training step."""
import torch

import attnops


def _inputs(seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(2, 4, 256, 64, generator=g).to("cuda", torch.float16) for _ in range(4)]


def _eager(q, k, v, dy, **kw):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attnops.flash_attention(*leaves, **kw)
    out.backward(dy)
    return [out.detach(), *(t.grad for t in leaves)]


def _check_graph(**kw):
    static = [t.clone() for t in _inputs(0)]
    leaves = [t.requires_grad_() for t in static[:3]]
    dy = static[3]

    def step():
        for t in leaves:
            t.grad = None
        out = attnops.flash_attention(*leaves, **kw)
        out.backward(dy)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (1, 2):
        fresh = _inputs(seed)
        with torch.no_grad():
            for dst, src in zip((*leaves, dy), fresh):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        want = _eager(*fresh, **kw)
        for got, ref in zip([out, *(t.grad for t in leaves)], want):
            torch.testing.assert_close(got, ref)


def test_graph_capture_fwd_bwd_full():
    _check_graph()


def test_graph_capture_fwd_bwd_causal():
    _check_graph(causal=True)


def test_graph_capture_varlen_with_device_cu_seqlens():
    cu = torch.tensor([0, 100, 300, 512], dtype=torch.int32, device="cuda")
    q, k, v, dy = (t.transpose(1, 2).reshape(512, 4, 64).contiguous() for t in _inputs(3))
    kw = dict(layout="TND", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=212, max_seqlen_k=212, causal=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attnops.flash_attention(*leaves, **kw).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    with torch.cuda.graph(graph):
        out = attnops.flash_attention(*leaves, **kw)
        out.backward(dy)
    graph.replay()
    torch.cuda.synchronize()
    want = _eager(q, k, v, dy, **kw)
    for got, ref in zip([out, *(t.grad for t in leaves)], want):
        torch.testing.assert_close(got, ref)


def test_compile_reduce_overhead_training_step():
    def step(q, k, v):
        return attnops.flash_attention(q, k, v, causal=True)

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for seed in range(3):
        q, k, v, dy = _inputs(seed)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = compiled(*leaves)
        out.backward(dy)
        want = _eager(q, k, v, dy, causal=True)
        for got, ref in zip([out.detach(), *(t.grad for t in leaves)], want):
            torch.testing.assert_close(got, ref)
