"""Signature tests generated from ``data/torch_npu_schemas.txt``: every implemented function has exactly the
schema's parameters (names, order, keyword-only marker, defaults), accepts positional and keyword call styles and
returns the schema's tuple (Tensor slots as tensors, ``int`` slots as Python ints)."""
from __future__ import annotations

import inspect

import pytest
import torch

from attnops import torch_npu

from .schemas import load_schemas

SCHEMAS = load_schemas()
NOT_IMPLEMENTED: set[str] = set()  # documented in docs/porting.md
IMPLEMENTED = sorted(set(SCHEMAS) - NOT_IMPLEMENTED)
# torch_npu returns an undefined tensor (None) in these Tensor slots when the matching input is absent
UNDEFINED_WHEN_ABSENT = {"npu_fusion_attention_grad": {3}, "npu_fusion_attention_grad_v2": {3, 4, 5}}


def _function(name: str):
    op, _, overload = name.partition(".")
    fn = getattr(torch_npu, op)
    return getattr(fn, overload) if overload else fn


def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _fa_inputs():
    q, k, v = _r(1, 2, 8, 16, seed=1), _r(1, 2, 8, 16, seed=2), _r(1, 2, 8, 16, seed=3)
    out, smax, ssum, *_ = torch_npu.npu_fusion_attention(q, k, v, 2, "BNSD")
    stats = dict(softmax_max=smax, softmax_sum=ssum, attention_in=out)
    return q, k, v, out, stats


def _select_inputs():
    q, k, v = _r(7, 4, 8, seed=4), _r(20, 2, 8, seed=5), _r(20, 2, 4, seed=6)
    topk = torch.zeros(7, 2, 2, dtype=torch.int32)
    topk[..., 1] = 1
    lens = dict(actual_seq_qlen=[3, 7], actual_seq_kvlen=[8, 20])
    return q, k, v, topk, lens


def case(name: str):
    """``(required positional arguments, extra keyword arguments the call needs)`` of each implemented schema."""
    if name in ("npu_fusion_attention", "npu_fusion_attention_v2"):
        q, k, v, _, _ = _fa_inputs()
        return (q, k, v, 2, "BNSD"), {}
    if name in ("npu_fusion_attention_grad", "npu_fusion_attention_grad_v2"):
        q, k, v, out, stats = _fa_inputs()
        return (q, k, v, torch.ones_like(out), 2, "BNSD"), stats
    if name in ("npu_fused_infer_attention_score", "npu_fused_infer_attention_score_v2", "npu_prompt_flash_attention"):
        return (_r(1, 3, 16), _r(1, 5, 16, seed=1), _r(1, 5, 16, seed=2)), {}
    if name in ("npu_fused_infer_attention_score.out", "npu_fused_infer_attention_score_v2.out"):
        return (_r(1, 3, 16), _r(1, 5, 16, seed=1), _r(1, 5, 16, seed=2)), {"out": [torch.empty(0), torch.empty(0)]}
    if name == "npu_incre_flash_attention":
        return (_r(1, 1, 16), _r(1, 5, 16, seed=1), _r(1, 5, 16, seed=2)), {}
    if name == "npu_nsa_compress":
        return (_r(40, 1, 16), _r(16, 1, seed=1), 16, 16), {}
    if name == "npu_nsa_compress_grad":
        return (_r(2, 1, 16, seed=2), _r(40, 1, 16), _r(16, 1, seed=1), 16, 16), {}
    if name == "npu_nsa_compress_attention":
        q, k, v = _r(7, 2, 8, seed=7), _r(9, 1, 8, seed=8), _r(9, 1, 4, seed=9)
        return (q, k, v, 0.5, 2, 32, 16, 32, 2), dict(actual_seq_qlen=[3, 7], actual_cmp_seq_kvlen=[4, 9],
                                                         actual_sel_seq_kvlen=[2, 5])
    if name == "npu_nsa_select_attention":
        q, k, v, topk, lens = _select_inputs()
        return (q, k, v, topk, 0.5, 4, 4, 2), lens
    if name == "npu_nsa_select_attention_grad":
        q, k, v, topk, lens = _select_inputs()
        out, smax, ssum = torch_npu.npu_nsa_select_attention(q, k, v, topk, 0.5, 4, 4, 2, **lens)
        return (torch.ones_like(out), q, k, v, out, smax, ssum, topk, 0.5, 4, 4, 2), lens
    if name == "npu_nsa_select_attention_infer":  # BSND decode, caches (blocks, page, KV_N, D)
        q, k, v = _r(2, 1, 4, 8, seed=10), _r(6, 4, 2, 8, seed=11), _r(6, 4, 2, 4, seed=12)
        topk = torch.tensor([[[0, 1], [1, -1]], [[0, -1], [0, 1]]], dtype=torch.int32)
        return (q, k, v, topk, 0.5, 4, 2, 4, 2, 4), dict(block_table=torch.tensor([[2, 5], [0, 3]]),
                                                         actual_seq_kvlen=[8, 6])
    if name == "npu_nsa_compress_attention_infer":  # TND decode, caches (blocks, page, KV_N*D)
        q, k, v = _r(2, 4, 8, seed=13), _r(6, 4, 16, seed=14), _r(6, 4, 8, seed=15)
        return (q, k, v, 0.5, 4, 2, 4, 3, 4, 2, 1), dict(block_table=torch.tensor([[2, 5, 1], [0, 3, 4]]),
                                                         actual_cmp_seq_kvlen=[9, 12])
    if name == "npu_nsa_compress_infer.cache":
        kv, w = _r(4, 8, 2, 16, seed=16), _r(4, 2, seed=17)
        return (kv, w, torch.tensor([1, 0]), 4, 2, 8), dict(block_table=torch.tensor([[2, 0], [3, 1]]),
                                                            actual_seq_len=[10, 7], cache=torch.zeros(3, 2, 16))
    if name == "npu_ring_attention_update":
        o1, o2, m1, m2 = _r(4, 1, 8), _r(4, 1, 8, seed=1), _r(1, 2, 4, 8, seed=2), _r(1, 2, 4, 8, seed=3)
        return (o1, m1, torch.ones(1, 2, 4, 8), o2, m2, torch.ones(1, 2, 4, 8)), {}
    if name in ("npu_scatter_pa_kv_cache", "npu_scatter_pa_kv_cache_functional", "_npu_reshape_and_cache"):
        key, value = _r(3, 2, 16, seed=18), _r(3, 2, 8, seed=19)
        caches = (torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 8))
        extra = {} if name == "_npu_reshape_and_cache" else {"cache_mode": "Norm"}
        return (key, value, *caches, torch.tensor([5, 0, 14], dtype=torch.int32)), extra
    if name in ("npu_gather_pa_kv_cache", "npu_gather_pa_kv_cache_functional"):
        caches = (_r(4, 4, 2, 16, seed=20), _r(4, 4, 2, 8, seed=21))
        return (*caches, torch.tensor([[2, 0], [3, 1]], dtype=torch.int32), torch.tensor([6, 3], dtype=torch.int32),
                torch.zeros(9, 2, 16), torch.zeros(9, 2, 8)), {}
    if name in ("_npu_paged_attention", "_npu_paged_attention_get_workspace"):
        caches = (_r(4, 4, 2, 16, seed=22), _r(4, 4, 2, 16, seed=23))
        return (_r(2, 4, 16, seed=24), *caches, 2, 4, 0.25, torch.tensor([[2, 0], [3, 1]], dtype=torch.int32),
                torch.tensor([6, 3], dtype=torch.int32), torch.empty(2, 4, 16)), {}
    if name == "_npu_flash_attention_unpad":
        q, k, v = _r(9, 4, 16, seed=25), _r(9, 2, 16, seed=26), _r(9, 2, 8, seed=27)
        return (q, k, v, torch.tensor([4, 5], dtype=torch.int32), 0.25, 4, 2, torch.empty(9, 4, 8)), {}
    if name in ("_npu_flash_attention", "_npu_flash_attention_v3", "_npu_flash_attention_unpad_v2"):
        q, k, v = _r(9, 4, 16, seed=28), _r(9, 2, 16, seed=29), _r(9, 2, 8, seed=30)
        mask = () if name == "_npu_flash_attention_unpad_v2" else (torch.triu(torch.ones(5, 5), 1),)
        return (q, k, v, *mask, torch.tensor([4, 5], dtype=torch.int32), 0.25, 4, 2), {"out": torch.empty(9, 4, 8)}
    if name in ("_npu_flash_attention_qlens", "_npu_paged_attention_splitfuse", "_npu_paged_attention_splitfuse_v2"):
        caches = (_r(4, 4, 2, 16, seed=31), _r(4, 4, 2, 8, seed=32))
        table, q_lens, kv_lens = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32), torch.tensor([2, 3]), \
            torch.tensor([6, 3])
        mask = torch.triu(torch.ones(5, 8), 1) if name == "_npu_paged_attention_splitfuse" else torch.ones(8, 8)
        lens_and_mask = (mask, q_lens, kv_lens) if name == "_npu_flash_attention_qlens" else (kv_lens, mask, q_lens)
        out = {"out": torch.empty(5, 4, 8)}
        if name == "_npu_flash_attention_qlens":
            return (_r(5, 4, 16, seed=33), *caches, table, *lens_and_mask, 2, 4, 0.25, out["out"]), {}
        required = (_r(5, 4, 16, seed=33), *caches, table, *lens_and_mask, 2, 4, 0.25)
        return (required, out) if name.endswith("_v2") else ((*required, out["out"]), {})
    if name == "_npu_paged_attention_mla":
        return (_r(2, 4, 24, seed=34), _r(4, 4, 1, 24, seed=35), 1, 4, 0.25, torch.tensor([[2, 0], [3, 1]]),
                torch.tensor([6, 3]), 16, torch.empty(2, 4, 16)), {}
    if name in ("npu_scatter_nd_update_", "npu_scatter_nd_update"):
        return (torch.zeros(6, 2, 4), torch.tensor([[4], [1]]), _r(2, 2, 4, seed=36)), {}
    if name == "npu_attention_update":
        return ([_r(6), _r(6, seed=1)], [_r(6, 4, seed=2), _r(6, 4, seed=3)], 1), {}
    if name in DSA_CASES:
        return DSA_CASES[name]()
    raise KeyError(name)


def _sfa_inputs():
    q, qr = _r(1, 2, 2, 512, seed=40), _r(1, 2, 2, 64, seed=41)
    kv, kr = _r(1, 3, 1, 512, seed=42), _r(1, 3, 1, 64, seed=43)
    idx = torch.tensor([[[[1, 0]], [[2, -1]]]], dtype=torch.int32)
    return q, qr, kv, kr, idx


def _sfa_case():
    q, qr, kv, kr, idx = _sfa_inputs()
    return (q, kv, kv, idx, 0.1), dict(query_rope=qr, key_rope=kr, attention_mode=2)


def _quant_case():
    from attnops.ops.dsa.quant_cache import quantize

    q, qr, kv, kr, idx = _sfa_inputs()
    packed = quantize(kv, kr.bfloat16())
    return (torch.cat([q, qr], -1).bfloat16(), packed, packed, idx, 0.1, 2, 2), dict(attention_mode=2)


def _kl_case():
    q, qr, kv, kr, idx = _sfa_inputs()
    _, smax, ssum = torch_npu.npu_sparse_flash_attention(q, kv, kv, idx, 0.1, query_rope=qr, key_rope=kr,
                                                         attention_mode=2, return_softmax_lse=True)
    qi, ki, w = _r(1, 2, 2, 128, seed=44), _r(1, 3, 1, 128, seed=45), _r(1, 2, 2, seed=46)
    return (q, kv, qi, ki, w, idx, smax, ssum, 0.1), dict(query_rope=qr, key_rope=kr)


def _prolog_inputs(v2=False):
    he, hcq, n, d, hckv, dr = 32, 16, 2, 8, 16, 8
    weights = (_r(he, hcq, seed=50), _r(hcq, n * (d + dr), seed=51), _r(n, d, hckv, seed=52),
               _r(he, hckv + dr, seed=53), _r(hcq, seed=54), _r(hckv, seed=55), _r(3, dr, seed=56),
               _r(3, dr, seed=57))
    caches = (torch.zeros(2, 16, 1, hckv), torch.zeros(2, 16, 1, dr))
    slots = torch.tensor([0, 17, 5])
    x = _r(3, he, seed=58)
    return ((x, *weights, slots, *caches), {}) if v2 else ((x, *weights, *caches), dict(cache_index=slots))


DSA_CASES = {
    "npu_lightning_indexer": lambda: ((_r(1, 3, 2, 128), _r(1, 3, 1, 128, seed=1), _r(1, 3, 2, seed=2)),
                                      dict(sparse_count=2)),
    "npu_sparse_flash_attention": _sfa_case,
    "npu_kv_quant_sparse_flash_attention": _quant_case,
    "npu_sparse_lightning_indexer_grad_kl_loss": _kl_case,
    "npu_interleave_rope": lambda: ((_r(1, 2, 3, 64), _r(1, 1, 3, 64, seed=1), _r(1, 1, 3, 64, seed=2)), {}),
    "npu_kv_rmsnorm_rope_cache": lambda: ((_r(2, 1, 1, 576), _r(512, seed=1), _r(2, 1, 1, 64, seed=2),
                                           _r(2, 1, 1, 64, seed=3), torch.tensor([3, -1]), torch.zeros(2, 16, 1, 64),
                                           torch.zeros(2, 16, 1, 512)), dict(cache_mode="PA")),
    "npu_mla_prolog_v3": _prolog_inputs,
    "npu_mla_prolog_v2": lambda: _prolog_inputs(v2=True),
}


def test_every_schema_is_implemented_or_listed():
    missing = [n for n in IMPLEMENTED if not callable(_function(n))]
    assert not missing
    assert NOT_IMPLEMENTED <= set(SCHEMAS)


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_signature_matches_schema(name):
    params = list(inspect.signature(_function(name)).parameters.values())
    schema = SCHEMAS[name].args
    assert [p.name for p in params] == [a.name for a in schema]
    for p, a in zip(params, schema):
        kind = inspect.Parameter.KEYWORD_ONLY if a.keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        assert p.kind == kind, a.name
        assert p.default == a.default and type(p.default) is type(a.default), a.name


def _check_returns(name, result):
    returns = SCHEMAS[name].returns
    if not returns:  # in-place ops return None
        assert result is None
        return
    result = result if isinstance(result, tuple) else (result,)
    assert len(result) == len(returns)
    for i, (value, typ) in enumerate(zip(result, returns)):
        if typ == "int":
            assert type(value) is int, (i, value)
        elif value is None:
            assert i in UNDEFINED_WHEN_ABSENT.get(name, ()), i
        else:
            assert isinstance(value, torch.Tensor), (i, value)


def _same(a, b):
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    for x, y in zip(a, b):
        assert (x is None and y is None) or (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y)


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_call_styles_and_returns(name):
    fn, schema = _function(name), SCHEMAS[name]
    required, extra = case(name)
    positional = fn(*required, **extra)
    _check_returns(name, positional)
    every = {a.name: a.default for a in schema.args if a.default is not inspect.Parameter.empty}
    every.update({a.name: v for a, v in zip(schema.args, required)}, **extra)
    by_keyword = fn(**every)
    _check_returns(name, by_keyword)
    _same(positional, by_keyword)
    if not any(a.keyword_only for a in schema.args):
        all_positional = fn(*[every[a.name] for a in schema.args])
        _same(positional, all_positional)
    with pytest.raises(TypeError):
        fn(*required, not_an_argument=1, **extra)
