"""NSA decode (``nsa_selected_attention_infer``, ``nsa_compress_attention_infer``) on the compiled CPU decode
kernel against the fp64 golden: fp32/fp16/bf16, selection blocks that straddle pages or share one, repeats, -1
padding, blocks cut at the KV length, head dims that are not multiples of the vector width; each test asserts which
path ran. Results are bitwise the same on 1 and 2 threads; without the kernel (or with ``precision="npu"``, fp64)
the PyTorch reference runs."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.ops.common import cpu_kernels
from attnops.ops.nsa import cpu_decode
from attnops.testing import golden_nsa
from attnops.testing.compare import assert_close_to_golden
from tests.helpers import randn

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
N, N2, D, DV = 8, 2, 20, 12
needs_kernel = pytest.mark.usefixtures("cpu_kernel")  # built once per session, skips without a compiler


@pytest.fixture
def kernel_calls(monkeypatch):
    """The number of decode calls the kernel served (a list holding one count)."""
    count = [0]
    real = cpu_kernels.paged_attention

    def counted(call):
        code = real(call)
        count[0] += code == 0
        return code

    monkeypatch.setattr(cpu_kernels, "paged_attention", counted)
    return count


def _paged(lens, page, dtype, seed):
    """``(query [B, N, D], key cache, value cache, block_table)``: each request's pages shuffled over the cache."""
    pages = [-(-n // page) for n in lens]
    order = torch.randperm(sum(pages) + 2, generator=torch.Generator().manual_seed(seed))
    table = torch.full((len(lens), max(pages)), -1, dtype=torch.int32)
    start = 0
    for b, p in enumerate(pages):
        table[b, :p] = order[start:start + p]
        start += p
    blocks = len(order)
    return (randn(len(lens), N, D, dtype=dtype, seed=seed), randn(blocks, page, N2, D, dtype=dtype, seed=seed + 1),
            randn(blocks, page, N2, DV, dtype=dtype, seed=seed + 2), table)


SEL_LENS = [23, 14]
# request 0 (blocks 0..3, the last cut at 23): a repeat and the cut block; request 1: a head that selects nothing
TOPK = torch.tensor([[[3, 1, 1, 0], [2, -1, 0, 0]], [[-1, 0, 1, 2], [2, 0, 1, -1]]], dtype=torch.int32)


def _selected_reduction(block):
    """The scores over D, then P V over the selected blocks' keys."""
    return D + TOPK.shape[-1] * block


def _selected(q, k, v, table, block, **kw):
    return attnops.nsa_selected_attention_infer(q, k, v, TOPK, table, SEL_LENS, select_block_size=block, scale=0.3,
                                                **kw)


@needs_kernel
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("block, page", [(6, 4), (3, 8)])  # blocks across page boundaries; several in one page
def test_selected_attention_on_the_kernel(kernel_calls, dtype, block, page):
    q, k, v, table = _paged(SEL_LENS, page, dtype, seed=block)
    out = _selected(q, k, v, table, block)
    assert kernel_calls[0] == 1 and out.dtype == dtype
    golden = golden_nsa.nsa_select_attention_infer(q, k, v, TOPK, table, SEL_LENS, 0.3, block)
    baseline = golden_nsa.nsa_select_attention_infer(q, k, v, TOPK, table, SEL_LENS, 0.3, block, dtype=dtype)
    assert_close_to_golden("attention_out", out, golden, baseline, reduction=_selected_reduction(block))
    assert torch.equal(out[1, :N // N2], torch.zeros(N // N2, DV, dtype=dtype))  # selected nothing


CMP_LENS = [40, 23, 13]  # compressed keys per request
CMP, STRIDE, SEL, COUNT = 32, 16, 64, 4


def _compressed(q, k, v, table, **kw):
    return attnops.nsa_compress_attention_infer(q, k, v, table, CMP_LENS, compress_block_size=CMP,
                                                compress_stride=STRIDE, select_block_size=SEL,
                                                select_block_count=COUNT, scale=0.2, **kw)


@needs_kernel
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_compress_attention_on_the_kernel(kernel_calls, monkeypatch, dtype):
    q, k, v, table = _paged(CMP_LENS, 8, dtype, seed=11)
    out, topk = _compressed(q, k, v, table)
    assert kernel_calls[0] == 1
    golden, _ = golden_nsa.nsa_compress_attention_infer(q, k, v, table, CMP_LENS, 0.2, CMP, STRIDE, SEL, COUNT)
    baseline, _ = golden_nsa.nsa_compress_attention_infer(q, k, v, table, CMP_LENS, 0.2, CMP, STRIDE, SEL, COUNT,
                                                          dtype=dtype)
    assert_close_to_golden("attention_out", out, golden, baseline, reduction=D + max(CMP_LENS))
    monkeypatch.setattr(cpu_decode, "unsupported", lambda *args: "the PyTorch path")
    assert torch.equal(topk, _compressed(q, k, v, table)[1])  # the same blocks from the kernel's probabilities
    assert kernel_calls[0] == 1


@needs_kernel
def test_bitwise_the_same_on_one_and_two_threads(kernel_calls, monkeypatch):
    """Every thread asked for used (no dynamic count): the last chunks are cut into single heads."""
    monkeypatch.setenv("ATTNOPS_CPU_DYNAMIC_THREADS", "0")
    q, k, v, table = _paged(SEL_LENS, 4, BF16, seed=3)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append((_selected(q, k, v, table, 6), *_compressed(*_paged(CMP_LENS, 8, BF16, seed=4))))
    finally:
        torch.set_num_threads(threads)
    assert kernel_calls[0] == 4
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("why", ["no kernel", "npu", "fp64"])
def test_the_reference_serves_what_the_kernel_does_not(kernel_calls, monkeypatch, why):
    if why == "no kernel":
        monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    dtype = {"no kernel": F32, "npu": F16, "fp64": torch.float64}[why]
    q, k, v, table = _paged(SEL_LENS, 4, dtype, seed=5)
    kw = {"precision": "npu"} if why == "npu" else {}
    out = _selected(q, k, v, table, 6, **kw)
    cmp_out, _ = _compressed(*_paged(CMP_LENS, 8, dtype, seed=6), **kw)
    assert kernel_calls[0] == 0 and out.dtype == cmp_out.dtype == dtype
    if why == "no kernel":  # the NPU's rounding and fp64 have their own tests
        golden = golden_nsa.nsa_select_attention_infer(q, k, v, TOPK, table, SEL_LENS, 0.3, 6)
        baseline = golden_nsa.nsa_select_attention_infer(q, k, v, TOPK, table, SEL_LENS, 0.3, 6, dtype=dtype)
        assert_close_to_golden("attention_out", out, golden, baseline, reduction=_selected_reduction(6))


@needs_kernel
def test_unvalidated_bad_values_read_what_the_reference_reads(kernel_calls, monkeypatch):
    """``ATTNOPS_VALIDATE=0``: a block id outside the cache contributes no keys, a negative index other than -1 or
    one past the length selects nothing, lengths (a tensor the op does not read) are clamped to the block table's
    pages; compressed keys in a block outside the cache leave the call to the reference (which keeps their
    columns in the block scores). The kernel matches the PyTorch path."""
    from attnops.ops.nsa import op

    monkeypatch.setenv("ATTNOPS_VALIDATE", "0")
    q, k, v, table = _paged(SEL_LENS, 4, F32, seed=7)
    table[0, 2] = 10_000  # keys 8..11 of request 0: outside the cache
    topk = torch.tensor([[[3, -7, 1, 0], [9, 2, -1, 1]], [[-2, 0, 1, 2], [2, 0, 1, -1]]], dtype=torch.int32)
    args = (q, k, v, topk, table, 0.3, N, N2, 6, topk.shape[-1], 4)
    lengths = torch.tensor([23, 10_000])  # 10_000: the table's 6 pages, 24 keys (request 1's last 2 pages: -1)
    got = op.nsa_selected_attention_infer(*args, None, lengths)
    assert kernel_calls[0] == 1
    monkeypatch.setattr(cpu_decode, "unsupported", lambda *a: "the PyTorch path")
    want = op.nsa_selected_attention_infer(*args, [23, 24])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    monkeypatch.undo()
    monkeypatch.setenv("ATTNOPS_VALIDATE", "0")
    calls = kernel_calls[0]
    q, k, v, table = _paged(CMP_LENS, 8, F32, seed=8)
    table[1, 0] = -5
    out, topk = _compressed(q, k, v, table)
    assert kernel_calls[0] == calls  # refused: the reference ran
    monkeypatch.setattr(cpu_decode, "unsupported", lambda *a: "the PyTorch path")
    want_out, want_topk = _compressed(q, k, v, table)
    assert torch.equal(out, want_out) and torch.equal(topk, want_topk)
