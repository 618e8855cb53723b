"""Names op-plugin's tests call, each against an fp64 formula of its own: ``npu_format_cast``/``get_npu_format``,
``npu_quant_fusion_attention``, FIA v2's ``out_dtype`` (and ``npu_fused_infer_attention_v2``), the batch
invariance of FIA, ``npu_scatter_nd_update_v2``, ``_npu_dropout_gen_mask`` with fusion attention's seed/offset per
SoC, NumPy scalars as floats and ``native_sparse_attention(block_counts=<int>)``."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import attnops
from attnops import torch_npu
from attnops._core import hifloat8
from attnops.torch_npu import npu_generator, soc
from attnops.torch_npu.scatter_nd import npu_scatter_nd_update_v2


def _r(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _attend(q, k, v, scale):
    return torch.softmax(scale * q.double() @ k.double().transpose(-1, -2), -1) @ v.double()


def test_format_cast_records_the_format_and_keeps_values():
    x = _r(2, 3, 4, 5)
    assert torch_npu.get_npu_format(x) == 0 and torch_npu.get_npu_format(x[0]) == 2  # NCHW for 4-D, else ND
    nz = torch_npu.npu_format_cast(x, 29)
    assert torch_npu.get_npu_format(nz) == 29 and torch_npu.get_npu_format(x) == 0
    assert torch.equal(nz, x) and nz.data_ptr() != x.data_ptr()
    assert torch_npu.npu_format_cast(nz, 29) is nz
    assert torch_npu.get_npu_format(torch_npu.npu_format_cast_(x, nz)) == 29
    with pytest.raises(ValueError, match="acl_format"):
        torch_npu.npu_format_cast(x, 99)


def test_quant_fusion_attention_fp8_per_block():
    b, n, s, d = 1, 2, 300, 16
    q8, k8, v8 = (_r(b, n, s, d, seed=i).to(torch.float8_e4m3fn) for i in (1, 2, 3))
    dq, dk, dv = (torch.rand(b, n, -(-s // blk), 1, generator=torch.Generator().manual_seed(blk)) + 0.5
                  for blk in (128, 256, 512))
    out, smax, ssum, *_ = torch_npu.npu_quant_fusion_attention(q8, k8, v8, n, "BNSD", d_scale_q=dq, d_scale_k=dk,
                                                              d_scale_v=dv, scale=0.25)
    per_token = lambda x8, ds, blk: x8.double() * ds.double().repeat_interleave(blk, 2)[:, :, :s]  # noqa: E731
    q, k, v = per_token(q8, dq, 128), per_token(k8, dk, 256), per_token(v8, dv, 512)
    scores = 0.25 * q @ k.transpose(-1, -2)
    p = (scores - scores.amax(-1, keepdim=True)).exp().to(torch.float8_e4m3fn).double()
    gold = (p @ v) / p.sum(-1, keepdim=True)
    assert out.dtype == torch.float16 and (out.double() - gold).abs().max() < 2e-3
    assert (ssum[..., 0].double() - p.sum(-1)).abs().max() < 1e-3 * s


def test_quant_fusion_attention_hifloat8_codes():
    q, k, v = (_r(1, 4, 2, 8, seed=i) for i in (4, 5, 6))  # BSND
    codes = [hifloat8.encode(x) for x in (q, k, v)]
    ones = [torch.ones(1, 2, 1, 1) for _ in range(3)]
    out = torch_npu.npu_quant_fusion_attention(*codes, 2, "BSND", d_scale_q=ones[0], d_scale_k=ones[1],
                                               d_scale_v=ones[2], scale=0.5, query_dtype=torch_npu.hifloat8)[0]
    qd, kd, vd = (hifloat8.decode(c).double().transpose(1, 2) for c in codes)
    scores = 0.5 * qd @ kd.transpose(-1, -2)
    p = (scores - scores.amax(-1, keepdim=True)).exp().to(torch.float8_e4m3fn).double()
    assert (out.transpose(1, 2).double() - (p @ vd) / p.sum(-1, keepdim=True)).abs().max() < 2e-3


@pytest.mark.parametrize("out_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch_npu.hifloat8])
def test_fia_v2_out_dtype_quantizes_the_output(out_dtype):
    q, k, v = _r(1, 2, 3, 8, seed=7), _r(1, 2, 9, 8, seed=8), _r(1, 2, 9, 8, seed=9)
    scale_out, offset_out = torch.tensor([40.0]), torch.tensor([1.5])
    out, _ = torch_npu.npu_fused_infer_attention_v2(q, k, v, num_query_heads=2, input_layout="BNSD",
                                                    softmax_scale=0.3, quant_scale_out=scale_out,
                                                    quant_offset_out=offset_out, out_dtype=out_dtype)
    gold = _attend(q, k, v, 0.3) * 40.0 + 1.5
    if out_dtype is torch_npu.hifloat8:
        assert torch.equal(out, hifloat8.encode(gold.float()))
    else:
        limit = torch.finfo(out_dtype).max
        assert out.dtype == out_dtype and torch.equal(out, gold.float().clamp(-limit, limit).to(out_dtype))


def test_fia_v2_out_dtype_is_ignored_without_quant_scale_out():
    q, k, v = _r(1, 2, 3, 8, seed=7), _r(1, 2, 9, 8, seed=8), _r(1, 2, 9, 8, seed=9)
    out, _ = torch_npu.npu_fused_infer_attention_score_v2(q, k, v, num_query_heads=2, input_layout="BNSD",
                                                          softmax_scale=0.3, out_dtype=torch.float8_e5m2)
    assert out.dtype == torch.float32 and (out.double() - _attend(q, k, v, 0.3)).abs().max() < 1e-5


def test_fia_rows_do_not_depend_on_the_batch():
    q, k, v = _r(4, 2, 3, 16, seed=10), _r(4, 2, 33, 16, seed=11), _r(4, 2, 33, 16, seed=12)
    whole, _ = torch_npu.npu_fused_infer_attention_score(q, k, v, num_heads=2, input_layout="BNSD", scale=0.25)
    for b in range(4):
        alone, _ = torch_npu.npu_fused_infer_attention_score(q[b:b + 1], k[b:b + 1], v[b:b + 1], num_heads=2,
                                                             input_layout="BNSD", scale=0.25)
        assert torch.equal(whole[b:b + 1], alone)
    assert (whole.double() - _attend(q, k, v, 0.25)).abs().max() < 1e-5


def test_scatter_nd_update_v2_skips_out_of_range_slots():
    cache = torch.zeros(6, 4, 3)
    flat = cache.view(-1, 3)
    updates = _r(4, 3, seed=13)
    npu_scatter_nd_update_v2(flat, torch.tensor([[5], [-1], [23], [24]]), updates)
    expect = torch.zeros(24, 3)
    expect[5], expect[23] = updates[0], updates[2]
    assert torch.equal(flat, expect)


@pytest.fixture
def on_soc():
    """Switch the reported SoC for one test; the SoC and the NPU generator are restored afterwards."""
    generator = dict(npu_generator._state)
    yield lambda name: soc.configure(name)
    soc.configure()
    npu_generator._state.clear()
    npu_generator._state.update(generator)


def _keep_bits(packed: torch.Tensor, numels: int) -> torch.Tensor:
    return torch.from_numpy(np.unpackbits(packed.numpy(), count=numels, bitorder="little")).bool()


def test_dropout_gen_mask_matches_fusion_attention_per_soc(on_soc):
    q, k, v = _r(1, 2, 16, 8, seed=14), _r(1, 2, 16, 8, seed=15), _r(1, 2, 16, 8, seed=16)
    mask = torch_npu._npu_dropout_gen_mask(q, [1, 2, 16, 16], p=0.25, seed=7, offset=12)
    assert mask.dtype == torch.uint8 and mask.numel() == 512 // 8
    keep = _keep_bits(mask, 512).view(1, 2, 16, 16)
    gold = (torch.softmax(0.3 * q.double() @ k.double().transpose(-1, -2), -1) * keep / 0.75) @ v.double()
    with_mask = torch_npu.npu_fusion_attention_v2(q, k, v, 2, "BNSD", scale=0.3, keep_prob=0.75, dropout_mask=mask,
                                                  seed=7, offset=12)
    assert (with_mask[0].double() - gold).abs().max() < 1e-5 and with_mask[4:6] == (7, 12)
    on_soc("Ascend950")
    seeded = torch_npu.npu_fusion_attention_v2(q, k, v, 2, "BNSD", scale=0.3, keep_prob=0.75, seed=7, offset=12)
    assert seeded[4:6] == (7, 12) and torch.equal(seeded[0], with_mask[0])
    on_soc("Ascend910B1")  # the NPU generator's (seed, offset) instead of the given ones
    npu_generator.manual_seed(7)
    first = torch_npu.npu_fusion_attention_v2(q, k, v, 2, "BNSD", scale=0.3, keep_prob=0.75, seed=1, offset=1)
    second = torch_npu.npu_fusion_attention_v2(q, k, v, 2, "BNSD", scale=0.3, keep_prob=0.75, seed=1, offset=1)
    assert first[4:6] == (7, 0) and second[4:6] == (7, 12) and torch.equal(second[0], with_mask[0])


def test_numpy_scalars_are_floats():
    q, k, v = _r(1, 2, 4, 8, seed=17), _r(1, 2, 4, 8, seed=18), _r(1, 2, 4, 8, seed=19)
    out = torch_npu.npu_fusion_attention(q, k, v, 2, "BNSD", scale=np.float16(0.25), keep_prob=np.float64(1.0))[0]
    assert (out.double() - _attend(q, k, v, float(np.float16(0.25)))).abs().max() < 1e-5


def test_native_sparse_attention_int_block_counts():
    q, k, v = _r(40, 2, 16, seed=20), _r(40, 1, 16, seed=21), _r(40, 1, 16, seed=22)
    gates = torch.rand(40, 2, 3, generator=torch.Generator().manual_seed(23))
    kw = dict(compress="mean", compress_block_size=8, compress_stride=8, select_block_size=8, select_block_count=3,
              window_size=8)
    by_int = attnops.native_sparse_attention(q, k, v, gates, block_counts=2, **kw)
    by_tensor = attnops.native_sparse_attention(q, k, v, gates, block_counts=torch.full((40, 1), 2), **kw)
    assert torch.equal(by_int, by_tensor)
    assert not torch.equal(by_int, attnops.native_sparse_attention(q, k, v, gates, block_counts=1, **kw))


def _block_sparse_fp64(q, k, v, block_mask, block_shape, scale):
    """fp64 attention of ``[N, Sq, D]`` rows where query block i sees key block j iff ``block_mask[n, i, j]``."""
    keep = block_mask.bool().repeat_interleave(block_shape[0], 1).repeat_interleave(block_shape[1], 2)
    keep = keep[:, :q.shape[1], :k.shape[1]]
    group = q.shape[0] // k.shape[0]
    k, v = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    s = (scale * q.double() @ k.transpose(-1, -2)).masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def test_block_sparse_attention_tnd_gqa_forward_and_backward():
    lens = [12, 7]
    t = sum(lens)
    q = _r(t, 4, 8, seed=24).requires_grad_()
    k, v = _r(t, 2, 8, seed=25).requires_grad_(), _r(t, 2, 8, seed=26).requires_grad_()
    mask = (torch.rand(2, 4, 3, 2, generator=torch.Generator().manual_seed(27)) > 0.4).to(torch.int8)
    mask[:, :, :, 0] = 1  # every query block sees a block
    cum = [12, 19]
    out, lse = torch_npu.npu_block_sparse_attention(q, k, v, mask, [5, 8], q_input_layout="TND",
                                                    kv_input_layout="TND", num_key_value_heads=2, scale_value=0.3,
                                                    actual_seq_lengths=cum, actual_seq_lengths_kv=cum)
    dout = _r(t, 4, 8, seed=28)
    grads = torch_npu.npu_block_sparse_attention_backward(dout, q, k, v, out, lse, mask, [5, 8], cum, cum, "TND",
                                                          "TND", 2, 0.3)
    gold_out, ref_grads = [], []
    for b, (start, n) in enumerate(zip([0, 12], lens)):
        rows = slice(start, start + n)
        qb, kb, vb = (x.detach()[rows].transpose(0, 1).double().requires_grad_() for x in (q, k, v))
        o, l = _block_sparse_fp64(qb, kb, vb, mask[b], [5, 8], 0.3)
        assert (out[rows].transpose(0, 1).double() - o).abs().max() < 1e-5
        assert (lse[rows, :, 0].T.double() - l).abs().max() < 1e-5
        o.backward(dout[rows].transpose(0, 1).double())
        for grad, ref in zip(grads, (qb, kb, vb)):
            assert (grad[rows].transpose(0, 1).double() - ref.grad).abs().max() < 1e-5
