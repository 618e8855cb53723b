"""Hypothesis property tests: random FIA configurations (layouts, GQA, lengths, sparse modes, masks, pse, paged
decode, tensor lists, left padding, prefix) through aclnn and the Pythonic API vs the fp64 golden; and
non-contiguous inputs."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnops import ParamInvalidError
from attnops.testing.golden_fia import encode_deq_scale, pack_int4
from tests.helpers import noncontig, randn
from tests.ops.fused_infer_attention.fia_helpers import (TRIU2048, check_fia, layout_of, make_inputs, rand_mask,
                                                         randint4, randint8, run, to_paged)

LAYOUTS = ["BSH", "BSND", "BNSD", "BNSD_BSND"]


@st.composite
def configs(draw):
    layout = draw(st.sampled_from(LAYOUTS))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    nkv = draw(st.sampled_from([1, 2]))
    n = nkv * draw(st.sampled_from([1, 2, 3]))
    b = draw(st.integers(1, 3))
    sq = draw(st.sampled_from([1, 2, 5, 17, 40])) if layout != "BNSD_BSND" else draw(st.sampled_from([2, 5, 17]))
    skv = draw(st.integers(1, 48))
    d = draw(st.sampled_from([16, 32]))
    seed = draw(st.integers(0, 2 ** 16))
    kw = dict(num_heads=n, num_key_value_heads=nkv, scale_value=draw(st.sampled_from([0.1, 0.25, 1.0])),
              input_layout=layout, softmax_lse_flag=True)
    g = torch.Generator().manual_seed(seed)
    feature = draw(st.sampled_from(["plain", "lengths", "leftpad", "prefix", "pse", "list"]))
    q, k, v = make_inputs(layout, b=b, n=n, nkv=nkv, sq=sq, skv=skv, d=d, dtype=dtype, seed=seed)
    if feature in ("lengths", "leftpad"):
        kw["actual_seq_lengths_kv"] = [int(x) for x in torch.randint(0, skv + 1, (b,), generator=g)]
        if sq > 1:
            kw["actual_seq_lengths"] = [int(x) for x in torch.randint(1, sq + 1, (b,), generator=g)]
        if feature == "leftpad":
            kw["kv_padding_size"] = torch.tensor([draw(st.integers(-1, min(2, skv)))])
            if sq > 1:
                kw["query_padding_size"] = torch.tensor([draw(st.integers(-1, min(2, sq - 1)))])
            qp = max(0, int(kw.get("query_padding_size", torch.tensor([0]))[0]))
            kp = max(0, int(kw["kv_padding_size"][0]))
            kw["actual_seq_lengths_kv"] = [min(x, max(0, skv - kp)) for x in kw["actual_seq_lengths_kv"]]
            if sq > 1:
                kw["actual_seq_lengths"] = [max(1, min(x, sq - qp)) for x in kw["actual_seq_lengths"]]
    plen = 0
    if feature == "prefix":
        plen = draw(st.integers(1, 6))
        _, kp, vp = make_inputs(layout, b=1, n=n, nkv=nkv, sq=plen, skv=plen, d=d, dtype=dtype, seed=seed + 7)
        kw.update(key_shared_prefix=kp, value_shared_prefix=vp,
                  actual_shared_prefix_len=[draw(st.integers(0, plen))])
    if feature == "pse":
        kw["pse_shift"] = randn(draw(st.sampled_from([1, b])), n, sq, skv, dtype=dtype, seed=seed + 3)
    if feature == "list":
        lens = [int(x) for x in torch.randint(1, skv + 1, (b,), generator=g)]
        k4 = randn(b, skv, nkv, d, dtype=dtype, seed=seed + 1)
        v4 = randn(b, skv, nkv, d, dtype=dtype, seed=seed + 2)
        k = [layout_of(k4[i:i + 1, :lens[i]], layout) for i in range(b)]
        v = [layout_of(v4[i:i + 1, :lens[i]], layout) for i in range(b)]
    cols = plen + skv
    if sq == 1:
        if draw(st.booleans()):
            kw["atten_mask"] = rand_mask(b, cols, seed=seed, p=0.3, keep_col0=False)
    else:
        mode = draw(st.sampled_from([0, 1, 2, 3, 4]))
        kw.update(sparse_mode=mode, pre_tokens=draw(st.sampled_from([0, 2, 10, 2147483647])),
                  next_tokens=draw(st.sampled_from([0, 3, 2147483647])), inner_precise=draw(st.sampled_from([0, 2])))
        if mode in (2, 3, 4):
            kw["atten_mask"] = TRIU2048
        elif mode == 1 or draw(st.booleans()):
            kw["atten_mask"] = rand_mask(b, sq, cols, seed=seed, p=0.3, keep_col0=False)
        if mode == 4 and kw["pre_tokens"] + kw["next_tokens"] < 0:
            kw["next_tokens"] = 0
    return q, k, v, kw


SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@SETTINGS
@given(configs())
def test_fia_random_configurations_vs_golden(cfg):
    q, k, v, kw = cfg
    for via in ("aclnn", "api"):
        check_fia(q, k, v, via=via, **kw)


@SETTINGS
@given(st.integers(1, 3), st.integers(1, 70), st.sampled_from([16, 32]), st.sampled_from(["BSH", "BNSD"]),
       st.integers(0, 2 ** 16))
def test_fia_random_paged_decode_vs_golden(b, max_len, bs, cache_layout, seed):
    g = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(0, max_len + 1, (b,), generator=g)]
    n, nkv, d = 4, 2, 16
    q = randn(b, n, 1, d, dtype=torch.float16, seed=seed)
    k = randn(b, nkv, max_len, d, dtype=torch.float16, seed=seed + 1)
    v = randn(b, nkv, max_len, d, dtype=torch.float16, seed=seed + 2)
    kc, bt = to_paged(k, lens, bs, cache_layout=cache_layout, seed=seed)
    vc, _ = to_paged(v, lens, bs, cache_layout=cache_layout, seed=seed)
    for via in ("aclnn", "api"):
        check_fia(q, kc, vc, via=via, block_table=bt, block_size=bs, actual_seq_lengths_kv=lens, num_heads=n,
                  num_key_value_heads=nkv, scale_value=0.25, input_layout="BNSD", softmax_lse_flag=True)


@pytest.mark.parametrize("sq", [1, 5, 20])
def test_fia_non_contiguous_inputs(sq):
    """The Pythonic API takes non-contiguous tensors; aclnn (seed: "不支持非连续的Tensor") either rejects them
    naming the argument or gives the contiguous result."""
    from tests.ops.fused_infer_attention.fia_helpers import run_aclnn
    q, k, v = make_inputs("BNSD", b=2, n=2, sq=sq, skv=9, d=16, dtype=torch.float16)
    m = rand_mask(2, 1, sq, 9, seed=1) if sq > 1 else rand_mask(2, 9, seed=1)
    kw = dict(num_heads=2, scale_value=0.25, input_layout="BNSD", atten_mask=m, sparse_mode=1,
              softmax_lse_flag=True)
    ref = run("api", q, k, v, **kw)
    nq, nk, nv, nm = noncontig(q), noncontig(k, "strided"), noncontig(v), noncontig(m)
    got = run("api", nq, nk, nv, **{**kw, "atten_mask": nm})
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    try:
        got = run_aclnn(nq, nk, nv, **{**kw, "atten_mask": nm})
    except ParamInvalidError as e:
        assert str(e).split(":")[0] in ("query", "key", "value", "atten_mask", "key[0]", "value[0]"), str(e)
    else:
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@st.composite
def quant_configs(draw):
    """Int8 full quant (Q_S > 1) or KV antiquant (int8/int4, every mode) with masks, lengths, paging, prefix."""
    kind = draw(st.sampled_from(["int8", "antiquant", "int4"]))
    seed = draw(st.integers(0, 2 ** 16))
    g = torch.Generator().manual_seed(seed)
    nkv = draw(st.sampled_from([1, 2]))
    n = nkv * draw(st.sampled_from([1, 2]))
    b = draw(st.integers(1, 3))
    skv = draw(st.integers(1, 40))
    layout = draw(st.sampled_from(["BSH", "BSND", "BNSD"]))
    kw = dict(num_heads=n, num_key_value_heads=nkv, scale_value=draw(st.sampled_from([0.1, 0.5])),
              input_layout=layout, softmax_lse_flag=True)
    if draw(st.booleans()):
        kw["actual_seq_lengths_kv"] = [int(x) for x in torch.randint(0, skv + 1, (b,), generator=g)]
    if kind == "int8":
        d, sq = 32, draw(st.sampled_from([2, 9, 20]))
        q = layout_of(randint8(b, sq, n, d, seed=seed), layout)
        k = layout_of(randint8(b, skv, nkv, d, seed=seed + 1), layout)
        v = layout_of(randint8(b, skv, nkv, d, seed=seed + 2), layout)
        kw.update(deq_scale1=encode_deq_scale(draw(st.sampled_from([3e-5, 7.3e-5, 1.5e-4]))),
                  quant_scale1=torch.tensor([draw(st.sampled_from([50.0, 127.0, 300.0]))]),
                  deq_scale2=torch.tensor([1 / 127]))
        if draw(st.booleans()):
            kw["quant_scale2"] = torch.tensor([draw(st.sampled_from([0.5, 2.0]))])
        mode = draw(st.sampled_from([0, 1, 3]))
        kw["sparse_mode"] = mode
        if mode == 3:
            kw["atten_mask"] = TRIU2048
        elif mode == 1:
            kw["atten_mask"] = rand_mask(b, sq, skv, seed=seed, p=0.3)
        if draw(st.booleans()):
            kw["pse_shift"] = randn(1, n, sq, skv, dtype=torch.float16, seed=seed + 3)
        return q, k, v, kw
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    d = 64 if kind == "int4" else 32
    q = layout_of(randn(b, 1, n, d, dtype=dtype, seed=seed), layout)
    if kind == "int4":
        k = pack_int4(layout_of(randint4(b, skv, nkv, d, seed=seed + 1), layout))
        v = pack_int4(layout_of(randint4(b, skv, nkv, d, seed=seed + 2), layout))
        modes = draw(st.sampled_from([(0, 0), (1, 1), (3, 3), (0, 1)]))
    else:
        k = layout_of(randint8(b, skv, nkv, d, seed=seed + 1), layout)
        v = layout_of(randint8(b, skv, nkv, d, seed=seed + 2), layout)
        modes = draw(st.sampled_from([(0, 0), (1, 1), (2, 2), (3, 3)] + ([(0, 1)] if dtype == torch.float16 else [])))
    for name, mode in zip(("key", "value"), modes):
        shape, pdt = {0: ((1, nkv, 1, d), dtype), 1: ((1, b, skv), torch.float32), 2: ((nkv,), dtype),
                      3: ((b, nkv, skv), torch.float32)}[mode]
        kw[f"{name}_antiquant_scale"] = (torch.rand(shape, generator=g) * 0.05 + 0.01).to(pdt)
        if draw(st.booleans()) or modes == (0, 1):
            kw[f"{name}_antiquant_offset"] = torch.randn(shape, generator=g).to(pdt)
    kw["key_antiquant_mode"], kw["value_antiquant_mode"] = modes
    if not modes == (0, 1) and not draw(st.booleans()):  # both offsets or none
        kw.pop("key_antiquant_offset", None)
        kw.pop("value_antiquant_offset", None)
    elif "key_antiquant_offset" in kw or "value_antiquant_offset" in kw:
        for name, mode in zip(("key", "value"), modes):
            if f"{name}_antiquant_offset" not in kw:
                kw[f"{name}_antiquant_offset"] = torch.zeros_like(kw[f"{name}_antiquant_scale"])
    if draw(st.booleans()):
        kw["atten_mask"] = rand_mask(b, skv, seed=seed, p=0.3)
    return q, k, v, kw


@SETTINGS
@given(quant_configs())
def test_fia_random_quant_configurations_vs_golden(cfg):
    q, k, v, kw = cfg
    for via in ("aclnn", "api"):
        check_fia(q, k, v, via=via, **kw)
