"""NSA decode index values: named errors with validation on (CPU tensors, the default); with
``ATTNOPS_VALIDATE=0`` bad values select nothing (a negative top-k index other than -1, an index past the length,
a block outside the cache), compared with the fp64 golden, on the CPU paths and the Triton kernels (interpreter);
a compression slot outside the cache writes nothing."""
from __future__ import annotations

import pytest
import torch

from attnops import torch_npu
from attnops._core.errors import ParamInvalidError
from attnops.testing import golden_nsa
from attnops.testing.compare import assert_close_to_golden
from tests.helpers import randn
from tests.torch_npu.test_nsa_select_infer import (BLOCK, BLOCKS, COUNT, DV, KV_LENS, N, N2, PAGE, REDUCTION,
                                                TABLE, TOPK, B)
from tests.triton_backend import DEVICE, triton_backend  # noqa: F401  (the fixture)

BAD_TOPK = TOPK.clone()
BAD_TOPK[0, 0] = torch.tensor([-2, 2, 0])  # -2 skipped, the row goes on
BAD_TOPK[1, 1] = torch.tensor([7, 0, -1])  # 7 is past request 1's 9 keys
BAD_TABLE = TABLE.clone()
BAD_TABLE[0, 1], BAD_TABLE[2, 0] = -1, BLOCKS + 3  # inside the lengths: their keys are not attended


def _select(q, k, v, topk, table, device="cpu"):
    return torch_npu.npu_nsa_select_attention_infer(
        q.to(device), k.to(device), v.to(device), topk.to(device), 0.3, N, N2, BLOCK, COUNT, PAGE, layout="TND",
        block_table=table.to(device), actual_seq_kvlen=KV_LENS).cpu()


def _inputs(dtype):
    return (randn(B, N, 16, dtype=dtype, seed=1), randn(BLOCKS, PAGE, N2, 16, dtype=dtype, seed=2),
            randn(BLOCKS, PAGE, N2, DV, dtype=dtype, seed=3))


def test_bad_topk_and_table_are_errors():
    q, k, v = _inputs(torch.float32)
    with pytest.raises(ParamInvalidError, match=r"^topk_indices: expected an index in \[0, 3\) .*, got "
                                                r"topk_indices\[0, 0, 0\] = -2$"):
        _select(q, k, v, BAD_TOPK, TABLE)
    with pytest.raises(ParamInvalidError, match=r"^block_table: expected a block id in \[0, 12\) .*, got "
                                                r"block_table\[0, 1\] = -1, but batch 0 has 21 tokens"):
        _select(q, k, v, TOPK, BAD_TABLE)


def test_index_times_block_past_int32_is_an_error():
    q, k, v = _inputs(torch.float32)
    topk = TOPK.clone()
    topk[1, 0, 0] = 2 ** 31 // BLOCK + 1  # index * block wraps around in int32
    with pytest.raises(ParamInvalidError, match=rf"got topk_indices\[1, 0, 0\] = {2 ** 31 // BLOCK + 1}$"):
        _select(q, k, v, topk.to(torch.int32), TABLE)


def _check_masked(out, q, k, v, dtype):
    golden = golden_nsa.nsa_select_attention_infer(q, k, v, BAD_TOPK, BAD_TABLE, KV_LENS, 0.3, BLOCK)
    baseline = golden_nsa.nsa_select_attention_infer(q, k, v, BAD_TOPK, BAD_TABLE, KV_LENS, 0.3, BLOCK, dtype=dtype)
    assert_close_to_golden("attention_out", out.reshape(B, N, DV), golden, baseline, reduction=REDUCTION)


def test_unvalidated_bad_values_select_nothing(monkeypatch):
    monkeypatch.setenv("ATTNOPS_VALIDATE", "0")
    q, k, v = _inputs(torch.float32)
    _check_masked(_select(q, k, v, BAD_TOPK, BAD_TABLE), q, k, v, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_kernel_unvalidated_bad_values_select_nothing(triton_backend, monkeypatch, dtype):  # noqa: F811
    monkeypatch.setenv("ATTNOPS_VALIDATE", "0")
    q, k, v = _inputs(dtype)
    out = _select(q, k, v, BAD_TOPK, BAD_TABLE, DEVICE)
    assert triton_backend, "the kernel did not run"
    _check_masked(out, q, k, v, dtype)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_compress_slot_outside_the_cache(monkeypatch, backend):
    monkeypatch.setenv("ATTNOPS_BACKEND", backend)
    x, w = randn(4, PAGE, 2, 16, seed=4), randn(8, 2, seed=5)
    table = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=torch.int32)
    cache = torch.zeros(3, 2, 16)
    with pytest.raises(ParamInvalidError, match=r"^slot_mapping: expected a slot in \[0, 3\) .*, got "
                                                r"slot_mapping\[1\] = 3$"):
        torch_npu.npu_nsa_compress_infer(x, w, torch.tensor([1, 3]), 8, 4, PAGE, block_table=table,
                                         actual_seq_len=[8, 12], cache=cache)
    monkeypatch.setenv("ATTNOPS_VALIDATE", "0")
    torch_npu.npu_nsa_compress_infer(x, w, torch.tensor([1, 3]), 8, 4, PAGE, block_table=table,
                                     actual_seq_len=[8, 12], cache=cache)
    assert bool(cache[1].abs().sum() > 0) and torch.equal(cache[[0, 2]], torch.zeros(2, 2, 16))


def _compress_case(dtype):
    from tests.torch_npu import test_nsa_compress_infer as C

    table = C.TABLE.clone()
    table[0, 2], table[2, 5] = -1, C.BLOCKS  # inside the requests' compressed keys
    return C, table, C._inputs(dtype)


def test_compress_attention_bad_block_is_an_error():
    C, table, (q, k, v) = _compress_case(torch.float32)
    with pytest.raises(ParamInvalidError, match=r"^block_table: .*got block_table\[0, 2\] = -1"):
        C._npu(q, k, v, block_table=table)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("kernel", [False, True])
def test_compress_attention_unvalidated_block_is_not_attended(monkeypatch, request, dtype, kernel):
    monkeypatch.setenv("ATTNOPS_VALIDATE", "0")
    launched = request.getfixturevalue("triton_backend") if kernel else None
    C, table, (q, k, v) = _compress_case(dtype)
    out, topk = C._npu(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), block_table=table.to(DEVICE))
    assert not kernel or launched, "the kernels did not run"
    args = (q, k, v, table, C.CMP_LENS, C.SCALE, C.CMP, C.STRIDE, C.SEL, C.COUNT)
    g_out, g_topk = golden_nsa.nsa_compress_attention_infer(*args)
    b_out, _ = golden_nsa.nsa_compress_attention_infer(*args, dtype=dtype)
    assert_close_to_golden("attention_out", out.cpu(), g_out, b_out, reduction=q.shape[-1] + max(C.CMP_LENS))
    assert torch.equal(topk.cpu()[..., :3], g_topk[..., :3])
