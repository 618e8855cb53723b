"""aclnn NSA operators: parameter order of the seeds, outputs vs the fp64 golden (fp16/bf16), and the two-phase
calling convention (get_workspace_size -> executor, run once)."""
from __future__ import annotations

import inspect

import pytest
import torch

from attnops import ParamInvalidError, aclnn
from attnops.aclnn import AclnnExecutor
from tests.ops.nsa.nsa_aclnn_params import OPS, base_params, compress_attention_params, selected_grad_params
from tests.ops.nsa.nsa_helpers import (causal_cmp_mask, check_compress, check_compress_attention, check_selected, cum,
                                       randn, random_topk)

LOW = [torch.float16, torch.bfloat16]

# The seeds' GetWorkspaceSize parameters (outputs, workspaceSize and executor excluded), in order, snake_cased.
SEED_ORDER = {
    "nsa_compress_grad": ["output_grad", "input", "weight", "act_seq_len", "compress_block_size", "compress_stride",
                          "act_seq_len_type", "layout"],
    "nsa_selected_attention_grad": ["query", "key", "value", "attention_out", "attention_out_grad", "softmax_max",
                                    "softmax_sum", "topk_indices", "actual_seq_qlen", "actual_seq_kvlen",
                                    "atten_mask", "scale_value", "selected_block_size", "selected_block_count",
                                    "head_num", "input_layout", "sparse_mode"],
}


@pytest.mark.parametrize("op", list(SEED_ORDER))
def test_seed_parameter_order(op):
    assert list(inspect.signature(OPS[op][1]).parameters) == SEED_ORDER[op]
    assert list(inspect.signature(OPS[op][0]).parameters) in (SEED_ORDER[op], ["args", "kwargs"])


@pytest.mark.parametrize("op", list(OPS))
def test_helper_parameters_follow_the_signature(op):
    assert list(base_params(op)) == list(inspect.signature(OPS[op][1]).parameters)


# ----------------------------------------------------------------------------------------------- values
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_compress_and_grad_vs_golden(dtype):
    lens = [0, 40, 7, 96]  # leading 0, a short sequence, dropped tails
    x = randn(sum(lens), 2, 32, dtype=dtype, seed=1)
    w = randn(32, 2, dtype=dtype, seed=2, scale=32 ** -0.5)
    check_compress(x, w, 32, 16, [0] + cum(lens[1:]), via="aclnn")
    w16 = randn(16, 2, dtype=dtype, seed=3, scale=0.25)
    check_compress(x, w16, 16, 16, cum(lens[1:]), via="aclnn", backward=False)  # the forward allows l == d


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("g", [1, 4])
def test_selected_and_grad_vs_golden(dtype, causal, g):
    q_lens, kv_lens, bs, count = [5, 0, 12], [32, 16, 48], 16, 2
    n2 = 2
    q = randn(sum(q_lens), n2 * g, 192, dtype=dtype, seed=3)
    k = randn(sum(kv_lens), n2, 192, dtype=dtype, seed=4)
    v = randn(sum(kv_lens), n2, 128, dtype=dtype, seed=5)
    topk = random_topk(q_lens, kv_lens, n2, count, bs, seed=6, distinct=g == 1)
    check_selected(q, k, v, topk, block=bs, q_lens=q_lens, kv_lens=kv_lens, causal=causal, via="aclnn")


def test_selected_sparse_mode_2_without_mask_is_not_causal():
    """Without atten_mask the NPU forces sparse_mode 0 (cann_semantics.md 7.4)."""
    p = base_params("nsa_selected_attention")
    causal = aclnn.nsa_selected_attention(*p.values())
    p["atten_mask"] = None
    plain = aclnn.nsa_selected_attention(*p.values())
    p["sparse_mode"] = 0
    mode0 = aclnn.nsa_selected_attention(*p.values())
    for a, b in zip(plain, mode0):
        assert torch.equal(a, b)
    assert not torch.equal(causal[2], plain[2])


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("g", [1, 4, 16])
def test_compress_attention_vs_golden(dtype, g):
    l, d, ls = 32, 16, 64
    seq = [100, 64]
    cmp_lens = [(n - l) // d + 1 for n in seq]  # 5, 3
    n2 = 1 if g == 16 else 2
    q = randn(sum(seq), n2 * g, 32, dtype=dtype, seed=7)
    k = randn(sum(cmp_lens), n2, 32, dtype=dtype, seed=8)
    v = randn(sum(cmp_lens), n2, 16, dtype=dtype, seed=9)
    mask = causal_cmp_mask(seq, cmp_lens, l, d)
    tmask = torch.zeros(max(seq), 2, dtype=torch.bool)
    tmask[:, 0] = True
    check_compress_attention(q, k, v, block=l, stride=d, select_block=ls, count=1, q_lens=seq, cmp_lens=cmp_lens,
                             atten_mask=mask, topk_mask=tmask, via="aclnn", backward=False)


@pytest.mark.parametrize("sparse_mode", [0, 1])
def test_compress_attention_sparse_modes(sparse_mode):
    p = compress_attention_params()
    p["sparse_mode"] = sparse_mode
    smax, ssum, out, topk = aclnn.nsa_compress_attention(*p.values())
    q_lens, cmp_lens = [2, 6], [5, 7]
    check_compress_attention(p["query"], p["key"], p["value"], block=32, stride=16, select_block=32, count=2,
                             q_lens=q_lens, cmp_lens=cmp_lens, atten_mask=p["atten_mask"], topk_mask=p["topk_mask"],
                             scale=p["scale_value"], via="aclnn", backward=False)
    assert out.dtype == torch.float16 and smax.dtype == torch.float32 and topk.dtype == torch.int32


def test_output_order_and_dtypes():
    smax, ssum, out = aclnn.nsa_selected_attention(*base_params("nsa_selected_attention").values())
    assert smax.shape == ssum.shape == (6, 2, 8) and smax.dtype == ssum.dtype == torch.float32
    assert out.shape == (6, 2, 128) and out.dtype == torch.float16
    dq, dk, dv = aclnn.nsa_selected_attention_grad(*selected_grad_params(forward=True).values())
    assert dq.shape == (6, 2, 192) and dk.shape == (80, 1, 192) and dv.shape == (80, 1, 128)
    assert dq.dtype == dk.dtype == dv.dtype == torch.float16
    smax, ssum, out, topk = aclnn.nsa_compress_attention(*compress_attention_params().values())
    assert smax.shape == (8, 2, 8) and out.shape == (8, 2, 16) and topk.shape == (8, 1, 2)
    ig, wg = aclnn.nsa_compress_grad(*base_params("nsa_compress_grad").values())
    assert ig.shape == (80, 2, 16) and wg.shape == (32, 2) and ig.dtype == wg.dtype == torch.float16


# ----------------------------------------------------------------------------------------------- two-phase form
def _same(a, b):
    if isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert torch.equal(a, b)


def _params(op):
    return selected_grad_params(forward=True) if op == "nsa_selected_attention_grad" else base_params(op)


@pytest.mark.parametrize("op", list(OPS))
def test_two_phase_equals_direct_call(op):
    run, get_ws = OPS[op]
    p = _params(op)
    ws, executor = get_ws(*p.values())
    assert isinstance(ws, int) and ws >= 0 and isinstance(executor, AclnnExecutor)
    _same(run(None, ws, executor, None), run(*p.values()))


@pytest.mark.parametrize("op", list(OPS))
def test_executor_runs_once(op):
    run, get_ws = OPS[op]
    ws, executor = get_ws(*_params(op).values())
    run(None, ws, executor, None)
    with pytest.raises(ParamInvalidError, match="^executor"):
        run(None, ws, executor, None)


@pytest.mark.parametrize("op", list(OPS))
def test_bad_workspace_size(op):
    run, get_ws = OPS[op]
    _, executor = get_ws(*_params(op).values())
    with pytest.raises(ParamInvalidError, match="^workspace_size"):
        run(None, -1, executor, None)
