"""Inference-only operators (FusedInferAttention, the NSA ``*_infer`` ops) in every dialect: inputs that require grad
give the same outputs, now with a grad_fn, and a backward raises InferenceOnlyError naming the training operator;
inputs that do not require grad are untouched; torch.compile(fullgraph=True) traces them and defers the error."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import attnops
from attnops import InferenceOnlyError, aclnn, torch_npu
from attnops._core.inference_only import inference_only_backward
from tests.helpers import randn
from tests.ops.fused_infer_attention.fia_helpers import aclnn_args, run_aclnn_two_phase

FIA = ("fused_infer_attention", "attnops.flash_attention", "npu_fusion_attention")
SELECTED = ("nsa_selected_attention_infer", "attnops.nsa_selected_attention", "npu_nsa_select_attention")
COMPRESS_ATTENTION = ("nsa_compress_attention_infer", "attnops.nsa_compress_attention", "npu_nsa_compress_attention")
COMPRESS = ("nsa_compress_infer", "attnops.nsa_compress", "npu_nsa_compress")


def _grad(x: torch.Tensor, grad: bool) -> torch.Tensor:
    return x.requires_grad_(grad)


def _case(fn, make_args):
    """A case: ``grad -> (fn, args)``, the call and its inputs, one of which requires grad when ``grad``."""
    return lambda grad: (fn, make_args(grad))


# ------------------------------------------------------------------------------------------------ FIA cases
INT_MAX = 2147483647


def _bnsd(q_s: int, grad: bool, dtype=torch.float32):
    """GQA query [2, 4, q_s, 16] over keys [2, 2, 20, 16] (BNSD); the query requires grad when ``grad``."""
    return (_grad(randn(2, 4, q_s, 16, dtype=dtype), grad), randn(2, 2, 20, 16, dtype=dtype, seed=1),
            randn(2, 2, 20, 16, dtype=dtype, seed=2))


def _python(q_s):
    def fn(q, k, v):
        return attnops.fused_infer_attention(q, k, v, num_key_value_heads=2, actual_seq_lengths_kv=[20, 7],
                                             return_lse=True)
    return _case(fn, lambda grad: _bnsd(q_s, grad))


def _python_value_list(grad):
    """Per-batch key/value lists (the aclnn TensorList); the values require grad, not the query."""
    ks = [randn(1, 2, n, 16, seed=3 + n) for n in (20, 9)]
    vs = [_grad(randn(1, 2, n, 16, seed=5 + n), grad) for n in (20, 9)]
    return (lambda q, ks, vs: attnops.fused_infer_attention(q, ks, vs, num_key_value_heads=2),
            (_bnsd(1, False)[0], ks, vs))


def _aclnn(q_s, two_phase=False):
    def fn(q, k, v):
        kw = dict(num_heads=4, num_key_value_heads=2, scale_value=0.25, input_layout="BNSD", softmax_lse_flag=True)
        if two_phase:
            return run_aclnn_two_phase(q, k, v, **kw)
        return aclnn.fused_infer_attention_score_v2(*aclnn_args(q, k, v, **kw))
    return _case(fn, lambda grad: _bnsd(q_s, grad, torch.float16))  # aclnn: fp16/bf16 only


def _npu_fias(q, k, v):
    return torch_npu.npu_fused_infer_attention_score(q, k, v, num_heads=4, num_key_value_heads=2, scale=0.25,
                                                     input_layout="BNSD", softmax_lse_flag=True)


def _npu_fias_paged_key(grad):
    """Decode over a paged cache [blocks, block_size, N2*D] that requires grad (BSH)."""
    def fn(q, cache, table):
        return torch_npu.npu_fused_infer_attention_score(q, cache, cache.detach(), num_heads=4,
                                                         num_key_value_heads=2, scale=0.25, block_table=table,
                                                         block_size=16, actual_seq_lengths_kv=[27, 9])
    return fn, (randn(2, 1, 64, seed=1), _grad(randn(5, 16, 32, seed=2), grad),
                torch.tensor([[3, 0], [1, -1]], dtype=torch.int32))


def _npu_fias_v2(q_s, sink_grad=False):
    def fn(q, k, v, sink):
        return torch_npu.npu_fused_infer_attention_score_v2(q, k, v, num_query_heads=4, num_key_value_heads=2,
                                                            softmax_scale=0.25, input_layout="BNSD",
                                                            learnable_sink=sink, return_softmax_lse=True)
    return lambda grad: (fn, (*_bnsd(q_s, grad and not sink_grad), _grad(randn(4, seed=9), grad and sink_grad)))


def _npu_fias_out(q, k, v, out):
    return torch_npu.npu_fused_infer_attention_score.out(q, k, v, num_heads=4, num_key_value_heads=2,
                                                         input_layout="BNSD", softmax_lse_flag=True, out=out)


def _npu_ifa(q, k, v):
    return torch_npu.npu_incre_flash_attention(q, k, v, num_heads=4, num_key_value_heads=2, scale_value=0.25,
                                               input_layout="BNSD", actual_seq_lengths=[20, 7])


def _npu_pfa(q, k, v):
    return torch_npu.npu_prompt_flash_attention(q, k, v, num_heads=4, num_key_value_heads=2, scale_value=0.25,
                                                input_layout="BNSD", next_tokens=INT_MAX)


# ------------------------------------------------------------------------------------------------ NSA cases
B, N, N2, D, PAGE = 2, 4, 2, 16, 8
TABLE = torch.tensor([[2, 0, 3], [1, 4, -1]], dtype=torch.int32)
TOPK = torch.tensor([[[0, 2], [1, -1]], [[1, 0], [0, 1]]], dtype=torch.int32)  # blocks of 8 keys


def _paged_inputs(grad: bool):
    """A query [2, 4, 16] (requires grad when ``grad``) and paged caches [5, 8, 2, 16]."""
    return _grad(randn(B, N, D), grad), randn(5, PAGE, N2, D, seed=1), randn(5, PAGE, N2, D, seed=2)


def _paged(fn):
    return _case(fn, _paged_inputs)


def _python_selected(q, k, v):
    return attnops.nsa_selected_attention_infer(q, k, v, TOPK, TABLE, [20, 13], select_block_size=8)


def _npu_selected(q, k, v):
    return torch_npu.npu_nsa_select_attention_infer(q, k, v, TOPK, 0.25, N, N2, 8, 2, PAGE, layout="TND",
                                                    block_table=TABLE, actual_seq_kvlen=[20, 13])


def _python_compress_attention(q, k, v):
    return attnops.nsa_compress_attention_infer(q, k, v, TABLE, [20, 13], compress_block_size=4, compress_stride=2,
                                                select_block_size=4, select_block_count=3)


def _npu_compress_attention(q, k, v):
    return torch_npu.npu_nsa_compress_attention_infer(q, k, v, 0.25, N, N2, 4, 3, PAGE, 4, 2, layout="TND",
                                                      block_table=TABLE, actual_cmp_seq_kvlen=[20, 13])


def _npu_compress(which):
    """The compressed-key cache update; ``which`` of the paged input, the weight and the cache (a non-leaf: a leaf
    that requires grad takes no in-place update) requires grad."""
    def fn(kv, w, cache):
        return torch_npu.npu_nsa_compress_infer(kv, w, torch.tensor([1, 0]), 4, 2, 8,
                                                block_table=torch.tensor([[2, 0], [3, 1]]), actual_seq_len=[10, 8],
                                                cache=cache)
    return lambda grad: (fn, (_grad(randn(4, 8, 2, 16, seed=25), grad and which == "input"),
                              _grad(randn(4, 2, seed=26), grad and which == "weight"),
                              _grad(torch.zeros(3, 2, 16), grad and which == "cache").clone()))


CASES = {
    "python_decode": (_python(1), FIA),
    "python_prefill": (_python(6), FIA),
    "python_value_list": (_python_value_list, FIA),
    "aclnn_decode": (_aclnn(1), FIA),
    "aclnn_prefill_two_phase": (_aclnn(6, two_phase=True), FIA),
    "npu_fias_decode": (_case(_npu_fias, lambda grad: _bnsd(1, grad)), FIA),
    "npu_fias_prefill": (_case(_npu_fias, lambda grad: _bnsd(6, grad)), FIA),
    "npu_fias_paged_key": (_npu_fias_paged_key, FIA),
    "npu_fias_out": (_case(_npu_fias_out, lambda grad: (*_bnsd(1, grad), [torch.empty(0), torch.empty(0)])), FIA),
    "npu_fias_v2_decode": (_npu_fias_v2(1), FIA),
    "npu_fias_v2_prefill": (_npu_fias_v2(6), FIA),
    "npu_fias_v2_sink": (_npu_fias_v2(6, sink_grad=True), FIA),
    "npu_incre_flash_attention": (_case(_npu_ifa, lambda grad: _bnsd(1, grad)), FIA),
    "npu_prompt_flash_attention": (_case(_npu_pfa, lambda grad: _bnsd(6, grad)), FIA),
    "python_nsa_selected_infer": (_paged(_python_selected), SELECTED),
    "npu_nsa_select_attention_infer": (_paged(_npu_selected), SELECTED),
    "python_nsa_compress_attention_infer": (_paged(_python_compress_attention), COMPRESS_ATTENTION),
    "npu_nsa_compress_attention_infer": (_paged(_npu_compress_attention), COMPRESS_ATTENTION),
    "npu_nsa_compress_infer": (_npu_compress("input"), COMPRESS),
    "npu_nsa_compress_infer_weight": (_npu_compress("weight"), COMPRESS),
    "npu_nsa_compress_infer_cache": (_npu_compress("cache"), COMPRESS),
}


def _tensors(result) -> list[torch.Tensor]:
    return [result] if isinstance(result, torch.Tensor) else list(result)


def _float(result) -> list[torch.Tensor]:
    return [t for t in _tensors(result) if t.is_floating_point() and t.numel() > 0]


def _raises(tensor: torch.Tensor, expected: tuple[str, str, str]) -> None:
    name, training, npu_training = expected
    with pytest.raises(InferenceOnlyError) as info:
        tensor.float().sum().backward()
    message = str(info.value)
    assert f"{name} (torch_npu: " in message and "is inference-only: it has no backward" in message
    assert f"For training use {training} (torch_npu: {npu_training})" in message


def _run(case: str, grad: bool):
    fn, args = CASES[case][0](grad)
    return fn(*args)


@pytest.mark.parametrize("case", CASES)
def test_requires_grad_gives_the_same_outputs_and_backward_raises(case):
    expected = CASES[case][1]
    plain, traced = _run(case, False), _run(case, True)
    assert len(_tensors(plain)) == len(_tensors(traced))
    for a, b in zip(_tensors(plain), _tensors(traced)):
        assert torch.equal(a, b.detach()) and not a.requires_grad  # inputs without grad: untouched
    differentiable = _float(traced)
    assert differentiable and all(t.grad_fn is not None for t in differentiable)
    for t in differentiable:  # every output, the lse included
        _raises(t, expected)


@pytest.mark.parametrize("case", ["python_decode", "aclnn_decode", "npu_fias_prefill", "npu_fias_v2_sink",
                                  "npu_nsa_select_attention_infer", "npu_nsa_compress_infer"])
def test_no_grad_mode_gives_no_grad_fn(case):
    with torch.no_grad():
        assert all(not t.requires_grad for t in _tensors(_run(case, True)))


def test_error_type():
    assert issubclass(InferenceOnlyError, RuntimeError) and "InferenceOnlyError" in attnops.__all__


def test_inference_only_backward_op_raises_and_has_a_fake_kernel():
    g = torch.ones(2, 3)
    with pytest.raises(InferenceOnlyError, match="^the message$"):
        inference_only_backward(g, [4, 5], torch.float16, "the message")
    with FakeTensorMode() as mode:
        fake = inference_only_backward(mode.from_tensor(g), [4, 5], torch.float16, "the message")
    assert fake.shape == (4, 5) and fake.dtype == torch.float16


def _op_args(op, **values) -> tuple:
    """The custom op's arguments in schema order: ``values`` by name, the schema's default or None for the rest."""
    return tuple(values.get(a.name, a.default_value if a.has_default_value() else None) for a in op._schema.arguments)


@pytest.mark.parametrize("name", ["fused_infer_attention", "nsa_selected_attention_infer",
                                  "nsa_compress_attention_infer"])
def test_opcheck_with_a_query_that_requires_grad(name):
    """Schema, autograd registration and fake kernel with a query that requires grad (opcheck's AOT test runs a
    backward, which raises by design: the compile tests below cover it)."""
    op = getattr(torch.ops.attnops, name).default
    if name == "fused_infer_attention":
        args = _op_args(op, query=randn(2, 1, 32).requires_grad_(), key=randn(2, 9, 32, seed=1),
                        value=randn(2, 9, 32, seed=2), num_heads=2, scale=0.25, pre_tokens=INT_MAX,
                        next_tokens=INT_MAX, input_layout="BSH", num_key_value_heads=0, sparse_mode=0,
                        inner_precise=0, block_size=0, antiquant_mode=0, key_antiquant_mode=0, value_antiquant_mode=0)
    else:
        q, k, v = _paged_inputs(True)
        args = ((q, k, v, TOPK, TABLE, 0.25, N, N2, 8, 2, PAGE, [20, 13]) if name == "nsa_selected_attention_infer"
                else (q, k, v, TABLE, 0.25, N, N2, 4, 3, PAGE, 4, 2, [20, 13]))
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


# ------------------------------------------------------------------------------------------------ torch.compile
@pytest.mark.parametrize("case", ["python_decode", "python_prefill", "npu_fias_decode", "npu_fias_prefill",
                                  "npu_fias_v2_sink", "npu_incre_flash_attention", "python_nsa_selected_infer",
                                  "npu_nsa_compress_attention_infer", "npu_nsa_compress_infer"])
def test_compile_fullgraph_with_requires_grad_inputs(case):
    """The forward compiles with inputs that require grad and matches eager; the backward raises at run time."""
    torch._dynamo.reset()
    make, expected = CASES[case]
    eager = _tensors(_run(case, True))
    fn, args = make(True)
    compiled = _tensors(torch.compile(fn, fullgraph=True, backend="aot_eager")(*args))
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    _raises(_float(compiled)[0], expected)
