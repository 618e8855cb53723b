"""``attnops compare`` on FIA v2, FlashAttention v3, the grad ops called directly and the NSA operators:
msprobe-made dumps (committed) and hand-written ones with NPU-pickled tensors."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnops import torch_npu
from attnops.__main__ import main
from attnops.msprobe import judge_path
from attnops.msprobe.verdict import judge_indices

from .npu_dump import write_dump

DATA = Path(__file__).parent / "data"
B, S, N, D = 1, 32, 2, 16
SCALE = D ** -0.5
EXACT_NOTE = "E is attnops' exact result"


def _verdicts(results):
    return {r.call: r.verdict for r in results}


def _randn(*shape, seed: int, dtype=torch.float16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --------------------------------------------------------------------------------- committed msprobe dumps
def test_msprobe_dump_of_correct_fia_v2_and_nsa_calls_passes(capsys):
    assert main(["compare", str(DATA / "correct_more")]) == 0
    results = judge_path(DATA / "correct_more")
    assert _verdicts(results) == dict.fromkeys((
        "NPU.npu_fused_infer_attention_score_v2.0.forward", "NPU.npu_nsa_compress.0.forward",
        "NPU.npu_nsa_compress.0.backward", "NPU.npu_nsa_compress_attention.0.forward",
        "NPU.npu_nsa_compress_attention.0.backward", "NPU.npu_nsa_select_attention_infer.0.forward",
        "NPU.npu_nsa_compress_attention_infer.0.forward"), "PASS")
    notes = {r.call: r.note for r in results}
    assert EXACT_NOTE in notes["NPU.npu_nsa_compress.0.backward"]  # compression: no NPU rounding emulated
    assert notes["NPU.npu_nsa_compress_attention.0.forward"] == ""
    compared = {(r.call, t.name) for r in results for t in r.tensors}
    assert ("NPU.npu_nsa_compress_attention.0.forward", "topk_indices") in compared
    assert ("NPU.npu_nsa_compress_attention_infer.0.forward", "topk_indices") in compared
    assert ("NPU.npu_nsa_compress.0.backward", "weight_grad") in compared
    assert "7 calls: 7 PASS, 0 FAIL, 0 SKIP" in capsys.readouterr().out


def test_msprobe_dump_of_corrupted_fia_v2_and_nsa_calls_fails_each_call(capsys):
    """FIA v2: one mask row flipped, QK^T overflowing in fp16; NSA: compression with another weight, selected
    attention over other blocks, compressed attention without the scale."""
    assert main(["compare", str(DATA / "corrupt_more")]) == 1
    out = capsys.readouterr().out
    for call in ("npu_fused_infer_attention_score_v2.0", "npu_fused_infer_attention_score_v2.1",
                 "npu_nsa_compress.0", "npu_nsa_select_attention_infer.0", "npu_nsa_compress_attention_infer.0"):
        assert f"FAIL  step0/proc27728  NPU.{call}.forward" in out
    assert "inf/NaN positions differ" in out.split("npu_fused_infer_attention_score_v2.1.forward")[1]
    assert "5 calls: 0 PASS, 5 FAIL, 0 SKIP" in out


# ------------------------------------------------------------------------------------ hand-written dumps
def _qkv(seed: int, *shape):
    return (_randn(*shape, seed=seed + i) for i in range(3))


def test_fa_v3_and_grad_ops_called_directly(tmp_path):
    q, k, v = _qkv(0, B, S, N, D)
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)
    kwargs = dict(atten_mask=mask, scale=SCALE)
    fwd = torch_npu.npu_fusion_attention_v3(q, k, v, N, "BSND", **kwargs)
    dy = _randn(B, S, N, D, seed=9)
    grad_kwargs = dict(atten_mask=mask, softmax_max=fwd[1], softmax_sum=fwd[2], attention_in=fwd[0],
                       scale_value=SCALE)
    grads = torch_npu.npu_fusion_attention_grad(q, k, v, dy, N, "BSND", **grad_kwargs)
    wrong_dq = grads[0].clone()
    wrong_dq[0, 5] *= 2
    calls = {"NPU.npu_fusion_attention_v3.0.forward": {"input_args": [q, k, v, N, "BSND"], "input_kwargs": kwargs,
                                                       "output": list(fwd)}}
    for i, dq in enumerate((grads[0], wrong_dq)):
        calls[f"NPU.npu_fusion_attention_grad.{i}.forward"] = {
            "input_args": [q, k, v, dy, N, "BSND"], "input_kwargs": grad_kwargs,
            "output": [dq, *grads[1:3], None, grads[4]]}
    results = judge_path(write_dump(tmp_path, calls))
    assert _verdicts(results) == {"NPU.npu_fusion_attention_v3.0.forward": "PASS",
                                  "NPU.npu_fusion_attention_grad.0.forward": "PASS",
                                  "NPU.npu_fusion_attention_grad.1.forward": "FAIL"}
    assert [t.name for t in results[0].tensors] == ["attention_out", "softmax_max", "softmax_sum"]  # not seed/offset
    assert [t.name for t in results[2].tensors if t.verdict.verdict == "FAIL"] == ["dq"]


def test_nsa_grad_ops_called_directly(tmp_path):
    q = _randn(S, N, D, seed=10)
    k, v = _randn(S, 1, D, seed=11), _randn(S, 1, D, seed=12)
    topk = torch.stack([torch.zeros(S, dtype=torch.int32), torch.arange(S, dtype=torch.int32) // 8], -1).view(S, 1, 2)
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)
    lens = dict(atten_mask=mask, actual_seq_qlen=[S], actual_seq_kvlen=[S])
    out, smax, ssum = torch_npu.npu_nsa_select_attention(q, k, v, topk, SCALE, N, 8, 2, **lens)
    dy = _randn(S, N, D, seed=13)
    sel_args = [dy, q, k, v, out, smax, ssum, topk, SCALE, N, 8, 2]
    weight = torch.rand(8, 1, generator=torch.Generator().manual_seed(14)).half()
    cmp_grad = _randn(7, 1, D, seed=15)
    cmp_args = [cmp_grad, k, weight, 8, 4]
    results = judge_path(write_dump(tmp_path, {
        "NPU.npu_nsa_select_attention_grad.0.forward": {
            "input_args": sel_args, "input_kwargs": lens,
            "output": list(torch_npu.npu_nsa_select_attention_grad(*sel_args, **lens))},
        "NPU.npu_nsa_compress_grad.0.forward": {
            "input_args": cmp_args, "input_kwargs": {"actual_seq_len": [S]},
            "output": list(torch_npu.npu_nsa_compress_grad(*cmp_args, actual_seq_len=[S]))}}))
    assert _verdicts(results) == {"NPU.npu_nsa_select_attention_grad.0.forward": "PASS",
                                  "NPU.npu_nsa_compress_grad.0.forward": "PASS"}
    assert [t.name for t in results[1].tensors] == ["input_grad", "weight_grad"] and EXACT_NOTE in results[1].note


def test_fia_route_without_npu_emulation_is_judged_against_exact_with_a_note(tmp_path):
    """Per-token antiquant KV in decode: precision="npu" does not cover it, so E is the exact result."""
    q = _randn(1, N, 1, D, seed=16)
    k8, v8 = (torch.randint(-8, 8, (1, N, S, D), dtype=torch.int8, generator=torch.Generator().manual_seed(s))
              for s in (17, 18))
    kwargs = dict(key_antiquant_scale=torch.rand(1, S, generator=torch.Generator().manual_seed(19)) / 8,
                  value_antiquant_scale=torch.rand(1, S, generator=torch.Generator().manual_seed(20)) / 8,
                  key_antiquant_mode=1, value_antiquant_mode=1, num_heads=N, input_layout="BNSD", scale=SCALE)
    out = torch_npu.npu_fused_infer_attention_score(q, k8, v8, **kwargs)
    (result,) = judge_path(write_dump(tmp_path, {"NPU.npu_fused_infer_attention_score.0.forward": {
        "input_args": [q, k8, v8], "input_kwargs": kwargs, "output": list(out)}}))
    assert result.verdict == "PASS" and result.tensors[0].verdict.exact
    assert result.note.startswith(EXACT_NOTE) and "per-token antiquant" in result.note


@pytest.mark.parametrize("npu, verdict", [
    ([[0, 2], [3, 1]], "PASS"),  # the same blocks, in another order
    ([[0, 2], [1, 2]], "FAIL"),
])
def test_selected_blocks_are_judged_as_sets(npu, verdict):
    result = judge_indices(torch.tensor(npu, dtype=torch.int32), torch.tensor([[2, 0], [1, 3]], dtype=torch.int32))
    assert result.verdict == verdict
    assert result.reasons == ([] if verdict == "PASS" else ["1 of 2 rows select other blocks than the emulation"])
