"""The ATB names of ``attnops.torch_npu`` (SelfAttention over packed K/V, PagedAttention over paged caches) and
``npu_scatter_nd_update(_)``, against a plain fp64 golden written here from ATB's semantics: each query row of a
sequence attends to the keys its mask keeps, ``softmax(scale * q k^T) v`` per head (GQA: head ``h`` reads KV head
``h // (N / N_kv)``), a row that keeps nothing is 0."""
from __future__ import annotations

import pytest
import torch

from attnops import ParamInvalidError, torch_npu
from attnops.testing.compare import assert_close_to_golden
from tests.helpers import randn

F16, F64 = torch.float16, torch.float64
N, KVN, D, DV, BLOCK = 4, 2, 32, 16, 16


def attend(q, k, v, keep, scale, dtype=F64):
    """``q [S, N, D]``, ``k [L, N_kv, D]``, ``v [L, N_kv, Dv]``, ``keep [S, L]`` bool -> ``[S, N, Dv]``."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.to(dtype), k.to(dtype).repeat_interleave(group, 1), v.to(dtype).repeat_interleave(group, 1)
    scores = torch.einsum("snd,lnd->nsl", q, k) * scale
    scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return torch.einsum("nsl,lnd->snd", probs, v)


def causal_end(s, length):
    """Row ``i`` of the last ``s`` tokens of a ``length``-token sequence keeps keys ``j <= length - s + i``."""
    return torch.arange(length)[None, :] <= torch.arange(s)[:, None] + length - s


def golden_packed(q, k, v, lens, keeps, scale):
    """Per packed sequence, in fp64 and in fp16 (the baseline)."""
    starts = [sum(lens[:b]) for b in range(len(lens))]
    return [torch.cat([attend(q[s:s + n], k[s:s + n], v[s:s + n], keep, scale, dt)
                       for s, n, keep in zip(starts, lens, keeps)]) for dt in (F64, F16)]


def check(out, golden, reduction):
    """``reduction``: the scores over D, then P V over the longest sequence's keys."""
    assert_close_to_golden("out", out, golden[0], golden[1], reduction=reduction)


# --- SelfAttention over packed K/V --------------------------------------------------------------------------------

LENS = [7, 19, 0, 12]
T = sum(LENS)


def packed_inputs():
    return randn(T, N, D, dtype=F16, seed=1), randn(T, KVN, D, dtype=F16, seed=2), randn(T, KVN, DV, dtype=F16, seed=3)


@pytest.mark.parametrize("kernel_type", [0, 2])
def test_flash_attention_unpad_v2_is_full_attention(kernel_type):
    q, k, v = packed_inputs()
    out = torch.empty(T, N, DV, dtype=F16)
    torch_npu._npu_flash_attention_unpad_v2(q, k, v, torch.tensor(LENS, dtype=torch.int32), 0.2, N, KVN,
                                           kernel_type=kernel_type, out=out)
    check(out, golden_packed(q, k, v, LENS, [torch.ones(n, n, dtype=torch.bool) for n in LENS], 0.2), D + max(LENS))


@pytest.mark.parametrize("masked", [float("-inf"), 1.0])  # vllm-ascend: fp16 masks -inf, bf16 masks 1
def test_flash_attention_explicit_mask_top_left_corner(masked):
    q, k, v = packed_inputs()
    keep = torch.rand(24, 24, generator=torch.Generator().manual_seed(4)) > 0.4
    mask = torch.zeros(24, 24, dtype=F16).masked_fill(~keep, masked)
    out = torch.empty(T, N, DV, dtype=F16)
    torch_npu._npu_flash_attention(q, k, v, mask, torch.tensor(LENS, dtype=torch.int32), 0.2, N, KVN, out)
    check(out, golden_packed(q, k, v, LENS, [keep[:n, :n] for n in LENS], 0.2), D + max(LENS))


def test_flash_attention_v3_is_causal_whatever_the_compressed_mask_holds():
    q, k, v = packed_inputs()
    out = torch.empty(T, N, DV, dtype=F16)
    torch_npu._npu_flash_attention_v3(q, k, v, torch.zeros(128, 128, dtype=F16), torch.tensor(LENS), 0.2, N, KVN,
                                      out=out)
    check(out, golden_packed(q, k, v, LENS, [causal_end(n, n) for n in LENS], 0.2), D + max(LENS))


def test_self_attention_validation():
    q, k, v = packed_inputs()
    out, lens = torch.empty(T, N, DV, dtype=F16), torch.tensor(LENS)
    with pytest.raises(ParamInvalidError, match="kernel_type: expected 0 .* or 2"):
        torch_npu._npu_flash_attention_unpad_v2(q, k, v, lens, 0.2, N, KVN, kernel_type=1, out=out)
    with pytest.raises(ParamInvalidError, match="mask_type: expected 3"):
        torch_npu._npu_flash_attention_v3(q, k, v, torch.ones(128, 128), lens, 0.2, N, KVN, mask_type=1, out=out)
    with pytest.raises(ParamInvalidError, match="mask: expected .*one mask for every sequence"):
        torch_npu._npu_flash_attention(q, k, v, torch.ones(4, 24, 24), lens, 0.2, N, KVN, out)
    with pytest.raises(ParamInvalidError, match=r"mask: expected .*max_seq_len >= the longest sequence \(19\)"):
        torch_npu._npu_flash_attention(q, k, v, torch.ones(16, 16), lens, 0.2, N, KVN, out)
    with pytest.raises(ParamInvalidError, match="seq_len: expected non-negative per-sequence lengths summing to T"):
        torch_npu._npu_flash_attention(q, k, v, torch.ones(24, 24), torch.tensor([7, 19]), 0.2, N, KVN, out)


# --- PagedAttention and the prefix-cache prefill over paged caches ------------------------------------------------

CTX, NEW = [37, 5, 16], [4, 5, 1]  # cached tokens per sequence (the new ones last) and new query tokens
TABLE = torch.tensor([[6, 1, 9], [3, 0, 0], [2, 7, 0]], dtype=torch.int32)


def paged(per_seq, width):
    """Caches ``[12, BLOCK, heads, width]`` holding sequence ``b``'s token ``t`` at block ``TABLE[b, t // BLOCK]``."""
    cache = randn(12, BLOCK, per_seq[0].shape[1], width, dtype=per_seq[0].dtype, seed=99)
    for b, x in enumerate(per_seq):
        for t in range(x.shape[0]):
            cache[TABLE[b, t // BLOCK], t % BLOCK] = x[t]
    return cache


def paged_inputs(dv=DV):
    ks = [randn(n, KVN, D, dtype=F16, seed=10 + b) for b, n in enumerate(CTX)]
    vs = [randn(n, KVN, dv, dtype=F16, seed=20 + b) for b, n in enumerate(CTX)]
    q = randn(sum(NEW), N, D, dtype=F16, seed=5)
    return q, ks, vs, paged(ks, D), paged(vs, dv)


def golden_paged(q, ks, vs, keeps, scale):
    starts = [sum(NEW[:b]) for b in range(len(NEW))]
    return [torch.cat([attend(q[s:s + n], k, v, keep, scale, dt) for s, n, k, v, keep in zip(starts, NEW, ks, vs,
                                                                                              keeps)])
            for dt in (F64, F16)]


@pytest.mark.parametrize("flat", [False, True], ids=["[T, N, D]", "[T, N*D] (sglang)"])
def test_flash_attention_qlens_causal_after_the_prefix(flat):
    q, ks, vs, kc, vc = paged_inputs()
    out = torch.empty(sum(NEW), N * DV if flat else N, *(() if flat else (DV,)), dtype=F16)
    torch_npu._npu_flash_attention_qlens(q.flatten(1) if flat else q, kc, vc, TABLE, torch.ones(128, 128, dtype=F16),
                                         torch.tensor(NEW, dtype=torch.int32), torch.tensor(CTX, dtype=torch.int32),
                                         KVN, N, 0.2, out)
    check(out.view(-1, N, DV), golden_paged(q, ks, vs, [causal_end(n, c) for n, c in zip(NEW, CTX)], 0.2), D + max(CTX))


def test_paged_attention_splitfuse_v2_is_the_same_causal_prefill():
    q, ks, vs, kc, vc = paged_inputs()
    out = torch.empty(sum(NEW), N, DV, dtype=F16)
    torch_npu._npu_paged_attention_splitfuse_v2(q, kc, vc, TABLE, torch.tensor(CTX), torch.ones(128, 128),
                                                torch.tensor(NEW), KVN, N, 0.2, out=out)
    check(out, golden_paged(q, ks, vs, [causal_end(n, c) for n, c in zip(NEW, CTX)], 0.2), D + max(CTX))
    with pytest.raises(ParamInvalidError, match="mask_type: expected 5"):
        torch_npu._npu_paged_attention_splitfuse_v2(q, kc, vc, TABLE, torch.tensor(CTX), torch.ones(128, 128),
                                                    torch.tensor(NEW), KVN, N, 0.2, mask_type=3, out=out)


def test_paged_attention_splitfuse_reads_one_mask_row_per_token():
    q, ks, vs, kc, vc = paged_inputs()
    keep = torch.rand(sum(NEW), 40, generator=torch.Generator().manual_seed(6)) > 0.3
    mask = torch.zeros(sum(NEW), 40, dtype=F16).masked_fill(~keep, float("-inf"))
    out = torch.empty(sum(NEW), N, DV, dtype=F16)
    torch_npu._npu_paged_attention_splitfuse(q, kc, vc, TABLE, torch.tensor(CTX), mask, torch.tensor(NEW), KVN, N,
                                             0.2, out)
    starts = [sum(NEW[:b]) for b in range(len(NEW))]
    check(out, golden_paged(q, ks, vs, [keep[s:s + n, :c] for s, n, c in zip(starts, NEW, CTX)], 0.2), D + max(CTX))


def test_paged_prefill_validation():
    q, _, _, kc, vc = paged_inputs()
    out = torch.empty(sum(NEW), N, DV, dtype=F16)
    call = torch_npu._npu_flash_attention_qlens
    with pytest.raises(ParamInvalidError, match=r"seq_len\[1\]: expected at most context_lens\[1\]=4"):
        call(q, kc, vc, TABLE, torch.ones(128, 128), torch.tensor([4, 5, 1]), torch.tensor([37, 4, 16]), KVN, N, 0.2,
             out)
    with pytest.raises(ParamInvalidError, match="seq_len: expected per-sequence query lengths summing to T=10"):
        call(q, kc, vc, TABLE, torch.ones(128, 128), torch.tensor([4, 5, 2]), torch.tensor(CTX), KVN, N, 0.2, out)
    with pytest.raises(ParamInvalidError, match="context_lens: expected one length per sequence"):
        call(q, kc, vc, TABLE, torch.ones(128, 128), torch.tensor(NEW), torch.tensor([37, 5]), KVN, N, 0.2, out)
    with pytest.raises(ParamInvalidError, match="mask: expected .*one row per query token"):
        torch_npu._npu_paged_attention_splitfuse(q, kc, vc, TABLE, torch.tensor(CTX), torch.zeros(10, 20),
                                                 torch.tensor(NEW), KVN, N, 0.2, out)


def test_paged_attention_mla_reads_the_value_from_the_key_cache():
    dv = 24
    ks = [randn(n, 1, D, dtype=F16, seed=30 + b) for b, n in enumerate(CTX)]
    kc = paged(ks, D)
    q = randn(len(CTX), N, D, dtype=F16, seed=7)
    out = torch.empty(len(CTX), N, dv, dtype=F16)
    torch_npu._npu_paged_attention_mla(q, kc, 1, N, 0.2, TABLE, torch.tensor(CTX, dtype=torch.int32), dv, out)
    golden = [torch.cat([attend(q[b:b + 1], k, k[..., :dv], torch.ones(1, k.shape[0], dtype=torch.bool), 0.2, dt)
                         for b, k in enumerate(ks)]) for dt in (F64, F16)]
    check(out, golden, D + max(CTX))
    with pytest.raises(ParamInvalidError, match="mla_vheadsize"):
        torch_npu._npu_paged_attention_mla(q, kc, 1, N, 0.2, TABLE, torch.tensor(CTX), D + 1, out)


# --- npu_scatter_nd_update(_) --------------------------------------------------------------------------------------

def test_scatter_nd_update_writes_the_indexed_rows():
    cache = randn(6, 3, 4, seed=40)
    before = cache.clone()
    indices, updates = torch.tensor([[4, 1], [0, 2], [5, 0]], dtype=torch.int32), randn(3, 4, seed=41)
    expected = before.clone()
    for (i, j), row in zip(indices.tolist(), updates):
        expected[i, j] = row
    copy = torch_npu.npu_scatter_nd_update(cache, indices, updates)
    assert torch.equal(cache, before) and torch.equal(copy, expected)
    assert torch_npu.npu_scatter_nd_update_(cache, indices, updates) is cache
    assert torch.equal(cache, expected)


def test_scatter_nd_update_validation():
    cache = torch.zeros(6, 2, 4)
    with pytest.raises(ParamInvalidError, match=r"updates: expected .*shape \[2, 2, 4\]|updates: expected .*2, 2, 4"):
        torch_npu.npu_scatter_nd_update_(cache, torch.tensor([[1], [2]]), torch.zeros(2, 4))
    with pytest.raises(ParamInvalidError, match=r"indices: expected indices in \[0, \[6\]\)"):
        torch_npu.npu_scatter_nd_update_(cache, torch.tensor([[1], [6]]), torch.zeros(2, 2, 4))
    with pytest.raises(ParamInvalidError, match=r"indices: expected indices in"):
        torch_npu.npu_scatter_nd_update_(cache, torch.tensor([[-1]]), torch.zeros(1, 2, 4))
    with pytest.raises(ParamInvalidError, match="indices: expected at least 2 dims"):
        torch_npu.npu_scatter_nd_update_(cache, torch.tensor([1, 2]), torch.zeros(2, 2, 4))
    assert not cache.any()
