"""``attnops compare`` on the DeepSeek-V4 custom APIs (vllm-ascend's ``_C_ascend`` ops and ``cann_ops_transformer``)
from hand-written dumps with NPU-pickled tensors: correct calls PASS, corrupted ones FAIL, E's note says it is
exact-then-cast."""
from __future__ import annotations

import torch

from attnops import cann_ops_transformer as cot
from attnops.msprobe import judge_path
from attnops.torch_npu import dsv4 as va

from .npu_dump import write_dump

NOTE = "E is attnops' exact result"


def _randn(*shape, seed, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def _sharedkv_call():
    """vllm-ascend's decode call: TND bf16 query, paged sliding-window and compressed caches, CSA indices, sinks."""
    q = _randn(4, 4, 64, seed=1)
    ori, cmp = _randn(4, 16, 1, 64, seed=2), _randn(2, 16, 1, 64, seed=3)
    kwargs = dict(ori_kv=ori, cmp_kv=cmp, cmp_sparse_indices=_i32([[[0, -1]], [[1, 0]], [[2, 1]], [[0, 1]]]),
                  ori_block_table=_i32([[2, 0], [3, -1]]), cmp_block_table=_i32([[1], [0]]),
                  cu_seqlens_q=_i32([0, 3, 4]), seqused_kv=_i32([22, 9]), sinks=_randn(4, seed=4, dtype=torch.float32),
                  softmax_scale=0.125, cmp_ratio=4, ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=127,
                  ori_win_right=0, layout_q="TND", layout_kv="PA_ND")
    return [q], kwargs, list(va.npu_sparse_attn_sharedkv(q, **kwargs))


def _ot_call():
    q, ori = _randn(1, 8, 2, 32, seed=5), _randn(1, 8, 1, 32, seed=6)
    kwargs = dict(ori_kv=ori, softmax_scale=0.2, ori_win_left=3, return_softmax_lse=True)
    return [q], kwargs, list(cot.sparse_flash_mla(q, **kwargs))


def _compressor_call():
    x = _randn(10, 64, seed=7)
    wkv, wgate = _randn(32, 64, seed=8) * 0.125, _randn(32, 64, seed=9) * 0.125
    state, ape = torch.zeros(3, 16, 64), _randn(4, 32, seed=10, dtype=torch.float32)
    args = [x, wkv, wgate, state.clone(), ape, 4]
    kwargs = dict(state_block_table=_i32([[1]]), cu_seqlens=_i32([0, 10]), coff=2)
    out = cot.compressor(x, wkv, wgate, state.clone(), ape, 4, **kwargs)
    return args, kwargs, out


def _indexer_call():
    q, k, w = _randn(1, 9, 2, 32, seed=11), _randn(1, 3, 1, 32, seed=12), torch.rand(1, 9, 2)
    kwargs = dict(cmp_residual_k=_i32([1]), mask_mode=3, cmp_ratio=4)
    return [q, k, w, 2], kwargs, list(cot.lightning_indexer(q, k, w, 2, **kwargs))


def _entries(corrupt: bool) -> dict:
    calls = {"_C_ascend.npu_sparse_attn_sharedkv.0.forward": _sharedkv_call(),
             "cann_ops_transformer.sparse_flash_mla.0.forward": _ot_call(),
             "cann_ops_transformer.compressor.0.forward": _compressor_call(),
             "cann_ops_transformer.lightning_indexer.0.forward": _indexer_call()}
    entries = {}
    for name, (args, kwargs, out) in calls.items():
        if corrupt:
            if name.endswith("lightning_indexer.0.forward"):
                out = [out[0].flip(-1).where(out[0][..., :1] < 0, out[0] + 1), out[1]]  # other keys selected
            elif isinstance(out, list):
                out = [out[0] * 1.05, *out[1:]]
            else:
                out = out * 1.05
        entries[name] = {"input_args": args, "input_kwargs": kwargs, "output": out}
    return entries


def test_correct_dsv4_calls_pass_with_the_exact_then_cast_note(tmp_path):
    results = judge_path(write_dump(tmp_path, _entries(corrupt=False)))
    assert {r.call: r.verdict for r in results} == {
        "_C_ascend.npu_sparse_attn_sharedkv.0.forward": "PASS",
        "cann_ops_transformer.sparse_flash_mla.0.forward": "PASS",
        "cann_ops_transformer.compressor.0.forward": "PASS", "cann_ops_transformer.lightning_indexer.0.forward": "PASS"}
    assert all(r.note.startswith(NOTE) for r in results)
    names = {r.call: [t.name for t in r.tensors] for r in results}
    assert names["_C_ascend.npu_sparse_attn_sharedkv.0.forward"] == ["attn_out"]  # the lse placeholder is not judged
    assert names["cann_ops_transformer.sparse_flash_mla.0.forward"] == ["attn_out", "softmax_lse"]
    assert names["cann_ops_transformer.lightning_indexer.0.forward"] == ["sparse_indices"]


def test_corrupted_dsv4_calls_fail(tmp_path):
    results = judge_path(write_dump(tmp_path, _entries(corrupt=True)))
    assert {r.verdict for r in results} == {"FAIL"} and len(results) == 4


def test_backward_entries_are_skipped_with_the_reason(tmp_path):
    args, kwargs, out = _ot_call()
    (result,) = judge_path(write_dump(tmp_path, {
        "cann_ops_transformer.sparse_flash_mla.0.forward": {"input_args": args, "input_kwargs": kwargs,
                                                            "output": out},
        "cann_ops_transformer.sparse_flash_mla.0.backward": {"input": [torch.ones_like(out[0])],
                                                             "output": [torch.ones_like(out[0])]}}), api="*backward")
    assert result.verdict == "SKIP" and "grad op called directly" in result.reason


def test_grad_op_and_vllm_compressor_and_quant_indexer_pass(tmp_path):
    (q,), kwargs, (out, lse) = _ot_call()
    dout = _randn(*q.shape, seed=13)
    grad_kwargs = dict(softmax_scale=0.2, ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=3, ori_win_right=0)
    grads = [g for g in cot.sparse_flash_mla_grad(q, dout, out, lse, kwargs["ori_kv"], **grad_kwargs)]
    x_args, _, _ = _compressor_call()
    rope = [_randn(3, 8, seed=14, dtype=torch.float32), _randn(3, 8, seed=15, dtype=torch.float32)]
    vllm_args = [*x_args[:5], torch.ones(16), *rope, _i32([[1]]), _i32([0, 10]), None, None, 8, 4, 2, 1e-6, 2, 1]
    vllm_out = va.compressor(*[a.clone() if isinstance(a, torch.Tensor) else a for a in vllm_args])
    g = torch.Generator().manual_seed(16)
    qi, ki = (torch.randint(-8, 8, shape, generator=g, dtype=torch.int8) for shape in ((9, 2, 32), (1, 4, 1, 32)))
    sq, sk, w = torch.rand(9, 2, generator=g) + 0.5, torch.rand(1, 4, 1, generator=g) + 0.5, torch.rand(9, 2)
    idx_kwargs = dict(actual_seq_lengths_query=_i32([9]), actual_seq_lengths_key=_i32([14]), block_table=_i32([[0]]),
                      layout_query="TND", layout_key="PA_BSND", sparse_count=2, cmp_ratio=4)
    results = judge_path(write_dump(tmp_path, {
        "cann_ops_transformer.sparse_flash_mla_grad.0.forward": {
            "input_args": [q, dout, out, lse, kwargs["ori_kv"]], "input_kwargs": grad_kwargs, "output": grads},
        "_C_ascend.compressor.0.forward": {"input_args": vllm_args, "input_kwargs": {}, "output": vllm_out},
        "_C_ascend.npu_vllm_quant_lightning_indexer.0.forward": {
            "input_args": [qi, ki, w, sq, sk], "input_kwargs": idx_kwargs,
            "output": list(va.npu_vllm_quant_lightning_indexer(qi, ki, w, sq, sk, **idx_kwargs))}}))
    assert {r.call: r.verdict for r in results} == dict.fromkeys((
        "cann_ops_transformer.sparse_flash_mla_grad.0.forward", "_C_ascend.compressor.0.forward",
        "_C_ascend.npu_vllm_quant_lightning_indexer.0.forward"), "PASS")
    assert [t.name for t in results[0].tensors] == ["d_q", "d_ori_kv"]
