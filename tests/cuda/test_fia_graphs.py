"""FIA paged decode in CUDA graphs: a captured ``FusedInferAttentionPlan.run`` replayed with new KV lengths and
block tables written into the captured tensors (vllm's way) equals eager calls and the fp64 golden; and
``torch.compile(mode="reduce-overhead")`` of a torch_npu decode step with tensor lengths equals eager."""
import pytest
import torch

import attnops
from attnops import torch_npu
from attnops.testing.compare import assert_close_to_golden, fia_reduction
from tests.helpers import randn
from tests.ops.fused_infer_attention.fia_helpers import golden, to_paged

N, NKV, D, BS, B = 32, 8, 128, 128, 4
STEPS = ([1000, 3, 0, 2048], [2048, 2048, 2048, 2048], [1, 700, 1500, 129], [0, 0, 5, 0])


def _cache(dtype, layout):
    """Pages for four sequences of 2048 tokens, shuffled, with a block table of 16 columns (capacity 2048)."""
    lens = [2048] * B
    kc, bt = to_paged(randn(B, NKV, 2048, D, dtype=dtype, seed=1), lens, BS, cache_layout=layout, seed=3)
    vc, _ = to_paged(randn(B, NKV, 2048, D, dtype=dtype, seed=2), lens, BS, cache_layout=layout, seed=3)
    return kc.cuda(), vc.cuda(), bt[:, :16].contiguous().cuda()


def _eager(q, kc, vc, bt, lens, layout):
    """The one-call API with the lengths as a device tensor (the same work split as the capacity plan)."""
    lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return attnops.fused_infer_attention(q, kc, vc, layout=layout, num_key_value_heads=NKV, num_heads=N,
                                         scale=D ** -0.5, block_table=bt, block_size=BS, actual_seq_lengths_kv=lens,
                                         return_lse=True)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("layout", ("BSH", "BNSD"))
def test_captured_run_replays_new_lengths_and_tables(dtype, layout):
    kc, vc, table = _cache(dtype, layout)
    q = randn(B, 1, N * D, dtype=dtype, seed=4).cuda() if layout == "BSH" else randn(B, N, 1, D, dtype=dtype,
                                                                                     seed=4).cuda()
    lengths = torch.tensor(STEPS[0], dtype=torch.int32, device="cuda")
    block_table = table.clone()
    plan = attnops.fused_infer_attention_plan(q, kc, vc, layout=layout, num_heads=N, num_key_value_heads=NKV,
                                              scale=D ** -0.5, block_table=block_table, block_size=BS,
                                              actual_seq_lengths_kv=lengths, return_lse=True)
    assert plan.kernels
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        plan.run(q, kc, vc, block_table=block_table, actual_seq_lengths_kv=lengths)  # compile before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = plan.run(q, kc, vc, block_table=block_table, actual_seq_lengths_kv=lengths)
    for step, lens in enumerate(STEPS):
        new_table = table.roll(step, 0)
        lengths.copy_(torch.tensor(lens, dtype=torch.int32))
        block_table.copy_(new_table)
        graph.replay()
        want_out, want_lse = _eager(q, kc, vc, new_table, lens, layout)
        torch.testing.assert_close(out, want_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
        kw = dict(num_heads=N, num_key_value_heads=NKV, scale_value=D ** -0.5, input_layout=layout,
                  softmax_lse_flag=True, block_table=new_table.cpu(), block_size=BS, actual_seq_lengths_kv=lens)
        cpu = [x.cpu() for x in (q, kc, vc)]
        g, base = golden(*cpu, **kw), golden(*cpu, dtype=dtype, **kw)
        red = fia_reduction(*cpu[:2], **kw)
        assert_close_to_golden("attention_out", out.cpu(), g.out, base.out, reduction=red)
        assert_close_to_golden("softmax_lse", lse.cpu(), g.lse, base.lse, reduction=red)


def test_reduce_overhead_compile_with_tensor_lengths():
    torch._dynamo.reset()
    kc, vc, table = _cache(torch.float16, "BNSD")
    q = randn(B, N, 1, D, dtype=torch.float16, seed=4).cuda()

    def step(q, lengths, block_table):
        return torch_npu.npu_fused_infer_attention_score(
            q, kc, vc, block_table=block_table, actual_seq_lengths_kv=lengths, num_heads=N,
            num_key_value_heads=NKV, input_layout="BNSD", block_size=BS, scale=D ** -0.5, softmax_lse_flag=True)

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for i, lens in enumerate(STEPS + STEPS):
        lengths = torch.tensor(lens, dtype=torch.int32, device="cuda")
        block_table = table.roll(i, 0)
        got = [x.clone() for x in compiled(q, lengths, block_table)]
        for a, b in zip(got, step(q, lengths, block_table)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
