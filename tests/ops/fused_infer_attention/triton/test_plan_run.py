"""``attnops.fused_infer_attention_plan`` / ``.run`` on the Triton decode kernels vs the fp64 golden: the work split
balanced over the batch's KV tokens, lengths that change between runs of one plan (host lists and tensors, a plan
for the capacity), shuffled pages in ND and NZ caches, int8/int4 KV, dense KV, masks and lse. Every test forces
``ATTNOPS_BACKEND=triton`` (the interpreter on CPU tensors) and checks the kernels ran."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.ops.fused_infer_attention.triton.decode_plan import split_counts
from attnops.testing.compare import assert_close_to_golden, fia_reduction
from attnops.testing.golden_fia import pack_int4
from tests.helpers import randn
from tests.ops.fused_infer_attention.fia_helpers import TRIU2048, golden, rand_mask, randint4, randint8, to_paged
from tests.ops.fused_infer_attention.test_fia_nz_cache import nz
from tests.triton_backend import DEVICE

F16, F32 = torch.float16, torch.float32
KERNELS = ["split_kernel", "merge_kernel"]
N, NKV, D, BS = 4, 2, 16, 16


def _dev(x):
    return x.to(DEVICE) if isinstance(x, torch.Tensor) else x


def _cache(lens, *, quant=None, layout="BNSD", seed=0, capacity_blocks=0):
    """Shuffled pages of K and V for ``lens`` (+ spare blocks), a block table padded to ``capacity_blocks``."""
    b, s = len(lens), max(max(lens), 1)
    if quant == "int8":
        k, v = randint8(b, NKV, s, D, seed=seed), randint8(b, NKV, s, D, seed=seed + 1)
    elif quant == "int4":
        k, v = randint4(b, NKV, s, D, seed=seed), randint4(b, NKV, s, D, seed=seed + 1)
    else:
        k, v = randn(b, NKV, s, D, dtype=F16, seed=seed), randn(b, NKV, s, D, dtype=F16, seed=seed + 1)
    kc, bt = to_paged(k, lens, BS, cache_layout="BNSD", seed=seed + 2, extra_blocks=4)
    vc, _ = to_paged(v, lens, BS, cache_layout="BNSD", seed=seed + 2, extra_blocks=4)
    if quant == "int4":
        kc, vc = pack_int4(kc.clamp(-8, 7)), pack_int4(vc.clamp(-8, 7))  # the spare pages too
    if layout == "NZ":
        kc, vc = nz(kc), nz(vc)
    if capacity_blocks > bt.shape[1]:
        bt = torch.cat([bt, torch.full((b, capacity_blocks - bt.shape[1]), -1, dtype=bt.dtype)], 1)
    return kc, vc, bt


def _check(launched, out, q, kc, vc, *, lens, bt, **kw):
    """The run's ``(out, lse)`` against the golden of the same call, and the decode kernels launched."""
    assert launched[-2:] == KERNELS, launched
    kw = dict(kw, num_heads=N, num_key_value_heads=NKV, scale_value=0.25, input_layout="BNSD",
              softmax_lse_flag=True, block_table=bt, block_size=BS, actual_seq_lengths_kv=list(lens))
    g, base = golden(q, kc, vc, **kw), golden(q, kc, vc, dtype=F16, **kw)
    red = fia_reduction(q, kc, **kw)
    assert_close_to_golden("attention_out", out[0].cpu(), g.out, base.out, reduction=red)
    assert_close_to_golden("softmax_lse", out[1].cpu(), g.lse, base.lse, reduction=red)


def _plan(q, kc, vc, bt, lens, **kw):
    return attnops.fused_infer_attention_plan(_dev(q), _dev(kc), _dev(vc), num_heads=N, num_key_value_heads=NKV,
                                              scale=0.25, block_table=_dev(bt), block_size=BS,
                                              actual_seq_lengths_kv=_dev(lens), return_lse=True, **kw)


def _programs(kv_lens, n2, capacity=None):
    """Split-kernel programs (units x KV heads) and units per batch of a plan on an H100 (132 SMs)."""
    batch = len(kv_lens) if kv_lens is not None else 1
    splits, _ = split_counts(kv_lens, batch, n2, capacity or max(kv_lens), torch.device("meta"), interpret=False)
    return int(splits.sum()) * n2, splits.tolist()


@pytest.mark.parametrize("n2", [8, 1])
def test_splits_fill_two_waves_of_an_h100(n2):
    """B=1 x 32k and B=64 x 8k give at least two programs per SM (264), MQA included, with host lengths and with a
    capacity plan (device lengths)."""
    for kv_lens in ([32768], [8192] * 64):
        assert _programs(kv_lens, n2)[0] >= 2 * 132
    for batch, capacity in ((1, 32768), (64, 8192)):
        splits, _ = split_counts(None, batch, n2, capacity, torch.device("meta"), interpret=False)
        assert int(splits.sum()) * n2 >= 2 * 132
    assert _programs([32768], 8) == (280, [35])
    assert _programs([32768], 1) == (512, [512])
    assert _programs([8192] * 64, 8) == (512, [1] * 64)
    assert _programs([8192] * 64, 1) == (320, [5] * 64)


def test_splits_are_balanced_over_the_batch_tokens():
    """One long sequence among short ones is split into units of about the batch's mean share; short ones are not."""
    programs, splits = _programs([131072] + [1024] * 63, 8)
    assert splits == [23] + [1] * 63 and programs == 688
    assert _programs([4096, 10, 300, 0], 8)[1] == [32, 1, 3, 1]
    assert _programs([0], 8)[1] == [1]


@pytest.mark.parametrize("layout", ["BNSD", "NZ"])
def test_lengths_change_between_runs_of_one_plan(triton_backend, layout):
    """A plan for host lengths runs later calls with other lengths, as lists and as tensors, and a new table."""
    lens = [70, 5, 33]
    q = randn(3, N, 1, D, dtype=F16, seed=9)
    kc, vc, bt = _cache(lens, layout=layout)
    plan = _plan(q, kc, vc, bt, lens)
    assert plan.kernels
    _check(triton_backend, plan.run(_dev(q), _dev(kc), _dev(vc), block_table=_dev(bt)), q, kc, vc, lens=lens,
           bt=bt)
    table = bt.flip(0)  # rows of 3, 1 and 5 valid pages
    for new in ([40, 16, 75], torch.tensor([48, 0, 1], dtype=torch.int32)):
        out = plan.run(_dev(q), _dev(kc), _dev(vc), block_table=_dev(table), actual_seq_lengths_kv=_dev(new))
        _check(triton_backend, out, q, kc, vc, lens=torch.as_tensor(new).tolist(), bt=table)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_capacity_plan_with_tensor_lengths(triton_backend, quant):
    """Lengths given as a tensor: a plan for any length up to the block table's capacity (6 pages), run with new
    lengths and tables written into the same tensors; page-managed int8/int4 scales."""
    q = randn(2, N, 1, D, dtype=F16, seed=3)
    kc, vc, bt = _cache([96, 90], quant=quant)
    bt = bt[:, :6].contiguous()
    g = torch.Generator().manual_seed(1)
    quant_kw = {f"{x}_antiquant_scale": torch.rand(kc.shape[0], NKV, BS, generator=g) * (0.2 if quant == "int4" else
                                                                                        0.02) + 0.005
                for x in ("key", "value")}
    quant_kw.update(key_antiquant_mode=5, value_antiquant_mode=5)
    lens, table = _dev(torch.tensor([40, 7], dtype=torch.int32)), _dev(bt.clone())
    plan = _plan(q, kc, vc, table, lens, **{k: _dev(v) for k, v in quant_kw.items()})
    for new, new_table in (([40, 7], bt), ([90, 0], bt), ([3, 96], bt.flip(0))):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        table.copy_(new_table)
        out = plan.run(_dev(q), _dev(kc), _dev(vc), block_table=table, actual_seq_lengths_kv=lens)
        _check(triton_backend, out, q, kc, vc, lens=new, bt=new_table, **quant_kw)


def test_dense_kv_with_a_mask(triton_backend):
    """A dense KV (no block table) with a decode mask; lengths changed at run."""
    q, k, v = randn(2, N, 1, D, dtype=F16, seed=1), randn(2, NKV, 50, D, dtype=F16, seed=2), \
        randn(2, NKV, 50, D, dtype=F16, seed=3)
    mask = rand_mask(2, 50, seed=4)
    plan = attnops.fused_infer_attention_plan(_dev(q), _dev(k), _dev(v), num_heads=N, num_key_value_heads=NKV,
                                              scale=0.25, atten_mask=_dev(mask), actual_seq_lengths_kv=[50, 20],
                                              return_lse=True)
    out = plan.run(_dev(q), _dev(k), _dev(v), actual_seq_lengths_kv=[9, 50])
    assert triton_backend == KERNELS
    kw = dict(num_heads=N, num_key_value_heads=NKV, scale_value=0.25, input_layout="BNSD", softmax_lse_flag=True,
              atten_mask=mask, actual_seq_lengths_kv=[9, 50])
    g, base = golden(q, k, v, **kw), golden(q, k, v, dtype=F16, **kw)
    red = fia_reduction(q, k, **kw)
    assert_close_to_golden("attention_out", out[0].cpu(), g.out, base.out, reduction=red)
    assert_close_to_golden("softmax_lse", out[1].cpu(), g.lse, base.lse, reduction=red)


def test_run_checks_shapes_and_capacity(triton_backend):
    lens = [20, 3]
    q = randn(2, N, 1, D, dtype=F16, seed=1)
    kc, vc, bt = _cache(lens)
    plan = _plan(q, kc, vc, bt, lens)
    with pytest.raises(attnops.ParamInvalidError, match="query: expected a tensor of shape"):
        plan.run(_dev(q[:1]), _dev(kc), _dev(vc), block_table=_dev(bt))
    with pytest.raises(attnops.ParamInvalidError, match="block_table: expected"):
        plan.run(_dev(q), _dev(kc), _dev(vc), block_table=_dev(bt[:, :1]))
    with pytest.raises(attnops.ParamInvalidError, match=r"actual_seq_lengths_kv\[1\]"):
        plan.run(_dev(q), _dev(kc), _dev(vc), block_table=_dev(bt), actual_seq_lengths_kv=[1, 10 ** 6])


def test_a_plan_on_the_reference_makes_the_one_call(monkeypatch):
    """Without the kernels (the CPU reference), ``run`` is the one-call API with the new block table and lengths."""
    monkeypatch.setenv("ATTNOPS_BACKEND", "reference")
    lens = [20, 3]
    q = randn(2, N, 1, D, dtype=F16, seed=1)
    kc, vc, bt = _cache(lens)
    plan = attnops.fused_infer_attention_plan(q, kc, vc, num_heads=N, num_key_value_heads=NKV, scale=0.25,
                                              block_table=bt, block_size=BS, actual_seq_lengths_kv=lens)
    assert not plan.kernels
    out = plan.run(q, kc, vc, block_table=bt.flip(0), actual_seq_lengths_kv=[3, 20])
    want = attnops.fused_infer_attention(q, kc, vc, num_heads=N, num_key_value_heads=NKV, scale=0.25,
                                         block_table=bt.flip(0), block_size=BS, actual_seq_lengths_kv=[3, 20])
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_speculative_rows_causal_with_tensor_lengths(triton_backend):
    """Four query rows per batch, bottom-right causal: the band follows the lengths read on the device."""
    q = randn(2, 4, N, D, dtype=F16, seed=1)
    k, v = randn(2, 60, NKV, D, dtype=F16, seed=2), randn(2, 60, NKV, D, dtype=F16, seed=3)
    lens = torch.tensor([60, 9], dtype=torch.int32)
    plan = attnops.fused_infer_attention_plan(_dev(q), _dev(k), _dev(v), layout="BSND", num_heads=N,
                                              num_key_value_heads=NKV, scale=0.25, causal=True,
                                              actual_seq_lengths_kv=_dev(lens), return_lse=True)
    for new in ([60, 9], [5, 33], [0, 60]):
        lens.copy_(torch.tensor(new))
        out = plan.run(_dev(q), _dev(k), _dev(v), actual_seq_lengths_kv=_dev(lens))
        kw = dict(num_heads=N, num_key_value_heads=NKV, scale_value=0.25, input_layout="BSND", softmax_lse_flag=True,
                  atten_mask=TRIU2048, sparse_mode=3, actual_seq_lengths_kv=new)
        g, base = golden(q, k, v, **kw), golden(q, k, v, dtype=F16, **kw)
        red = fia_reduction(q, k, **kw)
        assert_close_to_golden("attention_out", out[0].cpu(), g.out, base.out, reduction=red)
        assert_close_to_golden("softmax_lse", out[1].cpu(), g.lse, base.lse, reduction=red)
    assert triton_backend == KERNELS * 3
