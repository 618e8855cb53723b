"""The paged-KV-cache kernels on CUDA: bit-exact against the CPU reference, and a cache write captured in a CUDA
graph (vllm's way) that writes the slots the caller puts into the same device tensors before each replay, skipping
the padding (-1) and out-of-range slots."""
import torch

from attnops import torch_npu
from tests.helpers import randn

N, D, BLOCKS, BLOCK = 2, 64, 6, 16


def _caches(dtype):
    return randn(BLOCKS, BLOCK, N, D, seed=1).to(dtype), randn(BLOCKS, N * D // 16, BLOCK, 16, seed=2).to(dtype)


def test_write_and_read_equal_the_cpu_reference():
    for dtype in (torch.float16, torch.bfloat16):
        key, value = randn(9, N, D, seed=3).to(dtype), randn(9, N, D, seed=4).to(dtype)
        slots = torch.tensor([5, -1, 40, 0, 95, 17, 64, -1, 33], dtype=torch.int32)
        cpu = _caches(dtype)
        gpu = [c.cuda() for c in cpu]
        torch_npu._npu_reshape_and_cache(key, value, *cpu, slots)
        torch_npu._npu_reshape_and_cache(key.cuda(), value.cuda(), *gpu, slots.cuda())
        for got, want in zip(gpu, cpu):
            assert torch.equal(got.cpu(), want)
        table, lens = torch.tensor([[3, 1, 0], [5, -1, 2]], dtype=torch.int32), torch.tensor([20, 30])
        out_cpu = torch_npu.npu_gather_pa_kv_cache_functional(*cpu, table, lens, torch.zeros(50, N, D, dtype=dtype),
                                                              torch.zeros(50, N, D, dtype=dtype))
        out_gpu = torch_npu.npu_gather_pa_kv_cache_functional(*gpu, table.cuda(), lens.cuda(),
                                                              torch.zeros(50, N, D, dtype=dtype, device="cuda"),
                                                              torch.zeros(50, N, D, dtype=dtype, device="cuda"))
        for got, want in zip(out_gpu, out_cpu):
            assert torch.equal(got.cpu(), want)


def test_cache_write_in_a_cuda_graph_follows_new_slots():
    key_cache, value_cache = (torch.zeros(BLOCKS, BLOCK, N, D, dtype=torch.float16, device="cuda") for _ in range(2))
    key, value = (torch.zeros(4, N, D, dtype=torch.float16, device="cuda") for _ in range(2))
    slots = torch.zeros(4, dtype=torch.int64, device="cuda")
    torch_npu._npu_reshape_and_cache(key, value, key_cache, value_cache, slots)  # warm-up (compiles the kernel)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch_npu._npu_reshape_and_cache(key, value, key_cache, value_cache, slots)
    for step, new_slots in enumerate(([3, 17, -1, 40], [95, -1, 96, 2 ** 40])):
        key.copy_(randn(4, N, D, seed=10 + step).half().cuda())
        value.copy_(randn(4, N, D, seed=20 + step).half().cuda())
        slots.copy_(torch.tensor(new_slots))
        expected = key_cache.clone()
        for t, s in enumerate(new_slots):
            if 0 <= s < BLOCKS * BLOCK:
                expected[s // BLOCK, s % BLOCK] = key[t]
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(key_cache, expected)
