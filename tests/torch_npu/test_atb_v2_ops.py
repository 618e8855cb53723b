"""ATB entry points added for op-plugin's tests, each against an fp64 formula of its own: the ALiBi mask types of
``_npu_flash_attention_v2`` / ``_npu_flash_attention_prefix_v2``, ``_npu_paged_attention_v2``, the int8
``_npu_paged_attention_quant``, ``npu_multi_head_latent_attention`` (with its lse), ``npu_paged_cache_load`` and
``_npu_reshape_and_cache_siso``."""
from __future__ import annotations

import itertools

import pytest
import torch

from attnops import torch_npu


def _r(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _attend(q, k, v, scale, bias=None):
    """fp64 softmax(scale * q k^T + bias) v for q ``[N, Sq, D]``, k/v ``[N, Skv, D]`` (GQA by repetition)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    s = scale * q @ k.transpose(-1, -2)
    s = s if bias is None else s + bias
    return torch.softmax(s, -1) @ v


def _alibi(slopes, sq, skv, sqrt=False):
    """ATB's compressed ALiBi: ``slopes[h] * (i - j)`` (or ``sqrt(i - j)``) for query ``i`` aligned bottom-right,
    -inf above the diagonal (ATB passes negative slopes)."""
    i = torch.arange(sq, dtype=torch.float64).view(-1, 1) + (skv - sq)
    j = torch.arange(skv, dtype=torch.float64).view(1, -1)
    dist = (i - j).clamp_min(0)
    bias = slopes.double().view(-1, 1, 1) * (dist.sqrt() if sqrt else dist)
    return bias.masked_fill(j > i, float("-inf"))


LENS = [5, 9]


@pytest.mark.parametrize("mask_type", [4, 5])
def test_flash_attention_v2_alibi_compress(mask_type):
    n, kvn, d = 4, 2, 16
    t = sum(LENS)
    q, k, v = _r(t, n * d, seed=1), _r(t, kvn * d, seed=2), _r(t, kvn * d, seed=3)
    slopes = -torch.tensor([0.5, 0.25, 0.125, 0.0625])  # ATB's negated slopes
    out = torch.empty(t, n * d)
    torch_npu._npu_flash_attention_v2(q, k, v, LENS, mask=torch.zeros(128, 128), slopes=slopes, mask_type=mask_type,
                                      scale_value=0.3, num_heads=n, num_kv_heads=kvn, out=out)
    for start, s in zip(itertools.accumulate([0, *LENS]), LENS):
        rows = slice(start, start + s)
        heads = lambda x, h: x[rows].view(s, h, d).transpose(0, 1)  # noqa: E731
        gold = _attend(heads(q, n), heads(k, kvn), heads(v, kvn), 0.3, _alibi(slopes, s, s, sqrt=mask_type == 5))
        assert (out[rows].view(s, n, d).transpose(0, 1).double() - gold).abs().max() < 1e-5


def test_flash_attention_v2_additive_and_boolean_masks():
    n, d, s = 2, 8, 6
    q, k, v = _r(s, n, d, seed=4), _r(s, n, d, seed=5), _r(s, n, d, seed=6)
    bias = _r(1, n, s, s, seed=7)
    out = torch.empty(s, n, d)
    torch_npu._npu_flash_attention_v2(q, k, v, [s], mask=bias, mask_type=2, scale_value=0.5, num_heads=n,
                                      num_kv_heads=n, out=out)
    gold = _attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), 0.5, bias[0].double())
    assert (out.transpose(0, 1).double() - gold).abs().max() < 1e-5
    causal = torch.ones(s, s).triu(1)
    torch_npu._npu_flash_attention_v2(q, k, v, [s], mask=causal, mask_type=1, scale_value=0.5, num_heads=n,
                                      num_kv_heads=n, out=out)
    gold = _attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), 0.5,
                   torch.zeros(s, s, dtype=torch.float64).masked_fill(causal.bool(), float("-inf")))
    assert (out.transpose(0, 1).double() - gold).abs().max() < 1e-5


def _paged(tokens: torch.Tensor, block_size: int, order: list[int]):
    """A paged cache holding ``tokens [S, N, D]`` in the blocks ``order`` (block table row), other blocks random."""
    blocks = -(-tokens.shape[0] // block_size)
    cache = _r(max(order) + 1, block_size, *tokens.shape[1:], seed=11)
    for slot in range(tokens.shape[0]):
        cache[order[slot // block_size], slot % block_size] = tokens[slot]
    return cache, torch.tensor([order[:blocks]], dtype=torch.int32)


def test_flash_attention_prefix_v2_sqrt_alibi():
    n, d, bs, skv, sq = 2, 8, 4, 10, 3
    k, v, q = _r(skv, 1, d, seed=8), _r(skv, 1, d, seed=9), _r(sq, n, d, seed=10)
    k_cache, table = _paged(k, bs, [3, 0, 5])
    v_cache, _ = _paged(v, bs, [3, 0, 5])
    slopes = torch.tensor([-0.5, -0.125])
    out = torch.empty(sq, n, d)
    torch_npu._npu_flash_attention_prefix_v2(q, k_cache.flatten(2), v_cache.flatten(2), table, torch.zeros(128, 128),
                                             [sq], [skv], slopes=slopes, mask_type=5, num_kv_heads=1, num_heads=n,
                                             scale_value=0.4, out=out)
    gold = _attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), 0.4, _alibi(slopes, sq, skv, sqrt=True))
    assert (out.transpose(0, 1).double() - gold).abs().max() < 1e-5


def test_paged_attention_v2_alibi_mask():
    n, d, bs = 2, 8, 4
    lens = [7, 3]
    q = _r(2, n, d, seed=12)
    seqs = [(_r(s, 1, d, seed=13 + i), _r(s, 1, d, seed=20 + i)) for i, s in enumerate(lens)]
    k_cache, v_cache = torch.zeros(6, bs, 1, d), torch.zeros(6, bs, 1, d)
    tables = [[0, 2], [4, 5]]
    for (k, v), row in zip(seqs, tables):
        for slot in range(k.shape[0]):
            k_cache[row[slot // bs], slot % bs], v_cache[row[slot // bs], slot % bs] = k[slot], v[slot]
    mask = _r(2, n, 1, 8, seed=30)
    out = torch.empty(2, n, d)
    torch_npu._npu_paged_attention_v2(q, k_cache, torch.tensor(tables, dtype=torch.int32), lens,
                                      value_cache=v_cache, mask=mask, num_kv_heads=1, num_heads=n, scale_value=0.3,
                                      mask_type=2, out=out)
    for i, ((k, v), s) in enumerate(zip(seqs, lens)):
        gold = _attend(q[i].unsqueeze(1), k.transpose(0, 1), v.transpose(0, 1), 0.3, mask[i, :, :, :s].double())
        assert (out[i].double() - gold.squeeze(1)).abs().max() < 1e-5


def test_paged_attention_quant_online_int8():
    n, d, bs, s = 2, 8, 4, 6
    gen = torch.Generator().manual_seed(40)
    q = torch.randint(-20, 21, (1, n, d), generator=gen, dtype=torch.int8)
    k = torch.randint(-20, 21, (s, 1, d), generator=gen, dtype=torch.int8)
    v = torch.randint(-20, 21, (s, 1, d), generator=gen, dtype=torch.int8)
    k_cache = torch.zeros(2, bs, 1, d, dtype=torch.int8)
    v_cache = torch.zeros(2, bs, 1, d, dtype=torch.int8)
    k_cache.view(-1, 1, d)[:s], v_cache.view(-1, 1, d)[:s] = k, v
    k_descale, v_descale = torch.tensor([0.01, 0.02]), torch.tensor([0.5, 0.25])
    out = torch.empty(1, n, d, dtype=torch.bfloat16)
    torch_npu._npu_paged_attention_quant(q, k_cache, v_cache, 1, n, 0.3, torch.tensor([[0, 1]], dtype=torch.int32),
                                         [s], 3, 27, k_descale, v_descale, out)
    sc = 0.3 * k_descale.double().view(-1, 1) * (q[0].double() @ k[:, 0].double().T)
    p = (sc - sc.amax(-1, keepdim=True)).exp()
    step = p.amax(-1, keepdim=True) / 127
    gold = v_descale.double().view(-1, 1) * step * ((p / step).round() @ v[:, 0].double()) / p.sum(-1, keepdim=True)
    assert (out[0].double() - gold).abs().max() <= 2 ** -7 * gold.abs().max()


def test_multi_head_latent_attention_with_lse():
    n, dc, dr, bs = 4, 16, 8, 4
    lens = [5, 2]
    q_nope, q_rope = _r(2, n, dc, seed=50), _r(2, n, dr, seed=51)
    ctkv, k_rope = _r(4, bs, 1, dc, seed=52), _r(4, bs, 1, dr, seed=53)
    table = torch.tensor([[1, 3], [2, 0]], dtype=torch.int32)
    out, lse = torch_npu.npu_multi_head_latent_attention(q_nope, q_rope, ctkv, k_rope, table, lens, n, 0.2, 1, True,
                                                         calc_type="calc_type_ring")
    for i, s in enumerate(lens):
        latent = torch.cat([ctkv[table[i, p // bs], p % bs] for p in range(s)]).double()  # [s, dc]
        rope = torch.cat([k_rope[table[i, p // bs], p % bs] for p in range(s)]).double()
        scores = 0.2 * (q_nope[i].double() @ latent.T + q_rope[i].double() @ rope.T)
        assert (out[i].double() - torch.softmax(scores, -1) @ latent).abs().max() < 1e-5
        assert (lse[i, :, 0].double() - torch.logsumexp(scores, -1)).abs().max() < 1e-5


def test_paged_cache_load_and_reshape_and_cache_siso():
    bs, d = 4, 6
    key_cache, value_cache = _r(5, bs, 1, d, seed=60), _r(5, bs, 1, 3, seed=61)
    table = torch.tensor([[4, 1, 0], [2, 3, 0]], dtype=torch.int32)
    lens, starts = torch.tensor([6, 3], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32)
    key, value = torch_npu.npu_paged_cache_load(key_cache, value_cache, table, lens, seq_starts=starts)
    expect = [(table[b, int(starts[b]) // bs + p // bs], p % bs) for b in range(2) for p in range(int(lens[b]))]
    assert torch.equal(key, torch.stack([key_cache[blk, row] for blk, row in expect]))
    assert torch.equal(value, torch.stack([value_cache[blk, row] for blk, row in expect]))
    cache = torch.zeros(3, bs, 2, d)
    tokens, slots = _r(3, 2, d, seed=62), torch.tensor([5, 0, 11], dtype=torch.int32)
    torch_npu._npu_reshape_and_cache_siso(tokens, cache, slots)
    assert torch.equal(cache.view(-1, 2, d)[slots.long()], tokens)
    assert cache.view(-1, 2, d).abs().sum(dim=(1, 2)).count_nonzero() == 3
