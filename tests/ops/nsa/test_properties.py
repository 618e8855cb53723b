"""Hypothesis property tests: random small selected-attention and compression configurations vs the golden."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .nsa_helpers import check_compress, check_selected, cum, randn

SETTINGS = settings(max_examples=20, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
DTYPES = st.sampled_from([torch.float16, torch.bfloat16, torch.float32])


@st.composite
def selected_configs(draw):
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    count = draw(st.integers(1, 4))
    batches = draw(st.integers(1, 3))
    n2 = draw(st.sampled_from([1, 2]))
    g = draw(st.sampled_from([1, 2, 4]))
    d = draw(st.sampled_from([4, 8, 16]))
    dv = draw(st.sampled_from([4, 8]))
    kv_lens = [bs * draw(st.integers(count, count + 3)) for _ in range(batches)]
    q_lens = [draw(st.integers(0, 9)) for _ in range(batches)]
    causal = draw(st.booleans())
    distinct = draw(st.booleans())
    rows = []
    for sq, skv in zip(q_lens, kv_lens):
        nblk = skv // bs
        for _ in range(sq * n2):
            if distinct:
                rows.append(draw(st.permutations(range(nblk)))[:count])
            else:
                rows.append([draw(st.integers(0, nblk - 1)) for _ in range(count)])
    topk = torch.tensor(rows, dtype=torch.int32).reshape(sum(q_lens), n2, count)
    return dict(bs=bs, q_lens=q_lens, kv_lens=kv_lens, n1=n2 * g, n2=n2, d=d, dv=dv, causal=causal, topk=topk,
                dtype=draw(DTYPES), seed=draw(st.integers(0, 1000)), scale=draw(st.sampled_from([None, 0.3, 1.0])))


@SETTINGS
@given(selected_configs())
def test_selected_property(cfg):
    q = randn(sum(cfg["q_lens"]), cfg["n1"], cfg["d"], dtype=cfg["dtype"], seed=cfg["seed"])
    k = randn(sum(cfg["kv_lens"]), cfg["n2"], cfg["d"], dtype=cfg["dtype"], seed=cfg["seed"] + 1)
    v = randn(sum(cfg["kv_lens"]), cfg["n2"], cfg["dv"], dtype=cfg["dtype"], seed=cfg["seed"] + 2)
    check_selected(q, k, v, cfg["topk"], block=cfg["bs"], q_lens=cfg["q_lens"], kv_lens=cfg["kv_lens"],
                   causal=cfg["causal"], scale=cfg["scale"], backward=sum(cfg["q_lens"]) > 0)


@st.composite
def compress_configs(draw):
    block = draw(st.integers(1, 12))
    stride = draw(st.integers(1, block))
    lens = [draw(st.integers(0, 40)) for _ in range(draw(st.integers(1, 4)))]
    return dict(block=block, stride=stride, lens=lens, n=draw(st.integers(1, 3)), d=draw(st.sampled_from([1, 5, 16])),
                dtype=draw(DTYPES), seed=draw(st.integers(0, 1000)),
                leading_zero=draw(st.booleans()))


@SETTINGS
@given(compress_configs())
def test_compress_property(cfg):
    lens = cfg["lens"]
    if sum(lens) == 0:
        lens = lens + [1]
    x = randn(sum(lens), cfg["n"], cfg["d"], dtype=cfg["dtype"], seed=cfg["seed"])
    w = randn(cfg["block"], cfg["n"], dtype=cfg["dtype"], seed=cfg["seed"] + 1)
    act = ([0] if cfg["leading_zero"] else []) + cum(lens)
    # fp32 weight_grad: known package bug, pinned by test_compress.py::test_compress_weight_grad_fp32_accumulation
    check_compress(x, w, cfg["block"], cfg["stride"], act)
