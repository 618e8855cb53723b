"""Pythonic FusedInferAttention: flash-attn style ``causal``, every tensor on the query's device, missing masks
refused, and ``torch.autocast`` (float inputs cast to the autocast dtype as SDPA; int8 inputs left alone)."""
import pytest
import torch

import attnops
from attnops.testing.compare import assert_close_to_golden, fia_reduction
from tests.ops.fused_infer_attention.fia_helpers import TRIU2048, golden, make_inputs


def _bottom_right_mask(sq: int, skv: int) -> torch.Tensor:
    """flash-attn's causal: query row i sees keys j <= i + skv - sq (True = masked)."""
    i, j = torch.arange(sq)[:, None], torch.arange(skv)[None, :]
    return j > i + skv - sq


@pytest.mark.parametrize("sq,skv", [(5, 5), (4, 9), (1, 7)])
def test_causal_matches_bottom_right_golden(sq, skv):
    q, k, v = make_inputs("BNSD", b=2, n=2, sq=sq, skv=skv, dtype=torch.float16, seed=3)
    out = attnops.fused_infer_attention(q, k, v, causal=True, scale=0.3)
    kw = dict(num_heads=2, input_layout="BNSD", scale_value=0.3)
    mask = None if sq == 1 else _bottom_right_mask(sq, skv)  # Q_S = 1: the mask is (B, KV_S); nothing masked
    expect = golden(q, k, v, atten_mask=mask, **kw).out
    base = golden(q, k, v, atten_mask=mask, dtype=torch.float16, **kw).out
    assert_close_to_golden("attention_out", out, expect, base, reduction=fia_reduction(q, k, **kw))
    if sq > 1:  # really masked: differs from full attention
        assert not torch.allclose(out.double(), golden(q, k, v, **kw).out, atol=1e-2)


def test_causal_equals_sparse_mode_3_with_per_batch_lengths():
    q, k, v = make_inputs("BSND", b=2, n=2, sq=6, skv=9, dtype=torch.float32, seed=5)
    lens = dict(actual_seq_lengths=[6, 3], actual_seq_lengths_kv=[9, 4])
    a = attnops.fused_infer_attention(q, k, v, layout="BSND", causal=True, **lens)
    b = attnops.fused_infer_attention(q, k, v, layout="BSND", sparse_mode=3, atten_mask=TRIU2048, **lens)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kw", [dict(sparse_mode=3, atten_mask=TRIU2048), dict(atten_mask=TRIU2048),
                                dict(pre_tokens=3), dict(next_tokens=0), dict(sparse_mode=1)])
def test_causal_with_cann_mask_options_raises(kw):
    q, k, v = make_inputs("BNSD", b=1, n=1, sq=4, skv=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="causal: expected causal/window_size alone"):
        attnops.fused_infer_attention(q, k, v, causal=True, **kw)


def test_causal_must_be_bool():
    q, k, v = make_inputs("BNSD", b=1, n=1, sq=4, skv=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="causal: expected a bool"):
        attnops.fused_infer_attention(q, k, v, causal=1)


@pytest.mark.parametrize("mode", [2, 3, 4])
def test_sparse_mode_without_mask_raises_naming_the_mask(mode):
    q, k, v = make_inputs("BNSD", b=1, n=1, sq=4, skv=4, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"atten_mask: expected a mask for sparse_mode .*torch.ones\(2048, 2048"):
        attnops.fused_infer_attention(q, k, v, sparse_mode=mode)


@pytest.mark.parametrize("name", ["key", "value", "atten_mask", "pse_shift", "key_list"])
def test_tensor_on_another_device_raises(name):
    q, k, v = make_inputs("BNSD", b=2, n=2, sq=3, skv=5, dtype=torch.float32)
    kw = dict(key=k, value=v)
    if name == "atten_mask":
        kw["atten_mask"] = torch.zeros(3, 5, dtype=torch.bool).to("meta")
    elif name == "pse_shift":
        kw["pse_shift"] = torch.zeros(2, 2, 3, 5).to("meta")
    elif name == "key_list":
        kw["key"], kw["value"] = [k[:1], k[1:].to("meta")], [v[:1], v[1:]]
        name = r"key\[1\]"
    else:
        kw[name] = kw[name].to("meta")
    with pytest.raises(ValueError, match=rf"{name}: expected a tensor on cpu \(the device of query\)"):
        attnops.fused_infer_attention(q, kw.pop("key"), kw.pop("value"), **kw)


@pytest.mark.parametrize("name", ["query", "key", "value", "atten_mask"])
def test_numpy_array_is_named_not_a_tensor(name):
    q, k, v = make_inputs("BNSD", b=1, n=2, sq=3, skv=5, dtype=torch.float32)
    kw = dict(query=q, key=k, value=v, atten_mask=torch.zeros(3, 5, dtype=torch.bool))
    kw[name] = kw[name].numpy()
    with pytest.raises(TypeError, match=rf"{name}: expected a torch.Tensor, got numpy.ndarray\. convert it"):
        attnops.fused_infer_attention(kw.pop("query"), kw.pop("key"), kw.pop("value"), **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_casts_float_inputs(dtype):
    q, k, v = make_inputs("BNSD", b=1, n=2, sq=4, skv=6, dtype=torch.float32, seed=8)
    pse = torch.randn(1, 2, 4, 6, generator=torch.Generator().manual_seed(9))
    with torch.autocast("cpu", dtype=dtype):
        out = attnops.fused_infer_attention(q.to(dtype), k, v, pse_shift=pse, scale=0.5)
    assert out.dtype == dtype
    lowp = [t.to(dtype) for t in (q, k, v, pse)]
    kw = dict(num_heads=2, input_layout="BNSD", scale_value=0.5, pse_shift=lowp[3])
    assert_close_to_golden("attention_out", out, golden(*lowp[:3], **kw).out,
                           golden(*lowp[:3], dtype=dtype, **kw).out, reduction=fia_reduction(q, k, **kw))


def test_autocast_leaves_int8_key_value_alone():
    q, k, v = make_inputs("BNSD", b=1, n=2, sq=1, skv=6, dtype=torch.float16, seed=2)
    k8, v8 = (t.mul(20).round().clamp(-127, 127).to(torch.int8) for t in (k, v))
    aq = dict(antiquant_scale=torch.full((2, 2, 16), 0.05, dtype=torch.float16),
              antiquant_offset=torch.zeros(2, 2, 16, dtype=torch.float16))
    plain = attnops.fused_infer_attention(q, k8, v8, **aq)
    with torch.autocast("cpu", dtype=torch.float16):
        auto = attnops.fused_infer_attention(q, k8, v8, **aq)
    torch.testing.assert_close(auto, plain, rtol=0, atol=0)


def test_without_autocast_mixed_dtypes_still_raise():
    q, k, v = make_inputs("BNSD", b=1, n=1, sq=3, skv=3, dtype=torch.float16)
    with pytest.raises(Exception, match="key"):
        attnops.fused_infer_attention(q, k.float(), v)
