"""FlashAttention-3's additions in attnops.flash_attn.fa3 against an fp64 reference of their documented semantics
(tests/flash_attn/fa3_ref.py), by FlashAttention's tolerance rule: ``qv``, a value head dim larger than the
query's, ``attention_chunk``, ``seqused_q/k``, ``window_size`` as a tensor; ``flash_attn_combine``;
``get_scheduler_metadata``; ``torch.ops.flash_attn_3``; and exactly zero dQ/dK for rows that see one key."""
import pytest
import torch

from attnops._core.errors import AclnnError, ParamInvalidError
from attnops.flash_attn import fa3
from attnops.testing.compare import assert_close_to_golden, attention_reductions
from tests.flash_attn.fa3_ref import fa3_ref, fa3_ref_varlen

BF16 = torch.bfloat16


def _randn(*shape, dtype=torch.float32, gen):
    return torch.randn(*shape, generator=gen).to(dtype)


def _check(actual_fn, ref_fn, inputs, *, grads=True, lengths):
    """``actual_fn(*inputs) -> (out, lse)`` against ``ref_fn(*inputs, dtype) -> (out, lse)``: the fp64 golden, the
    baseline in the inputs' dtype; outputs factor 2, gradients factor 3, the LSE within fp32 rounding."""
    q, k, v = inputs[:3]
    red = attention_reductions(q.shape[-1], v.shape[-1], *lengths)
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out, lse = actual_fn(*leaves)
    gold_in = [x.detach().double().requires_grad_() for x in inputs]
    gold, gold_lse = ref_fn(*gold_in, torch.float64)
    base_in = [x.detach().clone().requires_grad_() for x in inputs]
    base, _ = ref_fn(*base_in, q.dtype)
    assert out.shape == gold.shape and out.dtype == q.dtype
    assert_close_to_golden("out", out, gold, base, reduction=red["out"])
    finite = torch.isfinite(gold_lse)
    assert lse.dtype == torch.float32 and torch.equal(torch.isfinite(lse), finite)
    assert_close_to_golden("lse", lse[finite], gold_lse[finite], None, reduction=red["lse"])
    if grads:
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
        for name, a, g, b in zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, dout),
                                 torch.autograd.grad(gold, gold_in, dout.double()),
                                 torch.autograd.grad(base, base_in, dout)):
            assert_close_to_golden(name, a, g, b, factor=3.0, reduction=red[name])


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("causal", [False, True])
def test_qv_adds_qv_dot_v_with_the_joint_default_scale(dtype, causal):
    g = torch.Generator().manual_seed(0)
    q, k, v, qv = (_randn(2, s, h, d, dtype=dtype, gen=g) for s, h, d in ((9, 4, 8), (13, 2, 8), (13, 2, 24),
                                                                           (9, 4, 24)))
    _check(lambda q, k, v, qv: fa3.flash_attn_func(q, k, v, qv=qv, causal=causal, return_attn_probs=True),
           lambda q, k, v, qv, dt: fa3_ref(q, k, v, qv=qv, causal=causal, dtype=dt), (q, k, v, qv), lengths=(9, 13))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_value_head_dim_larger_than_the_query_s(dtype):
    g = torch.Generator().manual_seed(1)
    q, k, v = _randn(2, 7, 4, 8, dtype=dtype, gen=g), _randn(2, 11, 1, 8, dtype=dtype, gen=g), \
        _randn(2, 11, 1, 32, dtype=dtype, gen=g)
    _check(lambda q, k, v: fa3.flash_attn_func(q, k, v, window_size=(3, 2), return_attn_probs=True),
           lambda q, k, v, dt: fa3_ref(q, k, v, window_size=(3, 2), dtype=dt), (q, k, v), lengths=(7, 11))


@pytest.mark.parametrize("sq,sk,chunk,causal,window", [
    (12, 12, 4, True, (-1, -1)),
    (7, 19, 5, False, (-1, -1)),  # rows start mid-chunk; the chunk also bounds the right side
    (19, 7, 3, True, (-1, -1)),  # rows before chunk 0 see no key
    (16, 23, 6, False, (4, 2)),  # chunk and window together
    (5, 9, 30, False, (-1, -1)),  # one chunk: plain attention
])
def test_attention_chunk_dense(sq, sk, chunk, causal, window):
    g = torch.Generator().manual_seed(2)
    q, k, v = (_randn(2, s, h, 16, gen=g) for s, h in ((sq, 4), (sk, 2), (sk, 2)))
    options = dict(causal=causal, window_size=window, attention_chunk=chunk)
    _check(lambda q, k, v: fa3.flash_attn_func(q, k, v, return_attn_probs=True, **options),
           lambda q, k, v, dt: fa3_ref(q, k, v, dtype=dt, **options), (q, k, v), lengths=(sq, sk))


@pytest.mark.parametrize("chunk,causal,window,dtype", [
    (0, True, (-1, -1), torch.float32),
    (0, False, (3, 1), BF16),
    (4, True, (-1, -1), torch.float32),
    (3, False, (2, 5), BF16),
])
def test_varlen_seqused_and_chunk(chunk, causal, window, dtype):
    g = torch.Generator().manual_seed(3)
    cu_q, cu_k = [0, 6, 6, 15, 19], [0, 9, 12, 12, 25]
    used_q, used_k = [4, 0, 9, 2], [7, 3, 0, 10]
    q, k, v = (_randn(n, h, 16, dtype=dtype, gen=g) for n, h in ((19, 4), (25, 2), (25, 2)))
    options = dict(causal=causal, window_size=window, attention_chunk=chunk)
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731

    def actual(q, k, v):
        return fa3.flash_attn_varlen_func(q, k, v, as_tensor(cu_q), as_tensor(cu_k), 9, 13, as_tensor(used_q),
                                          as_tensor(used_k), return_attn_probs=True, **options)

    _check(actual, lambda q, k, v, dt: fa3_ref_varlen(q, k, v, cu_q, cu_k, used_q, used_k, dtype=dt, **options),
           (q, k, v), lengths=(9, 13))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, _ = actual(*leaves)
    dk = torch.autograd.grad(out.square().sum(), leaves)[1]
    unused_k = torch.ones(25, dtype=torch.bool)
    for b, n in enumerate(used_k):
        unused_k[cu_k[b]:cu_k[b] + n] = False
    assert torch.equal(dk[unused_k], torch.zeros_like(dk[unused_k]))  # keys past seqused_k are not seen


def test_window_size_as_a_tensor_and_the_refused_options():
    q = torch.randn(1, 8, 2, 16)
    assert torch.equal(fa3.flash_attn_func(q, q, q, window_size=torch.tensor([2, 1])),
                       fa3.flash_attn_func(q, q, q, window_size=(2, 1)))
    with pytest.raises(ParamInvalidError, match="q_descale"):
        fa3.flash_attn_func(q, q, q, q_descale=torch.ones(1, 2))
    with pytest.raises(ParamInvalidError, match="attention_chunk"):
        fa3.flash_attn_func(q, q, q, attention_chunk=-1)
    cu, too_long = torch.tensor([0, 8], dtype=torch.int32), torch.tensor([9], dtype=torch.int32)
    with pytest.raises(ParamInvalidError, match="seqused_k"):
        fa3.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 8, 8, seqused_k=too_long)
    with pytest.raises(AclnnError, match="cu_seqlens_k"):
        fa3.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu[:1], 8, 8, seqused_k=cu[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
def test_one_visible_key_gives_exactly_zero_dq_and_dk(dtype):
    """P == 1 on a row with one key: dS = P * (dP - rowsum(P * dP)) is exactly 0 (FA3 tests this without
    tolerance); also on a window of width one, and on the first row of a causal square."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (_randn(3, s, 4, 32, dtype=dtype, gen=g).requires_grad_() for s in (5, 1, 1))
    dq, dk, _ = torch.autograd.grad(fa3.flash_attn_func(q, k, v), (q, k, v), torch.randn(3, 5, 4, 32).to(dtype))
    assert not dq.any() and not dk.any()
    q, k, v = (_randn(2, 9, 2, 32, dtype=dtype, gen=g).requires_grad_() for _ in range(3))
    dq, dk, _ = torch.autograd.grad(fa3.flash_attn_func(q, k, v, window_size=(0, 0)), (q, k, v),
                                    torch.randn(2, 9, 2, 32).to(dtype))
    assert not dq.any() and not dk.any()
    dq = torch.autograd.grad(fa3.flash_attn_func(q, k, v, causal=True), q, torch.randn(2, 9, 2, 32).to(dtype))[0]
    assert not dq[:, 0].any() and dq[:, 1:].abs().amin(-1).gt(0).any()


def test_flash_attn_combine_matches_the_logsumexp_formula():
    g = torch.Generator().manual_seed(6)
    out_partial = torch.randn(4, 2, 5, 3, 40, generator=g).transpose(2, 3).contiguous().transpose(2, 3)
    lse_partial = torch.randn(4, 2, 5, 3, generator=g) * 3
    lse_partial[2:, 0] = float("-inf")  # splits that saw no key
    lse_partial[:, 1, 0] = float("-inf")  # a row that saw none at all
    lse64 = torch.logsumexp(lse_partial.double(), 0)
    weights = torch.exp(lse_partial.double() - lse64).nan_to_num(0.0)
    out64 = (weights.unsqueeze(-1) * out_partial.double()).sum(0)
    out, lse = fa3.flash_attn_combine(out_partial, lse_partial)
    assert out.dtype == torch.float32 and lse.shape == (2, 5, 3) and lse.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(lse.double(), lse64, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[1, 0], torch.zeros_like(out[1, 0])) and lse[1, 0].eq(float("-inf")).all()
    assert_close_to_golden("out", out, out64, None, reduction=4)
    target = torch.empty(2, 5, 3, 40, dtype=BF16)
    out16, _ = fa3.flash_attn_combine(out_partial, lse_partial, out=target, out_dtype=BF16)
    assert out16 is target and torch.equal(out16, out.to(BF16))
    with pytest.raises(ParamInvalidError, match="lse_partial"):
        fa3.flash_attn_combine(out_partial, lse_partial[:, :, :4])


def test_scheduler_metadata_is_accepted_back():
    lens = torch.tensor([3, 5], dtype=torch.int32)
    meta = fa3.get_scheduler_metadata(2, 1, 16, 4, 2, 8, lens, causal=True)
    q, cache = torch.randn(2, 1, 4, 8), torch.randn(2, 16, 2, 8)
    assert torch.equal(fa3.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, scheduler_metadata=meta),
                       fa3.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens))
    with pytest.raises(ParamInvalidError, match="num_heads_kv"):
        fa3.get_scheduler_metadata(2, 1, 16, 4, 3, 8, lens)
