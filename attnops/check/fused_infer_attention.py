"""Built-in FusedInferAttentionScore check cases: the aclnn operator and the Pythonic API against the fp64 golden
(``attnops.testing.golden_fia``); the baseline is the golden's formula in the input's low precision (fp16 for int8
queries). Int8 outputs are compared with the golden's unrounded value ``out * quant_scale2 + quant_offset2``, so the
baseline error includes the rounding every int8 result makes."""
from __future__ import annotations

import inspect

import torch

from .. import PagedKVCache, aclnn, fused_infer_attention
from ..testing import golden_fia
from ..testing.compare import fia_reduction
from .case import CheckCase, Comparison, input_device, moved, on_cpu, triton_runs_on_cuda

INT_MAX = 2147483647
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
CAUSAL_2048 = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
SEED_ORDER = tuple(inspect.signature(aclnn.fused_infer_attention_score_v2_get_workspace_size).parameters)
DEFAULTS = dict(num_heads=1, scale_value=1.0, pre_tokens=INT_MAX, next_tokens=INT_MAX, input_layout="BSH",
                num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0, antiquant_mode=0,
                softmax_lse_flag=True, key_antiquant_mode=0, value_antiquant_mode=0)
PYTHONIC = dict(scale_value="scale", input_layout="layout", softmax_lse_flag="return_lse")


def _randn(*shape, dtype=F32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _randint(lo, hi, *shape, dtype=torch.int8, seed=0):
    return torch.randint(lo, hi, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _mask(*shape, seed=0):
    m = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < 0.3
    m[..., 0] = False
    return m


def _call(via: str, q, k, v, kw: dict):
    if via == "aclnn":
        p = {**DEFAULTS, **kw, "query": q, "key": k if isinstance(k, list) else [k],
             "value": v if isinstance(v, list) else [v]}
        return aclnn.fused_infer_attention_score_v2(*(p.get(name) for name in SEED_ORDER))
    opts = {PYTHONIC.get(name, name): val for name, val in {**DEFAULTS, **kw}.items()}
    return fused_infer_attention(q, k, v, **opts)


def _case(via: str, make, call=None, with_lse: bool = True):
    """Run ``make()``'s inputs through ``call(q, k, v, kw) -> (out, lse)`` (default: the ``via`` dialect, kw in the
    aclnn names); ``with_lse=False`` for callers that return no lse (the lse slot is then ignored)."""
    def run(backend):
        q, k, v, kw = make()
        red = fia_reduction(q, k, **kw)
        g = golden_fia.fia_forward_detail(q, k, v, **kw, softmax_lse_flag=True)
        low = F16 if q.dtype == torch.int8 else q.dtype
        base = golden_fia.fia_forward_detail(q, k, v, **kw, softmax_lse_flag=True, dtype=low)
        dev = input_device(backend)
        q, k, v, kw = moved(dev, q), moved(dev, k), moved(dev, v), {n: moved(dev, x) for n, x in kw.items()}
        out, lse = on_cpu(call(q, k, v, kw) if call else _call(via, q, k, v, kw))
        if g.out_real is not None:
            outs = [Comparison("attention_out (int8)", out.double(), g.out_real, base.out, reduction=red)]
        else:
            outs = [Comparison("attention_out", out, g.out, base.out, reduction=red)]
        return outs + ([Comparison("softmax_lse", lse, g.lse, base.lse, reduction=red)] if with_lse else [])
    return run


def _prefill_mask_gqa():
    q, k, v = _randn(2, 24, 8 * 32, dtype=F16, seed=1), _randn(2, 40, 2 * 32, dtype=F16, seed=2), \
        _randn(2, 40, 2 * 32, dtype=F16, seed=3)
    return q, k, v, dict(num_heads=8, num_key_value_heads=2, scale_value=32 ** -0.5, atten_mask=_mask(2, 24, 40),
                         pre_tokens=20, next_tokens=8, actual_seq_lengths=[24, 17], actual_seq_lengths_kv=[40, 29])


def _decode_paged_mask_pse():
    cache = PagedKVCache(16, 16, num_kv_heads=2, head_dim=32, dtype=BF16)
    seqs = [cache.new_sequence() for _ in range(3)]
    for i, (s, t) in enumerate(zip(seqs, (70, 5, 33))):
        cache.append(s, _randn(t, 2, 32, seed=i), _randn(t, 2, 32, seed=10 + i))
    kw = cache.attention_kwargs(seqs)
    cols = kw["block_table"].shape[1] * 16
    return _randn(3, 8, 1, 32, dtype=BF16, seed=4), cache.key_cache, cache.value_cache, dict(
        kw, num_heads=8, num_key_value_heads=2, scale_value=32 ** -0.5, input_layout="BNSD",
        atten_mask=_mask(3, cols, seed=5), pse_shift=_randn(3, 8, 1, cols, dtype=BF16, seed=6))


def _tnd_causal():
    q, k, v = _randn(45, 4, 16, seed=1), _randn(60, 2, 16, seed=2), _randn(60, 2, 16, seed=3)
    return q, k, v, dict(num_heads=4, num_key_value_heads=2, scale_value=0.25, input_layout="TND",
                         atten_mask=CAUSAL_2048, sparse_mode=3, actual_seq_lengths=[20, 45],
                         actual_seq_lengths_kv=[22, 60])


def _tensor_list_decode():
    ks = [_randn(1, 2, s, 16, dtype=F16, seed=s) for s in (9, 31, 4)]
    vs = [_randn(1, 2, s, 16, dtype=F16, seed=50 + s) for s in (9, 31, 4)]
    return _randn(3, 2, 1, 16, dtype=F16, seed=7), ks, vs, dict(num_heads=2, scale_value=0.25, input_layout="BNSD",
                                                                actual_seq_lengths_kv=[9, 20, 4])


def _int8_in_fp16_out():
    q, k, v = (_randint(-127, 128, 2, 2, s, 32, seed=i) for i, s in enumerate((20, 36, 36)))
    return q, k, v, dict(num_heads=2, scale_value=0.7, input_layout="BNSD_BSND",
                         deq_scale1=golden_fia.encode_deq_scale(7.3e-5), quant_scale1=torch.tensor([127.0]),
                         deq_scale2=golden_fia.encode_deq_scale(1 / 127), atten_mask=CAUSAL_2048, sparse_mode=2)


def _fp16_in_int8_out_per_channel():
    q, k, v = _randn(2, 30, 64, dtype=F16, seed=1), _randn(2, 30, 64, dtype=F16, seed=2), \
        _randn(2, 30, 64, dtype=F16, seed=3)
    return q, k, v, dict(num_heads=2, scale_value=32 ** -0.5, quant_scale2=torch.rand(
        1, 1, 64, generator=torch.Generator().manual_seed(4)) * 40 + 20, quant_offset2=torch.full((1, 1, 64), 2.0))


def _antiquant_per_token_decode():
    b, s = 2, 21
    scale = torch.rand(1, b, s, generator=torch.Generator().manual_seed(5)) * 0.02 + 0.005
    return _randn(b, 1, 4, 32, dtype=F16, seed=1), _randint(-127, 128, b, s, 2, 32, seed=2), \
        _randint(-127, 128, b, s, 2, 32, seed=3), dict(
            num_heads=4, num_key_value_heads=2, scale_value=32 ** -0.5, input_layout="BSND",
            key_antiquant_scale=scale, value_antiquant_scale=scale * 2, key_antiquant_offset=_randn(1, b, s, seed=6),
            value_antiquant_offset=_randn(1, b, s, seed=7), key_antiquant_mode=1, value_antiquant_mode=1)


def _int4_decode():
    k4, v4 = (_randint(-8, 8, 2, 9, 64, dtype=torch.int64, seed=s) for s in (1, 2))
    return _randn(2, 1, 128, dtype=BF16, seed=3), golden_fia.pack_int4(k4), golden_fia.pack_int4(v4), dict(
        num_heads=2, num_key_value_heads=1, scale_value=0.125, key_antiquant_scale=torch.full((1, 1, 1, 64), 0.1,
                                                                                             dtype=BF16),
        value_antiquant_scale=torch.rand(1, 2, 9, generator=torch.Generator().manual_seed(4)) * 0.2 + 0.05,
        key_antiquant_mode=0, value_antiquant_mode=1)


def _left_padding():
    q, k, v = _randn(2, 12, 32, dtype=F16, seed=1), _randn(2, 20, 32, dtype=F16, seed=2), \
        _randn(2, 20, 32, dtype=F16, seed=3)
    return q, k, v, dict(num_heads=2, scale_value=0.25, actual_seq_lengths=[7, 10], actual_seq_lengths_kv=[13, 16],
                         query_padding_size=torch.tensor([1]), kv_padding_size=torch.tensor([2]),
                         atten_mask=CAUSAL_2048, sparse_mode=3)


def _shared_prefix():
    q, k, v = _randn(2, 2, 18, 16, dtype=F16, seed=1), _randn(2, 2, 10, 16, dtype=F16, seed=2), \
        _randn(2, 2, 10, 16, dtype=F16, seed=3)
    return q, k, v, dict(num_heads=2, scale_value=0.25, input_layout="BNSD",
                         key_shared_prefix=_randn(1, 2, 9, 16, dtype=F16, seed=4),
                         value_shared_prefix=_randn(1, 2, 9, 16, dtype=F16, seed=5), actual_shared_prefix_len=[7],
                         actual_seq_lengths_kv=[10, 6], atten_mask=CAUSAL_2048, sparse_mode=3)


def _paged_prefill_long():
    cache = PagedKVCache(8, 128, num_kv_heads=1, head_dim=16, layout="BnBsH")
    seqs = [cache.new_sequence() for _ in range(2)]
    for i, (s, t) in enumerate(zip(seqs, (300, 90))):
        cache.append(s, _randn(t, 1, 16, seed=i), _randn(t, 1, 16, seed=10 + i))
    return _randn(2, 48, 2, 16, seed=3), cache.key_cache, cache.value_cache, dict(
        cache.attention_kwargs(seqs), num_heads=2, num_key_value_heads=1, scale_value=0.25, input_layout="BSND",
        atten_mask=CAUSAL_2048, sparse_mode=3, actual_seq_lengths=[48, 40])


def _int8_cache_decode():
    cache = PagedKVCache(8, 16, num_kv_heads=2, head_dim=32, dtype=F16, quant="int8")
    seqs = [cache.new_sequence() for _ in range(2)]
    for i, (s, t) in enumerate(zip(seqs, (50, 17))):
        cache.append(s, _randn(t, 2, 32, seed=i), _randn(t, 2, 32, seed=10 + i))
    return _randn(2, 4, 1, 32, dtype=F16, seed=3), cache.key_cache, cache.value_cache, dict(
        cache.attention_kwargs(seqs), num_heads=4, num_key_value_heads=2, scale_value=32 ** -0.5, input_layout="BNSD")


def _value_head_dim_prefill():
    q, k, v = _randn(2, 4, 24, 48, dtype=F16, seed=1), _randn(2, 2, 40, 48, dtype=F16, seed=2), \
        _randn(2, 2, 40, 32, dtype=F16, seed=3)
    return q, k, v, dict(num_heads=4, num_key_value_heads=2, scale_value=48 ** -0.5, input_layout="BNSD",
                         atten_mask=CAUSAL_2048, sparse_mode=3, actual_seq_lengths_kv=[40, 29])


def _nz_cache_decode():
    cache = PagedKVCache(8, 16, num_kv_heads=2, head_dim=64, value_head_dim=32, dtype=F16, layout="NZ",
                         quant="int8")
    seqs = [cache.new_sequence() for _ in range(2)]
    for i, (s, t) in enumerate(zip(seqs, (50, 17))):
        cache.append(s, _randn(t, 2, 64, seed=i), _randn(t, 2, 32, seed=10 + i))
    return _randn(2, 1, 4, 64, dtype=F16, seed=3), cache.key_cache, cache.value_cache, dict(
        cache.attention_kwargs(seqs), num_heads=4, num_key_value_heads=2, scale_value=0.125, input_layout="BSND")


def _gqa_rows_causal():
    q, k, v = _randn(2, 4, 8, 32, dtype=F16, seed=1), _randn(2, 90, 2, 32, dtype=F16, seed=2), \
        _randn(2, 90, 2, 32, dtype=F16, seed=3)
    return q, k, v, dict(num_heads=8, num_key_value_heads=2, scale_value=32 ** -0.5, input_layout="BSND",
                         atten_mask=CAUSAL_2048, sparse_mode=3, actual_seq_lengths=[4, 3],
                         actual_seq_lengths_kv=[90, 41])


CASES = [
    ("aclnn", "BSH prefill fp16, GQA 4, mask + pre/next, actual lengths", _prefill_mask_gqa),
    ("aclnn", "BNSD decode bf16, paged BnNBsD, (B, KV_S) mask, pse", _decode_paged_mask_pse),
    ("python", "TND fp32, sparse_mode 3, GQA", _tnd_causal),
    ("aclnn", "BNSD decode fp16, tensor list of 3 lengths", _tensor_list_decode),
    ("aclnn", "BNSD_BSND int8 Q/K/V -> fp16, UINT64 deq scales, sparse_mode 2", _int8_in_fp16_out),
    ("aclnn", "BSH fp16 -> int8 output, per-channel scale + offset", _fp16_in_int8_out_per_channel),
    ("aclnn", "BSND decode fp16, int8 KV, per-token antiquant with offsets", _antiquant_per_token_decode),
    ("python", "BSH decode bf16, int4 KV, key per-channel + value per-token", _int4_decode),
    ("aclnn", "BSH prefill fp16, query + KV left padding, sparse_mode 3", _left_padding),
    ("aclnn", "BNSD prefill fp16, shared prefix, sparse_mode 3", _shared_prefix),
    ("python", "BSND prefill fp32 (48 rows), paged BnBsH, sparse_mode 3", _paged_prefill_long),
    ("python", "BNSD decode fp16, PagedKVCache int8 (page-managed scales)", _int8_cache_decode),
    ("aclnn", "BNSD prefill fp16, K 48 / V 32 head dims, sparse_mode 3", _value_head_dim_prefill),
    ("python", "BSND decode fp16, NZ int8 PagedKVCache, K 64 / V 32", _nz_cache_decode),
    ("aclnn", "BSND fp16, 4 query rows, GQA 4, sparse_mode 3, actual lengths", _gqa_rows_causal),
]
# cases the Triton decode kernels serve (bf16 ones on CUDA only: Triton's CPU interpreter has no bf16)
TRITON_CASES = {_decode_paged_mask_pse: BF16, _antiquant_per_token_decode: F16, _int4_decode: BF16,
                _int8_cache_decode: F16, _gqa_rows_causal: F16}
_OPERATOR = {"aclnn": "fused_infer_attention_score_v2", "python": "attnops.fused_infer_attention"}


def _backends(make) -> tuple[str, ...]:
    dtype = TRITON_CASES.get(make)
    if dtype is None or (dtype == BF16 and not triton_runs_on_cuda()):
        return ("reference",)
    return ("reference", "triton")


def cases() -> list[CheckCase]:
    return [CheckCase(_OPERATOR[via], name, _case(via, make), _backends(make)) for via, name, make in CASES]
